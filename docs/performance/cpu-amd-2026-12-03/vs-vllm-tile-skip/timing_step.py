import sys, time, numpy as np, jax, models
from jaxdecode.engine import step_ops
model, params, _ = models.load("/work/ckpt512")
ctx = step_ops.Context(model, params, 16, 2048, model.config.eos_token_ids)
be = ctx.backend
state = be.empty_state()
for kv in (128, 256, 128, 256):
    ts = []
    for rep in range(12):
        t0 = time.perf_counter()
        state, out = be.step(state, kv, 0)
        jax.block_until_ready(out)
        ts.append(time.perf_counter() - t0)
    print(sys.argv[1], f"step kv={kv} 16 rows: {np.median(ts[2:])*1e3:.1f} ms", flush=True)
