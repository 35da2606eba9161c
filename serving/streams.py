"""The server-sent events of streaming responses, kept for resumption (contract §6 T1-T4).

Each streaming HTTP response owns one `ResponseLog`: the ordered list of its SSE events
(`data` strings: chunks, the optional usage chunk, then ``[DONE]``). An event's SSE ``id`` is its
index in the log, so ids start at 0 and strictly increase by one. With n = 1 the log has one
chunk per engine stream event (start -> the first, empty chunk; each delta; the terminal event),
so the SSE id of a chunk equals the engine's `seq` (contract T1). With n > 1 the choices' events are
merged in the order the server reads them and the id is the position in that merged order.

One pump task per log reads the engine streams as soon as they produce (so the engine's
per-request buffer never fills and its back-pressure policy never triggers for HTTP clients);
readers (the original response and any `GET /v1/streams/{id}` reconnects) follow the log from a
position without consuming anything, so a reconnect after id k gets exactly the events after k,
each once, in order (T4). A log holds at most one event per generated token plus a few, so it is
bounded by the request's max_tokens; `StreamRegistry` bounds how many logs are kept and for how
long after they finish.
"""

from __future__ import annotations

import asyncio
import collections
import time
from typing import Any, AsyncIterator, Optional


class ResponseLog:
    """The SSE events of one streaming response; appended and read on the event loop thread."""

    def __init__(self, request_id: str, handles: list, *, chat: bool, include_usage: bool,
                 created: int, prompt_tokens: int):
        self.request_id = request_id
        self.handles = handles
        self.chat = chat
        self.include_usage = include_usage
        self.created = created
        self.prompt_tokens = prompt_tokens
        self.events: list[str] = []
        self.done = False
        self.finished_at: Optional[float] = None
        self.readers = 0
        self.tracked: Any = None  # the server's bookkeeping (transport_error, metrics)
        self.task: Optional[asyncio.Task] = None
        self._changed = asyncio.Event()

    def append(self, data: str) -> int:
        if self.done:
            raise RuntimeError(f"stream {self.request_id} is closed")
        self.events.append(data)
        self._signal()
        return len(self.events) - 1

    def close(self) -> None:
        if not self.done:
            self.done = True
            self.finished_at = time.monotonic()
            self._signal()

    def _signal(self) -> None:
        ev, self._changed = self._changed, asyncio.Event()
        ev.set()

    async def follow(self, after: int = -1, idle_s: Optional[float] = None
                     ) -> AsyncIterator[tuple[Optional[int], Optional[str]]]:
        """(id, data) of every event after `after`, waiting for new ones until the log closes;
        (None, None) after each `idle_s` seconds without an event (for keep-alive comments)."""
        i = max(-1, after) + 1
        while True:
            changed = self._changed
            while i < len(self.events):
                yield i, self.events[i]
                i += 1
            if self.done:
                return
            if changed is self._changed:
                try:
                    await asyncio.wait_for(changed.wait(), idle_s)
                except asyncio.TimeoutError:
                    yield None, None


class StreamRegistry:
    """Logs by request id: live ones are always kept; finished ones for `ttl_s` seconds, at most
    `max_finished` of them holding at most `max_events` events together (oldest dropped
    first). A kept log also keeps its engine handles (and their traces), so these bounds are
    what bounds the server's memory for resumable streams."""

    def __init__(self, max_finished: int = 256, ttl_s: float = 600.0,
                 max_events: int = 65536):
        self.max_finished = max_finished
        self.ttl_s = ttl_s
        self.max_events = max_events
        self._logs: "collections.OrderedDict[str, ResponseLog]" = collections.OrderedDict()

    def add(self, log: ResponseLog) -> None:
        self._purge()
        self._logs[log.request_id] = log

    def get(self, request_id: str) -> Optional[ResponseLog]:
        self._purge()
        return self._logs.get(request_id)

    def __len__(self) -> int:
        return len(self._logs)

    def _purge(self) -> None:
        now = time.monotonic()
        finished = [k for k, v in self._logs.items() if v.done]
        for k in finished:
            if now - (self._logs[k].finished_at or now) > self.ttl_s:
                del self._logs[k]
        finished = [k for k in finished if k in self._logs]
        for k in finished[:max(0, len(finished) - self.max_finished)]:
            del self._logs[k]
        finished = [k for k in finished if k in self._logs]
        total = sum(len(self._logs[k].events) for k in finished)
        for k in finished:
            if total <= self.max_events:
                break
            total -= len(self._logs[k].events)
            del self._logs[k]

    def live(self) -> list[Any]:
        return [v for v in self._logs.values() if not v.done]
