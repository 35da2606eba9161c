"""Device-side slot operations of the engine: a batch of `max_slots` rows in one StepState.

Requests admitted together are prefilled as one batch (padded to a power of two, their longest
prompt's bucket) and scattered into free slots;
ending a request marks its row done; back-pressure pauses rows. Slot indices and masks are
arrays, so admitting a request never recompiles.
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxdecode.config import SamplingParams
from jaxdecode.decode import params_dtype
from jaxdecode.model_api import DecoderModel
from jaxdecode.state import RowParams, StepState


def empty_state(model: DecoderModel, params: Any, slots: int, max_len: int,
                eos_token_ids: Sequence[int]) -> StepState:
    """Every row done: a step over it selects and writes nothing."""
    rows = RowParams.build([SamplingParams()] * slots, model.config.vocab_size, eos_token_ids,
                           keys=np.zeros((slots, 2), np.uint32))
    return _empty_state(model, params_dtype(params), max_len, rows)


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _empty_state(model: DecoderModel, dtype: Any, max_len: int, rows: RowParams) -> StepState:
    slots, vocab = rows.bias.shape
    return StepState(cache=model.init_cache(slots, max_len, dtype),
                     logits=jnp.zeros((slots, vocab), jnp.float32),
                     last_token=jnp.full((slots,), -1, jnp.int32),
                     step=jnp.zeros((slots,), jnp.int32),
                     counts=jnp.zeros((slots, vocab), jnp.int32),
                     seen=jnp.zeros((slots, vocab), bool), done=jnp.ones((slots,), bool),
                     paused=jnp.zeros((slots,), bool), finish=jnp.zeros((slots,), jnp.int32),
                     rows=rows)


def _keep_tables(fn):
    """Donate the state to `fn` except the shared grammar tables (`StepState.grammar`), which
    other states and the table cache also hold: they pass through untouched."""
    jitted = jax.jit(fn, donate_argnums=(0,))

    @functools.wraps(fn)
    def call(state: StepState, *args) -> StepState:
        tables = state.grammar
        args = [a.replace(grammar=None) if isinstance(a, StepState) else a for a in args]
        return jitted(state.replace(grammar=None), *args).replace(grammar=tables)

    return call


@_keep_tables
def insert(state: StepState, rows: StepState, slots: jax.Array) -> StepState:
    """Scatter the rows of a freshly prefilled state into `slots` (int32[n]; an index past the
    last slot drops that row, which pads a prefill batch). The cache's batch axis is 1."""
    def put(axis):
        def scatter(big, small):
            index = (slice(None),) * axis + (slots,)
            return big.at[index].set(small.astype(big.dtype), mode="drop")
        return scatter

    cache = state.cache.replace(k=put(1)(state.cache.k, rows.cache.k),
                                v=put(1)(state.cache.v, rows.cache.v),
                                lengths=put(0)(state.cache.lengths, rows.cache.lengths))
    rest = jax.tree.map(put(0), state.replace(cache=None), rows.replace(cache=None))
    return rest.replace(cache=cache)


@_keep_tables
def set_flags(state: StepState, release: jax.Array, paused: jax.Array) -> StepState:
    """Mark released rows done and set the paused mask (bool[slots] each)."""
    return state.replace(done=state.done | release, paused=paused)
