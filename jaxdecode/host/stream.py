"""The ordered per-request event stream (contract §6 T1-T7, §7 back-pressure).

`OrderedStream` is written by the engine (one producer) and read by one consumer at a time
(HTTP handler, `llm.stream()` iterator); all methods are thread-safe.

Events (`jaxdecode.types.Event`, all carrying ``seq``):
``start`` (seq 0; data: model_snapshot), ``delta`` (data: text), and exactly one terminal
event: ``completed`` (finish_reason, usage) / ``cancelled`` (finish_reason="cancelled", usage) /
``failed`` (error, message, usage).

- T1: ``seq`` = 0, 1, 2, ... strictly increasing and unique within the request.
- T2/T3: events are appended in seq order; the terminal event is the last one; a delta offered
  after the terminal event is dropped (and counted in ``dropped_after_terminal``), never sent.
- T4: the stream keeps a bounded history; ``events_after(seq)`` returns the kept events after
  ``seq`` and ``resume(seq)`` moves the reader's cursor there (a reconnecting client that
  deduplicates by ``(request_id, seq)`` receives each event exactly once). A seq that fell out of
  the history raises `ResumeUnavailable`.
- T6: output kinds. ``delta``: each delta event holds the new text. ``cumulative``: each delta
  event holds the whole text so far in ``text`` (and the new part in ``delta``).
  ``final_only``: no delta until the end, then one delta with the whole text right before the
  terminal event (so concatenating delta texts gives the output in every kind except
  cumulative).
- Log-probabilities: a delta emitted with ``logprobs`` (the request asked for them) carries
  them in ``data["logprobs"]`` -- the entries of this delta's new tokens, in every kind -- and
  where each of those tokens' text begins in the returned text in ``data["offsets"]``;
  ``final_only`` gathers both into its one delta. Such a delta is sent even when its text is
  empty (tokens that showed no text, e.g. skipped special tokens, at the end).
- T7: `Timings` records queue, prefill, decode, stop-buffer wait and send times separately; the
  stream measures ``send_s`` (time from append to hand-over to the reader).

Back-pressure (§7): the unsent events (appended, not yet taken by the reader) are bounded by
``max_buffered``. Policies:

- ``pause``: nothing is dropped; ``should_pause`` is True while the reader is ``max_buffered``
  events behind, and the engine must not schedule that request's decode steps (its StepState is
  kept, B1). Deltas that still arrive (a step already in flight) are accepted up to a hard cap of
  ``2 * max_buffered``; past it the stream overflows as below, so it never grows without bound.
- ``buffer``: keep generating and buffer up to the bound; the first delta that does not fit
  overflows the stream.
- ``fail``: the same mechanism as ``buffer`` (contract §7: "buffer (up to the bound), then fail"),
  accepted as an explicit name for it.

Overflow: the delta is dropped, ``overflowed`` becomes True (the engine should then fail the
request with ``output_buffer_overflow``), later deltas are dropped too, and a ``completed``
terminal requested afterwards is turned into ``failed(output_buffer_overflow)``: a request that
lost deltas never claims to be complete. Terminal events are always accepted (bound + 1).
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import threading
import time
from typing import Any, Callable, Deque, Iterator, List, Optional, Sequence

from jaxdecode.types import ErrorCode, Event, FinishReason, Usage

__all__ = [
    "OutputKind",
    "BackpressurePolicy",
    "Timings",
    "OrderedStream",
    "ResumeUnavailable",
    "TERMINAL_KINDS",
]

TERMINAL_KINDS = frozenset({"completed", "cancelled", "failed"})


class OutputKind(str, enum.Enum):
    DELTA = "delta"
    CUMULATIVE = "cumulative"
    FINAL_ONLY = "final_only"


class BackpressurePolicy(str, enum.Enum):
    PAUSE = "pause"
    BUFFER = "buffer"
    FAIL = "fail"


class ResumeUnavailable(LookupError):
    """The events after the requested seq are no longer kept (or the seq is in the future)."""


@dataclasses.dataclass
class Timings:
    """Per-request wall-clock seconds by phase (contract T7)."""

    queue_s: float = 0.0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    stop_buffer_wait_s: float = 0.0
    send_s: float = 0.0

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def _member(kind: type, value: Any, field: str):
    try:
        return kind(value)
    except ValueError:
        raise ValueError(
            f"{field} must be one of {[k.value for k in kind]}, got {value!r}") from None


class _Output:
    """The text and logprobs a stream has accepted, shaped per output kind (T6): a delta's data,
    or -- final_only -- everything kept for the one delta before the terminal event."""

    def __init__(self, kind: OutputKind):
        self.kind = kind
        self.length = 0  # characters accepted
        self._parts: List[str] = []  # text so far (cumulative / final_only)
        self._logprobs: Optional[list] = None  # final_only: kept for the end
        self._offsets: list = []

    def accept(self, text: str, logprobs: Optional[Sequence[Any]],
               offsets: Sequence[int]) -> Optional[dict]:
        """The delta's data, or None where final_only keeps it for the end."""
        self.length += len(text)
        if self.kind is OutputKind.FINAL_ONLY:
            self._parts.append(text)
            if logprobs is not None:
                self._logprobs = (self._logprobs or []) + list(logprobs)
                self._offsets += list(offsets)
            return None
        extra = {} if logprobs is None else {"logprobs": tuple(logprobs),
                                             "offsets": tuple(offsets)}
        if self.kind is OutputKind.CUMULATIVE:
            self._parts = ["".join(self._parts) + text]
            return {"text": self._parts[0], "delta": text, **extra}
        return {"text": text, **extra}

    def final_delta(self) -> Optional[dict]:
        """final_only: the one delta of everything kept (None when nothing was)."""
        if self.kind is not OutputKind.FINAL_ONLY or not (self._parts or self._logprobs):
            return None
        extra = ({} if self._logprobs is None
                 else {"logprobs": tuple(self._logprobs), "offsets": tuple(self._offsets)})
        data = {"text": "".join(self._parts), **extra}
        self._parts, self._logprobs, self._offsets = [], None, []
        return data


class OrderedStream:
    """Sequence numbers, output kinds, bounded buffer, back-pressure and resume for one request."""

    def __init__(
        self,
        request_id: str,
        *,
        output_kind: str = "delta",
        max_buffered: int = 256,
        policy: str = "buffer",
        keep: int = 1024,
        trace: Any = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.request_id = str(request_id)
        self.output_kind = _member(OutputKind, output_kind, "output_kind")
        self.policy = _member(BackpressurePolicy, policy, "policy")
        if max_buffered < 2 or keep < 0:
            raise ValueError("max_buffered must be at least 2" if max_buffered < 2
                             else "keep must be >= 0")
        self.max_buffered = int(max_buffered)
        self.keep = int(keep)
        self.trace = trace  # anything with .append(event) (a lifecycle Trace), or None
        self.clock = clock
        self.timings = Timings()
        self._cond = threading.Condition(threading.Lock())
        self._history: Deque[Event] = collections.deque()
        self._first_seq = 0
        self._next_seq = 0
        self._cursor = -1  # seq of the last event handed to the reader
        self._started = False
        self._terminal: Optional[Event] = None
        self._overflowed = False
        self._lost = 0
        self._dropped_after_terminal = 0
        self._output = _Output(self.output_kind)
        self._listeners: List[Callable[[], None]] = []
        self._reader_closed = False

    # ---- producer side ----------------------------------------------------------------------
    def continue_numbering(self, next_seq: int) -> None:
        """A request restored from a save continues its stream: the next event gets `next_seq`
        (call before `start`)."""
        with self._cond:
            if self._history or self._started:
                raise RuntimeError("continue_numbering must come before any event")
            self._first_seq = self._next_seq = int(next_seq)
            self._cursor = int(next_seq) - 1

    def start(self, model_snapshot: Optional[str] = None, **data: Any) -> Optional[Event]:
        """Append the ``start`` event (seq 0). Idempotent: returns None when already started."""
        with self._cond:
            if self._started or self._terminal is not None:
                return None
            ev = self._append_locked("start", {"model_snapshot": model_snapshot, **data})
        self._notify()
        return ev

    def emit(self, text: str, logprobs: Optional[Sequence[Any]] = None,
             offsets: Sequence[int] = ()) -> Optional[Event]:
        """Append a delta (with its tokens' `logprobs` and text `offsets` when the request
        asked for logprobs); returns the event, or None when nothing was appended.

        Empty text without logprobs, final_only (kept for the end), after the terminal event
        (L3/T3) and after an overflow all return None.
        """
        if not text and not logprobs:
            return None
        with self._cond:
            if self._terminal is not None:
                self._dropped_after_terminal += 1
                return None
            if self._overflowed:
                self._lost += 1
                return None
            if not self._started:
                self._append_locked("start", {"model_snapshot": None})
            cap = self.max_buffered * (2 if self.policy is BackpressurePolicy.PAUSE else 1)
            if (self.output_kind is not OutputKind.FINAL_ONLY
                    and self._next_seq - 1 - self._cursor >= cap):
                self._overflowed = True
                self._lost += 1
                return None
            data = self._output.accept(text, logprobs, offsets)
            if data is None:
                return None
            ev = self._append_locked("delta", data)
        self._notify()
        return ev

    def complete(self, finish_reason: Any, usage: Optional[Usage] = None, **data: Any) -> Optional[Event]:
        """Terminal ``completed`` (or ``failed(output_buffer_overflow)`` after an overflow)."""
        return self.terminate("completed", finish_reason=finish_reason, usage=usage, **data)

    def cancel(self, usage: Optional[Usage] = None, **data: Any) -> Optional[Event]:
        return self.terminate("cancelled", usage=usage, **data)

    def fail(self, error: Any, usage: Optional[Usage] = None, message: str = "",
             **data: Any) -> Optional[Event]:
        return self.terminate("failed", error=error, usage=usage, message=message, **data)

    def terminate(self, kind: str, **data: Any) -> Optional[Event]:
        """Append the single terminal event; returns None when one was already appended."""
        if kind not in TERMINAL_KINDS:
            raise ValueError(f"terminal kind must be one of {sorted(TERMINAL_KINDS)}, got {kind!r}")
        with self._cond:
            if self._terminal is not None:
                return None
            if not self._started:
                self._append_locked("start", {"model_snapshot": None})
            if kind == "completed" and self._overflowed:
                kind = "failed"
                data = {
                    "error": ErrorCode.OUTPUT_BUFFER_OVERFLOW,
                    "message": f"{self._lost} delta(s) did not fit the output buffer",
                    "usage": data.get("usage"),
                }
            if kind == "cancelled":
                data.setdefault("finish_reason", FinishReason.CANCELLED)
            final = self._output.final_delta()
            if final is not None:
                self._append_locked("delta", final)
            ev = self._append_locked(kind, data)
            self._terminal = ev
        self._notify()
        return ev

    # ---- state --------------------------------------------------------------------------------
    @property
    def started(self) -> bool:
        return self._started

    @property
    def finished(self) -> bool:
        """The terminal event has been appended."""
        return self._terminal is not None

    @property
    def terminal_event(self) -> Optional[Event]:
        return self._terminal

    @property
    def overflowed(self) -> bool:
        return self._overflowed

    lost_deltas = property(lambda self: self._lost)
    dropped_after_terminal = property(lambda self: self._dropped_after_terminal)

    @property
    def next_seq(self) -> int:
        return self._next_seq

    @property
    def unsent(self) -> int:
        with self._cond:
            return self._next_seq - 1 - self._cursor

    @property
    def should_pause(self) -> bool:
        """Pause policy: the reader is ``max_buffered`` events behind; do not schedule steps."""
        if self.policy is not BackpressurePolicy.PAUSE:
            return False
        with self._cond:
            return self._next_seq - 1 - self._cursor >= self.max_buffered

    @property
    def text_length(self) -> int:
        """Characters of output text accepted so far."""
        return self._output.length

    @property
    def reader_closed(self) -> bool:
        return self._reader_closed

    def close_reader(self) -> None:
        """The consumer went away (transport error, T5): the engine decides cancel or continue."""
        with self._cond:
            self._reader_closed = True
            self._cond.notify_all()
        self._notify()

    def add_listener(self, fn: Callable[[], None]) -> None:
        """Call `fn()` (from the producer thread, outside locks) after every appended event."""
        self._listeners.append(fn)

    def wait_for_space(self, timeout: Optional[float] = None) -> bool:
        """Block until the reader is less than ``max_buffered`` events behind (or timeout)."""
        with self._cond:
            return self._cond.wait_for(
                lambda: self._next_seq - 1 - self._cursor < self.max_buffered
                or self._terminal is not None,
                timeout,
            )

    # ---- consumer side -------------------------------------------------------------------------
    def get(self, timeout: Optional[float] = None) -> Optional[Event]:
        """The next event in seq order; None once the terminal event has been delivered.

        Blocks up to `timeout` seconds (forever when None); raises TimeoutError when nothing came.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                ev = self._take_locked()
                if ev is not None:
                    return ev
                if self._terminal is not None:
                    return None
                if deadline is None:
                    self._cond.wait()
                else:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        raise TimeoutError(f"no event for request {self.request_id} within {timeout}s")
                    self._cond.wait(remaining)

    def get_nowait(self) -> Optional[Event]:
        """The next event if one is ready, else None (also None at the end)."""
        with self._cond:
            return self._take_locked()

    def iter(self, timeout: Optional[float] = None) -> Iterator[Event]:
        """Events until (and including) the terminal one; `timeout` applies to each wait."""
        while True:
            ev = self.get(timeout)
            if ev is None:
                return
            yield ev
            if ev.kind in TERMINAL_KINDS:
                return

    __iter__ = iter

    def events_after(self, seq: int) -> List[Event]:
        """The kept events with a seq greater than `seq` (T4); does not move the cursor."""
        with self._cond:
            return self._after_locked(seq)

    def resume(self, after_seq: int) -> None:
        """Move the reader's cursor: the next `get()` returns the event after `after_seq` (T4)."""
        with self._cond:
            self._after_locked(after_seq)  # validates
            self._cursor = max(-1, after_seq)
            self._cond.notify_all()

    # ---- internals ---------------------------------------------------------------------------
    def _take_locked(self) -> Optional[Event]:
        """Hand the event after the cursor to the reader (None when it is not there yet)."""
        nxt = self._cursor + 1
        if nxt >= self._next_seq:
            return None
        ev = self._history[nxt - self._first_seq]
        self._cursor = nxt
        self.timings.send_s += max(0.0, self.clock() - ev.time)
        self._trim_locked()
        self._cond.notify_all()
        return ev

    def _after_locked(self, seq: int) -> List[Event]:
        seq = max(-1, int(seq))
        if seq >= self._next_seq:
            raise ResumeUnavailable(f"seq {seq} has not been produced (next is {self._next_seq})")
        if seq + 1 < self._first_seq:
            raise ResumeUnavailable(
                f"events after seq {seq} are no longer kept (oldest kept is {self._first_seq})"
            )
        start = seq + 1 - self._first_seq
        return list(self._history)[start:]

    def _append_locked(self, kind: str, data: dict) -> Event:
        ev = Event(kind=kind, request_id=self.request_id, seq=self._next_seq, data=data, time=self.clock())
        self._next_seq += 1
        if kind == "start":
            self._started = True
        self._history.append(ev)
        self._trim_locked()
        if self.trace is not None:
            self.trace.append(ev)
        self._cond.notify_all()
        return ev

    def _trim_locked(self) -> None:
        hist = self._history
        # Sent events beyond `keep` are forgotten; unsent events are never dropped here.
        while hist and len(hist) > self.keep and hist[0].seq <= self._cursor:
            hist.popleft()
            self._first_seq += 1

    def _notify(self) -> None:
        for fn in list(self._listeners):
            try:
                fn()
            except Exception:  # a listener must never break the producer
                pass

    def __repr__(self) -> str:
        return (f"OrderedStream({self.request_id!r}, kind={self.output_kind.value}, policy="
                f"{self.policy.value}, next_seq={self._next_seq}, finished={self.finished})")
