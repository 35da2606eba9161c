"""Enums, errors and result records shared by the device core and the host pipeline (contract §1, §9)."""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, Optional


class FinishReason(str, enum.Enum):
    """Why a request ended (contract §9). Values are the wire strings."""

    EOS = "eos"
    STOP_SEQUENCE = "stop_sequence"
    GRAMMAR_COMPLETE = "grammar_complete"
    MAX_OUTPUT_TOKENS = "max_output_tokens"
    CONTEXT_LIMIT = "context_limit"
    CANCELLED = "cancelled"
    DEADLINE_EXCEEDED = "deadline_exceeded"
    CONTENT_INTERRUPTED = "content_interrupted"
    MODEL_ERROR = "model_error"
    TRANSPORT_ERROR = "transport_error"


class ErrorCode(str, enum.Enum):
    """Error codes carried by a `failed` event (contract §9)."""

    DECODING_ERROR = "decoding_error"
    GRAMMAR_DEAD_END = "grammar_dead_end"
    ALL_TOKENS_MASKED = "all_tokens_masked"
    OUTPUT_BUFFER_OVERFLOW = "output_buffer_overflow"
    INVALID_REQUEST = "invalid_request"
    MODEL_ERROR = "model_error"
    TRANSPORT_ERROR = "transport_error"


class RequestState(str, enum.Enum):
    """Lifecycle states of contract §1."""

    CREATED = "CREATED"
    QUEUED = "QUEUED"
    PREFILLING = "PREFILLING"
    DECODING = "DECODING"
    DRAINING = "DRAINING"
    FINISHED = "FINISHED"
    CANCEL_REQUESTED = "CANCEL_REQUESTED"
    CANCELLED = "CANCELLED"
    FAILED = "FAILED"


class DecodingError(ValueError):
    """Bytes that cannot form UTF-8 under the strict policy (contract D2a, D4)."""


@dataclasses.dataclass(frozen=True)
class Usage:
    """Token counts of contract §9: selected, written into the cache, whose text was returned;
    `cached_tokens`: prompt tokens served from the prefix cache instead of being prefilled."""

    prompt_tokens: int = 0
    selected_tokens: int = 0
    processed_tokens: int = 0
    returned_tokens: int = 0
    cached_tokens: int = 0


@dataclasses.dataclass(frozen=True)
class Event:
    """One trace or stream event. `seq` is set for stream events (start, delta, terminal).

    The typed views below read a stream event's fields: a `delta` has `text`, and when its
    request asked for logprobs the `logprobs` entries (`TokenLogprob`) of its newly returned
    tokens with each one's `offsets` in the returned text; a terminal event (`completed`,
    `cancelled`, `failed`) has `finish_reason`, `stop` (the stop string or ids that ended it,
    None otherwise), `usage` and, when failed, `error`."""

    kind: str
    request_id: str
    seq: Optional[int] = None
    data: dict = dataclasses.field(default_factory=dict)
    time: float = 0.0

    @property
    def text(self) -> str:
        return self.data.get("text", "")

    @property
    def logprobs(self) -> Optional[tuple]:
        return self.data.get("logprobs")

    @property
    def offsets(self) -> tuple:
        return self.data.get("offsets", ())

    @property
    def finish_reason(self) -> Optional[FinishReason]:
        reason = self.data.get("finish_reason")
        return None if reason is None else FinishReason(reason)

    @property
    def error(self) -> Optional[ErrorCode]:
        error = self.data.get("error")
        return None if error is None else ErrorCode(error)

    @property
    def stop(self) -> Optional[Any]:
        return self.data.get("stop")

    @property
    def usage(self) -> Optional[Usage]:
        return self.data.get("usage")


@dataclasses.dataclass(frozen=True)
class TokenLogprob:
    """The log-probabilities of one returned output token (`Completion.logprobs`).

    `logprob` is the raw model log-probability of `token_id`: the log-softmax of the logits
    before any processor (penalties, bias, masks, temperature, truncation), as OpenAI and vLLM
    report it. `top` holds the request's `SamplingParams.logprobs` most likely ids as
    `(token_id, logprob)` pairs on the same raw scale, most likely first (ties: lower id first);
    the selected token appears in it only when it is among them.
    """

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclasses.dataclass(frozen=True)
class Completion:
    """One finished request of the engine (docs/architecture.md `jd.Completion`).

    `events` is the request's full trace (lifecycle, token.selected, decode.completed, deltas,
    the terminal event, resources.released); `prompt_index` / `index` place it among the
    prompts and the n samples of `LLM.generate`. `error` is the ErrorCode of a failed request.
    `logprobs` is None unless `SamplingParams.logprobs` > 0; then it holds one `TokenLogprob`
    per returned token (`usage.returned_tokens` of them; entry i belongs to `token_ids[i]`):
    tokens hidden by a stop string, a stop id or EOS are not reported.
    A beam-search request (`num_beams > 1`) has `index` = the beam's rank and `score` = its HF
    score, sum logprob / (generated length incl. EOS) ** length_penalty; None otherwise.
    """

    request_id: str
    text: str
    token_ids: tuple
    finish_reason: Optional[FinishReason]
    error: Optional[ErrorCode] = None
    usage: Usage = Usage()
    events: tuple = ()
    record: Optional[Any] = None
    prompt_index: int = 0
    index: int = 0
    state: Optional[RequestState] = None
    timings: Optional[dict] = None
    logprobs: Optional[tuple[TokenLogprob, ...]] = None
    score: Optional[float] = None
