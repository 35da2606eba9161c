import time, jax, jax.numpy as jnp, numpy as np
import models.layers as L
from jaxdecode.device import numerics
opts = numerics.compiler_options()
def timeit(f, *a):
    jax.block_until_ready(f(*a)); ts=[]
    for _ in range(7):
        t=time.perf_counter(); jax.block_until_ready(f(*a)); ts.append(time.perf_counter()-t)
    return min(ts)*1e3
rng = np.random.default_rng(0)
shapes = [(512,512)]*4 + [(512,1376)]*2 + [(1376,512)]
W = [[jnp.asarray(rng.standard_normal(s)*0.05, jnp.float32) for s in shapes] for _ in range(8)]
def model(x, W, tile):
    for ws in W:
        outs = [L.dense(x if w.shape[0]==512 else jnp.concatenate([x,x,x[..., :352]], -1), w, tile) for w in ws]
        x = x + sum(o[..., :512] for o in outs)
    return x
for B, T in [(1, 16), (4, 16), (16, 16), (1, 256)]:
    x = jnp.asarray(rng.standard_normal((B, T, 512)), jnp.float32)
    for size in [16, 64]:
        f = jax.jit(lambda x, W, r: model(x, W, L.Tiles(size, r)), compiler_options=opts)
        print(B, T, "tile", size, f"{timeit(f, x, W, jnp.int32(B)):.1f} ms")
    f = jax.jit(lambda x, W: model(x, W, None), compiler_options=opts)
    print(B, T, "plain", f"{timeit(f, x, W):.1f} ms")
