import sys
ROOT = __import__("pathlib").Path(__file__).resolve().parents[4]; sys.path.insert(0, str(ROOT))
import numpy as np, jax, jax.numpy as jnp
import models
from models import layers as L
from jaxdecode.engine import step_ops
mode = sys.argv[1]
model, params, _ = models.demo()
if mode == "hidden":
    L.CachedDecoder._head = lambda self, params, x, tile: x.astype(jnp.float32)
ctx = step_ops.Context(model, params, 8, 64, model.config.eos_token_ids)
rng = np.random.default_rng(7)
vocab, t = model.config.vocab_size, 16
prompts = [rng.integers(3, vocab, int(rng.integers(t + 1, 2 * t + 1))).tolist() for _ in range(8)]
tables = (1 + np.arange(8)[:, None] * ctx.pages_per_row + np.arange(ctx.pages_per_row)[None]).astype(np.int32)
def run(groups):
    state, logits = ctx.backend.empty_state(), {}
    for group in groups:
        lengths = np.array([min(t, len(prompts[i])) for i in group], np.int32)
        tokens = np.zeros((len(group), t), np.int32)
        for row, i in enumerate(group):
            tokens[row, :lengths[row]] = prompts[i][:lengths[row]]
        state, out = ctx.backend.chunk(state, tokens, np.zeros((len(group),), np.int32), lengths, tables[group], 256)
        for row, i in enumerate(group):
            logits[i] = np.asarray(out[row])
    return logits
alone = run([[i] for i in range(8)])
for rows in (2, 4, 8):
    got = run([list(range(j, j + rows)) for j in range(0, 8, rows)])
    bad = [i for i in range(8) if not np.array_equal(got[i], alone[i])]
    print(mode, rows, "rows: differing prompts", bad, flush=True)
