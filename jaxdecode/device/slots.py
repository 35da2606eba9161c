"""Device-side slot operations of the engine: a batch of rows in one state (a `StepState`, or
a speculative `SpecState`) over one pool of KV pages (`model_api.PagedKVCache`), whatever
backend runs it.

The empty state has every row done, so a step over it selects and writes nothing; its pool
holds `num_pages` pages (page 0 is the null page unused table entries point at). Prompts are
written into pages by chunked prefills and their rows set up (chunks.py); `insert` scatters new
rows into free slots and `set_flags` marks released rows done and paused rows paused. Row
indices, page tables and masks are arrays, so admitting a request never recompiles.
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
from jaxdecode.device import cache_ops, numerics
from jaxdecode.device import research as research_lib
from jaxdecode.device.speculative.state import SpecState
from jaxdecode.device.state import RowParams, StepState
from jaxdecode.model_api import DecoderModel, PagedKVCache, cache_sharding, fit_spec

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class SlotConfig:
    """Static part of the engine's slot state: the model (and, for a speculative state, the
    draft), the pools' dtypes, the positions per row, the pool (pages including the null page,
    page size), the engine's custom processors."""

    model: DecoderModel
    dtype: Any
    max_len: int
    num_pages: int
    page_size: int
    research: Optional[research_lib.ResearchConfig] = None
    speculative: bool = False
    draft: Optional[DecoderModel] = None
    draft_dtype: Any = None

    def pool(self, model: DecoderModel, rows: int, dtype: Any) -> PagedKVCache:
        c = model.config
        return PagedKVCache.zeros(c.num_layers, c.num_kv_heads, self.num_pages, self.page_size,
                                  c.head_dim, rows, self.max_len, dtype)


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
    return StepState(cache=config.pool(config.model, b, config.dtype),
                     logits=jnp.zeros((b, vocab), jnp.float32),
                     last_token=jnp.full((b,), -1, jnp.int32), step=jnp.zeros((b,), jnp.int32),
                     counts=jnp.zeros((b, vocab), jnp.int32), seen=jnp.zeros((b, vocab), bool),
                     done=jnp.ones((b,), bool), paused=jnp.zeros((b,), bool),
                     finish=jnp.zeros((b,), jnp.int32), rows=rows, **extra)


def _speculative(config: SlotConfig, rows: RowParams, research_args: Any = None) -> SpecState:
    b, vocab = rows.bias.shape
    zeros = jnp.zeros((b,), jnp.int32)
    state = SpecState(rows=rows, tcache=config.pool(config.model, b, config.dtype),
                      hist=jnp.zeros((b, config.max_len), jnp.int32),
                      lpbuf=jnp.zeros((b, config.max_len), jnp.float32),
                      length=jnp.ones((b,), jnp.int32), step=zeros,
                      counts=jnp.zeros((b, vocab), jnp.int32),
                      seen=jnp.zeros((b, vocab), bool), done=jnp.ones((b,), bool),
                      paused=jnp.zeros((b,), bool), finish=zeros, proposed=zeros,
                      accepted=zeros, target_tokens=zeros, iterations=zeros)
    if config.draft is not None:
        state = state.replace(dcache=config.pool(config.draft, b, config.draft_dtype),
                              lag=jnp.zeros((b,), bool))
    return state


def _empty_state(config: SlotConfig, rows: RowParams, research_args: Any = None):
    return (_speculative if config.speculative else _plain)(config, rows, research_args)


_empty = numerics.jit(_empty_state, static_argnums=(0,))


def empty_state(config: SlotConfig, rows: RowParams, *, mesh: Optional[Any] = None,
                research_args: Any = None) -> Any:
    """Every row done (a step over it selects and writes nothing): a StepState, or a SpecState
    when `config.speculative`. With a `jax.sharding.Mesh`, the state is created already placed
    by `state_sharding` (the jitted steps then keep it partitioned: GSPMD follows the
    shardings of their inputs). Custom processors (`config.research`) add their per-row
    carry, empty."""
    if mesh is None:
        return _empty(config, rows, research_args)
    shardings = state_sharding(mesh, jax.eval_shape(
        functools.partial(_empty_state, config), rows, research_args))
    build = numerics.jit(_empty_state, static_argnums=(0,), out_shardings=shardings)
    return build(config, rows, research_args)


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
