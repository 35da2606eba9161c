"""`LLM`: continuous batching over fixed slots, with streaming, cancellation and deadlines.

JetStream-style: admitted requests are prefilled (each alone at its own prompt bucket, so a
row's numerics never depend on its neighbours: docs/batch_invariance.md) and inserted into free
slots; one jitted decode step runs over all slots (finished and empty rows are masked). One
engine thread owns the device state and runs the host loop:

    admit queued requests into free slots -> apply releases and pauses -> dispatch step t+1
    -> process step t's tokens (detokenize, stop-match, stream) -> ...

Step t+1 is dispatched before step t's tokens are processed, so host work overlaps the device
step (JAX async dispatch). Each dispatched step carries a snapshot of which request owned each
slot; a token is processed only for a request that is still live and still owns the slot (the
duplicate guard: a token selected after a request's terminal event is never emitted, SPEC L3).
Cancels and deadlines are observed at these safe points (SPEC L4, §8); `cancel()` only sets a
flag and returns at once (C4).

Usage (SPEC §9): selected = tokens the device chose for the request; processed = those written
into the cache while the request went on (`decode.completed`); returned = those whose text was
returned. With several endings on one token the one that ends the text wins (S9).

Log-probabilities (`SamplingParams.logprobs` = N > 0): every selected token's raw log-probability
and top N are kept with the request (`TokenLogprob`). The step computes a static top
`MAX_LOGPROBS` (the largest N allowed; `LLM.logprobs_k`, capped by the vocabulary) whenever some
live row asked, else none, so new values of N never recompile; only then are they fetched.
Reported are exactly the returned tokens (`usage.returned_tokens`; those hidden by a stop string,
a stop id or EOS are not), in order: each delta event carries, in `data["logprobs"]`, the
entries of the tokens that became returned since the previous delta (a token is returned once
its text begins inside the returned text), the final delta also those that showed no text;
`Completion.logprobs` holds them all.

Speculative decoding (`speculative=`, SPEC §10): each step is one verify round over all slots
that emits 1..k+1 tokens per row, fed to the same per-token path (jaxdecode/speculative_engine.py).

Streams without a reader: `generate()` uses the `final_only` kind, so nothing accumulates;
`submit()` keeps up to `max_buffered` unsent events under the chosen back-pressure policy.

Beam search (`SamplingParams.num_beams > 1`, SPEC §10) runs in the beam lane
(jaxdecode/beam_lane.py): at the safe point after the queue sweep the engine thread takes the
queued beam requests and runs them as `jd.beam_search` calls; slot rows get no step meanwhile.

One bad request never hurts another (issue #12): every check happens in `submit` / `generate`
before anything is queued (`_make_handle`: SamplingParams, the vocabulary, `admission.check`
on the values the device will run, the constraint compile within `compile_budget`), so the
engine thread never meets a value it cannot hold. Host work for one request runs `_isolated`
(an exception fails that request). A failed device step is `_recover`ed: the request behind it
is found by retrying the step without it and fails alone; the others are rebuilt from their
prompt and selected tokens (`_prefill_into`) and go on unchanged; `health()` is degraded until
a step succeeds again.

Custom processors (`LLM(processors=[jd.LogitProcessor, ...])`, jaxdecode/research.py) are set
at construction and apply to every request, slot steps and beam calls alike; each slot row
carries its own processor states, started from `init_state` at admission. They never come
over HTTP (the server runs no user code). Not combined with `speculative=` (use
`jd.speculative_generate(processors=...)`) nor with `save_request` / `restore_request`.
Records name them (`processors`), and `jd.replay` reports a difference. A request rebuilt
after a failed step (`_recover`) sees its own prompt length and step again, but a stateful
processor's state restarts from `init_state` (its `engine.resumed` event says so): its tokens
from there on may differ from an uninterrupted run.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import itertools
import logging
import os
import threading
import time
from typing import Any, Callable, Iterator, Optional, Sequence, Union

import jax
import numpy as np

from jaxdecode.engine import admission, beam_lane, faults
from jaxdecode.device import constraints, decode, numerics
from jaxdecode.engine import speculative_engine
from jaxdecode import replay as replay_lib
from jaxdecode.engine import request_state, step_ops
from jaxdecode.device import research
from jaxdecode.config import MAX_LOGPROBS, SamplingParams
from jaxdecode.host import Lifecycle, OrderedStream, TextPipeline
from jaxdecode.model_api import DecoderModel
from jaxdecode.prompts import token_row, token_rows
from jaxdecode.device.state import EOS, RUNNING, STOP_TOKEN, RowParams, seed_key_data
from jaxdecode.tokenization import encode, eos_token_id
from jaxdecode.types import (Completion, DecodingError, ErrorCode, FinishReason, RequestState,
                             TokenLogprob, Usage)

logger = logging.getLogger(__name__)

Prompt = Union[str, Sequence[int]]

KV_BUCKET_MIN = step_ops.KV_BUCKET_MIN
MAX_FAULTS = 3  # failed steps a request may be running in before it fails (LLM._recover)


class QueueFull(RuntimeError):
    """The admission queue is at `max_queue`; retry later (HTTP 429)."""


class EngineClosed(RuntimeError):
    """The engine was closed; it accepts no more requests."""


class RequestHandle:
    """A submitted request: its events, trace, cancellation and result."""

    def __init__(self, engine: "LLM", request_id: str, prompt_ids: list, sampling: SamplingParams,
                 prompt_text: Optional[str],
                 seed: int, key_data: np.ndarray, prompt_index: int, index: int,
                 output_kind: str, grammar: Optional[Any] = None,
                 device_sampling: Optional[SamplingParams] = None):
        self.request_id = request_id
        self.grammar = grammar  # constraints.CompiledIndex of its response_format, or None
        # the settings the device runs: max_tokens capped to the context (admission.check)
        self.device_sampling = device_sampling or sampling
        self.faults = 0  # failed engine steps this request was running in (LLM._recover)
        self.prompt_ids = prompt_ids
        self.prompt_text = prompt_text
        self.sampling = sampling
        self.seed = seed
        self.key_data = key_data
        self.prompt_index = prompt_index
        self.index = index
        self.deadline = (time.monotonic() + sampling.deadline_s
                         if sampling.deadline_s is not None else None)
        stream = OrderedStream(request_id, output_kind=output_kind,
                               max_buffered=engine.max_buffered, policy=engine.backpressure)
        self.lifecycle = Lifecycle(request_id, stream=stream, trace=engine.trace_events)
        self.pipeline = TextPipeline(
            engine.tokenizer, prompt_ids=prompt_ids, stop=sampling.stop,
            stop_token_sequences=sampling.stop_id_sequences,
            include_stop_in_output=sampling.include_stop_in_output,
            skip_special_tokens=sampling.skip_special_tokens, errors=sampling.utf8_errors)
        self.token_ids: list[int] = []
        # one TokenLogprob per selected token when the request asked for logprobs, else None
        self.logprobs: Optional[list[TokenLogprob]] = [] if sampling.logprobs else None
        self.reported = 0  # logprobs already sent in a delta
        self.selected = 0
        self.processed = 0
        self.dispatched = 0  # steps dispatched while in a slot (one may be ahead of `selected`)
        self.slot: Optional[int] = None
        self.error_message = ""
        self.user_paused = False   # pause(): the row skips steps, its state unchanged (B1)
        self.in_flight = 0         # dispatched steps of this row not yet processed
        self.restored: Optional[dict] = None  # saved arrays, when restored from disk
        self.speculative: Optional[dict] = None  # acceptance counters (speculative engine)
        self.beam_row: list = [self]  # handles sharing one beam-search row (beam_lane)
        self.score: Optional[float] = None  # a beam's score (beam_lane)
        self._settled = threading.Event()
        self._engine = engine
        self._done = threading.Event()

    # -- user side ----------------------------------------------------------------------------

    def events(self, timeout: Optional[float] = None) -> Iterator:
        """The stream events in seq order: start, deltas, one terminal event."""
        return self.lifecycle.stream.iter(timeout)

    def trace(self) -> list:
        """The full event trace so far (lifecycle, token.selected, decode.completed, ...)."""
        return list(self.lifecycle.events)

    def cancel(self) -> None:
        """Ask for cancellation; returns at once, idempotent, a no-op once ended (SPEC C4)."""
        if self.lifecycle.request_cancel():
            self._engine._wake()

    def pause(self) -> None:
        """Stop scheduling this request's steps; its state stays exactly as it is (SPEC B1).
        Returns at once; `LLM.save_request` waits until no step of it is in flight."""
        self._settled.clear()
        self.user_paused = True
        self.lifecycle.record("paused")
        self._engine._wake()

    def resume(self) -> None:
        self.user_paused = False
        self.lifecycle.record("resumed")
        self._engine._wake()

    def result(self, timeout: Optional[float] = None) -> Completion:
        if not self._done.wait(timeout):
            raise TimeoutError(f"request {self.request_id} did not end within {timeout}s")
        return self.completion()

    @property
    def state(self) -> RequestState:
        return self.lifecycle.state

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def usage(self) -> Usage:
        return Usage(prompt_tokens=len(self.prompt_ids), selected_tokens=self.selected,
                     processed_tokens=self.processed,
                     returned_tokens=self.pipeline.returned_tokens)

    def take_logprobs(self) -> Optional[tuple[TokenLogprob, ...]]:
        """The logprobs of the returned tokens not yet sent in a delta (None when not asked)."""
        if self.logprobs is None:
            return None
        end = self.pipeline.returned_tokens
        new = tuple(self.logprobs[self.reported:end])
        self.reported = max(self.reported, end)
        return new

    def returned_logprobs(self) -> Optional[tuple[TokenLogprob, ...]]:
        """The logprobs of the returned tokens so far (None when not asked)."""
        if self.logprobs is None:
            return None
        return tuple(self.logprobs[:self.pipeline.returned_tokens])

    def completion(self) -> Completion:
        term = self.lifecycle.terminal_event
        data = term.data if term is not None else {}
        reason = data.get("finish_reason")
        finish = FinishReason(reason) if reason is not None else None
        error = ErrorCode(data["error"]) if data.get("error") is not None else None
        return Completion(
            request_id=self.request_id, text=self.pipeline.text,
            token_ids=tuple(self.token_ids), finish_reason=finish, error=error,
            usage=self.usage(), events=tuple(self.lifecycle.events),
            record=self._engine._record(self, finish, error),
            prompt_index=self.prompt_index, index=self.index, state=self.lifecycle.state,
            timings=self._timings(), score=self.score, logprobs=self.returned_logprobs())

    def _timings(self) -> dict:
        timings = self.lifecycle.timings(self.pipeline).as_dict()
        if self.speculative is not None:
            timings["speculative"] = dict(self.speculative)
        return timings

    def __repr__(self) -> str:
        return f"RequestHandle({self.request_id!r}, {self.lifecycle.state.value})"


def _logprob_entry(r: RequestHandle, token: int, logprob: Any, top_ids: Any,
                   top_logprobs: Any) -> TokenLogprob:
    """The request's record of one selected token: its raw logprob and its own top N. The
    step computed a top-k whenever a live row asked, so the arrays are there."""
    n = r.sampling.logprobs
    return TokenLogprob(token, float(logprob),
                        tuple(zip(top_ids[:n].tolist(), top_logprobs[:n].tolist())))


@dataclasses.dataclass
class _Dispatched:
    """A step in flight: its output, which request owned each slot when it was dispatched, and
    its static top-k (0 or LLM.logprobs_k)."""

    out: Any
    owners: list
    top_k: int = 0


class LLM:
    """The engine of DESIGN.md: `generate`, `stream`, `submit`, `close`; thread-safe.

    Per-request bounds (module docstring): `max_num_beams`, `max_n`; `max_constraint_compile_s`
    and `max_constraint_states` make the `CompileBudget` of a response_format compile."""

    def __init__(self, model: DecoderModel, params: Any, tokenizer: Any, *, max_slots: int = 8,
                 max_len: int = 2048, eos_token_ids: Optional[Sequence[int]] = None,
                 max_queue: int = 1024, max_buffered: int = 4096, backpressure: str = "buffer",
                 trace: bool = True, model_source: Optional[str] = None,
                 mesh: Optional[Any] = None, speculative: Optional[dict] = None,
                 step_hook: Optional[Any] = None, max_num_beams: int = admission.MAX_NUM_BEAMS,
                 max_n: int = admission.MAX_N, max_constraint_compile_s: float = 30.0,
                 max_constraint_states: int = constraints.limits.MAX_STATES,
                 processors: Optional[Sequence[Any]] = None):
        if not isinstance(max_slots, int) or max_slots < 1:
            raise ValueError(f"max_slots: must be a positive integer, got {max_slots!r}")
        if not isinstance(max_len, int) or not 2 <= max_len <= model.config.max_len:
            raise ValueError(f"max_len: must be in [2, {model.config.max_len}] (the model's "
                             f"context), got {max_len!r}")
        if not isinstance(max_queue, int) or max_queue < 1:
            raise ValueError(f"max_queue: must be a positive integer, got {max_queue!r}")
        self.model, self.params, self.tokenizer = model, params, tokenizer
        self.max_slots, self.max_len, self.max_queue = max_slots, max_len, max_queue
        self.max_buffered, self.backpressure, self.trace_events = max_buffered, backpressure, trace
        self.limits = admission.EngineLimits(max_len, max_slots, model.config.max_len,
                                             max_num_beams, max_n)
        self.compile_budget = constraints.CompileBudget(seconds=max_constraint_compile_s,
                                                        max_states=max_constraint_states)
        if eos_token_ids is None:
            eos_token_ids = model.config.eos_token_ids
            if not eos_token_ids and eos_token_id(tokenizer) is not None:
                eos_token_ids = (eos_token_id(tokenizer),)
        self.eos_token_ids = tuple(eos_token_ids)
        self.logprobs_k = min(MAX_LOGPROBS, model.config.vocab_size)  # the step's top-k
        self.model_source = model_source  # where the weights came from ("demo", a directory)
        # a jax.sharding.Mesh: the step state is placed by slots.state_sharding (KV cache per
        # model_api.CACHE_RULES); shard the params with models.shard_params(params, mesh)
        self.mesh = mesh
        # speculative decoding (SPEC §10): every step is one verify round over all slots
        self._spec: Optional[speculative_engine.SpeculativeRunner] = None
        if speculative is not None:
            config = speculative_engine.SpeculativeConfig.parse(speculative, model, max_len)
            if mesh is not None:
                raise ValueError("speculative: not supported together with mesh yet")
            self._spec = speculative_engine.SpeculativeRunner(config, model, params)
        # custom processors (jaxdecode/research.py): fixed for the engine's life
        self._research = research.configure(model, processors=processors)
        self._stateful_processors = any(p.stateful for p in processors or ())
        if self._research is not None and speculative is not None:
            raise ValueError("processors: not supported together with speculative= in the "
                             "engine (jd.speculative_generate takes processors)")
        if self._research is not None and step_hook is not None:
            raise ValueError("processors: not supported with step_hook (multi-host followers "
                             "run no user code)")
        # every device call is a step_ops.StepOp, given to step_hook.publish(op) before it is
        # applied: serving/distributed.py broadcasts them to the other hosts' followers
        self.step_hook = step_hook
        self._context = step_ops.Context(model, params, max_slots, max_len, self.eos_token_ids,
                                         mesh, replicate_outputs=step_hook is not None,
                                         tokenizer=tokenizer, spec=self._spec,
                                         research=self._research)
        self._hashes: dict = {}
        self.error: Optional[str] = None  # the last engine failure
        self.degraded: Optional[str] = None  # why, from a failed step to the next good one
        self._next_probe = 0.0  # when an idle degraded engine next checks its device
        self._admitting: list = []  # the batch `_admit` is placing (suspects of a failure)
        self._cond = threading.Condition()
        self._queue: collections.deque[RequestHandle] = collections.deque()
        self._slots: list[Optional[RequestHandle]] = [None] * max_slots
        self._release = np.zeros(max_slots, bool)
        self._paused = np.zeros(max_slots, bool)
        self._state = None
        self._bundle: Optional[constraints.TableBundle] = None  # grammar tables of live slots
        self._ids = itertools.count()
        self._closed = False
        self._thread: Optional[threading.Thread] = None
        self._jobs: collections.deque = collections.deque()

    # -- public API ------------------------------------------------------------------------------

    def submit(self, prompt: Prompt, params: Optional[SamplingParams] = None, *,
               request_id: Optional[str] = None, block: bool = False,
               cancelled: Optional[Callable[[], bool]] = None) -> RequestHandle:
        """Queue one request (n must be 1; `generate` expands n). Raises ValueError naming the
        bad field, `QueueFull` when the admission queue is full (unless `block`). A
        response_format is compiled here, within the engine's compile budget; `cancelled()`
        true (polled meanwhile) abandons it with a ValueError naming response_format."""
        handle = self._make_handle(prompt, params, request_id, cancelled=cancelled)
        self._enqueue([handle], block)
        return handle

    def submit_beams(self, prompt: Prompt, params: SamplingParams, *,
                     request_id: Optional[str] = None, block: bool = False,
                     cancelled: Optional[Callable[[], bool]] = None) -> list:
        """Queue a beam-search request (num_beams > 1) as its n best beams: one handle per
        rank sharing one search row (jaxdecode/beam_lane.py), ids `<request_id>-<rank>` when
        n > 1. Raises like `submit`."""
        if not isinstance(params, SamplingParams) or params.num_beams == 1:
            raise ValueError("num_beams: submit_beams() takes SamplingParams with num_beams > 1")
        rid = request_id or f"req-{next(self._ids)}"
        handles = [self._make_handle(prompt, params, rid if params.n == 1 else f"{rid}-{j}",
                                     index=j, output_kind=params.output_kind,
                                     cancelled=cancelled)
                   for j in range(params.n)]
        beam_lane.link_rows(handles)
        self._enqueue(handles, block)
        return handles

    def _make_handle(self, prompt: Prompt, params: Optional[SamplingParams],
                     request_id: Optional[str] = None, prompt_index: int = 0, index: int = 0,
                     output_kind: Optional[str] = None,
                     cancelled: Optional[Callable[[], bool]] = None) -> RequestHandle:
        """Every check a request gets, before it is queued: SamplingParams' own, the vocabulary,
        the engine limits (`admission.check`), the constraint compile (within its budget)."""
        sp = params if params is not None else SamplingParams()
        if not isinstance(sp, SamplingParams):
            raise ValueError(f"params: expected SamplingParams, got {type(sp).__name__}")
        if sp.n != 1 and output_kind is None:
            raise ValueError("n: submit() and stream() take one sample; use generate() for n > 1")
        prompt_ids = self._encode(prompt)
        sp.check_vocab(self.model.config.vocab_size)
        device_sp = admission.check(sp, len(prompt_ids), self.limits)  # before a compile
        if self._spec is not None and sp.num_beams == 1:  # beams take the beam lane
            self._spec.config.check_request(sp)
        grammar = None
        if sp.response_format is not None and sp.response_format.get("type") != "text":
            # the vocabulary its lane compiles with, so the beam lane finds it in the cache
            ending = beam_lane.ending_ids(self, sp) if sp.num_beams > 1 else self.eos_token_ids
            vocab = constraints.vocab_for(self.tokenizer, self.model.config.vocab_size,
                                          exclude_ids=ending)
            grammar = constraints.compile_format(sp.response_format, vocab,
                                                 budget=self.compile_budget, cancelled=cancelled)
        seed = sp.seed if sp.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
        key = decode.sample_keys(seed_key_data(seed), sp.n)[index]  # as jd.generate does
        rid = request_id or f"req-{next(self._ids)}"
        return RequestHandle(self, rid, prompt_ids, sp, prompt if isinstance(prompt, str) else None,
                             seed, key, prompt_index, index,
                             output_kind or sp.output_kind, grammar, device_sp)

    def _enqueue(self, handles: list, block: bool) -> None:
        """Queue handles together (the engine admits them in one prefill when slots allow)."""
        with self._cond:
            pending = list(handles)
            while pending:
                if self._closed:
                    raise EngineClosed("the engine is closed")
                room = self.max_queue - len(self._queue)
                if room <= 0:
                    if not block:
                        raise QueueFull(f"admission queue is full ({self.max_queue} requests)")
                    self._cond.wait(0.05)
                    continue
                for handle in pending[:room]:
                    handle.lifecycle.transition(RequestState.QUEUED)
                    handle.lifecycle.emit_start(self.model_snapshot)
                    self._queue.append(handle)
                pending = pending[room:]
                self._ensure_thread()
                self._cond.notify_all()

    def stream(self, prompt: Prompt, params: Optional[SamplingParams] = None,
               timeout: Optional[float] = None) -> Iterator:
        """Yield the request's stream events: start, deltas, one terminal event."""
        handle = self.submit(prompt, params)
        try:
            yield from handle.events(timeout)
        finally:
            if not handle.done:  # the consumer stopped early
                handle.cancel()

    def generate(self, prompts: Union[Prompt, Sequence[Prompt]],
                 params: Union[None, SamplingParams, Sequence[SamplingParams]] = None, *,
                 use_tqdm: bool = False) -> list[Completion]:
        """Run prompts to completion: a flat list, len(prompts) * n, each prompt's n samples
        adjacent (`Completion.prompt_index`, `Completion.index`); with num_beams > 1 the n
        samples are the prompt's n best beams, by rank."""
        prompts = token_rows(prompts, "prompt", text=True)
        if isinstance(params, (list, tuple)):
            if len(params) != len(prompts):
                raise ValueError(f"params: expected 1 or {len(prompts)} SamplingParams, "
                                 f"got {len(params)}")
            per_prompt = list(params)
        else:
            per_prompt = [params if params is not None else SamplingParams()] * len(prompts)
        handles = [self._make_handle(p, sp, prompt_index=i, index=j, output_kind="final_only")
                   for i, (p, sp) in enumerate(zip(prompts, per_prompt)) for j in range(sp.n)]
        beam_lane.link_rows(handles)  # a beam prompt's n handles are its n best beams
        self._enqueue(handles, block=True)  # validated all before queueing any
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(handles), desc="generate", unit="req")
        results = []
        for h in handles:
            results.append(h.result())
            if bar is not None:
                bar.update(1)
        if bar is not None:
            bar.close()
        return results

    def warmup(self, max_prompt_len: int = 64) -> int:
        """Compile every shape the engine can meet for prompts up to `max_prompt_len`
        (`step_ops.warmup_shapes`: the one-row prefill per prompt bucket, the slot
        scatter, the decode step -- with `speculative=`: the speculative round -- per attention
        bucket with and without logprobs). Returns the compilations. With a step hook, call it
        before the first request (the op must not interleave with the engine thread's)."""
        op = step_ops.warmup(max_prompt_len, self.logprobs_k)
        if self.step_hook is not None:
            self.step_hook.publish(op)
        return step_ops.warmup_shapes(self._context, max_prompt_len, self.logprobs_k)

    def close(self, timeout: float = 10.0) -> None:
        """Stop the engine thread; requests still queued or running end CANCELLED."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- reproducibility (SPEC §11, jaxdecode/replay.py) ---------------------------------------------

    @property
    def params_hash(self) -> str:
        """Content hash of the weights (computed once, on first use)."""
        if "params" not in self._hashes:
            self._hashes["params"] = replay_lib.params_hash(self.params)
        return self._hashes["params"]

    @property
    def tokenizer_hash(self) -> str:
        if "tokenizer" not in self._hashes:
            self._hashes["tokenizer"] = replay_lib.tokenizer_hash(self.tokenizer)
        return self._hashes["tokenizer"]

    @property
    def model_snapshot(self) -> str:
        """The snapshot named by every `start` event: the first 16 hex digits of the weights'
        hash."""
        return self.params_hash[:16]

    def _record(self, r: RequestHandle, finish: Optional[FinishReason],
                error: Optional[ErrorCode]) -> replay_lib.GenerationRecord:
        return replay_lib.build_record(
            model_hash=self.params_hash, model_config=self.model.config,
            model_source=self.model_source, tokenizer_hash_=self.tokenizer_hash,
            prompt_text=r.prompt_text, prompt_ids=r.prompt_ids, sampling=r.sampling, seed=r.seed,
            key_data=r.key_data, sample_index=r.index,
            layout={"engine": "LLM", "max_slots": self.max_slots, "max_len": self.max_len,
                    "prompt_bucket": decode.bucket(len(r.prompt_ids), self.max_len)},
            batch_invariance=numerics.guarantee(self.model, jax.default_backend()),
            detokenizer_mode=r.pipeline.detokenizer.mode, token_ids=r.token_ids,
            text=r.pipeline.text, finish_reason=finish.value if finish else None,
            error=error.value if error else None, usage=dataclasses.asdict(r.usage()),
            processors=self.processor_order)

    @property
    def processor_order(self) -> Optional[tuple]:
        """The processing stages with the engine's custom processors (None without them)."""
        return None if self._research is None else self._research.processor_order

    def run_record(self, record: replay_lib.GenerationRecord) -> Completion:
        """Run a record's request again: same prompt ids, settings, seed and sample index."""
        sp = dataclasses.replace(record.sampling, seed=record.data["rng"]["seed"])
        handle = self._make_handle(record.prompt_ids, sp, index=record.data["rng"]["sample_index"],
                                   output_kind="final_only")
        handle.prompt_text = record.data["prompt"]["text"]
        self._enqueue([handle], block=True)
        return handle.result()

    # -- pause, save, restore (SPEC B1) -----------------------------------------------------------

    def save_request(self, handle: RequestHandle, path: str, timeout: float = 60.0) -> str:
        """Pause `handle` and write its slice of the decoding state to `path` (orbax arrays +
        request.json): cache up to its length, logits, last token, step, penalty counts,
        per-row settings and key, grammar state, and the host counters. The request stays
        paused here (`resume()` or `cancel()` it); `restore_request` continues it anywhere."""
        if self._research is not None:  # processor states are not part of a saved request
            raise ValueError("processors: save_request is not supported with processors=")
        if handle.done or handle.slot is None:
            raise ValueError("request: only a running request (in a slot) can be saved")
        if self._spec is not None:
            raise ValueError("speculative: save_request is not supported with speculative=")
        handle.pause()
        if not handle._settled.wait(timeout):
            raise TimeoutError("request: a step of it is still in flight")
        arrays = self._on_engine_thread(lambda: self._extract_row(handle))
        meta = {"request_id": handle.request_id, "prompt_ids": handle.prompt_ids,
                "prompt_text": handle.prompt_text,
                "sampling": replay_lib.sampling_to_json(
                    dataclasses.replace(handle.sampling, seed=handle.seed)),
                "index": handle.index, "prompt_index": handle.prompt_index,
                "output_kind": handle.lifecycle.stream.output_kind.value,
                "token_ids": handle.token_ids, "selected": handle.selected,
                "logprobs": (None if handle.logprobs is None
                             else [dataclasses.astuple(e) for e in handle.logprobs]),
                "processed": handle.processed, "next_seq": handle.lifecycle.stream.next_seq,
                "model_hash": self.params_hash}
        return str(request_state.save(path, arrays, meta))

    def _extract_row(self, r: RequestHandle) -> dict:
        st, slot = self._state, r.slot
        length = int(st.cache.lengths[slot])
        row = lambda x: np.asarray(x[slot])  # noqa: E731
        arrays = {"k": np.asarray(st.cache.k[:, slot, :, :length]),
                  "v": np.asarray(st.cache.v[:, slot, :, :length]),
                  "length": np.int32(length), "logits": row(st.logits),
                  "last_token": row(st.last_token), "step": row(st.step),
                  "counts": row(st.counts), "seen": row(st.seen), "finish": row(st.finish)}
        for name, value in vars(st.rows).items():
            arrays["rows." + name] = row(value)
        if r.grammar is not None:
            arrays["grammar_local"] = np.int32(int(st.grammar_state[slot])
                                               - self._bundle.offsets[r.grammar.key])
        return arrays

    def restore_request(self, path: str) -> RequestHandle:
        """Continue a request saved by `save_request` (in this or another process): the output
        equals an uninterrupted run's, byte for byte."""
        if self._spec is not None:
            raise ValueError("speculative: restore_request is not supported with speculative=")
        if self._research is not None:
            raise ValueError("processors: restore_request is not supported with processors=")
        arrays, meta = request_state.load(path)
        if meta.get("model_hash") != self.params_hash:
            raise ValueError("path: the saved request was decoded with other weights")
        sp = replay_lib.sampling_from_json(meta["sampling"])
        r = self._make_handle(meta["prompt_ids"], sp, meta["request_id"],
                              meta["prompt_index"], meta["index"], meta["output_kind"])
        if not np.array_equal(r.key_data, arrays["rows.keys"]):
            raise ValueError("path: the saved key does not match the request's seed")
        r.prompt_text = meta["prompt_text"]
        r.token_ids = list(meta["token_ids"])
        r.selected, r.processed = meta["selected"], meta["processed"]
        for token in r.token_ids:  # rebuild the detokenizer and stop-matcher state
            r.pipeline.push(token)
        if r.logprobs is not None:  # the returned tokens' logprobs were sent before the save
            r.logprobs = [TokenLogprob(i, lp, tuple(map(tuple, top)))
                          for i, lp, top in meta.get("logprobs") or ()]
            r.reported = r.pipeline.returned_tokens
        r.lifecycle.stream.continue_numbering(meta["next_seq"])
        r.lifecycle.record("request.restored", selected=r.selected)
        r.restored = arrays
        self._enqueue([r], block=True)
        return r

    def _insert_restored(self, r: RequestHandle, slot: int) -> None:
        a = r.restored
        r.lifecycle.transition(RequestState.PREFILLING)
        initial = self._grammar_tables([r])
        state = None
        if initial is not None:
            local = int(a["grammar_local"]) if "grammar_local" in a else 0
            state = initial[0] + local if r.grammar is not None else -1
        self._device(step_ops.restore(a, slot, state))
        self._release[slot] = False
        r.slot, r.dispatched, r.restored = slot, r.selected, None
        self._slots[slot] = r
        r.lifecycle.transition(RequestState.DECODING)

    @property
    def num_waiting(self) -> int:
        return len(self._queue)

    @property
    def num_running(self) -> int:
        return sum(r is not None for r in self._slots)

    # -- validation ------------------------------------------------------------------------------

    def _encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            ids = encode(self.tokenizer, prompt)
        else:
            ids = token_row(prompt, "prompt")
        if not ids:
            raise ValueError("prompt: empty prompt (it encodes to no tokens)")
        bad = [i for i in ids if not 0 <= i < self.model.config.vocab_size]
        if bad:
            raise ValueError(f"prompt: token id {bad[0]} is outside the vocabulary "
                             f"(size {self.model.config.vocab_size})")
        if len(ids) >= self.max_len:
            raise ValueError(f"prompt: {len(ids)} tokens leave no room in max_len {self.max_len}")
        return ids

    # -- the engine thread -----------------------------------------------------------------------

    def _ensure_thread(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name="jaxdecode-engine",
                                            daemon=True)
            self._thread.start()

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def _run(self) -> None:
        in_flight: Optional[_Dispatched] = None
        while True:
            with self._cond:
                if self._closed:
                    break
                idle = (in_flight is None and not any(self._slots) and not self._queue
                        and not self._jobs)
                if idle and (self.degraded is None or time.monotonic() < self._next_probe):
                    self._cond.wait(0.5)
                    continue
            if idle:  # degraded with nothing to run: check the device itself
                self._check_device()
                continue
            try:
                self._run_jobs()
                self._sweep_queue()
                self._run_beams()
                self._admit()
                dispatched = self._dispatch()
                if in_flight is not None:
                    self._process(in_flight)
                in_flight = dispatched
                if in_flight is None:
                    self._sweep_slots()
                    with self._cond:  # every live row is paused: wait for the readers
                        if any(self._slots) and not self._queue and not self._closed:
                            self._cond.wait(0.01)
            except Exception as exc:  # a failed step: isolate the request behind it
                in_flight = None
                self._recover(exc)
        self._shutdown()

    def _run_jobs(self) -> None:
        while self._jobs:
            fn, box, done = self._jobs.popleft()
            try:
                box.append((True, fn()))
            except Exception as exc:  # handed back to the caller
                box.append((False, exc))
            done.set()

    def _on_engine_thread(self, fn, timeout: float = 60.0):
        """Run `fn` on the engine thread at its next safe point (it owns the device state)."""
        box: list = []
        done = threading.Event()
        with self._cond:
            self._jobs.append((fn, box, done))
            self._ensure_thread()
            self._cond.notify_all()
        if not done.wait(timeout):
            raise TimeoutError("the engine did not reach a safe point in time")
        ok, value = box[0]
        if not ok:
            raise value
        return value

    def _sweep_queue(self) -> None:
        """Cancels and deadlines of requests that have not reached a slot yet."""
        if not self._queue:
            return
        with self._cond:
            queued = list(self._queue)
        now = time.monotonic()
        for r in queued:
            with self._isolated(r):
                if r.lifecycle.observe_cancel():
                    self._end_cancelled(r)
                elif r.deadline is not None and now >= r.deadline:
                    self._end(r, FinishReason.DEADLINE_EXCEEDED)
        with self._cond:
            self._queue = collections.deque(r for r in self._queue if not r.lifecycle.is_terminal)
            self._cond.notify_all()

    def _run_beams(self) -> None:
        """The beam lane (jaxdecode/beam_lane.py): every queued beam request runs now."""
        with self._cond:
            beams = [r for r in self._queue if beam_lane.is_beam(r)]
            if not beams:
                return
            self._queue = collections.deque(r for r in self._queue if not beam_lane.is_beam(r))
            self._cond.notify_all()
        try:
            beam_lane.run(self, beams)  # isolates the rows behind a failed call itself
        except Exception as exc:  # anything else: the taken requests never hang
            logger.exception("beam lane failed")
            for r in beams:
                self._fail(r, ErrorCode.MODEL_ERROR, f"{type(exc).__name__}: {exc}")

    def _admit(self) -> None:
        free = [slot for slot, r in enumerate(self._slots) if r is None]
        with self._cond:
            batch = [self._queue.popleft() for _ in range(min(len(free), len(self._queue)))]
            self._cond.notify_all()
        if not batch:
            return
        self._admitting = batch  # suspects, should a device call below fail (`_recover`)
        if self._state is None:
            self._device(step_ops.init(self.max_slots, self.max_len, self.eos_token_ids))
        fresh = [r for r in batch if r.restored is None]
        restored = [r for r in batch if r.restored is not None]
        for r, slot in zip(restored, free[len(fresh):]):
            self._insert_restored(r, slot)
        if fresh:
            for r in fresh:  # a request requeued by `_recover` is DECODING already
                r.lifecycle.try_transition(RequestState.PREFILLING)
            self._prefill_into(fresh, free[:len(fresh)])
            for r in fresh:
                if not r.lifecycle.try_transition(RequestState.DECODING):
                    r.lifecycle.record("engine.resumed", selected=r.selected,
                                       processor_states_reset=self._stateful_processors)
        self._admitting = []

    def _prefill_into(self, batch: list, free: list) -> None:
        """Prefill the requests (one ADMIT op: each row alone at its own prompt bucket,
        docs/batch_invariance.md) and scatter them into slots `free`. A request that already
        selected tokens (requeued by `_recover`) is prefilled with its prompt and those tokens
        and goes on at its own step: its penalty counts, RNG step and grammar state are those it
        had, so it selects what it would have selected."""
        n = len(batch)
        inputs = [r.prompt_ids + r.token_ids for r in batch]
        t = decode.bucket(max(map(len, inputs)), self.max_len)
        tokens = np.zeros((n, t), np.int32)
        lengths = np.ones((n,), np.int32)
        targets = np.full((n,), self.max_slots, np.int32)  # padding rows are dropped
        sampling, keys = [SamplingParams()] * n, np.zeros((n, 2), np.uint32)
        resume = None
        if any(r.token_ids for r in batch):  # step, counts, last token, prompt length
            resume = (np.zeros((n,), np.int32), np.zeros((n, self.model.config.vocab_size),
                                                          np.int32), np.full((n,), -1, np.int32),
                      np.ones((n,), np.int32))
        for i, (r, ids, slot) in enumerate(zip(batch, inputs, free)):
            tokens[i, :len(ids)] = ids
            lengths[i], targets[i], keys[i] = len(ids), slot, r.key_data
            sampling[i] = r.device_sampling
            if resume is not None:
                resume[3][i] = len(r.prompt_ids)
                if r.token_ids:
                    resume[0][i], resume[2][i] = len(r.token_ids), r.token_ids[-1]
                    np.add.at(resume[1][i], r.token_ids, 1)
        rows = RowParams.build(sampling, self.model.config.vocab_size, self.eos_token_ids,
                               keys=keys)
        initial, states = self._grammar_tables(batch), None
        if initial is not None:
            states = np.full((n,), -1, np.int32)
            states[:len(batch)] = [s + r.grammar.walk(r.token_ids) if r.grammar is not None
                                   else s for s, r in zip(initial, batch)]
        self._device(step_ops.admit(tokens, lengths, targets, rows, states, resume))
        for r, slot in zip(batch, free):
            self._release[slot] = False
            r.slot, r.dispatched, r.in_flight = slot, len(r.token_ids), 0
            self._slots[slot] = r

    def _grammar_tables(self, batch: list) -> Optional[np.ndarray]:
        """Keep one table set for the constraints of the live slots plus `batch` (existing ones
        first, so offsets rarely move; else the live rows' states are rebased). Returns the
        initial grammar state of each request in `batch`, or None while nothing was ever
        constrained (then the step carries no tables and pays nothing)."""
        live = [r for r in self._slots if r is not None]
        wanted = [r.grammar for r in live + batch if r.grammar is not None]
        if not wanted and self._bundle is None:
            return None
        bundle = constraints.build_tables(wanted, self.model.config.vocab_size)
        if bundle is not self._bundle or self._state.grammar_state is None:
            # rebased on the device (no host read of the state: it may span other hosts)
            keys = [r.grammar.key if r is not None and r.grammar is not None else None
                    for r in self._slots]
            delta = [bundle.offsets[k] - self._bundle.offsets[k]
                     if k is not None and self._bundle is not None else 0 for k in keys]
            self._device(step_ops.grammar(
                np.array([k is not None for k in keys]), np.array(delta, np.int32),
                bundle.tables if bundle is not self._bundle else None))
            self._bundle = bundle
        return np.array([bundle.initial_state(r.grammar) for r in batch], np.int32)

    def _dispatch(self) -> Optional[_Dispatched]:
        owners = list(self._slots)
        paused = np.array([r is not None and (r.user_paused or r.lifecycle.stream.should_pause)
                           for r in owners])
        live = [r for r, p in zip(owners, paused) if r is not None and not p]
        for r, now, before in zip(owners, paused, self._paused):
            if r is not None and now != before:  # SPEC B1: the row stays exactly as it is
                r.lifecycle.record("backpressure.paused" if now else "backpressure.resumed")
        if self._state is not None and (self._release.any() or paused.any()
                                        or self._paused.any()):
            self._device(step_ops.flags(self._release.copy(), paused))
        self._release[:] = False
        self._paused = paused
        if not live:
            return None
        op = self._step_op(live)
        for r in live:
            r.dispatched += 1
            r.in_flight += 1
            r.lifecycle.record("decode.started", step=r.dispatched)
        out = self._device(op)
        return _Dispatched(out=out, owners=[r if r in live else None for r in owners],
                           top_k=op.scalar("top_logprobs"))

    def _step_op(self, live: list) -> step_ops.StepOp:
        """The STEP op for these live rows: the attention bucket covering each of them, and the
        top-k of logprobs when one asked."""
        if self._spec is not None:
            longest = max((self._spec.kv_needed(r) for r in live), default=1)
        else:
            longest = max((len(r.prompt_ids) + r.dispatched + 1 for r in live), default=1)
        kv_len = min(max(decode.bucket(longest), KV_BUCKET_MIN), self.max_len)
        k = self.logprobs_k if any(r.logprobs is not None for r in live) else 0
        return step_ops.step(kv_len, k)

    def _device(self, op: step_ops.StepOp) -> Any:
        """Every device call of the engine thread: published to the step hook, then applied
        (`step_ops.apply`, which followers on other hosts run with the same op)."""
        if self.step_hook is not None:
            self.step_hook.publish(op)
        self._state, out = step_ops.apply(self._context, self._state, op)
        return out

    def _process(self, step: _Dispatched) -> None:
        if self._spec is not None:
            self._process_round(step)
            return
        out = step.out
        lp_arrays = (out.logprob, out.top_ids, out.top_logprobs) if step.top_k else ()
        fetched = jax.device_get((out.token, out.finish) + lp_arrays)  # one transfer
        self.degraded = None  # a step succeeded
        tokens, finish = fetched[:2]
        logprob, top_ids, top_lps = fetched[2:] if step.top_k else (None, None, None)
        for slot, r in self._owned_rows(step):
            token, code = int(tokens[slot]), int(finish[slot])
            if token < 0:
                continue
            with self._isolated(r):
                entry = (_logprob_entry(r, token, logprob[slot], top_ids[slot], top_lps[slot])
                         if r.logprobs is not None else None)
                self._on_token(r, token, code, entry)
        self._sweep_slots()

    def _owned_rows(self, step: _Dispatched) -> Iterator[tuple[int, RequestHandle]]:
        """(slot, request) for each row of a processed step whose request still owns its slot
        and goes on. Settles the in-flight counts first; a request that ended after the step
        was sent is skipped (the duplicate guard), a cancelled one ends here and its in-flight
        result is discarded (SPEC L4)."""
        for r in step.owners:
            if r is not None:
                r.in_flight -= 1
        for slot, r in enumerate(step.owners):
            if r is None or r.lifecycle.is_terminal or r.slot != slot:
                continue
            if r.lifecycle.observe_cancel():
                self._end_cancelled(r)
                continue
            yield slot, r

    def _process_round(self, step: _Dispatched) -> None:
        """A speculative round's tokens: each row's emitted tokens go through `_on_token` in
        order, the earlier ones RUNNING and the last with the round's finish code; once the
        request ends (a stop string, a cancel) the rest of its tokens are dropped."""
        out = jax.device_get(step.out)  # one transfer (the top-k arrays are empty when 0)
        self.degraded = None  # a step succeeded
        for slot, r in self._owned_rows(step):
            with self._isolated(r):
                self._spec.count(r, out, slot)
                count = int(out.count[slot])
                for i in range(count):
                    code = int(out.finish[slot]) if i == count - 1 else RUNNING
                    token = int(out.tokens[slot, i])
                    entry = (_logprob_entry(r, token, out.logprob[slot, i],
                                            out.top_ids[slot, i], out.top_logprobs[slot, i])
                             if r.logprobs is not None else None)
                    self._on_token(r, token, code, entry)
                    if r.lifecycle.is_terminal:
                        break
        self._sweep_slots()

    def speculative_stats(self) -> dict:
        """Acceptance counters over every processed speculative round: proposed, accepted,
        target_tokens, iterations, mean_accepted_length (tokens per round). ValueError when the
        engine is not speculative."""
        if self._spec is None:
            raise ValueError("speculative: this engine was built without speculative=")
        return self._spec.stats()

    def _sweep_slots(self) -> None:
        now = time.monotonic()
        for r in list(self._slots):
            if r is None or r.lifecycle.is_terminal:
                continue
            if r.user_paused and r.in_flight == 0:
                r._settled.set()
            with self._isolated(r):
                if r.lifecycle.observe_cancel():
                    self._end_cancelled(r)
                elif r.deadline is not None and now >= r.deadline:
                    self._end(r, FinishReason.DEADLINE_EXCEEDED)

    def _on_token(self, r: RequestHandle, token: int, code: int,
                  entry: Optional[TokenLogprob]) -> None:
        lc = r.lifecycle
        if code in decode.ERRORS:  # NaN logits, every token masked, a grammar dead end (P2):
            self._fail(r, decode.ERRORS[code], decode.ERRORS[code].value)  # nothing selected
            return
        r.selected += 1
        t = r.selected
        r.token_ids.append(token)
        if entry is not None:
            r.logprobs.append(entry)
        lc.record("token.selected", step=t, token=token)
        if code == EOS or (code == STOP_TOKEN and not r.sampling.include_stop_in_output):
            self._end(r, decode.FINISH_REASONS[code])  # never shown (D6, S8)
            return
        try:
            pushed = r.pipeline.push(token)
        except (DecodingError, ValueError) as exc:
            self._fail(r, ErrorCode.DECODING_ERROR, str(exc))
            return
        lc.emit_delta(pushed.text, r.take_logprobs())
        if pushed.hit is not None:
            lc.record("stop.hit", stop=pushed.hit.stop, index=pushed.hit.index)
            self._end(r, FinishReason.STOP_SEQUENCE)
        elif code == RUNNING:
            r.processed += 1
            lc.record("decode.completed", step=t, cache_length=len(r.prompt_ids) + t)
        else:  # MAX_TOKENS, CONTEXT_LIMIT, GRAMMAR_COMPLETE, or a shown stop id
            self._end(r, decode.FINISH_REASONS[code])

    # -- endings (each ends the request exactly once, then releases its slot) ----------------------

    def _end(self, r: RequestHandle, reason: FinishReason) -> None:
        lc = r.lifecycle
        if lc.is_terminal:
            return
        lc.try_transition(RequestState.DRAINING)
        try:
            final = r.pipeline.finish(reason)
        except DecodingError as exc:
            self._fail(r, ErrorCode.DECODING_ERROR, str(exc))
            return
        lc.emit_delta(final.text, r.take_logprobs())
        if final.hit is not None and reason is not FinishReason.STOP_SEQUENCE:
            lc.record("stop.hit", stop=final.hit.stop, index=final.hit.index)
        lc.complete(final.finish_reason, usage=r.usage())
        self._release_slot(r)

    def _end_cancelled(self, r: RequestHandle) -> None:
        r.pipeline.cancel()
        r.lifecycle.cancel(usage=r.usage())
        self._release_slot(r)

    def _fail(self, r: RequestHandle, error: ErrorCode, message: str) -> None:
        r.error_message = message
        r.lifecycle.fail(error, usage=r.usage(), message=message)
        self._release_slot(r)

    def _release_slot(self, r: RequestHandle) -> None:
        slot = r.slot
        if slot is not None:
            def free():
                if self._slots[slot] is r:
                    self._slots[slot] = None
                    self._release[slot] = True
            r.lifecycle.release_once("slot", free)
        r._done.set()
        self._wake()

    @contextlib.contextmanager
    def _isolated(self, r: RequestHandle) -> Iterator[None]:
        """Host work for one request: an exception fails that request alone (its text
        pipeline failed: `decoding_error`), never the engine thread."""
        try:
            yield
        except Exception as exc:
            logger.exception("request %s failed in the host pipeline", r.request_id)
            self._fail(r, ErrorCode.DECODING_ERROR, f"{type(exc).__name__}: {exc}")

    # -- faults (SPEC §1: one bad request never hurts another) -----------------------------------

    def health(self) -> dict:
        """{"status": "ok" | "degraded" | "closed", "reason": ...}: degraded from a failed step
        (reason: its error) until a step succeeds again."""
        if self._closed:
            return {"status": "closed", "reason": "the engine is closed"}
        if self.degraded is not None:
            return {"status": "degraded", "reason": self.degraded}
        return {"status": "ok", "reason": None}

    def _recover(self, exc: Exception) -> None:
        """A step failed and took the device state with it. Every running request is a
        suspect: rebuilt in a fresh state from its prompt and selected tokens, with one step,
        groups of suspects are retried, halving (`faults.find_culprits`). A request that fails
        alone ends FAILED (`model_error`); the others are requeued first and go on from where
        they were, selecting the tokens they would have selected. When even an empty step fails,
        or no single request explains the failure, the device is at fault: the running
        requests fail. A request met by MAX_FAULTS failed steps fails too (no endless retry).
        Health is degraded (`health()`) from here until a step succeeds."""
        reason = f"{type(exc).__name__}: {exc}"
        logger.error("engine step failed: %s", reason, exc_info=exc)
        self.error = self.degraded = reason
        suspects = [r for r in dict.fromkeys(self._admitting + self._slots)
                    if r is not None and not r.lifecycle.is_terminal]
        self._admitting = []
        # the failing step is one of those in flight, beyond what the host has processed
        probe = functools.partial(self._probe, steps=1 + max(
            (r.in_flight for r in suspects), default=0))
        for r in suspects:
            r.faults += 1
            r.lifecycle.record("engine.fault", error=reason)
        try:
            self._reset_device()
            for r in (r for r in suspects if r.faults > MAX_FAULTS):
                self._fail(r, ErrorCode.MODEL_ERROR, f"{r.faults} engine steps failed while "
                           f"this request ran; the last: {reason}")
            suspects = [r for r in suspects if not r.lifecycle.is_terminal]
            try:
                self._probe([])
                found = faults.find_culprits(suspects, probe) if suspects else None
            except Exception as device_exc:  # the device fails with no request on it
                found, reason = [], f"{type(device_exc).__name__}: {device_exc}"
            for r, culprit_exc in found or ():
                self._fail(r, ErrorCode.MODEL_ERROR, "the model failed on this request's data "
                           f"(other requests go on): {type(culprit_exc).__name__}: "
                           f"{culprit_exc}")
        except Exception as recovery_exc:  # never leave a suspect hanging
            logger.exception("engine recovery failed")
            found, reason = [], f"{reason}; recovery: {recovery_exc!r}"
        if found == []:  # the device, or no single request explains it
            for r in suspects:
                self._fail(r, ErrorCode.MODEL_ERROR, "the engine step failed and no single "
                           f"request explains it: {reason}")
        innocent = [r for r in suspects if not r.lifecycle.is_terminal]
        with self._cond:  # they go on first, in their order
            self._queue.extendleft(reversed(innocent))
            self._cond.notify_all()

    def _probe(self, group: list, steps: int = 1) -> None:
        """Rebuild `group` in a fresh state and run `steps` steps, as the engine would (raises
        what they raise); the state is discarded either way."""
        try:
            self._device(step_ops.init(self.max_slots, self.max_len, self.eos_token_ids))
            if group:
                self._prefill_into(group, list(range(len(group))))
            for _ in range(steps):
                jax.block_until_ready(self._device(self._step_op(group)))
                for r in group:
                    r.dispatched, r.in_flight = r.dispatched + 1, r.in_flight + 1
        finally:
            for r in group:
                r.slot = None
            self._reset_device()

    def _check_device(self) -> None:
        """Idle and degraded: an empty step tells whether the device works again."""
        try:
            self._probe([])
            self.degraded = None
        except Exception as exc:
            self.degraded = f"{type(exc).__name__}: {exc}"
            self._next_probe = time.monotonic() + 1.0

    def _reset_device(self) -> None:
        """Drop the device state and every slot assignment (the requests stay as they are)."""
        self._device(step_ops.reset())
        self._bundle = None
        self._slots = [None] * self.max_slots
        self._release[:] = False
        self._paused[:] = False

    def _shutdown(self) -> None:
        with self._cond:
            victims = list(self._queue) + [r for r in self._slots if r is not None]
            self._queue.clear()
        for r in victims:
            r.lifecycle.request_cancel()
            self._end_cancelled(r)
