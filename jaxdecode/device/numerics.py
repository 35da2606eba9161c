"""Batch-invariant numerics of the decoder (docs/batch_invariance.md, X1).

A row's logits, processed distribution and selected token must not depend on the batch it sits
in. On XLA:CPU the order of a reduction follows the whole array's shape (a row's sum changes
with the number of rows), so every sum over the vocabulary in the device code -- the softmax
of top-p / min-p, the final log-softmax, the raw log-probabilities -- goes through
`invariance.fixed_sum`, whose layout depends on the row alone. Max, argmax, sorts, cumulative
sums and elementwise arithmetic are exact or row-local already. The model side is
`jaxdecode.invariance`'s; `jit` builds every decoder program (with its probes), `guarantee`
states what a record can promise.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from jaxdecode import invariance
from jaxdecode.invariance import (  # noqa: F401 -- re-exported for the decoder's programs
    ROW_TILE, compiler_options, fixed_sum)

Array = jax.Array

# The backends whose batch invariance the test suite checks bitwise (tests/test_batch_invariance.py)
TESTED_BACKENDS = ("cpu",)
# Rows of every decoding program: XLA simplifies a batch of one row (its unit dimensions)
# into another program, whose fused multiply-adds differ; a lone request gets a done row.
MIN_ROWS = 2


def min_rows(model: Any) -> int:
    """The fewest rows a decoding program of `model` runs: MIN_ROWS for a batch-invariant model,
    1 without invariance (the fast path: a lone row's products are matrix-vector products)."""
    return MIN_ROWS if invariance.mode_of(model) != "none" else 1


def jit(fun=None, **kwargs):
    """`jax.jit` with `compiler_options()`, created at the first call (so the backend is chosen
    and started by then); also a decorator factory: `@jit(static_argnums=...)`. jax accepts
    compiler options on a top-level jit only: a function jitted here is never called inside
    another one's trace (jit the undecorated function instead, as `slots.empty_state` does).
    A trace that meets product shapes no probe has answered (`invariance.ProbesNeeded`) is
    abandoned, the probes run, and the program is traced again: probes run when a program is
    built, never inside its trace."""
    if fun is None:
        return functools.partial(jit, **kwargs)
    jitted = []

    @functools.wraps(fun)
    def traced(*args, **kw):
        with invariance.recording() as missing:
            out = fun(*args, **kw)
        if missing:
            raise invariance.ProbesNeeded(frozenset(missing))
        return out

    @functools.wraps(fun)
    def call(*args, **kw):
        if not jitted:
            jitted.append(jax.jit(traced, compiler_options=compiler_options(), **kwargs))
        try:
            return jitted[0](*args, **kw)
        except invariance.ProbesNeeded as needed:
            invariance.run_probes(needed.shapes)
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
    """What a generation record states about batch invariance (docs/contract.md X1): `mode` is
    the construction the model ran (`invariance.mode_of`: "row_tiles", "fixed_shape", or
    "none" for a model without batch-invariant numerics -- `batch_invariant=False` or a model
    that declares none), and then `row_tile` its rows per product tile (the invariance holds
    for that tile); `bitwise` is True only for an invariant model on a backend the suite checks
    (docs/batch_invariance.md for accelerators)."""
    mode = invariance.mode_of(model)
    out = {"mode": mode, "backend": backend,
           "bitwise": mode != "none" and backend in TESTED_BACKENDS}
    if mode != "none":
        out["row_tile"] = int(getattr(model, "row_tile", ROW_TILE))
    return out
