"""Decode-step time of llama-512 at batch 1 and 16 with models.layers.ROW_TILE from the
environment (default 8, the shipped tile); XLA_FLAGS picks the product library."""
import functools, os, sys, time
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[4]))
import numpy as np, jax, jax.numpy as jnp
from models import hf
from jaxdecode.config import SamplingParams
from jaxdecode.device.decode import StepConfig, decode_step_jit, prepare
from jaxdecode.cli.bench.paged import paged_state
from jaxdecode.cli.bench.timing import prompts
from models import layers as L
L.ROW_TILE = int(os.environ.get("ROW_TILE", "8"))
model, params = hf.load(sys.argv[1] if len(sys.argv) > 1 else "/work/ckpt512")[:2]
for B in (1, 16):
    ids = prompts(B, 16, model.config.vocab_size, 0)
    sp = [SamplingParams(seed=r, max_tokens=80, temperature=0.8, ignore_eos=True) for r in range(B)]
    state = paged_state(prepare(model, params, ids, sp, 80, None)[0], 16)
    step = functools.partial(decode_step_jit, params=params, config=StepConfig(model, kv_len=128))
    fresh = lambda: jax.tree.map(jnp.copy, state)
    out = step(fresh()); jax.block_until_ready(out)
    ts = []
    for _ in range(5):
        st = fresh(); jax.block_until_ready(st)
        t = time.perf_counter()
        for _ in range(16):
            st = step(st)[0]
        jax.block_until_ready(st)
        ts.append((time.perf_counter() - t) / 16 * 1e3)
    lg = np.asarray(st.logits)
    print(B, "step ms min/med", round(min(ts), 2), round(float(np.median(ts)), 2), "logits sum", float(lg.astype(np.float64).sum()), flush=True)
