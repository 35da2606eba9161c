"""The OpenAI-compatible HTTP API over one `jd.LLM` (docs/architecture.md "Command line and HTTP").

    app = create_app(llm, model_name="demo", api_key=None, on_disconnect="cancel")

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``
(and ``/v1/models/{id}``), ``GET /v1/streams/{request_id}`` (resume, contract T4), ``GET /health``,
``GET /metrics``. With `api_key` set, every route except ``/health`` needs
``Authorization: Bearer <key>`` (401 otherwise).

Requests: see `serving.protocol` for the fields, defaults, the OpenAI error body and the finish
reason mapping; `serving.chat` for chat templates. A request with ``n`` > 1 is submitted as n
engine requests (ids ``<id>-<i>``) by `LLM.submit_n`, as `LLM.generate` expands n: choice 0 is
the request alone, choice i >= 1 samples with ``fold_in(key(seed), i)`` and shares choice 0's
prompt pages; with ``num_beams`` > 1 the n choices are the n best beams of one search.
``logprobs`` / ``top_logprobs`` are answered in OpenAI's formats (`serving.protocol`), also in
every streaming chunk that carries tokens; ``echo``, ``best_of`` != n, ``suffix`` and ``tools``
get a 400 "not supported" instead of a silent no-op; ``response_format`` goes to the engine, which
enforces it inside the decode step; a constraint it cannot compile -- or not within the
engine's compile budget -- raises ValueError("response_format: ...") and becomes a 400 naming
``response_format``; a client that disconnects while its constraint compiles abandons the
compile (`submit_watching`).

Status codes: 400 bad input (pydantic errors too, never 422; a body nested deeper than the JSON
parser's limit names the top-level field holding the nesting); 401 bad or missing key; 404 an
unknown model / route / stream; 413 a body over `max_body_bytes`; 429 with ``Retry-After`` when
the admission queue is full (`QueueFull`); 503 when the engine is closed. Every validation
happens before the engine queues anything (`jd.LLM.submit`), so one request's bad values never
reach another's step. A request that the engine fails (``failed`` event) gets, without
streaming, 500 ``server_error`` for a model, decoding or buffer failure and 400 naming the
field for request-caused ones (all tokens masked: ``logit_bias``, grammar dead end:
``response_format``); while streaming, an SSE event ``{"error": {...}}`` for that choice. An
unexpected exception is answered 500 ``internal_error`` by the route itself, so the keep-alive
connection survives. /health: 200 ``{"status": "ok"}``; 503 with ``status: "degraded"`` and
the ``reason`` from an engine step that failed until a step succeeds again (`LLM.health()`), or
``status: "closed"``.

`speculative` (the setting `jaxdecode serve --speculative` built the engine with, e.g.
``{"draft": "prompt_lookup", "k": 4, "ngram_max": 3, "ngram_min": 1}``) is reported by /health
and the model card; /metrics then adds the engine's acceptance counters.

Streaming: ``text/event-stream`` with ``data: <chunk json>`` per event -- and ``id: <n>`` before
it when the client asks (``stream_options.include_ids``, or the header ``X-Event-Ids: true``;
always on ``GET /v1/streams/{id}``): plain OpenAI clients and benchmark tools such as
``vllm bench serve`` read every line as ``data: ``, so ids are opt-in -- then an
optional usage chunk (``stream_options.include_usage``: ``choices: []``; every other chunk then
has ``"usage": null``) and ``data: [DONE]``; see `serving.streams` for ids and resumption. The
response id is in the ``x-request-id`` header and in every chunk's ``id``.

Disconnects (contract T5): when the last reader of a response goes away before its end, policy
``cancel`` (default) cancels the engine requests -- they end CANCELLED in the engine, and the
server records them as ``transport_error`` (metric label, log line, and the
``jaxdecode_finish_reason`` of the final chunk a reconnecting reader sees), never as EOS. Policy
``continue`` lets them run; their stream stays resumable. Non-streaming requests are polled for
disconnects while they wait and follow the same policy.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import logging
import os
import threading
import time
import uuid
from typing import Any, Callable, Optional, Sequence

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import StreamingResponse

from jaxdecode.engine import EngineClosed, QueueFull
from jaxdecode.host.stream import TERMINAL_KINDS
from jaxdecode.tokenization import encode
from jaxdecode.types import ErrorCode, FinishReason, RequestState
from serving import chat as chat_mod
from serving.logs import log_event
from serving.metrics import Metrics
from serving.protocol import (ApiError, ChatCompletionRequest, CompletionRequest, bad_request,
                              check_unsupported, error_from_value_error,
                              format_logprobs, max_tokens_field, openai_finish_reason,
                              parse_request, sampling_params, top_logprobs_count)
from serving.streams import ResponseLog, StreamRegistry

ON_DISCONNECT = ("cancel", "continue")
# error codes of a failed request that the request itself caused (400, not 500), with the
# field that caused it (decoding_error is not one: text is decoded with "replace", so only a
# model that samples ids outside its tokenizer's vocabulary can cause it)
_CLIENT_ERRORS = {ErrorCode.ALL_TOKENS_MASKED: "logit_bias",
                  ErrorCode.GRAMMAR_DEAD_END: "response_format",
                  ErrorCode.INVALID_REQUEST: None}


def _ended(handle: Any) -> bool:
    """The terminal event is in the stream (the lifecycle state turns terminal a moment before
    its event is appended, so the state alone is not enough to read the event)."""
    return handle.terminal_event is not None


def _terminal(handle: Any):
    return handle.terminal_event


def _failure(data: dict) -> ApiError:
    """The error of a request the engine failed (its `failed` event's data): 400 naming the
    field for what the request itself caused, else 500."""
    code = ErrorCode(data["error"]) if data.get("error") else ErrorCode.MODEL_ERROR
    message = f"generation failed: {data.get('message') or code.value}"
    if code in _CLIENT_ERRORS:
        param = _CLIENT_ERRORS[code]
        return ApiError(400, f"{param}: {message}" if param else message, param=param,
                        code=code.value)
    return ApiError(500, message, code=code.value, type="server_error")


def usage_object(prompt_tokens: int, handles: list) -> dict:
    """OpenAI's usage of one completion request (its choices' engine requests): completion
    tokens summed, and the prompt tokens served from the prefix cache
    (`prompt_tokens_details.cached_tokens`; the prompt's samples share one prefill)."""
    usages = [h.usage() for h in handles]
    completion = sum(u.selected_tokens for u in usages)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": max(u.cached_tokens for u in usages)}}


def _json(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


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


class AuthMiddleware:
    """Bearer api key on every route except the open ones (pure ASGI, before any body is read)."""

    def __init__(self, app, api_key: Optional[str], open_paths=("/health",)):
        self.app, self.api_key, self.open_paths = app, api_key, set(open_paths)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or not self.api_key or scope.get("path") in self.open_paths:
            await self.app(scope, receive, send)
            return
        auth = dict(scope.get("headers") or ()).get(b"authorization", b"").decode("latin-1")
        scheme, _, token = auth.partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(),
                                                              self.api_key.encode()):
            await self.app(scope, receive, send)
            return
        err = ApiError(401, "invalid or missing api key (send 'Authorization: Bearer <key>')",
                       code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        await error_response(err)(scope, receive, send)


@dataclasses.dataclass
class _Tracked:
    """One HTTP completion request's engine requests, for metrics and the final log line."""

    request_id: str
    endpoint: str
    handles: list
    stream: bool
    t0: float
    transport_error: bool = False
    finished: bool = False
    top_logprobs: Optional[int] = None  # top entries shown per token; None: no logprobs


class Server:
    """The state behind one app: engine, metrics, stream registry, policies."""

    def __init__(self, llm: Any, *, model_name: str, api_key: Optional[str],
                 on_disconnect: str, max_body_bytes: int, log_prompts: bool,
                 stream_ttl_s: float, max_kept_streams: int, retry_after_s: int,
                 max_n: int, keepalive_s: float = 15.0, record_dir: Optional[str] = None,
                 speculative: Optional[dict] = None):
        self.llm = llm
        self.speculative = speculative
        self.record_dir = record_dir
        if record_dir:
            os.makedirs(record_dir, exist_ok=True)
        self.model_name = model_name
        self.api_key = api_key
        self.on_disconnect = on_disconnect
        self.max_body_bytes = max_body_bytes
        self.log_prompts = log_prompts
        self.retry_after_s = retry_after_s
        self.max_n = max_n
        self.metrics = Metrics(llm, speculative=speculative is not None)
        self.registry = StreamRegistry(max_finished=max_kept_streams, ttl_s=stream_ttl_s)
        self.keepalive_s = keepalive_s
        self.fingerprint = f"jaxdecode-{getattr(llm, 'model_snapshot', '')}"
        self.created = int(time.time())
        self._background: set = set()
        self._token_texts: dict[int, str] = {}

    def token_text(self, token_id: int) -> str:
        """The tokenizer's decode of one id (special tokens shown), cached."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self.llm.tokenizer.decode([token_id], skip_special_tokens=False)
            self._token_texts[token_id] = text
        return text

    def logprobs_object(self, entries: Optional[tuple], offsets: Sequence[int], chat: bool,
                        tracked: _Tracked) -> Optional[dict]:
        """A choice's OpenAI logprobs for `entries` (returned tokens whose text begins at
        `offsets`); None when the request did not ask for logprobs."""
        if tracked.top_logprobs is None or entries is None:
            return None
        return format_logprobs(entries, tracked.top_logprobs, self.token_text, chat=chat,
                               offsets=() if chat else offsets)

    # -- helpers ----------------------------------------------------------------------------------

    async def read_body(self, request: Request) -> bytes:
        length = request.headers.get("content-length")
        too_big = ApiError(413, f"request body exceeds {self.max_body_bytes} bytes",
                           code="request_too_large")
        if length is not None:
            try:
                if int(length) > self.max_body_bytes:
                    raise too_big
            except ValueError:
                raise bad_request("invalid Content-Length header", code="invalid_header") from None
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > self.max_body_bytes:
                raise too_big
            chunks.append(chunk)
        return b"".join(chunks)

    def reject(self, err: ApiError, request_id: Optional[str], endpoint: str) -> JSONResponse:
        reason = err.code or f"http_{err.status}"
        self.metrics.rejected.labels(reason=reason).inc()
        log_event("request.rejected", logging.INFO, request_id=request_id, endpoint=endpoint,
                  status=err.status, param=err.param, code=err.code, message=err.message)
        return error_response(err, request_id)

    def check_model(self, model: Optional[str]) -> None:
        if model is not None and model != self.model_name:
            raise ApiError(404, f"model: the model {model!r} does not exist (this server "
                                f"serves {self.model_name!r})", param="model",
                           code="model_not_found")

    def label(self, handle: Any, tracked: _Tracked) -> str:
        state = handle.state
        term = _terminal(handle)
        data = term.data if term is not None else {}
        if state is RequestState.CANCELLED:
            return (FinishReason.TRANSPORT_ERROR.value if tracked.transport_error
                    else FinishReason.CANCELLED.value)
        if state is RequestState.FAILED:
            err = data.get("error")
            return ErrorCode(err).value if err is not None else ErrorCode.MODEL_ERROR.value
        reason = data.get("finish_reason")
        return FinishReason(reason).value if reason is not None else "unknown"

    def finish(self, tracked: _Tracked) -> None:
        """Metrics and the log line, once, after every engine request of `tracked` ended."""
        if tracked.finished:
            return
        tracked.finished = True
        choices = []
        for h in tracked.handles:
            label = self.label(h, tracked)
            try:
                timing = self.metrics.observe(h, label)
            except Exception:  # metrics must never break a response
                logging.getLogger("serving").exception("metrics failed")
                timing = {}
            entry = {"engine_request_id": h.request_id, "finish_reason": label,
                     "usage": dataclasses.asdict(h.usage()), **timing}
            if self.log_prompts:
                entry["text"] = h.text
            if self.record_dir:
                self.write_record(h)
            choices.append(entry)
        log_event("request.finished", request_id=tracked.request_id, endpoint=tracked.endpoint,
                  stream=tracked.stream, transport_error=tracked.transport_error,
                  seconds=round(time.monotonic() - tracked.t0, 6), choices=choices)

    def write_record(self, handle: Any) -> None:
        """`--record-dir`: the request's generation record as <engine request id>.json."""
        try:
            handle.completion().record.save(
                os.path.join(self.record_dir, f"{handle.request_id}.json"))
        except Exception:  # a record must never break a response
            logging.getLogger("serving").exception("writing the record failed")

    def on_gone(self, tracked: _Tracked) -> None:
        """The last client of a live request went away (contract T5)."""
        if self.on_disconnect == "cancel":
            tracked.transport_error = True
            for h in tracked.handles:
                h.cancel()
            log_event("request.disconnected", logging.WARNING, request_id=tracked.request_id,
                      action="cancel", finish_reason="transport_error")
        else:
            log_event("request.disconnected", logging.INFO, request_id=tracked.request_id,
                      action="continue")

    def spawn(self, coro) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    # -- submission -------------------------------------------------------------------------------

    def _submit(self, req: Any, chat: bool, request_id: str, stream: bool,
                cancelled: Callable[[], bool]) -> tuple[list, list]:
        """Validate, tokenize and queue every choice (runs in a worker thread; `cancelled()`
        true abandons a constraint compile). Returns (handles, prompt ids)."""
        llm = self.llm
        check_unsupported(req, chat=chat, max_n=self.max_n)
        n = 1 if req.n is None else req.n
        default_max = llm.max_len if chat else 16
        sp = sampling_params(req, chat=chat, stream=stream, default_max_tokens=default_max)
        _, mt_name = max_tokens_field(req, chat)
        try:
            if chat:
                ids, _ = chat_mod.chat_prompt_ids(llm.tokenizer, req.messages)
            else:
                prompt = req.prompt
                if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
                    if len(prompt) != 1:
                        raise ValueError("prompt: send one prompt per request (a list of "
                                         f"{len(prompt)} prompts was given)")
                    prompt = prompt[0]
                ids = encode(llm.tokenizer, prompt) if isinstance(prompt, str) else list(prompt)
            # n expanded by the engine (jaxdecode/engine/samples.py), as LLM.generate does
            handles = llm.submit_n(ids, dataclasses.replace(sp, n=n), request_id=request_id,
                                   cancelled=cancelled)
        except ValueError as exc:
            raise error_from_value_error(exc, chat=chat, max_tokens_name=mt_name) from None
        except QueueFull as exc:
            raise ApiError(429, f"the server is busy: {exc}; retry later", code="queue_full",
                           type="rate_limit_error",
                           headers={"Retry-After": str(self.retry_after_s)}) from None
        except EngineClosed:
            raise ApiError(503, "the engine is closed", code="engine_closed",
                           type="server_error") from None
        return handles, ids

    async def submit_watching(self, request: Request, *args) -> tuple[list, list]:
        """`_submit` in a worker thread while the client is watched: a disconnect abandons a
        constraint compile in progress (its worker process is killed)."""
        gone = threading.Event()

        async def watch() -> None:
            while not await request.is_disconnected():
                await anyio.sleep(0.1)
            gone.set()

        watcher = asyncio.get_running_loop().create_task(watch())
        try:
            return await anyio.to_thread.run_sync(self._submit, *args, gone.is_set)
        finally:
            watcher.cancel()

    async def complete(self, request: Request, chat: bool) -> Response:
        request_id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        endpoint = "/v1/chat/completions" if chat else "/v1/completions"
        t0 = time.monotonic()
        try:
            body = await self.read_body(request)
            req = parse_request(ChatCompletionRequest if chat else CompletionRequest, body)
            self.check_model(req.model)
            stream = bool(req.stream)
            handles, ids = await self.submit_watching(request, req, chat, request_id, stream)
        except ApiError as err:
            return self.reject(err, request_id, endpoint)
        except Exception:  # answered here: an exception past the route would drop the connection
            logging.getLogger("serving").exception("request %s failed", request_id)
            return self.reject(ApiError(500, "internal server error", code="internal_error",
                                        type="server_error"), request_id, endpoint)
        fields = dict(request_id=request_id, endpoint=endpoint, stream=stream, n=len(handles),
                      prompt_tokens=len(ids), max_tokens=handles[0].sampling.max_tokens)
        if self.log_prompts:
            fields["prompt"] = ([m.model_dump() for m in req.messages] if chat else req.prompt)
        log_event("request.received", **fields)
        tracked = _Tracked(request_id, endpoint, handles, stream, t0,
                           top_logprobs=top_logprobs_count(req, chat))
        if stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            log = ResponseLog(request_id, handles, chat=chat, include_usage=include_usage,
                              created=int(time.time()), prompt_tokens=len(ids))
            log.tracked = tracked
            self.registry.add(log)
            log.task = self.spawn(self.pump(log, tracked))
            ids = bool(req.stream_options and req.stream_options.include_ids) or (
                request.headers.get("x-event-ids", "").lower() in ("1", "true"))
            return SSEResponse(self.sse(log, -1, tracked, ids),
                               headers={"x-request-id": request_id})
        return await self.respond(request, tracked, chat, len(ids))

    # -- non-streaming ----------------------------------------------------------------------------

    async def wait_terminal(self, handles: list, request: Optional[Request]) -> bool:
        """Wait until every handle ended; False when the client disconnected first."""
        loop = asyncio.get_running_loop()
        wake = asyncio.Event()

        def notify() -> None:
            try:
                loop.call_soon_threadsafe(wake.set)
            except RuntimeError:  # the loop is closed
                pass

        for h in handles:
            h.add_listener(notify)
        while True:
            wake.clear()
            if all(_ended(h) for h in handles):
                return True
            try:
                await asyncio.wait_for(wake.wait(), 0.25)
            except asyncio.TimeoutError:
                pass
            if request is not None and not all(_ended(h) for h in handles):
                if await request.is_disconnected():
                    return False

    async def respond(self, request: Request, tracked: _Tracked, chat: bool,
                      prompt_tokens: int) -> Response:
        handles = tracked.handles
        if not await self.wait_terminal(handles, request):
            self.on_gone(tracked)

            async def settle() -> None:
                await self.wait_terminal(handles, None)
                self.finish(tracked)

            self.spawn(settle())
            return Response(status_code=499)  # nobody reads it
        self.finish(tracked)
        choices = []
        for i, h in enumerate(handles):
            term = _terminal(h)
            data = term.data if term is not None else {}
            if term is None or term.kind == "failed":
                return error_response(_failure(data), tracked.request_id)
            choices.append(self._final_choice(h, i, chat, tracked))
        body = {"id": tracked.request_id,
                "object": "chat.completion" if chat else "text_completion",
                "created": int(time.time()), "model": self.model_name,
                "system_fingerprint": self.fingerprint, "choices": choices,
                "usage": usage_object(prompt_tokens, handles)}
        return JSONResponse(body, headers={"x-request-id": tracked.request_id})

    def _finish_fields(self, h: Any, tracked: _Tracked) -> dict:
        label = self.label(h, tracked)
        reason = openai_finish_reason(label) if label in FinishReason._value2member_map_ else "stop"
        term = _terminal(h)
        stop = term.stop if term is not None else None
        return {"finish_reason": reason, "jaxdecode_finish_reason": label,
                "stop_reason": list(stop) if isinstance(stop, tuple) else stop}

    def _final_choice(self, h: Any, i: int, chat: bool, tracked: _Tracked) -> dict:
        entries, text = h.logprobs, h.text
        offsets = [h.token_offset(j) for j in range(len(entries or ()))]
        logprobs = self.logprobs_object(entries, offsets, chat, tracked)
        if chat:
            choice = {"index": i, "message": {"role": "assistant", "content": text},
                      "logprobs": logprobs}
        else:
            choice = {"index": i, "text": text, "logprobs": logprobs}
        choice.update(self._finish_fields(h, tracked))
        if h.score is not None:  # extension: a beam's HF score (contract §10)
            choice["score"] = h.score
        return choice

    # -- streaming --------------------------------------------------------------------------------

    def _chunk(self, log: ResponseLog, choice: dict) -> str:
        obj = {"id": log.request_id,
               "object": "chat.completion.chunk" if log.chat else "text_completion",
               "created": log.created, "model": self.model_name,
               "system_fingerprint": self.fingerprint, "choices": [choice]}
        if log.include_usage:
            obj["usage"] = None
        return _json(obj)

    def _event_data(self, log: ResponseLog, i: int, ev: Any, tracked: _Tracked) -> Optional[str]:
        h = log.handles[i]
        if ev.kind == "start":
            if log.chat:
                choice = {"index": i, "delta": {"role": "assistant", "content": ""},
                          "logprobs": None, "finish_reason": None}
            else:
                choice = {"index": i, "text": "", "logprobs": None, "finish_reason": None}
            return self._chunk(log, choice)
        if ev.kind == "delta":
            text, entries = ev.text, ev.logprobs
            logprobs = self.logprobs_object(entries, ev.offsets, log.chat, tracked)
            if log.chat:
                choice = {"index": i, "delta": {"content": text}, "logprobs": logprobs,
                          "finish_reason": None}
            else:
                choice = {"index": i, "text": text, "logprobs": logprobs, "finish_reason": None}
            return self._chunk(log, choice)
        if ev.kind == "failed":
            return _json({**_failure(ev.data).body(), "id": log.request_id, "index": i})
        if ev.kind in TERMINAL_KINDS:  # completed / cancelled
            base = ({"index": i, "delta": {}, "logprobs": None} if log.chat
                    else {"index": i, "text": "", "logprobs": None})
            base.update(self._finish_fields(h, tracked))
            return self._chunk(log, base)
        return None

    async def pump(self, log: ResponseLog, tracked: _Tracked) -> None:
        """Move the engine streams' events into the log as soon as they are produced."""
        loop = asyncio.get_running_loop()
        wake = asyncio.Event()

        def notify() -> None:
            try:
                loop.call_soon_threadsafe(wake.set)
            except RuntimeError:
                pass

        for h in log.handles:
            h.add_listener(notify)
        live = list(range(len(log.handles)))
        # a choice's opening chunk (no text) goes out with its first token or its end, as
        # vLLM's does: a client timing the first chunk measures the time to the first token
        opening: dict = {}
        try:
            while live:
                wake.clear()
                moved = False
                for i in list(live):
                    handle = log.handles[i]
                    while True:
                        ev = handle.next_event()
                        if ev is None:
                            break
                        moved = True
                        data = self._event_data(log, i, ev, tracked)
                        if ev.kind == "start":
                            opening[i] = data
                            continue
                        if i in opening:
                            log.append(opening.pop(i))
                        if data is not None:
                            log.append(data)
                        if ev.kind in TERMINAL_KINDS:
                            live.remove(i)
                            break
                if not live:
                    break
                if moved:
                    await asyncio.sleep(0)
                else:
                    try:
                        await asyncio.wait_for(wake.wait(), 1.0)
                    except asyncio.TimeoutError:
                        pass
            if log.include_usage:
                log.append(_json({
                    "id": log.request_id,
                    "object": "chat.completion.chunk" if log.chat else "text_completion",
                    "created": log.created, "model": self.model_name,
                    "system_fingerprint": self.fingerprint, "choices": [],
                    "usage": usage_object(log.prompt_tokens, log.handles)}))
        except Exception:
            logging.getLogger("serving").exception("stream pump failed for %s", log.request_id)
            for h in log.handles:
                h.cancel()
            err = ApiError(500, "internal error while streaming", code="internal_error",
                           type="server_error")
            log.append(_json({**err.body(), "id": log.request_id}))
        finally:
            if not log.done:
                log.append("[DONE]")
                log.close()
            if all(_ended(h) for h in log.handles):
                self.finish(tracked)
            else:  # cancelled (server shutdown): make sure the engine requests end
                for h in log.handles:
                    h.cancel()

    async def sse(self, log: ResponseLog, after: int, tracked: _Tracked, ids: bool = True):
        """The SSE bytes of `log` after event id `after` (with `id:` lines when `ids`);
        applies the disconnect policy when the last reader leaves before the end."""
        log.readers += 1
        try:
            async for i, data in log.follow(after, idle_s=self.keepalive_s):
                if i is None:  # a comment line keeps proxies from closing an idle stream
                    yield ": keep-alive\n\n"
                else:
                    yield f"id: {i}\ndata: {data}\n\n" if ids else f"data: {data}\n\n"
        finally:
            log.readers -= 1
            if not log.done and log.readers == 0:
                self.on_gone(tracked)

    async def resume(self, request: Request, request_id: str) -> Response:
        try:
            log = self.registry.get(request_id)
            if log is None:
                raise ApiError(404, f"no kept stream for request {request_id!r} (unknown, not "
                                    "streamed, or expired)", param="request_id",
                               code="stream_not_found")
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
        except ApiError as err:
            return self.reject(err, request_id, "/v1/streams")
        log_event("stream.resumed", request_id=request_id, after=after, done=log.done)
        return SSEResponse(self.sse(log, after, log.tracked),
                           headers={"x-request-id": request_id})

    # -- other routes -----------------------------------------------------------------------------

    def health(self) -> JSONResponse:
        llm = self.llm
        state = llm.health()
        body = {"status": state["status"], "model": self.model_name,
                "running": llm.num_running, "waiting": llm.num_waiting}
        if state["reason"] is not None:
            body["reason"] = state["reason"]
        if self.speculative is not None:
            body["speculative"] = self.speculative
        return JSONResponse(body, status_code=200 if state["status"] == "ok" else 503)

    def models(self) -> dict:
        return {"object": "list", "data": [self.model_card()]}

    def model_card(self) -> dict:
        card = {"id": self.model_name, "object": "model", "created": self.created,
                "owned_by": "jaxdecode", "max_model_len": self.llm.max_len}
        if self.speculative is not None:
            card["speculative"] = self.speculative
        return card


def create_app(llm: Any, *, model_name: str, api_key: Optional[str] = None,
               on_disconnect: str = "cancel", max_body_bytes: int = 4 << 20,
               log_prompts: bool = False, stream_ttl_s: float = 600.0,
               max_kept_streams: int = 256, retry_after_s: int = 1, max_n: Optional[int] = None,
               keepalive_s: float = 15.0, close_llm_on_shutdown: bool = False,
               record_dir: Optional[str] = None,
               speculative: Optional[dict] = None) -> FastAPI:
    """The FastAPI app serving `llm` under `model_name` (see the module docstring)."""
    if on_disconnect not in ON_DISCONNECT:
        raise ValueError(f"on_disconnect: must be one of {ON_DISCONNECT}, got {on_disconnect!r}")
    if max_body_bytes < 1:
        raise ValueError(f"max_body_bytes: must be positive, got {max_body_bytes}")
    server = Server(llm, model_name=model_name, api_key=api_key, on_disconnect=on_disconnect,
                    max_body_bytes=max_body_bytes, log_prompts=log_prompts,
                    stream_ttl_s=stream_ttl_s, max_kept_streams=max_kept_streams,
                    retry_after_s=retry_after_s,
                    max_n=max(1, min(max_n or llm.limits.max_n, llm.max_queue)),
                    keepalive_s=keepalive_s, record_dir=record_dir, speculative=speculative)

    import contextlib

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        for log in server.registry.live():
            for h in log.handles:
                h.cancel()
        if close_llm_on_shutdown:
            await anyio.to_thread.run_sync(llm.close)

    app = FastAPI(title="jaxdecode", version="0.1.0", lifespan=lifespan)
    app.state.server = server
    app.add_middleware(AuthMiddleware, api_key=api_key)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError):
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        errors = exc.errors()
        loc = tuple(errors[0].get("loc", ())) if errors else ()
        param = ".".join(str(p) for p in loc[1:]) or None
        return error_response(bad_request(f"{param or 'request'}: "
                                          f"{errors[0].get('msg') if errors else exc}", param,
                                          "invalid_type"))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return error_response(ApiError(exc.status_code, str(exc.detail), code=code,
                                       headers=getattr(exc, "headers", None)))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        logging.getLogger("serving").exception("unhandled error")
        return error_response(ApiError(500, "internal server error", code="internal_error",
                                       type="server_error"))

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await server.complete(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await server.complete(request, chat=True)

    @app.get("/v1/models")
    async def models():
        return server.models()

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id != server.model_name:
            raise ApiError(404, f"model: the model {model_id!r} does not exist", param="model",
                           code="model_not_found")
        return server.model_card()

    @app.get("/v1/streams/{request_id}")
    async def resume(request_id: str, request: Request):
        return await server.resume(request, request_id)

    @app.get("/health")
    async def health():
        return server.health()

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(server.metrics.registry),
                        media_type=CONTENT_TYPE_LATEST)

    return app
