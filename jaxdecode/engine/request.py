"""One engine request: its internal state (`Request`) and the user's view of it
(`RequestHandle`).

`Request` is what the engine layers share -- the settings the device runs, the host text
pipeline, the lifecycle and its stream, the counters of contract §9. Where it sits (slot, pages,
prefill progress, steps in flight) is the scheduler's `Placement`, not a field here. Only the
engine thread changes it, except the two flags a user may set from any thread (cancel, through
the lifecycle; pause). `RequestHandle` is what `LLM.submit` returns: events,
trace, result, cancel / pause / resume, and read-only properties (text, usage, token offsets)
that serving and notebooks use instead of the internals.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Iterator, Optional

import numpy as np

from jaxdecode.config import SamplingParams
from jaxdecode.host import Lifecycle, OrderedStream, TextPipeline
from jaxdecode.types import (Completion, ErrorCode, Event, FinishReason, RequestState,
                             TokenLogprob, Usage)


class Request:
    """Internal state of one request (module docstring). `device_sampling` is what the device
    runs (max_tokens capped to the context, `admission.check`); `grammar` the compiled
    response_format (constraints.CompiledIndex) or None."""

    def __init__(self, request_id: str, prompt_ids: list, sampling: SamplingParams, *,
                 tokenizer: Any, prompt_text: Optional[str], seed: int, key_data: np.ndarray,
                 prompt_index: int, index: int, output_kind: str, max_buffered: int,
                 backpressure: str, trace: bool, grammar: Optional[Any] = None,
                 device_sampling: Optional[SamplingParams] = None):
        self.request_id, self.prompt_ids, self.prompt_text = request_id, prompt_ids, prompt_text
        self.sampling, self.device_sampling = sampling, device_sampling or sampling
        self.seed, self.key_data = seed, key_data
        self.prompt_index, self.index, self.grammar = prompt_index, index, grammar
        self.deadline = (time.monotonic() + sampling.deadline_s
                         if sampling.deadline_s is not None else None)
        stream = OrderedStream(request_id, output_kind=output_kind, max_buffered=max_buffered,
                               policy=backpressure)
        self.lifecycle = Lifecycle(request_id, stream=stream, trace=trace)
        self.pipeline = TextPipeline(
            tokenizer, prompt_ids=prompt_ids, stop=sampling.stop,
            stop_token_sequences=sampling.stop_id_sequences,
            include_stop_in_output=sampling.include_stop_in_output,
            skip_special_tokens=sampling.skip_special_tokens, errors=sampling.utf8_errors)
        self.token_ids: list[int] = []
        # one TokenLogprob per selected token when the request asked for logprobs, else None
        self.logprobs: Optional[list[TokenLogprob]] = [] if sampling.logprobs else None
        self.reported = 0            # logprobs already sent in a delta
        self.selected = self.processed = 0
        self.ahead: Optional[int] = None  # first token streamed before its step (output.py)
        self.faults = 0              # failed engine steps it was running in (core recovery)
        self.error_message = ""
        self.user_paused = False     # pause(): the row skips steps, its state unchanged (B1)
        self.restored: Optional[dict] = None    # saved arrays, when restored from disk
        self.speculative: Optional[dict] = None  # acceptance counters (speculative backend)
        self.beam_row: list = [self]  # requests sharing one beam-search row (beam_lane)
        self.score: Optional[float] = None       # a beam's score (beam_lane)
        self.cached_tokens = 0       # prompt tokens mapped from the prefix cache (§9)
        self.params_hash: Optional[str] = None  # the weights it runs on (set when queued, R4)
        self.adapter, self.adapter_tag = 0, ""  # its LoRA index and key (adapters.py, R6)
        self.share_with: Optional["Request"] = None  # sample 0 of its prompt (n > 1)
        self.settled = threading.Event()         # paused with no step in flight
        self.finished = threading.Event()        # ended and released

    @property
    def is_beam(self) -> bool:
        return self.sampling.num_beams > 1

    def usage(self) -> Usage:
        return Usage(prompt_tokens=len(self.prompt_ids), selected_tokens=self.selected,
                     processed_tokens=self.processed,
                     returned_tokens=self.pipeline.returned_tokens,
                     cached_tokens=min(self.cached_tokens, len(self.prompt_ids)))

    def take_logprobs(self) -> Optional[tuple[TokenLogprob, ...]]:
        """The logprobs of the returned tokens not yet sent in a delta (None when not asked)."""
        if self.logprobs is None:
            return None
        end = self.pipeline.returned_tokens
        new = tuple(self.logprobs[self.reported:end])
        self.reported = max(self.reported, end)
        return new

    def returned_logprobs(self) -> Optional[tuple[TokenLogprob, ...]]:
        """The logprobs of the returned tokens so far (None when not asked)."""
        if self.logprobs is None:
            return None
        return tuple(self.logprobs[:self.pipeline.returned_tokens])

    def timings(self) -> dict:
        timings = self.lifecycle.timings(self.pipeline).as_dict()
        if self.speculative is not None:
            timings["speculative"] = dict(self.speculative)
        return timings

    def __repr__(self) -> str:
        return f"Request({self.request_id!r}, {self.lifecycle.state.value})"


def logprob_entry(r: Request, token: int, logprob: Any, top_ids: Any,
                  top_logprobs: Any) -> TokenLogprob:
    """The request's record of one selected token: its raw logprob and its own top N (the step
    computed a top-k whenever a live row asked, so the arrays are there)."""
    n = r.sampling.logprobs
    return TokenLogprob(token, float(logprob),
                        tuple(zip(top_ids[:n].tolist(), top_logprobs[:n].tolist())))


class RequestHandle:
    """A submitted request as its user sees it: events, trace, cancellation, result."""

    def __init__(self, request: Request, wake: Callable[[], None],
                 record: Callable[..., Any]):
        """`wake()` nudges the engine thread; `record(request, finish, error)` builds the
        request's generation record (records.py)."""
        self._request, self._wake, self._record = request, wake, record

    @property
    def request_id(self) -> str:
        return self._request.request_id

    @property
    def prompt_ids(self) -> list:
        return self._request.prompt_ids

    @property
    def sampling(self) -> SamplingParams:
        return self._request.sampling

    @property
    def seed(self) -> int:
        return self._request.seed

    @property
    def selected(self) -> int:
        """Tokens selected so far (contract §9 `selected_tokens`)."""
        return self._request.selected

    @property
    def score(self) -> Optional[float]:
        """A beam's HF score (beam search), else None."""
        return self._request.score

    @property
    def text(self) -> str:
        """The text returned so far."""
        return self._request.pipeline.text

    @property
    def logprobs(self) -> Optional[tuple]:
        """The returned tokens' `TokenLogprob`s so far (None when the request did not ask)."""
        return self._request.returned_logprobs()

    def token_offset(self, i: int) -> int:
        """Where returned token i's text begins in `text` (OpenAI's `text_offset`)."""
        return self._request.pipeline.token_offset(i)

    # -- events ---------------------------------------------------------------------------------

    def events(self, timeout: Optional[float] = None) -> Iterator[Event]:
        """The stream events in seq order: start, deltas, one terminal event."""
        return self._request.lifecycle.stream.iter(timeout)

    def events_after(self, seq: int) -> list[Event]:
        """The buffered stream events after `seq` (contract T4: resume after a reconnect)."""
        return self._request.lifecycle.stream.events_after(seq)

    def next_event(self) -> Optional[Event]:
        """The next unread stream event, or None when none is there yet (never blocks)."""
        return self._request.lifecycle.stream.get_nowait()

    def add_listener(self, fn: Callable[[], None]) -> None:
        """Call `fn()` (from the engine thread) whenever the stream gains an event."""
        self._request.lifecycle.stream.add_listener(fn)

    @property
    def terminal_event(self) -> Optional[Event]:
        """The stream's terminal event once it is there (the state turns terminal a moment
        before its event is appended), else None."""
        stream = self._request.lifecycle.stream
        return stream.terminal_event if stream.finished else None

    def trace(self) -> list:
        """The full event trace so far (lifecycle, token.selected, decode.completed, ...)."""
        return list(self._request.lifecycle.events)

    @property
    def state_times(self) -> dict:
        """When the request entered each lifecycle state (monotonic seconds)."""
        return self._request.lifecycle.state_times

    # -- control --------------------------------------------------------------------------------

    def cancel(self) -> None:
        """Ask for cancellation; returns at once, idempotent, a no-op once ended (contract C4)."""
        if self._request.lifecycle.request_cancel():
            self._wake()

    def pause(self) -> None:
        """Stop scheduling this request's steps; its state stays exactly as it is (contract B1).
        Returns at once; `LLM.save_request` waits until no step of it is in flight."""
        self._request.settled.clear()
        self._request.user_paused = True
        self._request.lifecycle.record("paused")
        self._wake()

    def resume(self) -> None:
        self._request.user_paused = False
        self._request.lifecycle.record("resumed")
        self._wake()

    # -- results --------------------------------------------------------------------------------

    def result(self, timeout: Optional[float] = None) -> Completion:
        if not self._request.finished.wait(timeout):
            raise TimeoutError(f"request {self.request_id} did not end within {timeout}s")
        return self.completion()

    @property
    def state(self) -> RequestState:
        return self._request.lifecycle.state

    @property
    def done(self) -> bool:
        return self._request.finished.is_set()

    def usage(self) -> Usage:
        return self._request.usage()

    def completion(self) -> Completion:
        r = self._request
        term = r.lifecycle.terminal_event
        data = term.data if term is not None else {}
        reason = data.get("finish_reason")
        finish = FinishReason(reason) if reason is not None else None
        error = ErrorCode(data["error"]) if data.get("error") is not None else None
        return Completion(
            request_id=r.request_id, text=r.pipeline.text, token_ids=tuple(r.token_ids),
            finish_reason=finish, error=error, usage=r.usage(), events=tuple(r.lifecycle.events),
            record=self._record(r, finish, error), prompt_index=r.prompt_index,
            index=r.index, state=r.lifecycle.state, timings=r.timings(), score=r.score,
            logprobs=r.returned_logprobs())

    def __repr__(self) -> str:
        return f"RequestHandle({self.request_id!r}, {self.state.value})"
