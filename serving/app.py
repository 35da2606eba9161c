"""The OpenAI-compatible HTTP API over one `jd.LLM` (docs/architecture.md "Command line and HTTP").

    app = create_app(llm, model_name="demo", api_key=None, on_disconnect="cancel")

This module holds the routes, the app assembly and `Server` (the app's state and policies);
`serving.submission` reads and queues a request, `serving.render` builds the OpenAI objects,
`serving.responses` writes them (JSON, SSE) over the engine-to-loop listener bridge.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``
(and ``/v1/models/{id}``), ``GET /v1/streams/{request_id}`` (resume, contract T4),
``POST /tokenize`` and ``POST /detokenize`` (`serving.tokenize`), ``GET /health``,
``GET /metrics``. With `api_key` set, every route except ``/health`` needs
``Authorization: Bearer <key>`` (401 otherwise).

Requests: see `serving.protocol` for the fields, defaults, the OpenAI error body and the finish
reason mapping; `serving.chat` for chat templates. A request with ``n`` > 1 is submitted as n
engine requests (ids ``<id>-<i>``) by `LLM.submit_n`, as `LLM.generate` expands n: choice 0 is
the request alone, choice i >= 1 samples with ``fold_in(key(seed), i)`` and shares choice 0's
prompt pages; with ``num_beams`` > 1 the n choices are the n best beams of one search.
``logprobs`` / ``top_logprobs`` are answered in OpenAI's formats (`serving.protocol`), also in
every streaming chunk that carries tokens; ``tools`` / ``tool_choice`` are tool calling
(`serving.tools`: named and required calls generated under their schemas; `serving.tool_calls`:
``message.tool_calls`` and the streamed pieces); ``echo``, ``best_of`` != n and ``suffix``
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
import contextlib
import dataclasses
import hmac
import logging
import os
import time
import uuid
from typing import Any, Optional

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from serving.chat import call_format_of
from serving.logs import log_event
from serving.metrics import Metrics
from serving.protocol import (ApiError, ChatCompletionRequest, CompletionRequest, bad_request,
                              error_from_value_error, parse_request, top_logprobs_count)
from serving.render import Renderer, failure, finish_label
from serving.responses import (SSEResponse, error_response, last_event_id, pump, sse,
                               wait_terminal)
from serving.streams import ResponseLog, StreamRegistry
from serving.submission import Tracked, check_model, read_body, submit_watching
from serving.tokenize import DetokenizeRequest, TokenizeRequest, detokenize, tokenize
from serving.tools import plan_for

ON_DISCONNECT = ("cancel", "continue")


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


class Server:
    """The state behind one app: engine, metrics, stream registry, policies; its routes'
    handlers (submission: `serving.submission`, rendering: `serving.render`, writers:
    `serving.responses`)."""

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
        adapters = getattr(llm, "adapters", None)  # LoRA adapters served by name (R6)
        self.adapters = () if adapters is None else adapters.names
        self.api_key = api_key
        self.on_disconnect = on_disconnect
        self.max_body_bytes = max_body_bytes
        self.log_prompts = log_prompts
        self.retry_after_s = retry_after_s
        self.max_n = max_n
        self.metrics = Metrics(llm, speculative=speculative is not None)
        self.registry = StreamRegistry(max_finished=max_kept_streams, ttl_s=stream_ttl_s)
        self.keepalive_s = keepalive_s
        self.call_format = call_format_of(llm.tokenizer)  # the auto calls' grammar
        self.renderer = Renderer(llm.tokenizer, model_name,
                                 f"jaxdecode-{getattr(llm, 'model_snapshot', '')}")
        self.created = int(time.time())
        self._background: set = set()

    def reject(self, err: ApiError, request_id: Optional[str], endpoint: str) -> JSONResponse:
        reason = err.code or f"http_{err.status}"
        self.metrics.rejected.labels(reason=reason).inc()
        log_event("request.rejected", logging.INFO, request_id=request_id, endpoint=endpoint,
                  status=err.status, param=err.param, code=err.code, message=err.message)
        return error_response(err, request_id)

    def finish(self, tracked: Tracked) -> None:
        """Metrics and the log line, once, after every engine request of `tracked` ended."""
        if tracked.finished:
            return
        tracked.finished = True
        choices = []
        for h in tracked.handles:
            label = finish_label(h, tracked.transport_error)
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

    def on_gone(self, tracked: Tracked) -> None:
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

    # -- completions ------------------------------------------------------------------------------

    async def complete(self, request: Request, chat: bool) -> Response:
        request_id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        endpoint = "/v1/chat/completions" if chat else "/v1/completions"
        t0 = time.monotonic()
        try:
            body = await read_body(request, self.max_body_bytes)
            req = parse_request(ChatCompletionRequest if chat else CompletionRequest, body)
            lora = check_model(req.model, self.model_name, self.adapters)
            stream = bool(req.stream)
            tools = (await anyio.to_thread.run_sync(
                lambda: plan_for(req.tools, req.tool_choice, req.response_format,
                                 self.call_format))
                if chat else None)
            handles, ids = await submit_watching(
                request, self.llm, req, chat=chat, request_id=request_id, stream=stream,
                max_n=self.max_n, retry_after_s=self.retry_after_s, tools=tools, lora=lora)
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
        tracked = Tracked(request_id, endpoint, handles, stream, t0,
                          top_logprobs=top_logprobs_count(req, chat), tools=tools)
        if stream:
            return self.stream(request, req, tracked, chat, len(ids))
        return await self.respond(request, tracked, chat, len(ids))

    def stream(self, request: Request, req: Any, tracked: Tracked, chat: bool,
               prompt_tokens: int) -> Response:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        log = ResponseLog(tracked.request_id, tracked.handles, chat=chat,
                          include_usage=include_usage, created=int(time.time()),
                          prompt_tokens=prompt_tokens)
        log.tracked = tracked
        self.registry.add(log)
        log.task = self.spawn(pump(log, tracked, self.renderer, self.finish))
        ids = bool(req.stream_options and req.stream_options.include_ids) or (
            request.headers.get("x-event-ids", "").lower() in ("1", "true"))
        return SSEResponse(sse(log, -1, self.keepalive_s, lambda: self.on_gone(tracked), ids),
                           headers={"x-request-id": tracked.request_id})

    async def respond(self, request: Request, tracked: Tracked, chat: bool,
                      prompt_tokens: int) -> Response:
        handles = tracked.handles
        if not await wait_terminal(handles, request):
            self.on_gone(tracked)

            async def settle() -> None:
                await wait_terminal(handles, None)
                self.finish(tracked)

            self.spawn(settle())
            return Response(status_code=499)  # nobody reads it
        self.finish(tracked)
        for h in handles:
            term = h.terminal_event
            if term is None or term.kind == "failed":
                return error_response(failure(term.data if term is not None else {}),
                                      tracked.request_id)
        body = self.renderer.completion(tracked, chat, prompt_tokens, int(time.time()))
        return JSONResponse(body, headers={"x-request-id": tracked.request_id})

    async def resume(self, request: Request, request_id: str) -> Response:
        try:
            log = self.registry.get(request_id)
            if log is None:
                raise ApiError(404, f"no kept stream for request {request_id!r} (unknown, not "
                                    "streamed, or expired)", param="request_id",
                               code="stream_not_found")
            after = last_event_id(request, log)
        except ApiError as err:
            return self.reject(err, request_id, "/v1/streams")
        log_event("stream.resumed", request_id=request_id, after=after, done=log.done)
        tracked = log.tracked
        return SSEResponse(sse(log, after, self.keepalive_s, lambda: self.on_gone(tracked)),
                           headers={"x-request-id": request_id})

    # -- other routes -----------------------------------------------------------------------------

    async def tokens(self, request: Request, endpoint: str) -> Response:
        """/tokenize and /detokenize (`serving.tokenize`), validated like the completions."""
        forward = endpoint == "/tokenize"
        try:
            body = await read_body(request, self.max_body_bytes)
            req = parse_request(TokenizeRequest if forward else DetokenizeRequest, body)
            check_model(req.model, self.model_name, self.adapters)
            answer = await anyio.to_thread.run_sync(
                lambda: tokenize(self.llm, req) if forward else detokenize(self.llm, req))
        except ApiError as err:
            return self.reject(err, None, endpoint)
        except ValueError as exc:  # the chat template's (`messages: ...`)
            return self.reject(error_from_value_error(exc, chat=True), None, endpoint)
        return JSONResponse(answer)

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
        return {"object": "list",
                "data": [self.model_card(m) for m in (self.model_name, *self.adapters)]}

    def model_card(self, model_id: str) -> dict:
        """The card of the served model or of one of its LoRA adapters (vLLM's: `parent`
        names the base; 404 naming `model` for another id)."""
        check_model(model_id, self.model_name, self.adapters)
        card = {"id": model_id, "object": "model", "created": self.created,
                "owned_by": "jaxdecode", "max_model_len": self.llm.max_len}
        if model_id != self.model_name:
            card.update(root=model_id, parent=self.model_name)
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
    _add_error_handlers(app)
    _add_routes(app, server)
    return app


def _add_error_handlers(app: FastAPI) -> None:
    """Every error as the OpenAI error body (400 for pydantic's errors, never 422)."""

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


def _add_routes(app: FastAPI, server: Server) -> None:
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
        return server.model_card(model_id)

    @app.get("/v1/streams/{request_id}")
    async def resume(request_id: str, request: Request):
        return await server.resume(request, request_id)

    @app.post("/tokenize")
    async def tokenize_route(request: Request):
        return await server.tokens(request, "/tokenize")

    @app.post("/detokenize")
    async def detokenize_route(request: Request):
        return await server.tokens(request, "/detokenize")

    @app.get("/health")
    async def health():
        return server.health()

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(server.metrics.registry),
                        media_type=CONTENT_TYPE_LATEST)
