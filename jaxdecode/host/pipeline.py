"""One request's text pipeline: ids -> detokenizer -> stop matchers -> safe text (contract §4, §5, §9).

`TextPipeline` glues `StopSequenceMatcher` (stop id sequences, on the id stream),
`IncrementalDetokenizer` and `StopMatcher` (stop strings, on the text) in that order:

    token id -> [StopSequenceMatcher: hold ids that may start a stop sequence]
             -> IncrementalDetokenizer.push -> StopMatcher.push -> safe text (+ hit)

The engine feeds it the ids that survived the device-side checks (EOS and single stop ids end
the request before reaching it, D6/S8 -- push them only when the request shows them), emits the
returned text as deltas, and calls `finish(reason)` exactly once when the request ends.

Endings
-------
- Stop hit (string or id sequence) during `push`: the matcher's text after the stop point is
  gone, the detokenizer's undecoded tail is discarded, not finished (D5), and the pipeline
  accepts no more ids. `finish()` then reports ``stop_sequence`` whatever reason the engine
  passes -- S9: when the token that completes a stop is also the last one ``max_tokens``
  allows, the stop wins. An id-sequence hit releases the text the string matcher was holding
  (it precedes the stop point and matched no stop string).
- Non-stop ending (eos, max_output_tokens, context_limit, deadline_exceeded (C3), ...):
  held ids are released (they were no stop), ``detokenizer.finish()`` drains the tail (D4;
  strict raises `DecodingError` -> the engine fails the request with ``decoding_error``), the
  drained text still passes the stop matcher (S6; a hit there turns the reason into
  ``stop_sequence``), then the held text is flushed.
- ``cancelled``: `cancel()` -- held text and pending bytes are dropped; the already returned
  prefix is unchanged.

Usage: ``returned_tokens`` counts output tokens whose text was returned (contract §9): on a stop,
the tokens whose text starts before the stop point (after it, with ``include_stop_in_output``);
on a cancel, those whose text starts before the end of the returned text; otherwise every token
pushed into the detokenizer. Example S4: 101 "AB", 102 "CD", stop "BCD" -> text "A",
returned_tokens 1.

``stop_wait_s`` accumulates the time during which the stop matcher held text (T7).
"""

from __future__ import annotations

import bisect
import time
from typing import Any, Callable, List, NamedTuple, Optional, Sequence, Union

from jaxdecode.types import DecodingError, ErrorCode, FinishReason

from .detokenizer import IncrementalDetokenizer
from .stop import StopHit, StopMatcher, StopSequenceMatcher

__all__ = ["TextPipeline", "PushResult", "FinishResult"]


class PushResult(NamedTuple):
    text: str
    hit: Optional[StopHit]


class FinishResult(NamedTuple):
    text: str
    finish_reason: FinishReason
    hit: Optional[StopHit]


_EMPTY = PushResult("", None)


class TextPipeline:
    """Per-request ids -> safe text, with stop handling and returned-token accounting."""

    def __init__(
        self,
        tokenizer: Any = None,
        *,
        prompt_ids: Sequence[int] = (),
        stop: Sequence[str] = (),
        stop_token_sequences: Sequence[Union[int, Sequence[int]]] = (),
        include_stop_in_output: bool = False,
        skip_special_tokens: bool = True,
        errors: str = "strict",
        spaces_between_special_tokens: bool = True,
        detokenizer: Optional[IncrementalDetokenizer] = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        if detokenizer is None:
            if tokenizer is None:
                raise ValueError("TextPipeline needs a tokenizer or a detokenizer")
            detokenizer = IncrementalDetokenizer(
                tokenizer,
                prompt_ids=prompt_ids,
                skip_special_tokens=skip_special_tokens,
                errors=errors,
                spaces_between_special_tokens=spaces_between_special_tokens,
            )
        self.detokenizer = detokenizer
        self.matcher = StopMatcher(stop, include_in_output=include_stop_in_output)
        self.seq_matcher = (
            StopSequenceMatcher(stop_token_sequences, include_in_output=include_stop_in_output)
            if stop_token_sequences
            else None
        )
        self.include_stop_in_output = bool(include_stop_in_output)
        self._no_stops = not self.matcher.stops
        self.clock = clock
        self._parts: List[str] = []
        self._starts: List[int] = []  # detokenized-text offset at which each pushed id starts
        self._chars = 0  # characters produced by the detokenizer so far
        self._returned_chars = 0  # of those, characters returned (stop text excluded)
        self._pushed = 0  # ids offered to push()
        self._returned_tokens: Optional[int] = None
        self._done = False
        self.hit: Optional[StopHit] = None
        self.finish_reason: Optional[FinishReason] = None
        self.error: Optional[ErrorCode] = None
        self.stop_wait_s = 0.0
        self._held_since: Optional[float] = None

    # ---- properties -------------------------------------------------------------------------
    @property
    def text(self) -> str:
        """All text returned so far."""
        if len(self._parts) > 1:
            self._parts = ["".join(self._parts)]
        return self._parts[0] if self._parts else ""

    @property
    def done(self) -> bool:
        return self._done

    @property
    def stopped(self) -> bool:
        """A stop string or stop sequence has hit: push no more ids."""
        return self.hit is not None

    @property
    def pushed_tokens(self) -> int:
        return self._pushed

    @property
    def returned_tokens(self) -> int:
        if self._returned_tokens is not None:
            return self._returned_tokens
        return bisect.bisect_left(self._starts, self._returned_chars)

    def token_offset(self, index: int) -> int:
        """The character offset in the output text at which the text of pushed id `index`
        begins (for a returned token: its offset in the returned text)."""
        return self._starts[index]

    # ---- feeding ----------------------------------------------------------------------------
    def push(self, token_id: int) -> PushResult:
        """Feed one selected id; returns the newly safe text and the stop hit, if any."""
        if self._done or self.hit is not None:
            return _EMPTY
        self._pushed += 1
        if self.seq_matcher is None:
            return self._push_text(token_id)
        released, seq_hit = self.seq_matcher.push(token_id)
        out: List[str] = []
        for t in released:
            r = self._push_text(t)
            if r.text:
                out.append(r.text)
            if r.hit is not None:
                self.seq_matcher.discard()
                return PushResult("".join(out), r.hit)
        if seq_hit is not None:
            held = self.matcher.flush()
            if held:
                out.append(self._record(held))
            self._stop_wait_update()
            self._on_stop(seq_hit, string_hit=False)
        return PushResult("".join(out), seq_hit)

    def push_many(self, token_ids: Sequence[int]) -> PushResult:
        out: List[str] = []
        for t in token_ids:
            r = self.push(t)
            if r.text:
                out.append(r.text)
            if r.hit is not None:
                return PushResult("".join(out), r.hit)
        return PushResult("".join(out), None)

    def _push_text(self, token_id: int) -> PushResult:
        start = self._chars
        try:
            s = self.detokenizer.push(token_id)
        except DecodingError:
            self._starts.append(start)
            self._fail_decoding()
            raise
        self._starts.append(start)
        if not s:
            return _EMPTY
        self._chars += len(s)
        if self._no_stops:
            self._parts.append(s)
            self._returned_chars += len(s)
            return PushResult(s, None)
        safe, hit = self.matcher.push(s)
        if hit is not None:
            text = self._record(safe)
            self._stop_wait_update()
            self._on_stop(hit, string_hit=True)
            return PushResult(text, hit)
        self._stop_wait_update()
        return PushResult(self._record(safe) if safe else "", None)

    def _record(self, text: str) -> str:
        if text:
            self._parts.append(text)
            self._returned_chars += len(text)
        return text

    def _stop_wait_update(self) -> None:
        if self.matcher.held:
            if self._held_since is None:
                self._held_since = self.clock()
        elif self._held_since is not None:
            self.stop_wait_s += self.clock() - self._held_since
            self._held_since = None

    def _on_stop(self, hit: StopHit, string_hit: bool) -> None:
        self.hit = hit
        self.detokenizer.discard()  # D5: the undecoded tail after a stop is dropped, not an error
        if string_hit:
            start, end = self.matcher.hit_span
            cut = end if self.include_stop_in_output else start
            self._returned_tokens = bisect.bisect_left(self._starts, cut)
        else:
            self._returned_tokens = len(self._starts)
        if self._held_since is not None:
            self.stop_wait_s += self.clock() - self._held_since
            self._held_since = None

    def _fail_decoding(self) -> None:
        self._done = True
        self.error = ErrorCode.DECODING_ERROR
        self.matcher.discard()
        if self.seq_matcher is not None:
            self.seq_matcher.discard()
        self._returned_tokens = bisect.bisect_left(self._starts, self._returned_chars)

    # ---- endings ----------------------------------------------------------------------------
    def finish(self, reason: Union[FinishReason, str] = FinishReason.EOS) -> FinishResult:
        """End the request once (see module docstring). Returns the final text and reason.

        Raises `DecodingError` (strict policy, D4) when the tail is not valid UTF-8.
        """
        if self._done:
            return FinishResult("", self.finish_reason, self.hit)
        reason = FinishReason(reason)
        if reason is FinishReason.CANCELLED:
            self.cancel()
            return FinishResult("", FinishReason.CANCELLED, None)
        if self.hit is not None:
            self._done = True
            self.finish_reason = FinishReason.STOP_SEQUENCE
            return FinishResult("", self.finish_reason, self.hit)
        out: List[str] = []
        if self.seq_matcher is not None:
            for t in self.seq_matcher.flush():
                r = self._push_text(t)
                if r.text:
                    out.append(r.text)
                if r.hit is not None:
                    return self._finish_stopped(out)
        try:
            tail = self.detokenizer.finish()
        except DecodingError:
            self._fail_decoding()
            raise
        if tail:
            self._chars += len(tail)
            safe, hit = self.matcher.push(tail)  # S6: finish() output still passes the matcher
            if hit is not None:
                out.append(self._record(safe))
                self._on_stop(hit, string_hit=True)
                return self._finish_stopped(out)
            if safe:
                out.append(self._record(safe))
        held = self.matcher.flush()
        if held:
            out.append(self._record(held))
        self._stop_wait_update()
        self._done = True
        self.finish_reason = reason
        self._returned_tokens = len(self._starts)
        return FinishResult("".join(out), reason, None)

    def _finish_stopped(self, out: List[str]) -> FinishResult:
        self._done = True
        self.finish_reason = FinishReason.STOP_SEQUENCE
        return FinishResult("".join(out), self.finish_reason, self.hit)

    def cancel(self) -> None:
        """Cancelled: drop held text and pending bytes; the returned prefix stays as it is."""
        if self._done:
            return
        self.detokenizer.discard()
        self.matcher.discard()
        if self.seq_matcher is not None:
            self.seq_matcher.discard()
        if self._held_since is not None:
            self.stop_wait_s += self.clock() - self._held_since
            self._held_since = None
        self._done = True
        self.finish_reason = FinishReason.CANCELLED
        if self._returned_tokens is None:
            self._returned_tokens = bisect.bisect_left(self._starts, self._returned_chars)
