"""OpenAI response and chunk rendering, for completions and chat, streaming and not
(docs/architecture.md "Command line and HTTP"; finish reasons: contract §9, `serving.protocol`).

One envelope (`Renderer.envelope`: ``id``, ``object``, ``created``, ``model``,
``system_fingerprint``, ``choices`` and ``usage`` when present) is shared by the
non-streaming body, every streaming chunk and the usage chunk; one choice renderer per shape
(final choice, opening / delta / finishing chunk). Nothing here touches the engine or the
transport: it reads the engine requests' handles and returns dicts or JSON strings.
"""

from __future__ import annotations

import json
from typing import Any, Optional, Sequence

from jaxdecode.host.stream import TERMINAL_KINDS
from jaxdecode.types import ErrorCode, FinishReason, RequestState
from serving import tool_calls
from serving.protocol import ApiError, format_logprobs, openai_finish_reason

# error codes of a failed request that the request itself caused (400, not 500), with the
# field that caused it (decoding_error is not one: text is decoded with "replace", so only a
# model that samples ids outside its tokenizer's vocabulary can cause it)
_CLIENT_ERRORS = {ErrorCode.ALL_TOKENS_MASKED: "logit_bias",
                  ErrorCode.GRAMMAR_DEAD_END: "response_format",
                  ErrorCode.INVALID_REQUEST: None}
_NO_USAGE = object()  # `envelope` without a "usage" key


def to_json(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def failure(data: dict) -> ApiError:
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


def finish_label(handle: Any, transport_error: bool) -> str:
    """The exact finish reason of an ended engine request (contract §9), with a cancel that a
    disconnect caused reported as ``transport_error`` (contract T5)."""
    state = handle.state
    term = handle.terminal_event
    data = term.data if term is not None else {}
    if state is RequestState.CANCELLED:
        return (FinishReason.TRANSPORT_ERROR.value if transport_error
                else FinishReason.CANCELLED.value)
    if state is RequestState.FAILED:
        err = data.get("error")
        return ErrorCode(err).value if err is not None else ErrorCode.MODEL_ERROR.value
    reason = data.get("finish_reason")
    return FinishReason(reason).value if reason is not None else "unknown"


def _object(chat: bool, stream: bool) -> str:
    if chat:
        return "chat.completion.chunk" if stream else "chat.completion"
    return "text_completion"


class Renderer:
    """The OpenAI objects of one app (its model name and fingerprint, its tokenizer's texts)."""

    def __init__(self, tokenizer: Any, model_name: str, fingerprint: str):
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.fingerprint = fingerprint
        self._token_texts: dict[int, str] = {}

    def token_text(self, token_id: int) -> str:
        """The tokenizer's decode of one id (special tokens shown), cached."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            self._token_texts[token_id] = text
        return text

    def logprobs(self, entries: Optional[tuple], offsets: Sequence[int], chat: bool,
                 top_logprobs: Optional[int]) -> Optional[dict]:
        """A choice's OpenAI logprobs for `entries` (returned tokens whose text begins at
        `offsets`); None when the request did not ask for logprobs (`top_logprobs` None)."""
        if top_logprobs is None or entries is None:
            return None
        return format_logprobs(entries, top_logprobs, self.token_text, chat=chat,
                               offsets=() if chat else offsets)

    def envelope(self, request_id: str, chat: bool, stream: bool, created: int,
                 choices: list, handles: Sequence[Any], usage: Any = _NO_USAGE) -> dict:
        """The object around `choices` (of the engine requests `handles`): a response body,
        or a chunk when `stream`; `model` names the LoRA adapter the request selected, else
        the served model."""
        model = next((h.sampling.lora for h in handles if h.sampling.lora), self.model_name)
        obj = {"id": request_id, "object": _object(chat, stream), "created": created,
               "model": model, "system_fingerprint": self.fingerprint,
               "choices": choices}
        if usage is not _NO_USAGE:
            obj["usage"] = usage
        return obj

    def finish_fields(self, handle: Any, transport_error: bool) -> dict:
        label = finish_label(handle, transport_error)
        reason = openai_finish_reason(label) if label in FinishReason._value2member_map_ else "stop"
        term = handle.terminal_event
        stop = term.stop if term is not None else None
        return {"finish_reason": reason, "jaxdecode_finish_reason": label,
                "stop_reason": list(stop) if isinstance(stop, tuple) else stop}

    # -- non-streaming ----------------------------------------------------------------------------

    def final_choice(self, handle: Any, i: int, chat: bool, tracked: Any) -> dict:
        entries, text = handle.logprobs, handle.text
        offsets = [handle.token_offset(j) for j in range(len(entries or ()))]
        logprobs = self.logprobs(entries, offsets, chat, tracked.top_logprobs)
        fields = self.finish_fields(handle, tracked.transport_error)
        if chat and tracked.tools is not None and tracked.tools.mode != "none":
            message, has_calls = tool_calls.final_message(
                tracked.tools, text, complete=tool_calls.completed(fields))
            fields["finish_reason"] = tool_calls.reason(tracked.tools, fields["finish_reason"],
                                                        has_calls)
            choice = {"index": i, "message": message, "logprobs": logprobs}
        elif chat:
            choice = {"index": i, "message": {"role": "assistant", "content": text},
                      "logprobs": logprobs}
        else:
            choice = {"index": i, "text": text, "logprobs": logprobs}
        choice.update(fields)
        if handle.score is not None:  # extension: a beam's HF score (contract §10)
            choice["score"] = handle.score
        return choice

    def completion(self, tracked: Any, chat: bool, prompt_tokens: int, created: int) -> dict:
        """The response body of a request whose engine requests all completed."""
        choices = [self.final_choice(h, i, chat, tracked) for i, h in enumerate(tracked.handles)]
        return self.envelope(tracked.request_id, chat, False, created, choices,
                             tracked.handles, usage_object(prompt_tokens, tracked.handles))

    # -- streaming --------------------------------------------------------------------------------

    def chunk(self, log: Any, choice: dict) -> str:
        usage = None if log.include_usage else _NO_USAGE
        return to_json(self.envelope(log.request_id, log.chat, True, log.created, [choice],
                                     log.handles, usage))

    def usage_chunk(self, log: Any) -> str:
        """`stream_options.include_usage`: the closing chunk with no choices."""
        return to_json(self.envelope(log.request_id, log.chat, True, log.created, [],
                                     log.handles, usage_object(log.prompt_tokens, log.handles)))

    def event_data(self, log: Any, i: int, ev: Any, tracked: Any) -> Optional[str]:
        """The SSE data of choice `i`'s engine event `ev` (None: the event sends nothing)."""
        if ev.kind == "failed":
            return to_json({**failure(ev.data).body(), "id": log.request_id, "index": i})
        if ev.kind == "start":
            text, logprobs, reason = "", None, {"finish_reason": None}
        elif ev.kind == "delta":
            logprobs = self.logprobs(ev.logprobs, ev.offsets, log.chat, tracked.top_logprobs)
            text, reason = ev.text, {"finish_reason": None}
        elif ev.kind in TERMINAL_KINDS:  # completed / cancelled
            text, logprobs = "", None
            reason = self.finish_fields(log.handles[i], tracked.transport_error)
        else:
            return None
        if not log.chat:
            return self.chunk(log, {"index": i, "text": text, "logprobs": logprobs, **reason})
        plan = tracked.tools
        if plan is not None and plan.mode != "none":
            delta = self.tool_delta(tracked, i, ev, text, reason)
        else:
            delta = ({"role": "assistant", "content": ""} if ev.kind == "start"
                     else {"content": text} if ev.kind == "delta" else {})
        return self.chunk(log, {"index": i, "delta": delta, "logprobs": logprobs, **reason})

    def tool_delta(self, tracked: Any, i: int, ev: Any, text: str, reason: dict) -> dict:
        """Choice `i`'s delta under its tool plan (`serving.tool_calls.ToolStream`); sets the
        tool finish reason on the terminal event's `reason`."""
        stream = tracked.tool_streams.setdefault(i, tool_calls.ToolStream(tracked.tools))
        if ev.kind == "start":
            return stream.opening()
        if ev.kind == "delta":
            return stream.feed(text)
        delta = stream.finish(complete=tool_calls.completed(reason))
        reason["finish_reason"] = tool_calls.reason(tracked.tools, reason["finish_reason"],
                                                    stream.has_calls)
        return delta
