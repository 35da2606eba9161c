"""Slot backends: how the engine runs its device (JetStream's prefill / insert / generate).

A backend owns the device programs of one kind of step over a fixed batch of rows. The engine
never branches on the kind: every step returns up to K tokens per row (`StepResult`), plain
decoding being K = 1 and speculative decoding K = k + 1, and the output processor feeds them
through one per-token path.

    empty_state()                  every row done, an empty page pool
    chunk(state, tokens, start, length, tables, kv_len)
                                   one prefill chunk of each of n rows into its pages
                                   (rows padded to shapes.row_bucket) -> logits
    new_rows(logits, prompt, length, rows, tables, ...)
                                   the rows that start decoding after a prompt
    insert(state, rows, slots)     scatter new rows into slots
    copy_pages(state, src, dst)    copy on write of a shared partial page
    set_flags(state, release, paused)
    first_tokens(state, slots, top_k)
                                   the first token of rows whose prefill just ended, selected
                                   as their first step will select it (None: the backend
                                   does not stream it early)
    step(state, kv_len, top_k, steps, rows)
                                   one step over every row (or over `rows` only, when the
                                   backend `compacts`) -> (state, device output); the plain
                                   backend may run `steps` decode steps in one call
    fetch(out, top_k)              the one host transfer of a step -> StepResult
    kv_needed(request, steps)      the attention positions the next step needs for a request
    warmup(state, chunks, prompt widths, kv buckets, top-ks, row counts)
    observe(request, result, slot) per-row bookkeeping once a step is processed

Both backends are pure device code over `jaxdecode.device` (the KV cache in pages:
`model_api.PagedKVCache`); they hold no request state except the speculative acceptance
counters. Page allocation is the host's (engine/pages.py).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Optional, Protocol, Sequence

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxdecode.device import chunks, decode, numerics, slots
from jaxdecode.device.cache_ops import shared_tables
from jaxdecode.device.speculative import RoundConfig, spec_round
from jaxdecode.device.state import RowParams
from jaxdecode.engine.speculative import COUNTERS, SpeculativeConfig
from jaxdecode.model_api import DecoderModel, params_dtype
from jaxdecode.shapes import row_bucket


@dataclasses.dataclass
class StepResult:
    """One step's host output, B rows, K positions, N top logprobs (0 when not asked):
    tokens int32[B, K] in order (-1 past `counts`); counts int32[B] tokens emitted (0 for an
    empty, done or paused row); finish int32[B] the finish code of a row's last token (every
    earlier one is RUNNING); logprob f32[B, K] raw log-probabilities; top_ids / top_logprobs
    [B, K, N]; accepted int32[B] draft tokens among the emitted ones (speculative), or None."""

    tokens: np.ndarray
    counts: np.ndarray
    finish: np.ndarray
    logprob: np.ndarray
    top_ids: np.ndarray
    top_logprobs: np.ndarray
    accepted: Optional[np.ndarray] = None


class SlotBackend(Protocol):
    def empty_state(self) -> Any: ...
    def chunk(self, state: Any, tokens: np.ndarray, start: np.ndarray, length: np.ndarray,
              tables: np.ndarray, kv_len: int) -> tuple[Any, Any]: ...
    def new_rows(self, logits: Any, prompt: np.ndarray, length: int, rows: RowParams,
             tables: np.ndarray, grammar_state: Optional[np.ndarray] = None,
             resume: Optional[dict] = None) -> Any: ...
    def insert(self, state: Any, rows: Any, targets: np.ndarray) -> Any: ...
    def copy_pages(self, state: Any, src: np.ndarray, dst: np.ndarray) -> Any: ...
    def set_flags(self, state: Any, release: np.ndarray, paused: np.ndarray) -> Any: ...
    def first_tokens(self, state: Any, slots: np.ndarray, top_k: int) -> Any: ...
    def step(self, state: Any, kv_len: int, top_k: int, steps: int = 1,
             rows: Optional[np.ndarray] = None) -> tuple[Any, Any]: ...
    def fetch(self, out: Any, top_k: int) -> StepResult: ...
    def kv_needed(self, r: Any, steps: int = 1) -> int: ...
    def warmup(self, state: Any, chunk_shapes: Sequence[tuple], prompt_widths: Sequence[int],
               kv_buckets: Sequence[int], top_ks: Sequence[int],
               row_counts: Sequence[int] = ()) -> Any: ...
    def observe(self, r: Any, result: StepResult, slot: int) -> None: ...


@dataclasses.dataclass(frozen=True)
class Pages:
    """The page pool's shape: pages (including the null page 0) and positions per page."""

    num_pages: int
    page_size: int


class _Rows:
    """What both backends share: the model, the slot count, the page pool, the empty state,
    chunked prefill, new rows, insert, copies and flags.

    replicate_outputs: gather each step's output onto every device of `mesh`, so the leader
    can read it when the state is spread over other hosts' devices (a collective: the leader
    and its followers agree, step_ops.Context)."""

    speculative = False
    compacts = False  # `step` runs a subset of rows (`rows`)

    def __init__(self, model: DecoderModel, params: Any, rows: int, max_len: int,
                 eos_token_ids: Sequence[int], pages: Pages, research: Optional[Any] = None,
                 mesh: Optional[Any] = None, replicate_outputs: bool = False,
                 draft: Optional[DecoderModel] = None, draft_params: Any = None):
        self.model, self.params, self.rows, self.max_len = model, params, rows, max_len
        self.eos_token_ids, self.research, self.mesh = tuple(eos_token_ids), research, mesh
        self.pages, self.draft, self.draft_params = pages, draft, draft_params
        self.replicate_outputs = replicate_outputs and mesh is not None
        self.slot_config = slots.SlotConfig(
            model, params_dtype(params), max_len, pages.num_pages, pages.page_size,
            None if research is None else research.config, self.speculative, draft,
            None if draft is None else params_dtype(draft_params))

    def _research(self) -> dict:
        return {} if self.research is None else {"research_args": self.research.args}

    def _output(self, out: Any) -> Any:
        return _replicator(self.mesh)(out) if self.replicate_outputs else out

    def empty_state(self) -> Any:
        rows = slots.empty_rows(self.rows, self.model.config.vocab_size, self.eos_token_ids)
        return slots.empty_state(self.slot_config, rows, mesh=self.mesh, **self._research())

    def chunk(self, state: Any, tokens: np.ndarray, start: np.ndarray, length: np.ndarray,
              tables: np.ndarray, kv_len: int) -> tuple[Any, Any]:
        """Chunks of n rows (tokens int32[n, T], start / length int32[n], tables int32[n, P])
        in one call of `shapes.row_bucket(n)` rows; the padding rows (length 0, the null page)
        write nothing and the model skips their weight products. Returns the state and the
        logits f32[rows, V] (row i: chunk i)."""
        pad = row_bucket(len(tokens)) - len(tokens)
        rows = lambda x: np.concatenate(  # noqa: E731
            [np.asarray(x, np.int32), np.zeros((pad,) + np.shape(x)[1:], np.int32)])
        config = chunks.ChunkConfig(self.model, kv_len, self.draft)
        return chunks.prefill_chunk(state, self.params, self.draft_params, rows(tokens),
                                    rows(start), rows(length), rows(tables), config=config)

    def new_rows(self, logits: Any, prompt: np.ndarray, length: int, rows: RowParams,
             tables: np.ndarray, grammar_state: Optional[np.ndarray] = None,
             resume: Optional[dict] = None) -> Any:
        config = chunks.RowsConfig(self.speculative, self.max_len, self.slot_config.research,
                                   grammar_state is not None, self.draft is not None)
        return chunks.new_rows(config, logits, prompt[None], np.array([length], np.int32),
                               rows, tables, grammar_state, resume, **self._research())

    def insert(self, state: Any, rows: Any, targets: np.ndarray) -> Any:
        return slots.insert(state, rows, targets)

    def copy_pages(self, state: Any, src: np.ndarray, dst: np.ndarray) -> Any:
        return chunks.copy_pages(state, src, dst)

    def set_flags(self, state: Any, release: np.ndarray, paused: np.ndarray) -> Any:
        return slots.set_flags(state, release, paused)

    def observe(self, r: Any, result: StepResult, slot: int) -> None:
        return None

    def first_tokens(self, state: Any, slots: np.ndarray, top_k: int) -> Any:
        return None

    def warmup(self, state: Any, chunk_shapes: Sequence[tuple], prompt_widths: Sequence[int],
               kv_buckets: Sequence[int], top_ks: Sequence[int],
               row_counts: Sequence[int] = ()) -> Any:
        """Compile each chunk program (rows, length T, attention bucket), the new rows for each
        prompt width and their insert, the flags, and the step for each attention bucket and
        top-k, over every row and over each of `row_counts` rows (tables point at the null
        page; the inserted row is dropped)."""
        table = np.zeros((-(-self.max_len // self.pages.page_size),), np.int32)
        first = None
        for n, t, kv in chunk_shapes:
            one = np.ones((n,), np.int32)
            state, logits = self.chunk(state, np.zeros((n, t), np.int32), np.zeros_like(one), one,
                                       np.zeros((n,) + table.shape, np.int32), kv)
            first = chunks.logits_row(logits, np.int32(0))
        params = slots.empty_rows(1, self.model.config.vocab_size, self.eos_token_ids)
        for width in prompt_widths:
            grammar = None if state.grammar_state is None else np.full((1,), -1, np.int32)
            new = self.new_rows(first, np.zeros((width,), np.int32), 1, params, table[None],
                            grammar)
            state = self.insert(state, new, np.full((1,), self.rows, np.int32))
        flags = np.zeros((self.rows,), bool)
        state = self.set_flags(state, flags, flags)
        subsets = [None] + [np.arange(n, dtype=np.int32) for n in row_counts if self.compacts]
        for kv in kv_buckets:
            for top_k in top_ks:
                for rows in subsets:
                    state, out = self.step(state, kv, top_k, rows=rows)
        for n in sorted({first_rows(n) for n in range(1, self.rows + 1)}):
            for top_k in top_ks:
                self.first_tokens(state, np.zeros((n,), np.int32), top_k)
        return state


class PlainBackend(_Rows):
    """K = steps: `steps` decode steps per engine step, one program for any count
    (`decode.decode_steps_jit`, the loop body of `jd.generate`), over the live rows only when
    they are few (`compacts`; not with a mesh, whose rows are spread over devices); with
    research options one `decode.decode_step` over every row (their per-step outputs; a
    processor may couple rows)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.compacts = self.research is None and self.mesh is None

    def first_tokens(self, state: Any, slots: np.ndarray, top_k: int) -> Any:
        """`decode.first_tokens` of rows `slots` (n of them) in a call of
        `first_rows(n)` rows (the first slot repeated pads it); output row i is slots[i]. None with research options (a processor may couple
        rows, and their outputs come with the step) or a mesh (rows on other devices)."""
        if not self.compacts:
            return None
        rows = np.full((first_rows(len(slots)),), slots[0], np.int32)
        rows[:len(slots)] = slots
        return decode.first_tokens(state, rows, top_logprobs=top_k)

    def step(self, state: Any, kv_len: int, top_k: int, steps: int = 1,
             rows: Optional[np.ndarray] = None) -> tuple[Any, Any]:
        config = decode.StepConfig(self.model, top_k, kv_len, self.slot_config.research)
        if rows is not None and not self.compacts:
            raise ValueError("rows: this backend steps every row")
        if self.research is None:
            loop = decode.LoopConfig(config, decode.MAX_STEPS_PER_CALL)
            state, out = decode.decode_steps_jit(state, self.params, np.int32(steps), rows,
                                                 config=loop)
        elif steps == 1:
            state, out = decode.decode_step_jit(state, self.params, config=config,
                                                **self._research())
        else:
            raise ValueError("steps: one decode step per call with research options")
        return state, self._output(out)

    def fetch(self, out: Any, top_k: int) -> StepResult:
        arrays = (out.token, out.finish) + ((out.logprob, out.top_ids, out.top_logprobs)
                                            if top_k else ())
        fetched = jax.device_get(arrays)  # one transfer
        token, finish = fetched[:2]
        per_token = fetched[2:]
        if token.ndim == 1:  # one step: its step axis
            token, per_token = token[:, None], [x[:, None] for x in per_token]
        b, k = token.shape
        logprob, top_ids, top_lp = (per_token if top_k else
                                    (np.zeros((b, k), np.float32), np.zeros((b, k, 0), np.int32),
                                     np.zeros((b, k, 0), np.float32)))
        return StepResult(tokens=token, counts=(token >= 0).sum(1).astype(np.int32),
                          finish=finish, logprob=logprob, top_ids=top_ids, top_logprobs=top_lp)

    def kv_needed(self, r: Any, steps: int = 1) -> int:
        """Prompt, dispatched steps and the tokens this step writes."""
        return len(r.prompt_ids) + r.dispatched + steps


def first_rows(n: int) -> int:
    """The rows of a `first_tokens` call for n new rows: a power of two, at least
    numerics.MIN_ROWS (warm-up compiles each)."""
    return max(row_bucket(n), numerics.MIN_ROWS)


@functools.lru_cache(maxsize=None)
def _replicator(mesh: Any):
    """`tree` gathered onto every device of `mesh` (a collective: every process calls it)."""
    return jax.jit(lambda tree: tree, out_shardings=NamedSharding(mesh, PartitionSpec()))


@shared_tables
def _round(state: Any, tparams: Any, dparams: Any, *, config: RoundConfig):
    return spec_round(config, tparams, dparams, state)


class SpeculativeBackend(_Rows):
    """K = k + 1: one `speculative.spec_round` per engine step over every slot (one loop body
    with `jd.speculative_generate`). Keeps the acceptance counters (`stats`)."""

    speculative = True

    def __init__(self, spec: SpeculativeConfig, *args, **kwargs):
        super().__init__(*args, draft=spec.draft, draft_params=spec.draft_params, **kwargs)
        self.spec = spec
        self.totals = dict.fromkeys(COUNTERS, 0)

    def step(self, state: Any, kv_len: int, top_k: int, steps: int = 1,
             rows: Optional[np.ndarray] = None) -> tuple[Any, Any]:
        if steps != 1 or rows is not None:
            raise ValueError("steps: a speculative engine runs one round over every row")
        spec = self.spec
        config = RoundConfig(self.model, spec.draft, spec.k, spec.ngrams, kv_len, top_k,
                             spec.num_branches)
        state, out = _round(state, self.params, spec.draft_params, config=config)
        return state, self._output(out)

    def fetch(self, out: Any, top_k: int) -> StepResult:
        out = jax.device_get(out)  # one transfer (the top-k arrays are empty when 0)
        return StepResult(tokens=out.tokens, counts=out.count, finish=out.finish,
                          logprob=out.logprob, top_ids=out.top_ids,
                          top_logprobs=out.top_logprobs, accepted=out.accepted)

    def kv_needed(self, r: Any, steps: int = 1) -> int:
        """An upper bound of L + k + 1 for the round about to be dispatched: the prompt, the
        processed tokens and k + 1 tokens for each round in flight and this one."""
        return len(r.prompt_ids) + r.selected + (self.spec.k + 1) * (r.in_flight + 1)

    def observe(self, r: Any, result: StepResult, slot: int) -> None:
        """Add one processed round of `r` to its counters and the engine's."""
        emitted, accepted = int(result.counts[slot]), int(result.accepted[slot])
        if emitted == 0:
            return
        add = {"proposed": self.spec.k * self.spec.num_branches, "accepted": accepted,
               "target_tokens": emitted - accepted, "iterations": 1}
        mine = r.speculative if r.speculative is not None else dict.fromkeys(COUNTERS, 0)
        for name, value in add.items():
            self.totals[name] += value
            mine[name] += value
        r.speculative = mine
        r.lifecycle.record("speculative.round", round=mine["iterations"], emitted=emitted,
                           accepted=accepted)

    def stats(self) -> dict:
        """Engine totals over every processed round: proposed, accepted, target_tokens,
        iterations, and mean_accepted_length = tokens per round (1.0 = no gain)."""
        out = dict(self.totals)
        out["mean_accepted_length"] = ((out["accepted"] + out["target_tokens"])
                                       / max(1, out["iterations"]))
        return out
