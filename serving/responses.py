"""The response writers: JSON errors, the SSE response, and the bridge from the engine's
threads to the event loop (docs/architecture.md "Command line and HTTP"; contract T4, T5).

`EngineWake` is the one listener bridge: an engine handle calls its listener from the engine's
thread, which wakes an `asyncio.Event` on the app's loop. `wait_terminal` (non-streaming) and
`pump` (streaming: the engine events into a `ResponseLog`) wait on it; `sse` writes a log's
events as ``text/event-stream`` bytes and reports the last reader leaving early.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable, Optional

import anyio
from fastapi import Request
from fastapi.responses import JSONResponse
from starlette.responses import StreamingResponse

from jaxdecode.host.stream import TERMINAL_KINDS
from serving.protocol import ApiError, bad_request
from serving.render import Renderer, to_json
from serving.streams import ResponseLog


def ended(handle: Any) -> bool:
    """The terminal event is in the stream (the lifecycle state turns terminal a moment before
    its event is appended, so the state alone is not enough to read the event)."""
    return handle.terminal_event is not None


def error_response(err: ApiError, request_id: Optional[str] = None) -> JSONResponse:
    headers = dict(err.headers)
    if request_id:
        headers["x-request-id"] = request_id
    return JSONResponse(err.body(), status_code=err.status, headers=headers)


class SSEResponse(StreamingResponse):
    """A `text/event-stream` response that always watches for the client's disconnect (also
    under ASGI 2.4, where Starlette would only notice at the next send) and always closes its
    body iterator, so the iterator's cleanup (the disconnect policy) runs at once."""

    media_type = "text/event-stream"

    def __init__(self, content, headers: Optional[dict] = None):
        super().__init__(content, headers={"Cache-Control": "no-cache",
                                           "X-Accel-Buffering": "no", **(headers or {})})

    async def __call__(self, scope, receive, send) -> None:
        try:
            async with anyio.create_task_group() as tg:
                async def stream() -> None:
                    try:
                        await self.stream_response(send)
                    except OSError:  # the socket went away while sending
                        pass
                    tg.cancel_scope.cancel()

                async def watch() -> None:
                    await self.listen_for_disconnect(receive)
                    tg.cancel_scope.cancel()

                tg.start_soon(stream)
                tg.start_soon(watch)
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                with anyio.CancelScope(shield=True):
                    await aclose()


class EngineWake:
    """Wakes the running loop whenever one of `handles` produces an event (the listener runs
    in the engine's thread)."""

    def __init__(self, handles: list):
        loop = asyncio.get_running_loop()
        self._event = asyncio.Event()

        def notify() -> None:
            try:
                loop.call_soon_threadsafe(self._event.set)
            except RuntimeError:  # the loop is closed
                pass

        for h in handles:
            h.add_listener(notify)

    def clear(self) -> None:
        self._event.clear()

    async def wait(self, timeout_s: float) -> None:
        """Until the next event, or `timeout_s`."""
        try:
            await asyncio.wait_for(self._event.wait(), timeout_s)
        except asyncio.TimeoutError:
            pass


async def wait_terminal(handles: list, request: Optional[Request]) -> bool:
    """Wait until every handle ended; False when the client disconnected first."""
    wake = EngineWake(handles)
    while True:
        wake.clear()
        if all(ended(h) for h in handles):
            return True
        await wake.wait(0.25)
        if request is not None and not all(ended(h) for h in handles):
            if await request.is_disconnected():
                return False


def _drain(log: ResponseLog, i: int, tracked: Any, renderer: Renderer, opening: dict) -> tuple:
    """Move choice `i`'s pending events into `log`; (any moved, the choice ended). A choice's
    opening chunk (no text) goes out with its first token or its end, as vLLM's does: a client
    timing the first chunk measures the time to the first token."""
    moved = False
    while (ev := log.handles[i].next_event()) is not None:
        moved = True
        data = renderer.event_data(log, i, ev, tracked)
        if ev.kind == "start":
            opening[i] = data
            continue
        if i in opening:
            log.append(opening.pop(i))
        if data is not None:
            log.append(data)
        if ev.kind in TERMINAL_KINDS:
            return moved, True
    return moved, False


async def pump(log: ResponseLog, tracked: Any, renderer: Renderer,
               finish: Callable[[Any], None]) -> None:
    """Move the engine streams' events into the log as soon as they are produced; `finish`
    (metrics, the log line) once every engine request ended."""
    wake = EngineWake(log.handles)
    live = list(range(len(log.handles)))
    opening: dict = {}
    try:
        while live:
            wake.clear()
            moved = False
            for i in list(live):
                moved_i, done = _drain(log, i, tracked, renderer, opening)
                moved |= moved_i
                if done:
                    live.remove(i)
            if not live:
                break
            if moved:
                await asyncio.sleep(0)
            else:
                await wake.wait(1.0)
        if log.include_usage:
            log.append(renderer.usage_chunk(log))
    except Exception:
        logging.getLogger("serving").exception("stream pump failed for %s", log.request_id)
        for h in log.handles:
            h.cancel()
        err = ApiError(500, "internal error while streaming", code="internal_error",
                       type="server_error")
        log.append(to_json({**err.body(), "id": log.request_id}))
    finally:
        if not log.done:
            log.append("[DONE]")
            log.close()
        if all(ended(h) for h in log.handles):
            finish(tracked)
        else:  # cancelled (server shutdown): make sure the engine requests end
            for h in log.handles:
                h.cancel()


async def sse(log: ResponseLog, after: int, keepalive_s: float, on_gone: Callable[[], None],
              ids: bool = True):
    """The SSE bytes of `log` after event id `after` (with `id:` lines when `ids`); calls
    `on_gone` (the disconnect policy) when the last reader leaves before the end."""
    log.readers += 1
    try:
        async for i, data in log.follow(after, idle_s=keepalive_s):
            if i is None:  # a comment line keeps proxies from closing an idle stream
                yield ": keep-alive\n\n"
            else:
                yield f"id: {i}\ndata: {data}\n\n" if ids else f"data: {data}\n\n"
    finally:
        log.readers -= 1
        if not log.done and log.readers == 0:
            on_gone()


def last_event_id(request: Request, log: ResponseLog) -> int:
    """The event id a resuming reader has seen (``Last-Event-ID`` header or
    ``last_event_id`` query; -1: none), checked against `log` (contract T4)."""
    raw = request.headers.get("last-event-id")
    if raw is None:
        raw = request.query_params.get("last_event_id")
    try:
        after = -1 if raw is None or raw.strip() == "" else int(raw)
    except ValueError:
        raise bad_request(f"Last-Event-ID: expected an event id (integer), got {raw!r}",
                          "Last-Event-ID") from None
    if after < -1 or after >= len(log.events):
        raise bad_request(f"Last-Event-ID: event {after} has not been sent (the stream "
                          f"has {len(log.events)} events)", "Last-Event-ID")
    return after
