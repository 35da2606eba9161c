"""Chunk-call time (16-token prompts, attention bucket 128), llama-512, in the tree of cwd."""
import sys, os, time, numpy as np
sys.path.insert(0, os.getcwd())
import jax, models
from jaxdecode.engine import step_ops
model, params, _ = models.load("/work/ckpt512")
ctx = step_ops.Context(model, params, 16, 2048, model.config.eos_token_ids)
be = ctx.backend
state = be.empty_state()
P = ctx.pages_per_row
tables = (1 + np.arange(16)[:, None] * P + np.arange(P)[None]).astype(np.int32)
for B in (1, 8, 16):
    toks = np.ones((B, 16), np.int32); st = np.zeros((B,), np.int32); ln = np.full((B,), 15, np.int32)
    ts = []
    for rep in range(7):
        t0 = time.perf_counter()
        state, lg = be.chunk(state, toks, st, ln, tables[:B], 128)
        jax.block_until_ready(lg)
        ts.append(time.perf_counter() - t0)
    dt = float(np.median(ts[1:]))
    print(sys.argv[1], f"T=16 rows={B}: {dt*1e3:.1f} ms/call {dt*1e3/B:.1f} ms/row", flush=True)
