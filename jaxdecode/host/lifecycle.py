"""The request lifecycle of contract §1 (L1-L4), the per-request trace, and release-once cleanup (R1).

The state machine is data: `TRANSITIONS` maps each state to the states it may move to, and
anything else raises `IllegalTransition`:

    CREATED -> QUEUED -> PREFILLING -> DECODING -> DRAINING -> FINISHED
    CREATED -> FAILED
    QUEUED | PREFILLING -> DRAINING
    QUEUED | PREFILLING | DECODING | DRAINING -> FAILED
    QUEUED | PREFILLING | DECODING -> CANCEL_REQUESTED -> CANCELLED

`Lifecycle` guards one request's state with a re-entrant lock.

- L1: FINISHED, CANCELLED, FAILED are terminal; nothing leaves them.
- L2: terminal states are entered only through `transition_and_emit_terminal` (plain
  `transition` to a terminal state raises), which fixes the state and appends the single
  terminal event -- into the attached `OrderedStream`, or the trace -- inside one critical
  section. A second terminal attempt (the loser of a cancel/complete race) returns None and
  changes nothing. If the stream lost deltas to an overflow, FINISHED becomes
  FAILED(output_buffer_overflow) in the same section, so state and event always agree.
- L3: deltas go through `emit_delta`, which takes the same lock and drops text once the request
  is terminal -- or CANCEL_REQUESTED (L4: a step in flight finishes but its text is discarded).
  `complete()` on a CANCEL_REQUESTED request ends it CANCELLED: the observed cancel wins.
- L4 / C1 / C4: `request_cancel()` (any thread) only sets a flag and records
  ``cancel.requested``: it returns at once, is idempotent and is a no-op on a request that has
  ended or is draining. The engine calls `observe_cancel()` at a safe point: it moves the
  request to CANCEL_REQUESTED (``cancel.observed``), and `cancel()` later ends it as CANCELLED.
  ``fail()`` on a CANCEL_REQUESTED request ends it as CANCELLED (the table has no
  CANCEL_REQUESTED -> FAILED edge); the error is kept in the event data.
- R1: `release_once(name, fn)` runs each named cleanup at most once; an exception in it is
  logged and recorded (``resources.released`` with ``ok=False``) and never reopens the request.

Trace: a list of `jaxdecode.types.Event` with kinds ``lifecycle`` (from, to), ``token.selected``
(step, token), ``decode.started`` (step), ``decode.completed`` (step, cache_length),
``stop.hit`` (stop), ``cancel.requested``, ``cancel.observed``, ``start``, ``delta`` (text),
``completed``, ``cancelled``, ``failed``, ``resources.released``. ``Lifecycle(trace=False)``
makes recording a no-op; otherwise a record is one small object appended to a list.
"""

from __future__ import annotations

import logging
import threading
import time
from types import MappingProxyType
from typing import Any, Callable, Dict, FrozenSet, Iterator, List, Mapping, Optional, Sequence

from jaxdecode.types import ErrorCode, Event, FinishReason, RequestState, Usage

from .stream import OrderedStream, Timings

__all__ = [
    "TRANSITIONS",
    "TERMINAL_STATES",
    "CANCELLABLE_STATES",
    "TERMINAL_EVENT_KIND",
    "IllegalTransition",
    "is_allowed",
    "Trace",
    "Lifecycle",
]

logger = logging.getLogger(__name__)

S = RequestState

TRANSITIONS: Mapping[RequestState, FrozenSet[RequestState]] = MappingProxyType(
    {
        S.CREATED: frozenset({S.QUEUED, S.FAILED}),
        S.QUEUED: frozenset({S.PREFILLING, S.DRAINING, S.FAILED, S.CANCEL_REQUESTED}),
        S.PREFILLING: frozenset({S.DECODING, S.DRAINING, S.FAILED, S.CANCEL_REQUESTED}),
        S.DECODING: frozenset({S.DRAINING, S.FAILED, S.CANCEL_REQUESTED}),
        S.DRAINING: frozenset({S.FINISHED, S.FAILED}),
        S.CANCEL_REQUESTED: frozenset({S.CANCELLED}),
        S.FINISHED: frozenset(),
        S.CANCELLED: frozenset(),
        S.FAILED: frozenset(),
    }
)
TERMINAL_STATES: FrozenSet[RequestState] = frozenset({S.FINISHED, S.CANCELLED, S.FAILED})
CANCELLABLE_STATES: FrozenSet[RequestState] = frozenset({S.QUEUED, S.PREFILLING, S.DECODING})
TERMINAL_EVENT_KIND: Mapping[RequestState, str] = MappingProxyType(
    {S.FINISHED: "completed", S.CANCELLED: "cancelled", S.FAILED: "failed"}
)


class IllegalTransition(RuntimeError):
    """A transition that `TRANSITIONS` does not allow (contract §1)."""

    def __init__(self, from_state: RequestState, to_state: RequestState, detail: str = ""):
        self.from_state = from_state
        self.to_state = to_state
        msg = f"illegal transition {RequestState(from_state).value} -> {RequestState(to_state).value}"
        super().__init__(f"{msg}: {detail}" if detail else msg)


def is_allowed(from_state: RequestState, to_state: RequestState) -> bool:
    return RequestState(to_state) in TRANSITIONS[RequestState(from_state)]


class Trace:
    """The per-request event trace (cheap when disabled)."""

    __slots__ = ("request_id", "enabled", "clock", "_events")

    def __init__(self, request_id: str, enabled: bool = True, clock: Callable[[], float] = time.monotonic):
        self.request_id = str(request_id)
        self.enabled = bool(enabled)
        self.clock = clock
        self._events: List[Event] = []

    def record(self, kind: str, seq: Optional[int] = None, **data: Any) -> None:
        if self.enabled:
            self._events.append(Event(kind, self.request_id, seq, data, self.clock()))

    def append(self, event: Event) -> None:
        if self.enabled:
            self._events.append(event)

    @property
    def events(self) -> List[Event]:
        return list(self._events)

    def kinds(self) -> List[str]:
        return [e.kind for e in self._events]

    def of_kind(self, kind: str) -> List[Event]:
        return [e for e in self._events if e.kind == kind]

    def __len__(self) -> int:
        return len(self._events)

    def __iter__(self) -> Iterator[Event]:
        return iter(list(self._events))


def _terminal_payload(to: RequestState, finish_reason: Any, error: Any, message: str,
                      usage: Optional[Usage]) -> dict:
    """The data of the terminal event that ends in state `to` (contract §9)."""
    if to is S.FINISHED:
        return {"finish_reason": finish_reason, "usage": usage}
    if to is S.CANCELLED:
        payload = {"finish_reason": FinishReason.CANCELLED, "usage": usage}
        if error is not None:
            payload.update(error=error, message=message)
        return payload
    return {"error": error, "message": message, "usage": usage}


class Lifecycle:
    """One request's state, terminal event and trace (contract §1, §8, R1)."""

    def __init__(
        self,
        request_id: str,
        *,
        stream: Optional[OrderedStream] = None,
        trace: Any = True,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.request_id = str(request_id)
        self.clock = clock
        if isinstance(trace, Trace):
            self.trace = trace
        else:
            self.trace = Trace(self.request_id, enabled=bool(trace), clock=clock)
        self.stream = stream
        if stream is not None and stream.trace is None:
            stream.trace = self.trace
        self._lock = threading.RLock()
        self._state = S.CREATED
        self._state_times: Dict[RequestState, float] = {S.CREATED: clock()}
        self._terminal_event: Optional[Event] = None
        self._cancel_flag = False
        self._released: Dict[str, bool] = {}
        self._seq = 0  # stream-less sequence numbers for start/delta/terminal
        self._started = False
        self.dropped_after_terminal = 0

    # ---- state ------------------------------------------------------------------------------
    @property
    def state(self) -> RequestState:
        return self._state

    @property
    def is_terminal(self) -> bool:
        return self._state in TERMINAL_STATES

    @property
    def terminal_event(self) -> Optional[Event]:
        return self._terminal_event

    @property
    def state_times(self) -> Dict[RequestState, float]:
        """Clock value at which each visited state was entered."""
        return dict(self._state_times)

    @property
    def cancel_requested(self) -> bool:
        return self._cancel_flag

    def _set_locked(self, to: RequestState) -> None:
        frm = self._state
        self._state = to
        self._state_times.setdefault(to, self.clock())
        self.trace.record("lifecycle", **{"from": frm, "to": to})

    def transition(self, to: RequestState) -> None:
        """Move to a non-terminal state; raises `IllegalTransition` when not allowed."""
        to = RequestState(to)
        with self._lock:
            frm = self._state
            if to in TERMINAL_STATES:
                raise IllegalTransition(
                    frm, to, "terminal states are entered through transition_and_emit_terminal (L2)"
                )
            if to not in TRANSITIONS[frm]:
                raise IllegalTransition(frm, to)
            self._set_locked(to)

    def try_transition(self, to: RequestState) -> bool:
        """Like `transition` but returns False instead of raising."""
        try:
            self.transition(to)
            return True
        except IllegalTransition:
            return False

    def transition_and_emit_terminal(
        self,
        to: RequestState,
        *,
        finish_reason: Any = None,
        error: Any = None,
        message: str = "",
        usage: Optional[Usage] = None,
        **data: Any,
    ) -> Optional[Event]:
        """Fix the terminal state and append its single terminal event atomically (L2).

        Returns the terminal event, or None when the request had already ended (no change).
        Raises `IllegalTransition` when the current state may not move to `to`.
        """
        to = RequestState(to)
        if to not in TERMINAL_STATES:
            raise IllegalTransition(self._state, to, "not a terminal state")
        with self._lock:
            if self._state in TERMINAL_STATES:
                return None
            frm = self._state
            if to not in TRANSITIONS[frm]:
                raise IllegalTransition(frm, to)
            stream = self.stream
            if to is S.FINISHED:
                if finish_reason is None:
                    raise ValueError("FINISHED needs a finish_reason")
                if stream is not None and stream.overflowed:
                    to = S.FAILED
                    error = ErrorCode.OUTPUT_BUFFER_OVERFLOW
                    message = f"{stream.lost_deltas} delta(s) did not fit the output buffer"
            if to is S.FAILED and error is None:
                raise ValueError("FAILED needs an error code")
            kind = TERMINAL_EVENT_KIND[to]
            payload = {**_terminal_payload(to, finish_reason, error, message, usage), **data}
            self._set_locked(to)
            if stream is not None:
                ev = stream.terminate(kind, **payload)
                if ev is None:  # the stream was ended directly by someone else
                    ev = stream.terminal_event
            else:
                if not self._started:
                    self._emit_start_locked(None, {})
                ev = self._local_event_locked(kind, payload)
            self._terminal_event = ev
            return ev

    # ---- convenience endings -------------------------------------------------------------------
    def complete(self, finish_reason: Any, usage: Optional[Usage] = None, **data: Any) -> Optional[Event]:
        """End normally: passes through DRAINING when needed, then FINISHED (one section).

        On a request whose cancel was already observed (CANCEL_REQUESTED) the cancel wins: it
        ends CANCELLED. None when the request had already ended."""
        with self._lock:
            if self._state in TERMINAL_STATES:
                return None
            if self._state is S.CANCEL_REQUESTED:  # the observed cancel wins the race (L2)
                return self.transition_and_emit_terminal(S.CANCELLED, usage=usage)
            if self._state in (S.QUEUED, S.PREFILLING, S.DECODING):
                self._set_locked(S.DRAINING)
            return self.transition_and_emit_terminal(
                S.FINISHED, finish_reason=finish_reason, usage=usage, **data
            )

    def fail(self, error: Any, usage: Optional[Usage] = None, message: str = "", **data: Any) -> Optional[Event]:
        """End with an error (FAILED; CANCELLED when a cancel was already observed)."""
        with self._lock:
            if self._state in TERMINAL_STATES:
                return None
            if self._state is S.CANCEL_REQUESTED:
                return self.transition_and_emit_terminal(
                    S.CANCELLED, error=error, message=message, usage=usage, **data
                )
            return self.transition_and_emit_terminal(
                S.FAILED, error=error, message=message, usage=usage, **data
            )

    def cancel(self, usage: Optional[Usage] = None, **data: Any) -> Optional[Event]:
        """Make an observed cancel effective (CANCELLED). None when already ended or draining."""
        with self._lock:
            if self._state in TERMINAL_STATES or self._state is S.DRAINING:
                return None
            if self._state in CANCELLABLE_STATES:
                self._observe_locked()
            return self.transition_and_emit_terminal(S.CANCELLED, usage=usage, **data)

    # ---- cancellation ----------------------------------------------------------------------------
    def request_cancel(self) -> bool:
        """Ask for cancellation (any thread; returns at once; idempotent). True when accepted."""
        with self._lock:
            if self._state in TERMINAL_STATES or self._state is S.DRAINING:
                return False
            if not self._cancel_flag:
                self._cancel_flag = True
                self.trace.record("cancel.requested")
            return True

    def observe_cancel(self) -> bool:
        """At a safe point: turn a requested cancel into CANCEL_REQUESTED. True when it did
        (or the request already is CANCEL_REQUESTED)."""
        with self._lock:
            if self._state is S.CANCEL_REQUESTED:
                return True
            if self._cancel_flag and self._state in CANCELLABLE_STATES:
                self._observe_locked()
                return True
            return False

    def _observe_locked(self) -> None:
        if not self._cancel_flag:
            self._cancel_flag = True
            self.trace.record("cancel.requested")
        self._set_locked(S.CANCEL_REQUESTED)
        self.trace.record("cancel.observed")

    # ---- stream events -----------------------------------------------------------------------------
    def emit_start(self, model_snapshot: Optional[str] = None, **data: Any) -> Optional[Event]:
        with self._lock:
            if self._state in TERMINAL_STATES or self._started:
                return None
            return self._emit_start_locked(model_snapshot, data)

    def _emit_start_locked(self, model_snapshot: Optional[str], data: dict) -> Optional[Event]:
        self._started = True
        if self.stream is not None:
            return self.stream.start(model_snapshot, **data)
        return self._local_event_locked("start", {"model_snapshot": model_snapshot, **data})

    def _local_event_locked(self, kind: str, data: dict) -> Event:
        """A stream-less request's event: numbered here, kept in the trace."""
        ev = Event(kind, self.request_id, self._seq, data, self.clock())
        self._seq += 1
        self.trace.append(ev)
        return ev

    def emit_delta(self, text: str, logprobs: Optional[Sequence[Any]] = None,
                   offsets: Sequence[int] = ()) -> Optional[Event]:
        """Append a text delta (with its tokens' `logprobs` and text `offsets`, see
        `OrderedStream.emit`) unless the request is terminal (L3) or its cancel was observed
        (L4: the result of a step still in flight is discarded). None when nothing was sent."""
        if not text and not logprobs:
            return None
        with self._lock:
            if self._state in TERMINAL_STATES or self._state is S.CANCEL_REQUESTED:
                self.dropped_after_terminal += 1
                return None
            if not self._started:
                self._emit_start_locked(None, {})
            if self.stream is not None:
                return self.stream.emit(text, logprobs, offsets)
            data = {"text": text} if logprobs is None else {
                "text": text, "logprobs": tuple(logprobs), "offsets": tuple(offsets)}
            return self._local_event_locked("delta", data)

    # ---- trace ----------------------------------------------------------------------------------
    def record(self, kind: str, **data: Any) -> None:
        """Append a non-stream trace event (token.selected, decode.completed, stop.hit, ...)."""
        self.trace.record(kind, **data)

    @property
    def events(self) -> List[Event]:
        return self.trace.events

    # ---- resources (R1) -------------------------------------------------------------------------
    def release_once(self, name: str, fn: Optional[Callable[[], Any]] = None) -> bool:
        """Run the cleanup `fn` for resource `name` exactly once. True if this call ran it."""
        with self._lock:
            if name in self._released:
                return False
            self._released[name] = True
        ok = True
        err = ""
        if fn is not None:
            try:
                fn()
            except Exception as exc:  # logged, recorded, never reopens the request (R1)
                ok = False
                err = f"{type(exc).__name__}: {exc}"
                logger.exception("cleanup of %s for request %s failed", name, self.request_id)
        self._released[name] = ok
        self.trace.record("resources.released", resource=name, ok=ok, **({"error": err} if err else {}))
        return True

    @property
    def released(self) -> Dict[str, bool]:
        """Resources released so far, with whether their cleanup succeeded."""
        return dict(self._released)

    # ---- timings (T7) ---------------------------------------------------------------------------
    def timings(self, pipeline: Any = None) -> Timings:
        """Queue, prefill and decode times from the state entry times; stop-buffer wait from
        `pipeline.stop_wait_s`; send time from the attached stream."""
        t = self._state_times
        out = Timings()
        if S.QUEUED in t:
            end = t[S.PREFILLING] if S.PREFILLING in t else self._first_end()
            out.queue_s = max(0.0, end - t[S.QUEUED])
        if S.PREFILLING in t:
            end = t[S.DECODING] if S.DECODING in t else self._first_end()
            out.prefill_s = max(0.0, end - t[S.PREFILLING])
        if S.DECODING in t:
            end = self._first_end()
            out.decode_s = max(0.0, end - t[S.DECODING])
        if pipeline is not None:
            out.stop_buffer_wait_s = float(getattr(pipeline, "stop_wait_s", 0.0))
        if self.stream is not None:
            out.send_s = self.stream.timings.send_s
        return out

    def _first_end(self) -> float:
        t = self._state_times
        for s in (S.DRAINING, S.CANCEL_REQUESTED, S.FINISHED, S.CANCELLED, S.FAILED):
            if s in t:
                return t[s]
        return self.clock()

    def __repr__(self) -> str:
        return f"Lifecycle({self.request_id!r}, state={self._state.value})"

