"""OpenAI wire protocol: request models, the error body, and the mapping onto `SamplingParams`.

Requests are parsed with pydantic in strict mode (a JSON number is accepted for a float field,
but a string is not a number and `true` is not an integer); unknown fields are ignored, like
vLLM. Every problem becomes `ApiError`, rendered as the OpenAI error body

    {"error": {"message": ..., "type": "invalid_request_error", "param": ..., "code": ...}}

with HTTP 400 (never FastAPI's 422). `param` names the OpenAI field: engine and
`SamplingParams` messages start with their own field name, which `PARAM_NAMES` maps back
(`include_stop_in_output` -> `include_stop_str_in_output`, `prompt` -> `messages` for chat,
`max_tokens` -> `max_completion_tokens` when the request used that name).

Finish reasons (`finish_reason` is OpenAI's value; `jaxdecode_finish_reason` carries the exact
contract §9 reason):

    eos, stop_sequence, grammar_complete        -> "stop"
    max_output_tokens, context_limit            -> "length"
    deadline_exceeded                           -> "length"  (a budget ran out, like length)
    content_interrupted                         -> "content_filter"
    cancelled, transport_error                  -> "abort"   (vLLM's value; not in OpenAI's enum)

Log-probabilities (`top_logprobs_count`, `format_logprobs`): ``/v1/completions`` takes
``logprobs: 0..20`` (OpenAI allows 5) and answers OpenAI's legacy object
``{"tokens", "token_logprobs", "top_logprobs": [{text: logprob}], "text_offset"}``, where each
top dict holds the N most likely tokens plus the chosen one (so N + 1 entries at most, as OpenAI
says; ids that decode to the same text keep the chosen one's, else the likeliest), most likely
first, and ``text_offset`` is each token's character offset in the choice's text.
``/v1/chat/completions`` takes ``logprobs: true`` and ``top_logprobs: 0..20`` (``top_logprobs``
> 0 without ``logprobs: true`` is a 400) and answers ``{"content": [{"token", "logprob",
"bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}``. A token's text is the
tokenizer's decode of that one id (special tokens included), ``bytes`` its UTF-8 bytes; values
are the raw model log-probabilities (before temperature and the other processors), clamped
to >= -9999.0 so JSON never sees -inf. The engine is asked for max(N, 1) top entries (it
reports nothing for 0); the response shows N. Streaming chunks carry the same object for
the tokens of their delta (see `jaxdecode.engine` for which tokens those are).
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Callable, Optional, Sequence, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from jaxdecode.config import MAX_LOGPROBS, SamplingParams
from jaxdecode.types import FinishReason, TokenLogprob

OPENAI_FINISH = {
    FinishReason.EOS: "stop",
    FinishReason.STOP_SEQUENCE: "stop",
    FinishReason.GRAMMAR_COMPLETE: "stop",
    FinishReason.MAX_OUTPUT_TOKENS: "length",
    FinishReason.CONTEXT_LIMIT: "length",
    FinishReason.DEADLINE_EXCEEDED: "length",
    FinishReason.CONTENT_INTERRUPTED: "content_filter",
    FinishReason.CANCELLED: "abort",
    FinishReason.TRANSPORT_ERROR: "abort",
    FinishReason.MODEL_ERROR: "abort",
}

MIN_LOGPROB = -9999.0
MAX_MESSAGES = 2048      # chat messages per request
MAX_CONTENT_PARTS = 256  # content parts per message
MAX_TOOL_CALLS = 128     # tool calls per assistant message


def openai_finish_reason(reason: Any) -> str:
    try:
        return OPENAI_FINISH[FinishReason(reason)]
    except (ValueError, KeyError):
        return "stop"


class ApiError(Exception):
    """An HTTP error with the OpenAI error body."""

    def __init__(self, status: int, message: str, *, param: Optional[str] = None,
                 code: Optional[str] = None, type: str = "invalid_request_error",
                 headers: Optional[dict] = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type, self.headers = type, dict(headers or {})

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def bad_request(message: str, param: Optional[str] = None, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, param=param, code=code)


# -- request models ------------------------------------------------------------------------------

class _Model(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Model):
    include_usage: Optional[bool] = None
    include_ids: Optional[bool] = None  # extension: SSE `id:` lines (resumable streams)


class _Common(_Model):
    model: Optional[str] = None
    max_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    n: Optional[int] = None
    stop: Optional[Union[str, list[str]]] = None
    seed: Optional[int] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    logit_bias: Optional[dict[str, float]] = None
    stream: Optional[bool] = None
    stream_options: Optional[StreamOptions] = None
    response_format: Optional[dict[str, Any]] = None
    user: Optional[str] = None
    # extensions (vLLM names)
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    min_tokens: Optional[int] = None
    ignore_eos: Optional[bool] = None
    include_stop_str_in_output: Optional[bool] = None
    # extensions (HF generate names): beam search, never streamed
    num_beams: Optional[int] = None
    length_penalty: Optional[float] = None
    early_stopping: Optional[Union[bool, str]] = None


class CompletionRequest(_Common):
    prompt: Union[str, list[int], list[str], list[list[int]]]
    logprobs: Optional[int] = None
    echo: Optional[bool] = None
    best_of: Optional[int] = None
    suffix: Optional[str] = None


class ContentPart(_Model):
    type: str
    text: Optional[str] = None


class FunctionCall(_Model):
    name: str
    arguments: str  # a JSON string, as OpenAI sends it


class ToolCall(_Model):
    id: Optional[str] = None
    type: Optional[str] = None
    function: FunctionCall


class ChatMessage(_Model):
    role: str
    content: Optional[Union[str, Annotated[list[ContentPart],
                                           Field(max_length=MAX_CONTENT_PARTS)]]] = None
    name: Optional[str] = None
    tool_calls: Optional[Annotated[list[ToolCall], Field(max_length=MAX_TOOL_CALLS)]] = None
    tool_call_id: Optional[str] = None


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: Optional[int] = None
    logprobs: Optional[bool] = None
    top_logprobs: Optional[int] = None
    tools: Optional[list[Any]] = None
    tool_choice: Optional[Any] = None


_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def _param_from_loc(loc: tuple) -> Optional[str]:
    """`("messages", 0, "role")` -> "messages[0].role"; stops at pydantic's union type tags."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif isinstance(part, str) and _IDENT.match(part) and part not in _TYPE_TAGS:
            out += f".{part}" if out else part
        else:
            break
    return out or None


_JSON_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|[\[\]{}:]')
_AT = re.compile(r"at line (\d+) column (\d+)")


def _field_at(body: bytes, message: str) -> Optional[str]:
    """The top-level field whose value holds the position a JSON error `message` names (`at
    line L column C`), or None."""
    m = _AT.search(message)
    if m is None:
        return None
    lines = body.split(b"\n")
    line, column = int(m.group(1)), int(m.group(2))
    offset = sum(len(x) + 1 for x in lines[:line - 1]) + column - 1
    text = body[:offset].decode("utf-8", "replace")
    depth, key, last = 0, None, None
    for token in _JSON_TOKEN.findall(text):
        if token in "[{":
            depth += 1
        elif token in "]}":
            depth -= 1
        elif token == ":":
            if depth == 1 and last is not None:
                key = last[1:-1]
        else:
            last = token
    return key


def parse_request(model: type, body: bytes):
    """Parse and validate a JSON body; raises ApiError(400) naming the bad field. A body
    nested too deeply for the parser (about 200 levels) names the top-level field holding the
    nesting."""
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        first = errors[0] if errors else {"loc": (), "msg": str(exc), "type": "invalid"}
        if first.get("type") == "json_invalid":
            msg = first.get("msg", "")
            param = _field_at(body, msg) if "recursion limit" in msg else None
            if param is not None:
                raise bad_request(f"{param}: nests too deeply ({msg})", param,
                                  "invalid_value") from None
            raise bad_request(f"the request body is not valid JSON: {msg}",
                              code="invalid_json") from None
        param = _param_from_loc(tuple(first.get("loc", ())))
        kind = "missing_required_parameter" if first.get("type") == "missing" else "invalid_type"
        msg = first.get("msg", "invalid value")
        more = f" ({len(errors) - 1} more error(s))" if len(errors) > 1 else ""
        raise bad_request(f"{param or 'body'}: {msg}{more}", param, kind) from None


# -- mapping onto SamplingParams -----------------------------------------------------------------

# SamplingParams / engine field -> OpenAI request field (where they differ)
PARAM_NAMES = {"include_stop_in_output": "include_stop_str_in_output"}


def param_for(field: str, *, chat: bool, max_tokens_name: str = "max_tokens") -> str:
    if field == "prompt":
        return "messages" if chat else "prompt"
    if field == "max_tokens":
        return max_tokens_name
    return PARAM_NAMES.get(field, field)


def error_from_value_error(exc: ValueError, *, chat: bool, max_tokens_name: str = "max_tokens",
                           ) -> ApiError:
    """An engine / SamplingParams ValueError ("field: message") as a 400 naming the param."""
    text = str(exc)
    field, sep, rest = text.partition(":")
    if not sep or not _IDENT.match(field.strip()):
        return bad_request(text)
    field = field.strip()
    param = param_for(field, chat=chat, max_tokens_name=max_tokens_name)
    code = "invalid_value"
    if field == "prompt" and "leave no room" in rest:
        code = "context_length_exceeded"
    elif field == "response_format" and "not supported" in rest:
        code = "unsupported_parameter"
    return bad_request(f"{param}:{rest}", param, code)


def _unsupported(param: str, what: str) -> ApiError:
    return bad_request(f"{param}: {what}", param, "unsupported_parameter")


def check_unsupported(req: _Common, *, chat: bool, max_n: int) -> None:
    """Fields jaxdecode accepts but cannot honour yet get a 400 instead of a silent no-op; so
    do `n` and the logprobs fields out of range, and chat `top_logprobs` without `logprobs`
    (`tools` / `tool_choice`: `serving.tools`)."""
    n = 1 if req.n is None else req.n
    if not 1 <= n <= max_n:
        raise bad_request(f"n: must be in [1, {max_n}], got {n}", "n")
    if req.stream and (req.num_beams or 1) > 1:
        raise _unsupported("stream", "beam search (num_beams > 1) returns final results only; "
                           "send stream: false")
    if chat:
        if req.top_logprobs is not None and not 0 <= req.top_logprobs <= MAX_LOGPROBS:
            raise bad_request(f"top_logprobs: must be in [0, {MAX_LOGPROBS}], got "
                              f"{req.top_logprobs}", "top_logprobs")
        if req.top_logprobs and not req.logprobs:
            raise bad_request("top_logprobs: needs logprobs set to true", "top_logprobs")
    else:
        if req.logprobs is not None and not 0 <= req.logprobs <= MAX_LOGPROBS:
            raise bad_request(f"logprobs: must be in [0, {MAX_LOGPROBS}], got {req.logprobs}",
                              "logprobs")
        if req.echo:
            raise _unsupported("echo", "echoing the prompt is not supported")
        if req.best_of is not None and req.best_of != n:
            raise _unsupported("best_of", "best_of is not supported (use n)")
        if req.suffix:
            raise _unsupported("suffix", "suffix (insertion) is not supported")


def top_logprobs_count(req: _Common, chat: bool) -> Optional[int]:
    """How many top entries each token's logprobs show, or None when logprobs were not asked
    (after `check_unsupported`)."""
    if chat:
        return (req.top_logprobs or 0) if req.logprobs else None
    return req.logprobs


def max_tokens_field(req: _Common, chat: bool) -> tuple[Optional[int], str]:
    if chat and getattr(req, "max_completion_tokens", None) is not None:
        return req.max_completion_tokens, "max_completion_tokens"
    return req.max_tokens, "max_tokens"


def sampling_params(req: _Common, *, chat: bool, stream: bool, default_max_tokens: int
                    ) -> SamplingParams:
    """The request's SamplingParams (n=1: the server submits one engine request per choice).

    Defaults follow OpenAI: temperature 1, top_p 1, max_tokens 16 for completions and the
    remaining context for chat (the engine clamps max_tokens to max_len - prompt length).
    `top_k: -1` means disabled (vLLM's convention) like 0. Text is decoded with
    `utf8_errors="replace"` (U+FFFD, as vLLM), so a model's invalid bytes never fail a request.
    `num_beams`, `length_penalty`, `early_stopping` (extensions, HF names) ask for beam search;
    then `n` is the number of beams returned (the server sets it; see `LLM.submit_beams`).
    """
    max_tokens, mt_name = max_tokens_field(req, chat)
    shown = top_logprobs_count(req, chat)
    top_k = req.top_k
    if top_k == -1:
        top_k = 0
    kwargs: dict[str, Any] = dict(
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=0 if top_k is None else top_k,
        min_p=0.0 if req.min_p is None else req.min_p,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        presence_penalty=0.0 if req.presence_penalty is None else req.presence_penalty,
        frequency_penalty=0.0 if req.frequency_penalty is None else req.frequency_penalty,
        logit_bias=dict(req.logit_bias or {}),
        max_tokens=default_max_tokens if max_tokens is None else max_tokens,
        min_tokens=0 if req.min_tokens is None else req.min_tokens,
        stop=req.stop if req.stop is not None else (),
        include_stop_in_output=bool(req.include_stop_str_in_output),
        ignore_eos=bool(req.ignore_eos),
        seed=req.seed,
        logprobs=0 if shown is None else max(shown, 1),
        n=1,
        utf8_errors="replace",
        output_kind="delta" if stream else "final_only",
        response_format=req.response_format,
        num_beams=1 if req.num_beams is None else req.num_beams,
        length_penalty=1.0 if req.length_penalty is None else req.length_penalty,
        early_stopping=False if req.early_stopping is None else req.early_stopping,
    )
    try:
        return SamplingParams(**kwargs)
    except ValueError as exc:
        raise error_from_value_error(exc, chat=chat, max_tokens_name=mt_name) from None


def _lp(value: float) -> float:
    return value if value >= MIN_LOGPROB else MIN_LOGPROB  # -inf and NaN too


def format_logprobs(entries: Sequence[TokenLogprob], top_n: int, token_text: Callable[[int], str],
                    *, chat: bool, offsets: Sequence[int] = ()) -> dict:
    """The OpenAI logprobs object of `entries` (see the module docstring): `top_n` top entries
    per token, `token_text(id)` its text; `offsets` (completions only): each token's character
    offset in the choice's text."""
    if chat:
        def item(token_id: int, logprob: float) -> dict:
            text = token_text(token_id)
            return {"token": text, "logprob": _lp(logprob), "bytes": list(text.encode())}

        return {"content": [dict(item(e.token_id, e.logprob),
                                 top_logprobs=[item(i, lp) for i, lp in e.top[:top_n]])
                            for e in entries]}
    tops = []
    for e in entries:
        top: dict[str, float] = {}
        for i, lp in ((e.token_id, e.logprob), *e.top[:top_n]):
            top.setdefault(token_text(i), _lp(lp))  # ids with the same text: the first wins
        tops.append(dict(sorted(top.items(), key=lambda kv: -kv[1])))
    return {"tokens": [token_text(e.token_id) for e in entries],
            "token_logprobs": [_lp(e.logprob) for e in entries],
            "top_logprobs": tops, "text_offset": list(offsets)}
