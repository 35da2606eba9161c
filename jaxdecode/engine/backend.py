"""Slot backends: how the engine runs its device (JetStream's prefill / insert / generate).

A backend owns the device programs of one kind of step over a fixed batch of rows. The engine
never branches on the kind: every step returns up to K tokens per row (`StepResult`), plain
decoding being K = 1 and speculative decoding K = k + 1, and the output processor feeds them
through one per-token path.

    empty_state()                  every row done, an empty page pool
    chunk(state, tokens, start, length, tables, kv_len, adapters)
                                   one prefill chunk of each of n rows into its pages
                                   (rows padded to shapes.row_bucket) -> logits
    start(state, logits, finals, top_k)
                                   the rows that start decoding after the prompts whose last
                                   chunk that call ran (`NewRows`), with their copies on
                                   write -> (state, their first tokens, selected as their
                                   first step will select them; None: the backend does not
                                   stream them early)
    insert(state, rows, slots)     scatter new rows into slots (a restored row)
    set_flags(state, release, paused)
    step(state, kv_len, top_k, steps, rows)
                                   one step over every row (or over `rows` only, when the
                                   backend `compacts`) -> (state, device output); the plain
                                   backend may run `steps` decode steps in one call
    fetch(out, top_k)              the one host transfer of a step -> StepResult
    kv_needed(request, placement, steps)
                                   the attention positions the next step needs for a request
                                   (its scheduler `Placement`: steps dispatched, in flight)
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

from jaxdecode import kv_int8
from jaxdecode.device import chunks, decode, numerics, slots
from jaxdecode.device.cache_ops import shared_tables
from jaxdecode.device.speculative import RoundConfig, spec_round
from jaxdecode.device.state import RowParams
from jaxdecode.engine.speculative import COUNTERS, SpeculativeConfig
from jaxdecode.model_api import DecoderModel, params_dtype
from jaxdecode.shapes import power_of_two, row_bucket


@dataclasses.dataclass
class NewRows:
    """What the last chunk of a prompt sets up: the prompt (int32[T], padded) and its length,
    and per row that starts decoding from it (the request and the samples sharing its
    prompt pages): its slot, page table, settings, grammar state (when the engine has
    constraints) and `resume` arrays (step, counts, last token, prompt length) for a request
    rebuilt after a failed step; `copies` (src, dst) pages copied first (copy on write)."""

    prompt: np.ndarray
    prompt_length: int
    slots: np.ndarray
    tables: np.ndarray
    rows: RowParams
    grammar_state: Optional[np.ndarray] = None
    resume: Optional[tuple] = None
    copies: tuple = (np.zeros((0,), np.int32), np.zeros((0,), np.int32))


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
              tables: np.ndarray, kv_len: int,
              adapters: Optional[np.ndarray] = None) -> tuple[Any, Any]: ...
    def start(self, state: Any, logits: Any, finals: Sequence[tuple[int, NewRows]],
              top_k: int = 0) -> tuple[Any, Any]: ...
    def insert(self, state: Any, rows: Any, targets: np.ndarray) -> Any: ...
    def set_flags(self, state: Any, release: np.ndarray, paused: np.ndarray) -> Any: ...
    def step(self, state: Any, kv_len: int, top_k: int, steps: int = 1,
             rows: Optional[np.ndarray] = None) -> tuple[Any, Any]: ...
    def fetch(self, out: Any, top_k: int) -> StepResult: ...
    def kv_needed(self, r: Any, placed: Any, steps: int = 1) -> int: ...
    def warmup(self, state: Any, chunk_shapes: Sequence[tuple], prompt_widths: Sequence[int],
               kv_buckets: Sequence[int], top_ks: Sequence[int],
               row_counts: Sequence[int] = ()) -> Any: ...
    def observe(self, r: Any, result: StepResult, slot: int) -> None: ...


@dataclasses.dataclass(frozen=True)
class Pages:
    """The page pool's shape: pages (including the null page 0) and positions per page; its
    `kv_cache_dtype` ("auto": the weights' dtype, or "int8": jaxdecode/kv_int8.py)."""

    num_pages: int
    page_size: int
    kv_cache_dtype: str = "auto"


class _Rows:
    """What both backends share: the model, the slot count, the page pool, the empty state,
    chunked prefill, new rows, insert, copies and flags.

    replicate_outputs: gather each step's output onto every device of `mesh`, so the leader
    can read it when the state is spread over other hosts' devices (a collective: the leader
    and its followers agree, runner.Context)."""

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
            model, kv_int8.pool_dtype(pages.kv_cache_dtype, params_dtype(params)), max_len,
            pages.num_pages, pages.page_size, None if research is None else research.config,
            self.speculative, draft, None if draft is None else kv_int8.pool_dtype(
                pages.kv_cache_dtype, params_dtype(draft_params)))

    def _research(self) -> dict:
        return {} if self.research is None else {"research_args": self.research.args}

    def _output(self, out: Any) -> Any:
        return _replicator(self.mesh)(out) if self.replicate_outputs else out

    def empty_state(self) -> Any:
        rows = slots.empty_rows(self.rows, self.model.config.vocab_size, self.eos_token_ids)
        return slots.empty_state(self.slot_config, rows, mesh=self.mesh, **self._research())

    def chunk(self, state: Any, tokens: np.ndarray, start: np.ndarray, length: np.ndarray,
              tables: np.ndarray, kv_len: int,
              adapters: Optional[np.ndarray] = None) -> tuple[Any, Any]:
        """Chunks of n rows (tokens int32[n, T], start / length int32[n], tables int32[n, P],
        adapters int32[n]: LoRA adapter indices, default 0) in one call of `shapes.row_bucket(n)` rows; the padding rows (length 0, the null page)
        write nothing and the model skips their weight products. Returns the state and the
        logits f32[row_bucket(self.rows), V] (row i: chunk i; one shape for `start`)."""
        pad = row_bucket(len(tokens)) - len(tokens)
        rows = lambda x: np.concatenate(  # noqa: E731
            [np.asarray(x, np.int32), np.zeros((pad,) + np.shape(x)[1:], np.int32)])
        config = chunks.ChunkConfig(self.model, kv_len, self.draft, row_bucket(self.rows))
        adapters = np.zeros((len(tokens),), np.int32) if adapters is None else adapters
        return chunks.prefill_chunk(state, self.params, self.draft_params, rows(tokens),
                                    rows(start), rows(length), rows(tables), rows(adapters),
                                    config=config)

    def start(self, state: Any, logits: Any, finals: Sequence[tuple[int, NewRows]],
              top_k: int = 0) -> tuple[Any, Any]:
        """After a chunk call (its logits f32[rows, V]), the rows of each final (chunk row,
        `NewRows`): its copies on write, then each row built from the prompt's logits with its
        own settings and page table, and inserted into its slot -- three calls a row. No first
        tokens: this backend's first step selects them."""
        for row, final in finals:
            state = _copies(state, final)
            one_logits = chunks.logits_row(logits, np.int32(row))
            for i, slot in enumerate(final.slots):
                new = self._new_row(one_logits, final, i)
                state = self.insert(state, new, np.array([slot], np.int32))
        return state, None

    def _new_row(self, logits: Any, final: NewRows, i: int) -> Any:
        """Row i of a final, one row (chunks.new_rows) from its prompt's logits f32[1, V]."""
        one = lambda x: x[i:i + 1]  # noqa: E731
        resume = None
        if final.resume is not None:
            resume = dict(zip(("step", "counts", "last_token", "prompt_length"),
                              map(one, final.resume)))
            if self.speculative:  # a SpecState keeps its history
                del resume["last_token"]
        grammar = None if final.grammar_state is None else one(final.grammar_state)
        config = chunks.RowsConfig(self.speculative, self.max_len, self.slot_config.research,
                                   grammar is not None, self.draft is not None)
        return chunks.new_rows(config, logits, final.prompt[None],
                               np.array([final.prompt_length], np.int32),
                               decode.one_row(final.rows, i), one(final.tables), grammar, resume,
                               **self._research())

    def insert(self, state: Any, rows: Any, targets: np.ndarray) -> Any:
        return slots.insert(state, rows, targets)

    def set_flags(self, state: Any, release: np.ndarray, paused: np.ndarray) -> Any:
        return slots.set_flags(state, release, paused)

    def observe(self, r: Any, result: StepResult, slot: int) -> None:
        return None

    def warmup(self, state: Any, chunk_shapes: Sequence[tuple], prompt_widths: Sequence[int],
               kv_buckets: Sequence[int], top_ks: Sequence[int],
               row_counts: Sequence[int] = ()) -> Any:
        """Compile each chunk program (rows, length T, attention bucket), the new rows for each
        prompt width and their insert, the flags, and the step for each attention bucket and
        top-k, over every row and over each of `row_counts` rows (tables point at the null
        page; the inserted row is dropped)."""
        table = np.zeros((-(-self.max_len // self.pages.page_size),), np.int32)
        logits = None
        for n, t, kv in chunk_shapes:
            one = np.ones((n,), np.int32)
            state, logits = self.chunk(state, np.zeros((n, t), np.int32), np.zeros_like(one), one,
                                       np.zeros((n,) + table.shape, np.int32), kv)
        state = self._warm_start(state, logits, table, prompt_widths, top_ks)
        flags = np.zeros((self.rows,), bool)
        state = self.set_flags(state, flags, flags)
        subsets = [None] + [np.arange(n, dtype=np.int32) for n in row_counts if self.compacts]
        for kv in kv_buckets:
            for top_k in top_ks:
                for rows in subsets:
                    state, out = self.step(state, kv, top_k, rows=rows)
        return state

    def _warm_start(self, state: Any, logits: Any, table: np.ndarray,
                    prompt_widths: Sequence[int], top_ks: Sequence[int]) -> Any:
        """`start`'s programs: a new row for each prompt width (dropped)."""
        for width in prompt_widths:
            state, _ = self.start(state, logits, [(0, self._dropped(state, table, 1, width))])
        return state

    def _dropped(self, state: Any, table: np.ndarray, n: int, width: int) -> NewRows:
        """A final of n default rows that `start` drops (slots past the last row)."""
        grammar = None if state.grammar_state is None else np.full((n,), -1, np.int32)
        return NewRows(np.zeros((width,), np.int32), 1, np.full((n,), self.rows, np.int32),
                       np.broadcast_to(table, (n,) + table.shape),
                       slots.empty_rows(n, self.model.config.vocab_size, self.eos_token_ids),
                       grammar)


def _copies(state: Any, final: NewRows) -> Any:
    src, dst = final.copies
    return chunks.copy_pages(state, src, dst) if src.size else state


class PlainBackend(_Rows):
    """K = steps: `steps` decode steps per engine step, one program for any count
    (`decode.decode_steps_jit`, the loop body of `jd.generate`), over the live rows only when
    they are few (`compacts`; not with a mesh, whose rows are spread over devices); with
    research options one `decode.decode_step` over every row (their per-step outputs; a
    processor may couple rows)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.compacts = self.research is None and self.mesh is None

    def start(self, state: Any, logits: Any, finals: Sequence[tuple[int, NewRows]],
              top_k: int = 0) -> tuple[Any, Any]:
        """Every final's rows in one call (`chunks.start_rows`, `first_rows(n)` rows, padding
        rows dropped) after the copies, with their first tokens (output row i: the i-th new
        row, finals in order). Row by row, with no first tokens, with research options (a
        processor may couple rows, and their outputs come with the step) or a mesh (rows on
        other devices)."""
        if not self.compacts or not finals:
            return super().start(state, logits, finals, top_k)
        for _, final in finals:
            state = _copies(state, final)
        return chunks.start_rows(state, logits, *self._start_arrays(finals),
                                 config=chunks.StartConfig(self.max_len, top_k))

    def _start_arrays(self, finals: Sequence[tuple[int, NewRows]]) -> tuple:
        """`chunks.start_rows`'s host inputs, the rows of every final stacked and padded."""
        vocab = self.model.config.vocab_size
        n = sum(len(f.slots) for _, f in finals)
        size = first_rows(n, numerics.min_rows(self.model))
        which = np.zeros((size,), np.int32)
        seen = np.zeros((size, vocab), bool)
        lengths = np.zeros((size,), np.int32)
        tables = np.zeros((size, finals[0][1].tables.shape[1]), np.int32)
        targets = np.full((size,), self.rows, np.int32)
        params = [f.rows for _, f in finals] + [slots.empty_rows(size - n, vocab,
                                                                 self.eos_token_ids)]
        rows = jax.tree.map(lambda *xs: np.concatenate(xs), *params)
        grammar = (None if finals[0][1].grammar_state is None
                   else np.full((size,), -1, np.int32))
        resume = None
        if any(f.resume is not None for _, f in finals):
            resume = {"step": np.zeros((size,), np.int32),
                      "counts": np.zeros((size, vocab), np.int32),
                      "last_token": np.full((size,), -1, np.int32)}
        i = 0
        for row, f in finals:
            j = i + len(f.slots)
            which[i:j], lengths[i:j], tables[i:j], targets[i:j] = (
                row, f.prompt_length, f.tables, f.slots)
            seen[i:j, f.prompt[:f.prompt_length]] = True
            if grammar is not None:
                grammar[i:j] = f.grammar_state
            if f.resume is not None:  # the first rows of the group (only r selected any)
                for name, value in zip(("step", "counts", "last_token"), f.resume):
                    resume[name][i:i + len(value)] = value
            i = j
        return which, seen, lengths, rows, tables, targets, grammar, resume

    def _warm_start(self, state: Any, logits: Any, table: np.ndarray,
                    prompt_widths: Sequence[int], top_ks: Sequence[int]) -> Any:
        """`start`'s programs: one call for each row count and top-k (rows dropped)."""
        if not self.compacts:
            return super()._warm_start(state, logits, table, prompt_widths, top_ks)
        least = numerics.min_rows(self.model)
        for n in sorted({first_rows(n, least) for n in range(1, self.rows + 1)}):
            for top_k in top_ks:
                state, _ = self.start(state, logits, [(0, self._dropped(state, table, n, 1))],
                                      top_k)
        return state

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

    def kv_needed(self, r: Any, placed: Any, steps: int = 1) -> int:
        """Prompt, dispatched steps and the tokens this step writes."""
        return len(r.prompt_ids) + placed.dispatched + steps


def first_rows(n: int, least: int) -> int:
    """The rows of a `start` call for n new rows: a power of two, at least `least`
    (`numerics.min_rows`; warm-up compiles each; a start call costs little per padding row)."""
    return max(power_of_two(n), least)


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

    def kv_needed(self, r: Any, placed: Any, steps: int = 1) -> int:
        """An upper bound of L + k + 1 for the round about to be dispatched: the prompt, the
        processed tokens and k + 1 tokens for each round in flight and this one."""
        return len(r.prompt_ids) + r.selected + (self.spec.k + 1) * (placed.in_flight + 1)

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
