"""One streaming request as the client saw it: the SSE parser, the chunk text, and
`RequestResult` updated event by event (`apply_event`).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
from typing import Iterable, Optional

@dataclasses.dataclass
class RequestResult:
    """One streaming request as the client saw it (times in seconds from sending it)."""
    status: int = 0
    error: Optional[str] = None
    chunk_times: list[float] = dataclasses.field(default_factory=list)  # chunks with text
    completion_tokens: Optional[int] = None
    done: bool = False
    prompt_tokens: Optional[int] = None   # the usage chunk's (else the client's count)
    cached_tokens: Optional[int] = None   # usage.prompt_tokens_details.cached_tokens
    end_s: Optional[float] = None         # when [DONE] arrived

    @property
    def ok(self) -> bool:
        return (self.error is None and self.status == 200 and self.done
                and self.completion_tokens is not None)

    @property
    def ttft_s(self) -> Optional[float]:
        return self.chunk_times[0] if self.chunk_times else None

    @property
    def gaps_s(self) -> list[float]:
        return [b - a for a, b in itertools.pairwise(self.chunk_times)]

    @property
    def e2el_s(self) -> Optional[float]:
        """End-to-end latency: sent -> [DONE] (the last chunk with text when not recorded)."""
        if self.end_s is not None:
            return self.end_s
        return self.chunk_times[-1] if self.chunk_times else None

    @property
    def tpot_s(self) -> Optional[float]:
        """Time per output token after the first (vLLM's TPOT); None with <= 1 output token."""
        if (self.completion_tokens is None or self.completion_tokens < 2
                or self.ttft_s is None or self.e2el_s is None):
            return None
        return (self.e2el_s - self.ttft_s) / (self.completion_tokens - 1)

    def failure(self) -> str:
        """A short reason for a failed request (for the error counts)."""
        if self.error is not None:
            return self.error
        if self.status != 200:
            return f"http {self.status}"
        return "no [DONE]" if not self.done else "no usage chunk"


class SSEParser:
    """Server-sent events, fed line by line (without line endings); `feed` returns an event's
    data (multi-line data joined with "\\n") when a blank line ends it, else None. Comments
    (": keep-alive") and the other fields (id, event, retry) are ignored."""

    def __init__(self) -> None:
        self._data: list[str] = []

    def feed(self, line: str) -> Optional[str]:
        if not line:
            if not self._data:
                return None
            data, self._data = "\n".join(self._data), []
            return data
        if line.startswith(":"):
            return None
        field, _, value = line.partition(":")
        if field == "data":
            self._data.append(value.removeprefix(" "))
        return None


def sse_events(lines: Iterable[str]) -> list[str]:
    """The data of every complete event in `lines`."""
    parser = SSEParser()
    return [d for d in map(parser.feed, lines) if d is not None]


def chunk_text(chunk: dict) -> str:
    """The text of a completion or chat chunk's first choice ("" for role, usage and final
    chunks)."""
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    if "delta" in choice:
        return (choice["delta"] or {}).get("content") or ""
    return choice.get("text") or ""


def apply_event(result: RequestResult, data: str, elapsed_s: float) -> None:
    """Update `result` with one SSE event's data received `elapsed_s` after sending."""
    if data == "[DONE]":
        result.done = True
        result.end_s = elapsed_s
        return
    chunk = json.loads(data)
    if "error" in chunk:
        err = chunk["error"]
        result.error = "stream error: " + str(err.get("code") if isinstance(err, dict) else err)
        return
    usage = chunk.get("usage")
    if usage:
        result.completion_tokens = usage["completion_tokens"]
        if usage.get("prompt_tokens") is not None:
            result.prompt_tokens = usage["prompt_tokens"]
        details = usage.get("prompt_tokens_details")
        if isinstance(details, dict) and details.get("cached_tokens") is not None:
            result.cached_tokens = details["cached_tokens"]
    if chunk_text(chunk):
        result.chunk_times.append(elapsed_s)
