"""Batch-invariant numerics of the decoder (docs/batch_invariance.md).

A row's logits, processed distribution and selected token must not depend on the batch it sits
in. On XLA:CPU the order of a reduction follows the whole array's shape (a row's sum changes
with the number of rows), so every sum over the vocabulary in the device code -- the softmax
of top-p / min-p, the final log-softmax, the raw log-probabilities -- goes through
`model_api.fixed_sum`, whose layout depends on the row alone. Max, argmax, sorts, cumulative
sums and elementwise arithmetic are exact or row-local already. The model side (row tiles, key
blocks) is `models/layers.py`'s; `guarantee` states what a record can promise.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from jaxdecode.model_api import (  # noqa: F401 -- the product library, re-exported
    EIGEN_PRODUCTS, PRODUCTS_ENV, ROW_TILE, compiler_options, fixed_sum, place_invariant)

Array = jax.Array

# The backends whose batch invariance the test suite checks bitwise (tests/test_batch_invariance.py)
TESTED_BACKENDS = ("cpu",)
# Rows of every decoding program: XLA simplifies a batch of one row (its unit dimensions)
# into another program, whose fused multiply-adds differ; a lone request gets a done row.
MIN_ROWS = 2
@functools.cache
def check_row_tile(rows: int) -> None:
    """A model's `row_tile` (rows per weight-product tile) must keep every row's bits the same at
    every place of its tile under the products this process compiles with (`compiler_options`,
    which were chosen for `ROW_TILE` rows); raises ValueError naming `row_tile` where they do
    not. Checked on XLA:CPU, the backend whose invariance the suite tests."""
    if rows == ROW_TILE or jax.default_backend() not in TESTED_BACKENDS:
        return
    options = compiler_options()
    if not place_invariant(options, rows):
        library = "Eigen's" if options else "YNNPACK's"
        raise ValueError(
            f"row_tile: {library} products on this CPU give a row different bits at different "
            f"places of a {rows}-row tile, so a request's tokens would depend on its neighbours;"
            f" use row_tile {ROW_TILE} (the default) or another width that passes "
            "`jaxdecode.device.numerics.place_invariant`")


def jit(fun=None, **kwargs):
    """`jax.jit` with `compiler_options()`, created at the first call (so the backend is chosen
    and started by then); also a decorator factory: `@jit(static_argnums=...)`. jax accepts
    compiler options on a top-level jit only: a function jitted here is never called inside
    another one's trace (jit the undecorated function instead, as `slots.empty_state` does)."""
    if fun is None:
        return functools.partial(jit, **kwargs)
    jitted = []

    @functools.wraps(fun)
    def call(*args, **kw):
        if not jitted:
            jitted.append(jax.jit(fun, compiler_options=compiler_options(), **kwargs))
        return jitted[0](*args, **kw)

    return call


def _shifted(x: Array) -> Array:
    top = jnp.max(x, axis=-1, keepdims=True)
    return x - jax.lax.stop_gradient(jnp.where(jnp.isfinite(top), top, 0.0))


def log_softmax(x: Array) -> Array:
    """`jax.nn.log_softmax` over the last axis with the sum in `fixed_sum`'s layout."""
    z = _shifted(x)
    return z - jnp.log(fixed_sum(jnp.exp(z), -1, keepdims=True))


def softmax(x: Array) -> Array:
    """`jax.nn.softmax` over the last axis with the sum in `fixed_sum`'s layout."""
    e = jnp.exp(_shifted(x))
    return e / fixed_sum(e, -1, keepdims=True)


def guarantee(model: Any, backend: str) -> dict:
    """What a generation record states about batch invariance (SPEC §11, X1): `mode` is
    "row_tiles" when the model declares batch-invariant numerics (`batch_invariant`, see
    jaxdecode.model_api), else "none", and then `row_tile` its rows per product tile (the
    invariance holds for that tile); `bitwise` is True only for such a model on a backend the
    suite checks (the decoder's own sums are invariant everywhere; the model's products are
    tested on XLA:CPU only -- see docs/batch_invariance.md for accelerators)."""
    declared = bool(getattr(model, "batch_invariant", False))
    out = {"mode": "row_tiles" if declared else "none", "backend": backend,
           "bitwise": declared and backend in TESTED_BACKENDS}
    if declared:
        out["row_tile"] = int(getattr(model, "row_tile", ROW_TILE))
    return out
