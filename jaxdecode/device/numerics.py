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

from jaxdecode.model_api import fixed_sum

Array = jax.Array

# The backends whose batch invariance the test suite checks bitwise (tests/test_batch_invariance.py)
TESTED_BACKENDS = ("cpu",)
# Rows of every decoding program: XLA simplifies a batch of one row (its unit dimensions)
# into another program, whose fused multiply-adds differ; a lone request gets a done row.
MIN_ROWS = 2
# Options of every program the decoder compiles: XLA:CPU's Eigen products instead of jaxlib
# 0.10's default YNNPACK fusions -- about twice as fast for the decoder's small row tiles
# (docs/performance.md "YNNPACK products"), and batch invariant at 4-row tiles
# (models/layers.py ROW_TILE; docs/batch_invariance.md).
COMPILER_OPTIONS = {"xla_cpu_experimental_ynn_fusion_type": ""}


def jit(fun=None, **kwargs):
    """`jax.jit` with COMPILER_OPTIONS (also as a decorator factory: `@jit(static_argnums=...)`)."""
    if fun is None:
        return functools.partial(jit, **kwargs)
    return jax.jit(fun, compiler_options=COMPILER_OPTIONS, **kwargs)


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
    jaxdecode.model_api), else "none"; `bitwise` is True only for such a model on a backend the
    suite checks (the decoder's own sums are invariant everywhere; the model's products are
    tested on XLA:CPU only -- see docs/batch_invariance.md for accelerators)."""
    declared = bool(getattr(model, "batch_invariant", False))
    return {"mode": "row_tiles" if declared else "none", "backend": backend,
            "bitwise": declared and backend in TESTED_BACKENDS}
