"""Selection, contract §3 step 6, with per-request keys (contract X1).

The key of row r at step t (1-based) is `fold_in(request_key[r], t)`: it depends only on the
request's seed and the step, never on the row's slot or on its neighbours. Rows with
temperature 0 take the argmax (the greedy branch).
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from jaxdecode.device.state import RowParams

Array = jax.Array


def step_keys(rows: RowParams, t: Array) -> Array:
    """Typed keys[B] for step t (int32[B], 1-based)."""
    base = jax.vmap(jax.random.wrap_key_data)(rows.keys)
    return jax.vmap(jax.random.fold_in)(base, t)


def inverse_cdf(key: Array, logprobs: Array) -> Array:
    """One draw from a row's distribution with a single uniform: the first id whose cumulative
    probability exceeds u * total (ids of probability 0 are never chosen). One random number
    per row instead of one per vocabulary entry (Gumbel-max), the same distribution."""
    cdf = jnp.cumsum(jnp.exp(logprobs))
    u = jax.random.uniform(key, (), jnp.float32) * cdf[-1]
    return jnp.minimum(jnp.searchsorted(cdf, u, side="right"), logprobs.shape[-1] - 1)


def select(logprobs: Array, rows: RowParams, t: Array, live: Optional[Array] = None) -> Array:
    """logprobs f32[B, V] (already processed) -> int32[B] selected ids.

    The sampling branch is skipped entirely when every live row is greedy (`live` bool[B]:
    empty, ended and paused slots do not count; None: every row)."""
    greedy = jnp.argmax(logprobs, axis=-1).astype(jnp.int32)
    is_greedy = rows.temperature == 0

    def sample(_):
        drawn = jax.vmap(inverse_cdf)(step_keys(rows, t), logprobs).astype(jnp.int32)
        return jnp.where(is_greedy, greedy, drawn)

    skip = jnp.all(is_greedy if live is None else is_greedy | ~live)
    return jax.lax.cond(skip, lambda _: greedy, sample, None)
