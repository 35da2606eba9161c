"""Request submission: the body read under its size limit, the prompt tokenized, and every
choice queued in the engine (docs/architecture.md "Command line and HTTP").

Every validation happens before the engine queues anything (`jd.LLM.submit`), so one request's
bad values never reach another's step; ``n`` is expanded by the engine (`LLM.submit_n`,
jaxdecode/engine/samples.py), as `LLM.generate` expands it. Errors are `ApiError`s: 400 naming
the field, 413 a body over the limit, 429 with ``Retry-After`` on `QueueFull`, 503 when the
engine is closed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from typing import Any, Callable, Optional, Sequence

import anyio
from fastapi import Request

from jaxdecode.engine import EngineClosed, QueueFull
from jaxdecode.tokenization import encode
from serving import chat as chat_mod
from serving.protocol import (ApiError, bad_request, check_unsupported, error_from_value_error,
                              max_tokens_field, sampling_params)
from serving.tools import ToolPlan, tools_error


@dataclasses.dataclass
class Tracked:
    """One HTTP completion request's engine requests, for metrics and the final log line."""

    request_id: str
    endpoint: str
    handles: list
    stream: bool
    t0: float
    transport_error: bool = False
    finished: bool = False
    top_logprobs: Optional[int] = None  # top entries shown per token; None: no logprobs
    tools: Optional[ToolPlan] = None    # chat tool calling (`serving.tools`)
    tool_streams: dict = dataclasses.field(default_factory=dict)  # choice -> ToolStream


async def read_body(request: Request, max_body_bytes: int) -> bytes:
    """The request body; 413 past `max_body_bytes` (the header alone, or while reading)."""
    length = request.headers.get("content-length")
    too_big = ApiError(413, f"request body exceeds {max_body_bytes} bytes",
                       code="request_too_large")
    if length is not None:
        try:
            if int(length) > max_body_bytes:
                raise too_big
        except ValueError:
            raise bad_request("invalid Content-Length header", code="invalid_header") from None
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_body_bytes:
            raise too_big
        chunks.append(chunk)
    return b"".join(chunks)


def check_model(model: Optional[str], model_name: str, adapters: Sequence[str] = ()
                ) -> Optional[str]:
    """The LoRA adapter a request's `model` selects (None: the base model, `model_name` or
    absent); 404 naming `model` for any other name (contract R6)."""
    if model is None or model == model_name:
        return None
    if model in adapters:
        return model
    served = ", ".join(repr(m) for m in (model_name, *adapters))
    raise ApiError(404, f"model: the model {model!r} does not exist (this server serves "
                        f"{served})", param="model", code="model_not_found")


def prompt_ids(llm: Any, req: Any, chat: bool, tools: Optional[ToolPlan] = None) -> list:
    """The prompt's token ids: the chat template over the messages (and the tools), or the one
    prompt (text or ids)."""
    if chat:
        ids, _ = chat_mod.chat_prompt_ids(llm.tokenizer, req.messages,
                                          tools.templated() if tools else None)
        return ids
    prompt = req.prompt
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        if len(prompt) != 1:
            raise ValueError("prompt: send one prompt per request (a list of "
                             f"{len(prompt)} prompts was given)")
        prompt = prompt[0]
    return encode(llm.tokenizer, prompt) if isinstance(prompt, str) else list(prompt)


def submit(llm: Any, req: Any, *, chat: bool, request_id: str, stream: bool, max_n: int,
           retry_after_s: int, cancelled: Callable[[], bool],
           tools: Optional[ToolPlan] = None, lora: Optional[str] = None) -> tuple[list, list]:
    """Validate, tokenize and queue every choice (runs in a worker thread; `cancelled()`
    true abandons a constraint compile). Returns (handles, prompt ids). `tools` (chat, from
    `serving.tools.plan_for`): a named or required plan's constraint, or an auto plan's call grammar, replaces
    ``response_format``, and its compile errors name ``tools``; `lora`: the adapter the request's
    ``model`` selected (`check_model`)."""
    check_unsupported(req, chat=chat, max_n=max_n)
    n = 1 if req.n is None else req.n
    default_max = llm.max_len if chat else 16
    sp = sampling_params(req, chat=chat, stream=stream, default_max_tokens=default_max)
    if lora is not None:
        sp = dataclasses.replace(sp, lora=lora)
    constraint = None if tools is None else tools.response_format()
    _, mt_name = max_tokens_field(req, chat)
    try:
        if constraint is not None:
            sp = dataclasses.replace(sp, response_format=constraint)
        ids = prompt_ids(llm, req, chat, tools)
        handles = llm.submit_n(ids, dataclasses.replace(sp, n=n), request_id=request_id,
                               cancelled=cancelled)
    except ValueError as exc:
        if constraint is not None and str(exc).startswith("response_format"):
            raise tools_error(exc) from None
        raise error_from_value_error(exc, chat=chat, max_tokens_name=mt_name) from None
    except QueueFull as exc:
        raise ApiError(429, f"the server is busy: {exc}; retry later", code="queue_full",
                       type="rate_limit_error",
                       headers={"Retry-After": str(retry_after_s)}) from None
    except EngineClosed:
        raise ApiError(503, "the engine is closed", code="engine_closed",
                       type="server_error") from None
    return handles, ids


async def submit_watching(request: Request, llm: Any, req: Any, **kwargs) -> tuple[list, list]:
    """`submit` in a worker thread while the client is watched: a disconnect abandons a
    constraint compile in progress (its worker process is killed)."""
    gone = threading.Event()

    async def watch() -> None:
        while not await request.is_disconnected():
            await anyio.sleep(0.1)
        gone.set()

    watcher = asyncio.get_running_loop().create_task(watch())
    try:
        return await anyio.to_thread.run_sync(
            lambda: submit(llm, req, cancelled=gone.is_set, **kwargs))
    finally:
        watcher.cancel()
