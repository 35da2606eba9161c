"""Device-side slot operations of the engine: a batch of rows in one state (a `StepState`, or
a speculative `SpecState`), whatever backend runs it.

Admitted requests are prefilled one by one, each at its own prompt bucket (batch invariance),
and scattered into free rows (`insert`); ending a request marks its row done and
back-pressure pauses rows (`set_flags`). Row indices and masks are arrays, so admitting a
request never recompiles. The empty states are built here too: every row done, so a step over
them selects and writes nothing.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxdecode.config import SamplingParams
from jaxdecode.device import cache_ops, decode
from jaxdecode.device import research as research_lib
from jaxdecode.device.speculative.state import SpecState
from jaxdecode.device.state import RowParams, StepState
from jaxdecode.model_api import DecoderModel, cache_sharding, fit_spec

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class SlotConfig:
    """Static part of an empty slot state: the model (and the draft, for a speculative state),
    the caches' dtypes, the cache length, the engine's custom processors."""

    model: DecoderModel
    dtype: Any
    max_len: int
    research: Optional[research_lib.ResearchConfig] = None
    draft: Optional[DecoderModel] = None
    draft_dtype: Any = None


def empty_rows(rows: int, vocab_size: int, eos_token_ids: Sequence[int]) -> RowParams:
    """RowParams of `rows` default rows (host arrays), keys zero."""
    return RowParams.build([SamplingParams()] * rows, vocab_size, eos_token_ids,
                           keys=np.zeros((rows, 2), np.uint32))


def _plain(config: SlotConfig, rows: RowParams, research_args: Any = None) -> StepState:
    extra = {}
    if config.research is not None:
        empty = jnp.zeros((rows.bias.shape[0], 1), jnp.int32)
        extra["research"] = research_lib.initial_state(config.research, research_args, empty,
                                                       empty[:, 0], config.max_len, {})
    b, vocab = rows.bias.shape
    return StepState(cache=config.model.init_cache(b, config.max_len, config.dtype),
                     logits=jnp.zeros((b, vocab), jnp.float32),
                     last_token=jnp.full((b,), -1, jnp.int32), step=jnp.zeros((b,), jnp.int32),
                     counts=jnp.zeros((b, vocab), jnp.int32), seen=jnp.zeros((b, vocab), bool),
                     done=jnp.ones((b,), bool), paused=jnp.zeros((b,), bool),
                     finish=jnp.zeros((b,), jnp.int32), rows=rows, **extra)


def _speculative(config: SlotConfig, rows: RowParams, research_args: Any = None) -> SpecState:
    b, vocab = rows.bias.shape
    zeros = jnp.zeros((b,), jnp.int32)
    state = SpecState(rows=rows, tcache=config.model.init_cache(b, config.max_len, config.dtype),
                      hist=jnp.zeros((b, config.max_len), jnp.int32),
                      lpbuf=jnp.zeros((b, config.max_len), jnp.float32),
                      length=jnp.ones((b,), jnp.int32), step=zeros,
                      counts=jnp.zeros((b, vocab), jnp.int32),
                      seen=jnp.zeros((b, vocab), bool), done=jnp.ones((b,), bool),
                      paused=jnp.zeros((b,), bool), finish=zeros, proposed=zeros,
                      accepted=zeros, target_tokens=zeros, iterations=zeros)
    if config.draft is not None:
        state = state.replace(dcache=config.draft.init_cache(b, config.max_len,
                                                             config.draft_dtype),
                              lag=jnp.zeros((b,), bool))
    return state


@functools.partial(jax.jit, static_argnums=(0, 1))
def _empty(config: SlotConfig, speculative: bool, rows: RowParams, research_args: Any = None):
    return (_speculative if speculative else _plain)(config, rows, research_args)


def empty_state(config: SlotConfig, rows: RowParams, *, speculative: bool = False,
                mesh: Optional[Any] = None, research_args: Any = None) -> Any:
    """Every row done (a step over it selects and writes nothing): a StepState, or a SpecState
    with `speculative`. With a `jax.sharding.Mesh`, the state is created already placed by
    `state_sharding` (the jitted steps then keep it partitioned: GSPMD follows the shardings of
    their inputs). Custom processors (`config.research`) add their per-row carry, empty."""
    if mesh is None:
        return _empty(config, speculative, rows, research_args)
    shardings = state_sharding(mesh, jax.eval_shape(_empty, config, speculative, rows,
                                                    research_args))
    build = jax.jit(_empty, static_argnums=(0, 1), out_shardings=shardings)
    return build(config, speculative, rows, research_args)


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


@cache_ops.shared_tables
def insert(state: Any, rows: Any, slots: Array) -> Any:
    """Scatter the rows of a freshly prefilled state into rows `slots` (int32[n]; an index past
    the last row drops that row)."""
    return cache_ops.scatter_rows(state, rows, slots)


@cache_ops.shared_tables
def set_flags(state: Any, release: Array, paused: Array) -> Any:
    """Mark released rows done and set the paused mask (bool[rows] each)."""
    return state.replace(done=state.done | release, paused=paused)


@functools.partial(jax.jit, static_argnums=(0,))
def prefill_speculative(config: Any, tparams: Any, dparams: Any, tokens: Array, lengths: Array,
                        rows: RowParams) -> SpecState:
    """Freshly prefilled speculative rows (tokens int32[n, T] right-padded, T <= max_len;
    `config` a SlotConfig): caches hold the prompt but its last token (pending), the history
    holds the prompt. Only the draft's cache is kept: the round recomputes its logits."""
    n, t = tokens.shape
    st = decode.prefill(decode.PrefillConfig(config.model, config.max_len), tparams, tokens,
                        lengths, rows)
    zeros = jnp.zeros((n,), jnp.int32)
    state = SpecState(rows=rows, tcache=st.cache.replace(lengths=st.cache.lengths - 1),
                      hist=jnp.zeros((n, config.max_len), jnp.int32).at[:, :t].set(tokens),
                      lpbuf=jnp.zeros((n, config.max_len), jnp.float32), length=lengths,
                      step=zeros, counts=st.counts, seen=st.seen, done=jnp.zeros((n,), bool),
                      paused=jnp.zeros((n,), bool), finish=zeros, proposed=zeros,
                      accepted=zeros, target_tokens=zeros, iterations=zeros)
    if config.draft is not None:
        dcache = decode.prefill(decode.PrefillConfig(config.draft, config.max_len), dparams,
                                tokens, lengths, rows).cache
        state = state.replace(dcache=dcache.replace(lengths=dcache.lengths - 1),
                              lag=jnp.zeros((n,), bool))
    return state

