"""Selection, SPEC §3 step 6, with per-request keys (SPEC X1).

The key of row r at step t (1-based) is `fold_in(request_key[r], t)`: it depends only on the
request's seed and the step, never on the row's slot or on its neighbours. Rows with
temperature 0 take the argmax (the greedy branch).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxdecode.state import RowParams

Array = jax.Array


def step_keys(rows: RowParams, t: Array) -> Array:
    """Typed keys[B] for step t (int32[B], 1-based)."""
    base = jax.vmap(jax.random.wrap_key_data)(rows.keys)
    return jax.vmap(jax.random.fold_in)(base, t)


def select(logprobs: Array, rows: RowParams, t: Array) -> Array:
    """logprobs f32[B, V] (already processed) -> int32[B] selected ids."""
    greedy = jnp.argmax(logprobs, axis=-1)
    sampled = jax.vmap(jax.random.categorical)(step_keys(rows, t), logprobs)
    return jnp.where(rows.temperature == 0, greedy, sampled).astype(jnp.int32)
