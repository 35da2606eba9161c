import numpy as np, jax, jax.numpy as jnp
rng = np.random.default_rng(0)
for (k, n, tr) in [(512, 8192, False), (512, 8192, True), (512, 1376, False), (1376, 512, False), (32, 128, True), (32, 64, False)]:
    w = jnp.asarray(rng.standard_normal((n, k) if tr else (k, n), np.float32))
    dims = (((1,), (1 if tr else 0,)), ((), ()))
    f = jax.jit(lambda x: jax.lax.dot_general(x, w, dims))
    res = []
    for tile in (2, 4, 6, 8, 12, 16, 24, 32):
        x = rng.standard_normal((tile, k)).astype(np.float32)
        full = np.asarray(f(jnp.asarray(x)))
        bad = []
        for pos in range(tile):
            y = np.zeros_like(x); y[0] = x[pos]
            if not np.array_equal(np.asarray(f(jnp.asarray(y)))[0], full[pos]): bad.append(pos)
        res.append(f"{tile}:{'ok' if not bad else bad}")
    print(k, n, "T" if tr else "N", " ".join(res), flush=True)
