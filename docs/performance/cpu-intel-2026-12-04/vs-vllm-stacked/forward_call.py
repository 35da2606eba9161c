import sys, time, jax, jax.numpy as jnp, numpy as np
from serving.loading import load_model
from jaxdecode.device import numerics
model, params, tok = load_model("/work/ckpt512")
model = model.with_row_tile(int(sys.argv[1]))
def run(B, T):
    cache = model.init_cache(B, 128, jnp.float32)
    f = numerics.jit(lambda p, t, pos, c, l: model.forward(p, t, pos, c, lengths=l, kv_len=128, last_only=True)[0])
    toks = jnp.ones((B, T), jnp.int32); pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    l = jnp.full((B,), T, jnp.int32)
    jax.block_until_ready(f(params, toks, pos, cache, l))
    ts = []
    for _ in range(5):
        t0 = time.perf_counter(); jax.block_until_ready(f(params, toks, pos, cache, l)); ts.append(time.perf_counter() - t0)
    return min(ts) * 1e3
for B, T in [(2, 16), (16, 16), (16, 1), (2, 256)]:
    print(sys.argv[1], B, T, f"{run(B, T):.1f} ms")
import models.layers as L
orig = L.attention
L.attention = lambda q, k, v, *a, **kw: q
print("no attention:")
for B, T in [(2, 16), (16, 16)]:
    print(sys.argv[1], B, T, f"{run(B, T):.1f} ms")
