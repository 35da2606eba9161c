import time, jax, jax.numpy as jnp, numpy as np
from jaxdecode.device import numerics
opts = numerics.compiler_options()
rng = np.random.default_rng(1)
plain = jax.jit(lambda x, w: jax.lax.dot_general(x, w, (((1,), (0,)), ((), ()))), compiler_options=opts)
for R in [16, 8, 4]:
  for K, N in [(512, 512), (512, 1376), (1376, 512), (512, 8192), (256, 768), (768, 256), (32, 64), (64, 32), (32, 128)]:
    w = jnp.asarray(rng.standard_normal((K, N)) * 0.05, jnp.float32)
    bad = []
    for m in [R, 2*R, 3*R, 4*R, 8*R, 16*R, 32*R, 64*R, 256*R]:
        x = np.asarray(rng.standard_normal((m, K)), np.float32)
        full = np.asarray(plain(x, w))
        ref = np.concatenate([np.asarray(plain(x[i:i+R], w)) for i in range(0, m, R)])
        if not np.array_equal(full, ref): bad.append(m)
    print(f"R{R} K{K} N{N}: stacked differs from tiles at m={bad}", flush=True)
