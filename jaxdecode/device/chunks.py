"""Chunked prefill into KV pages, and the new rows of admitted requests (the engine's device
side of admission; docs/serving.md "Paged KV").

`prefill_chunk` runs one chunk of each of B prompts -- tokens [B, T], row i at positions
start[i] .. start[i]+T-1 -- through the model over the engine's page pool, each row with its
own page table: a chunk's K/V land in its row's pages, its queries attend to every earlier
position of the row (pages written by earlier chunks, or mapped from the prefix cache) and
causally within the chunk. It returns the logits of each chunk's last real token. A prompt is
prefilled in chunks that start at multiples of the chunk size from position 0; a row's
arithmetic does not depend on the rows beside it (row tiles, key blocks, fixed sums:
docs/batch_invariance.md; tests/test_batch_invariance.py checks chunk calls of 1 to 8 rows
bitwise), so the bits of a page depend only on the tokens up to it and the program's length T
(engine/pages.py keys the prefix cache on exactly that).

After a prompt's last chunk, `new_rows` builds the rows that start decoding from its logits --
the request, and the other samples of its prompt, which share its prompt pages -- each with
its own settings, key, page table and grammar state; `slots.insert` scatters them into their
slots. A plain engine does both for every prompt of a chunk call at once, and selects their
first tokens (`start_rows`). `copy_pages` gives each sample its own copy of the prompt's
partial last page (copy on write: that page receives output tokens). `write_pages` restores a
saved row's K/V into pages.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Optional

import jax
import jax.numpy as jnp

from jaxdecode.device import cache_ops, numerics
from jaxdecode.device import research as research_lib
from jaxdecode.device.decode import adapter_keyword, first_tokens, kv_len_keyword, last_logits
from jaxdecode.device.speculative.state import SpecState
from jaxdecode.device.state import RowParams, StepOutput, StepState
from jaxdecode.model_api import DecoderModel, PagedKVCache

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class ChunkConfig:
    """Static part of a chunk: the model (and a speculative engine's draft, whose pool is
    written too), the attention bucket covering start + T, and the rows of the logits it
    returns (0: the call's own; more: zero rows after them, so that what reads them has one
    shape whatever the call's rows)."""

    model: DecoderModel
    kv_len: int
    draft: Optional[DecoderModel] = None
    logit_rows: int = 0


def _write(model: DecoderModel, params: Any, pool: PagedKVCache, tokens: Array, start: Array,
           length: Array, table: Array, kv_len: int,
           adapters: Optional[Array] = None) -> tuple[PagedKVCache, Array]:
    view = pool.replace(page_table=table, lengths=start)
    positions = start[:, None] + jnp.arange(tokens.shape[1], dtype=jnp.int32)[None, :]
    last, out = last_logits(model, params, tokens, positions, view, length,
                            **kv_len_keyword(model, kv_len), **adapter_keyword(model, adapters))
    return pool.replace(**out.pools), last


@cache_ops.shared_tables
def prefill_chunk(state: Any, params: Any, draft_params: Any, tokens: Array, start: Array,
                  length: Array, table: Array, adapters: Array, *,
                  config: ChunkConfig) -> tuple[Any, Array]:
    """One chunk of each of B rows (tokens int32[B, T], start / length int32[B], table
    int32[B, P], adapters int32[B]: each row's LoRA adapter index, contract R6) into the pool
    (module docstring). Returns the state and the logits f32[B, V] after each chunk's last real
    token (f32[config.logit_rows, V], zero rows after them)."""
    state, logits = _prefill_chunk(state, params, draft_params, tokens, start, length, table,
                                   adapters, config)
    extra = max(0, config.logit_rows - logits.shape[0])
    return state, jnp.pad(logits, ((0, extra), (0, 0)))


def _prefill_chunk(state: Any, params: Any, draft_params: Any, tokens: Array, start: Array,
                   length: Array, table: Array, adapters: Array,
                   config: ChunkConfig) -> tuple[Any, Array]:
    if isinstance(state, SpecState):
        tcache, logits = _write(config.model, params, state.tcache, tokens, start, length, table,
                                config.kv_len, adapters)
        state = state.replace(tcache=tcache)
        if config.draft is not None:
            dcache, _ = _write(config.draft, draft_params, state.dcache, tokens, start, length,
                               table, config.kv_len)
            state = state.replace(dcache=dcache)
        return state, logits
    cache, logits = _write(config.model, params, state.cache, tokens, start, length, table,
                           config.kv_len, adapters)
    return state.replace(cache=cache), logits


@numerics.jit
def logits_row(logits: Array, row: Array) -> Array:
    """Row `row` (int32, traced: one program per call size) of a chunk call's logits, f32[1, V]."""
    return jax.lax.dynamic_slice_in_dim(logits, row, 1)


@dataclasses.dataclass(frozen=True)
class RowsConfig:
    """Static part of new rows: the kind of state, its positions per row, the engine's custom
    processors, whether the state carries grammar states, whether it has a draft cache."""

    speculative: bool
    max_len: int
    research: Optional[research_lib.ResearchConfig] = None
    grammar: bool = False
    draft: bool = False


def _per_row(x: Array, n: int) -> Array:
    return jnp.broadcast_to(x, (n,) + x.shape[1:])


def _row_fields(rows: RowParams, seen: Array, resume: dict) -> dict:
    """The fields every kind of new row has: settings, the prompt's token set seen bool[n, V],
    step and penalty counts (`resume`'s, else zero), not done, not paused, running."""
    n, vocab = seen.shape
    zeros = jnp.zeros((n,), jnp.int32)
    return dict(rows=rows, step=resume.get("step", zeros),
                counts=resume.get("counts", jnp.zeros((n, vocab), jnp.int32)), seen=seen,
                done=jnp.zeros((n,), bool), paused=jnp.zeros((n,), bool), finish=zeros)


def _plain_rows(fields: dict, logits: Array, lengths: Array, tables: Array, max_len: int,
                resume: dict) -> StepState:
    """New plain rows: `_row_fields`, logits f32[n, V], the prompt's pages and length."""
    n = lengths.shape[0]
    return StepState(**fields, cache=PagedKVCache(k=None, v=None, page_table=tables,
                                                  lengths=lengths, max_len=max_len),
                     logits=logits,
                     last_token=resume.get("last_token", jnp.full((n,), -1, jnp.int32)))


@numerics.jit(static_argnums=(0,))
def new_rows(config: RowsConfig, logits: Array, prompt: Array, length: Array, rows: RowParams,
             tables: Array, grammar_state: Optional[Array] = None, resume: Optional[dict] = None,
             research_args: Any = None) -> Any:
    """n rows that start decoding after a prompt (prompt int32[1, T] right-padded, length
    int32[1]; its last chunk's logits f32[1, V]): settings `rows` and page tables int32[n, P]
    per row; the grammar state int32[n] when the state has one; `resume` (step, counts,
    last_token, prompt_length; [n, ...] each) for a request rebuilt after a failed step, whose
    "prompt" ends with the tokens it had selected. A StepState, or a SpecState when
    `config.speculative` (caches hold the prompt but its last token, which is pending)."""
    n, vocab = rows.bias.shape
    real = jnp.arange(prompt.shape[1])[None, :] < length[:, None]
    seen = jnp.zeros((1, vocab), bool).at[jnp.zeros_like(prompt), prompt].max(real)
    zeros = jnp.zeros((n,), jnp.int32)
    resume = resume or {}
    lengths = _per_row(length, n)
    pages = lambda lens: PagedKVCache(k=None, v=None, page_table=tables,  # noqa: E731
                                      lengths=lens, max_len=config.max_len)
    common = _row_fields(rows, _per_row(seen, n), resume)
    if config.speculative:
        hist = jnp.zeros((n, config.max_len), jnp.int32).at[:, :prompt.shape[1]].set(
            jnp.where(real, prompt, 0))
        state = SpecState(**common, tcache=pages(lengths - 1), hist=hist,
                          lpbuf=jnp.zeros((n, config.max_len), jnp.float32), length=lengths,
                          proposed=zeros, accepted=zeros, target_tokens=zeros,
                          iterations=zeros)
        if config.draft:
            state = state.replace(dcache=pages(lengths - 1), lag=jnp.zeros((n,), bool))
    else:
        state = _plain_rows(common, _per_row(logits, n), lengths, tables, config.max_len,
                            resume)
    if config.grammar:
        state = state.replace(grammar_state=grammar_state)
    if config.research is not None:
        rs = research_lib.initial_state(config.research, research_args, _per_row(prompt, n),
                                        lengths, config.max_len, {})
        if "prompt_length" in resume:  # the prompt ends where the output began
            rs = rs.replace(prompt_length=resume["prompt_length"])
        state = state.replace(research=rs)
    return state


@dataclasses.dataclass(frozen=True)
class StartConfig:
    """Static part of `start_rows`: positions per row and the top log-probabilities of the
    first tokens."""

    max_len: int
    top_logprobs: int = 0


@cache_ops.shared_tables
def start_rows(state: StepState, logits: Array, which: Array, seen: Array, lengths: Array,
               rows: RowParams, tables: Array, slots: Array,
               grammar_state: Optional[Array] = None, resume: Optional[dict] = None, *,
               config: StartConfig) -> tuple[StepState, StepOutput]:
    """Every row that starts decoding after a chunk call, in one call (a plain state): row i
    from row which[i] of that call's logits f32[rows, V], with the prompt's token set
    seen bool[n, V], its length, settings, page table int32[n, P], grammar state and `resume`
    (step, counts, last_token: a request rebuilt after a failed step), scattered into slot
    slots[i] (past the last row: a padding row, dropped). Returns the state and each row's
    first token, selected as `decode.first_tokens` selects it from the inserted row."""
    resume = resume or {}
    pad = slots >= state.done.shape[0]
    new = _plain_rows(_row_fields(rows, seen, resume), logits[which], lengths, tables,
                      config.max_len, resume)
    if grammar_state is not None:
        new = new.replace(grammar_state=grammar_state)
    state = cache_ops.scatter_rows(state, new, slots)
    inserted = cache_ops.take_rows(state, jnp.where(pad, slots[0], slots))
    return state, first_tokens(inserted, config.top_logprobs)


def _pools(state: Any) -> list[str]:
    """The fields of a state that hold page pools."""
    if isinstance(state, SpecState):
        return ["tcache"] + (["dcache"] if state.dcache is not None else [])
    return ["cache"]


@cache_ops.shared_tables
def copy_pages(state: Any, src: Array, dst: Array) -> Any:
    """Page dst[i] becomes a copy of page src[i] in every pool of the state, every layer."""
    def copy(pool):
        return pool.replace(**{name: x.at[:, :, dst].set(x[:, :, src])
                               for name, x in pool.pools.items()})

    return state.replace(**{f: copy(getattr(state, f)) for f in _pools(state)})


@cache_ops.shared_tables
def write_pages(state: Any, pages: Array, saved: dict) -> Any:
    """A saved row's pools (`PagedKVCache.pools`: keys and values [layers, kv_heads,
    n * page_size, head_dim], an int8 pool's scales without head_dim) written into `pages`
    int32[n] of a plain state's pool (restoring a saved request)."""
    pool = state.cache

    def put(x, row):  # the pool is kv heads first
        shape = row.shape[:2] + (pages.shape[0], pool.page_size) + row.shape[3:]
        return x.at[:, :, pages].set(row.reshape(shape).swapaxes(0, 1).astype(x.dtype))

    return state.replace(cache=pool.replace(**{name: put(x, saved[name])
                                               for name, x in pool.pools.items()}))
