"""The output processor: the only loop over a step's rows. Tokens -> text pipeline -> stream
events and endings (contract §4-§6, §8, §9).

A processed step is a `Dispatched` record: the backend's output, which request owned each slot
when it was dispatched, and its top-k. For each row whose request still owns its slot and is
still live (the duplicate guard: a token selected after a request's terminal event is never
emitted, contract L3), each of its K tokens goes through `on_token` in order -- the earlier ones
RUNNING, the last with the step's finish code -- until the request ends; the rest is dropped.
Cancels observed here end the request and discard what its step produced (contract L4).

Endings (`end`, `end_cancelled`, `fail`) end a request exactly once and release its slot once
(contract L1, R1). They are the `OutputSink` the beam lane delivers its finished beams through.
Host work for one request runs `isolated`: an exception fails that request alone
(`decoding_error`), never the engine thread.

Usage (contract §9): selected = tokens the device chose for the request; processed = those written
into the cache while the request went on (`decode.completed`); returned = those whose text was
returned. With several endings on one token the one that ends the text wins (S9). Each delta
carries the logprob entries of the tokens that became returned since the previous delta and
where their text begins (typed `Event.logprobs` / `Event.offsets`); a terminal event names the
stop that hit (`Event.stop`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from typing import Any, Callable, Iterable, Iterator, Optional, Protocol

from jaxdecode.device.state import EOS, RUNNING, STOP_TOKEN
from jaxdecode.device.stops import ERRORS, FINISH_REASONS
from jaxdecode.engine.backend import SlotBackend, StepResult
from jaxdecode.engine.request import Request, logprob_entry
from jaxdecode.engine.scheduler import Scheduler
from jaxdecode.types import DecodingError, ErrorCode, FinishReason, RequestState, TokenLogprob

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class Dispatched:
    """A step in flight: the backend's output, the owner of each slot when it was dispatched
    (None: not live), its static top-k (0 or the engine's logprobs_k)."""

    out: Any
    owners: list
    top_k: int = 0


class OutputSink(Protocol):
    """How a producer of whole results outside the slot steps (the beam lane) ends its
    requests: its final text and finish reason, a cancel, a failure."""

    def complete(self, r: Request, text: str, reason: FinishReason, stop: Any = None) -> None:
        ...

    def end_cancelled(self, r: Request) -> None: ...

    def fail(self, r: Request, error: ErrorCode, message: str) -> None: ...


class OutputProcessor:
    """Turns processed steps into events and endings (module docstring). `on_step()` is
    called after every fetched step (the engine's health)."""

    def __init__(self, scheduler: Scheduler, backend: SlotBackend,
                 on_step: Callable[[], None] = lambda: None):
        self.scheduler, self.backend, self.on_step = scheduler, backend, on_step

    # -- a processed step ---------------------------------------------------------------------

    def process(self, step: Dispatched) -> None:
        result = self.backend.fetch(step.out, step.top_k)  # one transfer
        self.on_step()
        for slot, r in self._owned_rows(step):
            with self.isolated(r):
                self.backend.observe(r, result, slot)
                self._row(r, result, slot)
        self.sweep(list(self.scheduler.slots))

    def process_first(self, first: Dispatched) -> None:
        """The first tokens of the rows whose prefill just ended (`backend.start`; owner i is
        row i), streamed before the step that selects them again: each goes through
        `on_token` now, and that step's copy is checked and skipped (`_row`): the token is
        selected now and written when that step is processed (O2). A request that ended, was
        paused by its user or left its slot meanwhile waits for its step."""
        result = self.backend.fetch(first.out, first.top_k)  # one transfer
        for i, r in enumerate(first.owners):
            if (r.lifecycle.is_terminal or self.scheduler.placements.slot_of(r) is None
                    or r.user_paused or r.ahead is not None or int(result.counts[i]) != 1):
                continue
            with self.isolated(r):
                if r.lifecycle.observe_cancel():
                    self.end_cancelled(r)
                    continue
                self._row(r, result, i, written=False)
                if not r.lifecycle.is_terminal:
                    r.ahead = int(result.tokens[i, 0])

    def _row(self, r: Request, result: StepResult, slot: int, written: bool = True) -> None:
        count = int(result.counts[slot])
        for i in range(count):
            code = int(result.finish[slot]) if i == count - 1 else RUNNING
            token = int(result.tokens[slot, i])
            if r.ahead is not None:  # streamed from its prefill (process_first)
                expected, r.ahead = r.ahead, None
                if token != expected:  # the same selection on the same row state (X1)
                    self.fail(r, ErrorCode.MODEL_ERROR, f"the first step selected token "
                              f"{token}, not the {expected} streamed from the prefill")
                    return
                self._written(r)
                continue
            entry = (logprob_entry(r, token, result.logprob[slot, i], result.top_ids[slot, i],
                                   result.top_logprobs[slot, i])
                     if r.logprobs is not None else None)
            self.on_token(r, token, code, entry, written)
            if r.lifecycle.is_terminal:
                break

    def _owned_rows(self, step: Dispatched) -> Iterator[tuple[int, Request]]:
        """(slot, request) for each row of a processed step whose request still owns its slot
        and goes on. Settles the in-flight counts first; a request that ended after the step
        was sent is skipped (the duplicate guard), a cancelled one ends here and its in-flight
        result is discarded (contract L4)."""
        for r in step.owners:
            placed = self.scheduler.placements.get(r)
            if placed is not None:
                placed.in_flight -= 1
        for slot, r in enumerate(step.owners):
            if r is None or r.lifecycle.is_terminal or self.scheduler.placements.slot_of(r) != slot:
                continue
            if r.lifecycle.observe_cancel():
                self.end_cancelled(r)
                continue
            yield slot, r

    def on_token(self, r: Request, token: int, code: int, entry: Optional[TokenLogprob],
                 written: bool = True) -> None:
        """One selected token; `written`: the step that selected it also wrote it (not so for
        a first token streamed from the prefill, `process_first`)."""
        lc = r.lifecycle
        if code in ERRORS:  # NaN logits, every token masked, a grammar dead end (P2):
            self.fail(r, ERRORS[code], ERRORS[code].value)  # nothing selected
            return
        r.selected += 1
        t = r.selected
        r.token_ids.append(token)
        if entry is not None:
            r.logprobs.append(entry)
        lc.record("token.selected", step=t, token=token)
        if code == EOS or (code == STOP_TOKEN and not r.sampling.include_stop_in_output):
            self.end(r, FINISH_REASONS[code], stop=token if code == STOP_TOKEN else None)
            return  # never shown (D6, S8)
        try:
            pushed = r.pipeline.push(token)
        except (DecodingError, ValueError) as exc:
            self.fail(r, ErrorCode.DECODING_ERROR, str(exc))
            return
        self.emit(r, pushed.text)
        if pushed.hit is not None:
            lc.record("stop.hit", stop=pushed.hit.stop, index=pushed.hit.index)
            self.end(r, FinishReason.STOP_SEQUENCE, stop=pushed.hit.stop)
        elif code == RUNNING:
            if written:
                self._written(r)
        else:  # MAX_TOKENS, CONTEXT_LIMIT, GRAMMAR_COMPLETE, or a shown stop id
            self.end(r, FINISH_REASONS[code], stop=token if code == STOP_TOKEN else None)

    def _written(self, r: Request) -> None:
        """The last selected token is in the cache and the request goes on (O2)."""
        r.processed += 1
        r.lifecycle.record("decode.completed", step=r.selected,
                           cache_length=len(r.prompt_ids) + r.selected)

    def emit(self, r: Request, text: str) -> None:
        """A delta: `text` and the logprobs of the tokens returned since the last one."""
        first = r.reported
        entries = r.take_logprobs()
        offsets = () if entries is None else tuple(
            r.pipeline.token_offset(i) for i in range(first, first + len(entries)))
        r.lifecycle.emit_delta(text, entries, offsets)

    # -- sweeps (cancels and deadlines at safe points) ----------------------------------------

    def sweep(self, requests: Iterable[Optional[Request]]) -> None:
        """Observe cancels and deadlines of these requests (queued or in slots)."""
        now = time.monotonic()
        for r in requests:
            if r is None or r.lifecycle.is_terminal:
                continue
            if r.user_paused and self.scheduler.placements.in_flight(r) == 0:
                r.settled.set()
            with self.isolated(r):
                if r.lifecycle.observe_cancel():
                    self.end_cancelled(r)
                elif r.deadline is not None and now >= r.deadline:
                    self.end(r, FinishReason.DEADLINE_EXCEEDED)

    # -- endings (each ends the request exactly once, then releases its slot) -----------------

    def end(self, r: Request, reason: FinishReason, stop: Any = None) -> None:
        lc = r.lifecycle
        if lc.is_terminal:
            return
        lc.try_transition(RequestState.DRAINING)
        try:
            final = r.pipeline.finish(reason)
        except DecodingError as exc:
            self.fail(r, ErrorCode.DECODING_ERROR, str(exc))
            return
        if final.hit is not None and reason is not FinishReason.STOP_SEQUENCE:
            lc.record("stop.hit", stop=final.hit.stop, index=final.hit.index)
            stop = final.hit.stop
        self.complete(r, final.text, final.finish_reason, stop)

    def complete(self, r: Request, text: str, reason: FinishReason, stop: Any = None) -> None:
        """The last delta (`text` and the logprobs not yet sent), then the terminal event
        naming the stop that hit; the slot is released."""
        r.lifecycle.try_transition(RequestState.DRAINING)
        self.emit(r, text)
        r.lifecycle.complete(reason, usage=r.usage(), stop=stop)
        self.release(r)

    def end_cancelled(self, r: Request) -> None:
        r.pipeline.cancel()
        r.lifecycle.cancel(usage=r.usage())
        self.release(r)

    def fail(self, r: Request, error: ErrorCode, message: str) -> None:
        r.error_message = message
        r.lifecycle.fail(error, usage=r.usage(), message=message)
        self.release(r)

    def release(self, r: Request) -> None:
        """Free its slot once (R1) and wake whoever waits for it."""
        if self.scheduler.placements.slot_of(r) is not None:
            r.lifecycle.release_once("slot", lambda: self.scheduler.free(r))
        r.finished.set()
        self.scheduler.wake()

    @contextlib.contextmanager
    def isolated(self, r: Request) -> Iterator[None]:
        """Host work for one request: an exception fails that request alone (its text
        pipeline failed: `decoding_error`), never the engine thread."""
        try:
            yield
        except Exception as exc:
            logger.exception("request %s failed in the host pipeline", r.request_id)
            self.fail(r, ErrorCode.DECODING_ERROR, f"{type(exc).__name__}: {exc}")
