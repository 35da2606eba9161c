"""Device-side slot operations of the engine: a batch of `max_slots` rows in one StepState.

Admitted requests are prefilled one by one, each at its own prompt bucket (batch invariance),
and scattered into free slots; ending a request marks its row done; back-pressure pauses rows.
Slot indices and masks are arrays, so admitting a request never recompiles.
"""

from __future__ import annotations

import functools
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxdecode.device import research as research_lib
from jaxdecode.config import SamplingParams
from jaxdecode.model_api import params_dtype
from jaxdecode.model_api import DecoderModel, cache_sharding, fit_spec
from jaxdecode.device.state import RowParams, StepState


def empty_state(model: DecoderModel, params: Any, slots: int, max_len: int,
                eos_token_ids: Sequence[int], mesh: Optional[Any] = None,
                research: Optional[Any] = None, research_args: Optional[Any] = None
                ) -> StepState:
    """Every row done: a step over it selects and writes nothing. With a `jax.sharding.Mesh`,
    the state is created already placed by `state_sharding` (the jitted steps then keep it
    partitioned: GSPMD follows the shardings of their inputs). `research` (the engine's custom
    processors, jaxdecode/research.py) adds their per-row carry, empty."""
    rows = RowParams.build([SamplingParams()] * slots, model.config.vocab_size, eos_token_ids,
                           keys=np.zeros((slots, 2), np.uint32))
    args = (model, params_dtype(params), max_len, rows, research, research_args)
    if mesh is None:
        return _empty_state(*args)
    shardings = state_sharding(mesh, jax.eval_shape(_empty_state, *args))
    return jax.jit(_empty_state_fn, static_argnums=(0, 1, 2, 4), out_shardings=shardings)(*args)


def state_sharding(mesh: Any, state: StepState) -> StepState:
    """`NamedSharding`s for a StepState (arrays or shape structs): the cache by the rules of
    `model_api.CACHE_RULES`, per-row arrays with the batch on "data" (replicated when the slot
    count is not divisible), the shared grammar tables replicated."""
    batch = state.cache.batch

    def row(leaf):
        spec = ("data",) if leaf.ndim and leaf.shape[0] == batch else ()
        return NamedSharding(mesh, fit_spec(spec, leaf.shape, mesh))

    rest = jax.tree.map(row, state.replace(cache=None, grammar=None))
    grammar = jax.tree.map(lambda _: NamedSharding(mesh, PartitionSpec()), state.grammar)
    return rest.replace(cache=cache_sharding(mesh, state.cache), grammar=grammar)


def _empty_state_fn(model: DecoderModel, dtype: Any, max_len: int, rows: RowParams,
                    research: Optional[Any] = None, research_args: Optional[Any] = None
                    ) -> StepState:
    extra = {}
    if research is not None:
        empty = jnp.zeros((rows.bias.shape[0], 1), jnp.int32)
        extra["research"] = research_lib.initial_state(research, research_args, empty,
                                                       empty[:, 0], max_len, {})
    slots, vocab = rows.bias.shape
    return StepState(cache=model.init_cache(slots, max_len, dtype),
                     logits=jnp.zeros((slots, vocab), jnp.float32),
                     last_token=jnp.full((slots,), -1, jnp.int32),
                     step=jnp.zeros((slots,), jnp.int32),
                     counts=jnp.zeros((slots, vocab), jnp.int32),
                     seen=jnp.zeros((slots, vocab), bool), done=jnp.ones((slots,), bool),
                     paused=jnp.zeros((slots,), bool), finish=jnp.zeros((slots,), jnp.int32),
                     rows=rows, **extra)


_empty_state = jax.jit(_empty_state_fn, static_argnums=(0, 1, 2, 4))


def keep_tables(fn):
    """Jit `fn(state, ...)` with the state donated, except the shared grammar tables
    (`state.grammar`, on StepState and SpecState alike), which other states and the table cache
    also hold: they pass through untouched. Arguments of the state's type lose theirs too."""
    jitted = jax.jit(fn, donate_argnums=(0,))

    @functools.wraps(fn)
    def call(state, *args):
        tables = state.grammar
        args = [a.replace(grammar=None) if isinstance(a, type(state)) else a for a in args]
        return jitted(state.replace(grammar=None), *args).replace(grammar=tables)

    return call


@keep_tables
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


@keep_tables
def set_flags(state: StepState, release: jax.Array, paused: jax.Array) -> StepState:
    """Mark released rows done and set the paused mask (bool[slots] each)."""
    return state.replace(done=state.done | release, paused=paused)
