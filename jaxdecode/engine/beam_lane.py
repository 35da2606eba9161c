"""The engine's beam lane: `SamplingParams(num_beams > 1)` through `jd.LLM` (contract §10).

A beam request is not streamed token by token: beams reorder until the search ends, so (as in
HF `generate` and vLLM's beam search) its results are final. The engine thread takes the beam
requests out of the admission queue at its next safe point (after the queue sweep, before slot
admission) and runs them here, on the same thread, as `jd.beam_search` device calls (each a
BEAM step op through the engine's `device`, so multi-host followers make the same call):

- One row per prompt: `LLM.generate` links the `n` handles of a prompt (`link_rows`), which
  share one row and take its beams by rank (`Completion.index`); a handle from `submit` or
  `run_record` is a row of its own and takes beam `index` of `n` (rank 0 for `submit`).
- Rows queued together that share the call's scalar settings -- n, early_stopping,
  length_penalty, max new tokens, min new tokens, the ending ids and the response_format --
  run as one call (at most `max_slots` rows, and within the engine's KV budget,
  `admission.EngineLimits.kv_positions`, counting `admission.beam_positions` per row; a row
  alone always runs); `num_beams` may differ per row (beam_search pads to the widest width), so
  widths do not split calls, and so may the LoRA adapter (`SamplingParams(lora=)`, contract
  R6: each row's index travels with the call). `beam_search` compiles per width, output
  bucket and prompt bucket; max_new_tokens and the other numbers are runtime values.
- Latency trade-off: the call is one device program (the whole search, `lax.while_loop`), so
  the slot rows get no decode step while it runs -- their streams pause for that long (the
  step already in flight completes first). Running the call on another thread would overlap
  better but share the device anyway; the engine thread owns the slot state, and keeping beams
  on it keeps every lifecycle change on one thread.

Settings: max_tokens is capped to the room left in the engine's `max_len` (like a slot's);
min_tokens is beam_search's min_new_tokens; the ending ids are the engine's EOS ids (none with
`ignore_eos`) plus the single `stop_token_ids` (HF treats every `eos_token_id` alike; the
candidate count follows their number). response_format constrains every beam.

Each returned beam becomes a Completion through the request's own TextPipeline, so stop strings
and stop id sequences apply: the lifecycle goes QUEUED -> PREFILLING -> DECODING (the call)
-> DRAINING -> FINISHED, with events start, one delta carrying the whole text, and the terminal
event; the trace holds `beam.started`, a `token.selected` per kept token and `beam.result`
(rank, score, length). Finish reasons: the beam's last token is an EOS id -> eos (never shown,
D6), a stop id -> stop_sequence (shown with include_stop_in_output, S8), a stop string or id
sequence in the text -> stop_sequence with the text and `token_ids` cut at the token that
completed it (S3); a grammar that completed -> grammar_complete (known exactly for rank 0; a
lower-ranked beam shorter than the limit without an ending id completed its grammar); the
limit -> max_output_tokens, or context_limit when `max_len` capped max_tokens. `score` stays
the search's score of the whole hypothesis (a stop cut does not rescore).

Usage (contract §9), as if the request had selected its tokens one by one: selected = kept tokens;
processed = those the search wrote into the cache (all but the hypothesis' last token);
returned = the pipeline's count. Cancels and deadlines are observed before the call (queued
requests: the engine thread's queue sweep); a cancel that arrives during the call discards its
result (L4, CANCELLED). Results reach the requests through the engine's `OutputSink`
(output.py), never through engine internals. The deadline is not checked after the call: it
cannot stop midway, and its result is complete. A call that raises is retried without each half
of its rows (`faults.find_culprits`): the rows that fail alone end FAILED (`model_error`, the
engine's `error` records it), the others get their results; the slot state is untouched
throughout. Records pin num_beams, length_penalty, early_stopping and n with the other settings
and the beam rank as `sample_index`, so `jd.replay` reruns the search.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Callable, Optional

from jaxdecode.engine import admission, faults, step_ops
from jaxdecode.engine.output import OutputSink
from jaxdecode.engine.request import Request
from jaxdecode.types import ErrorCode, FinishReason, RequestState

logger = logging.getLogger(__name__)


def link_rows(requests: list) -> None:
    """The n requests of each beam prompt share one beam-search row (engine/samples.py)."""
    rows: dict = {}
    for r in requests:
        if r.is_beam:
            r.beam_row = rows.setdefault(r.prompt_index, [])
            r.beam_row.append(r)


class BeamLane:
    """Runs queued beam requests (module docstring): `device` applies a step op, `sink` ends
    requests, `limits` bound the calls; `error` is the last call failure."""

    def __init__(self, device: Callable[[step_ops.StepOp], Any], sink: OutputSink,
                 limits: admission.EngineLimits, eos_token_ids: tuple):
        self.device, self.sink, self.limits = device, sink, limits
        self.eos_token_ids = tuple(eos_token_ids)
        self.error: Optional[str] = None

    def _settings(self, r: Request) -> dict:
        sp = r.sampling
        limit = r.device_sampling.max_tokens  # capped to the room left in max_len
        return dict(num_return_sequences=sp.n, early_stopping=sp.early_stopping,
                    length_penalty=sp.length_penalty, max_new_tokens=limit,
                    min_new_tokens=min(sp.min_tokens, limit),
                    eos_token_ids=admission.ending_ids(self.eos_token_ids, sp),
                    response_format=sp.response_format)

    def _chunks(self, settings: dict, rows: list) -> list:
        """Consecutive rows of one call setting, split so that each call has at most
        max_slots rows and fits the KV budget (module docstring)."""
        out: list = []
        for row in rows:
            trial = (out[-1] if out else []) + [row]
            need = len(trial) * admission.beam_positions(
                self.limits, max(r[0].sampling.num_beams for r in trial),
                max(len(r[0].prompt_ids) for r in trial), settings["max_new_tokens"])
            if out and len(trial) <= self.limits.max_slots and need <= self.limits.kv_positions:
                out[-1] = trial
            else:
                out.append([row])
        return out

    def run(self, requests: list) -> None:
        """Run queued beam requests (taken out of the queue by the engine thread) to their
        end."""
        rows: dict = {}
        for r in requests:
            rows.setdefault(id(r.beam_row), []).append(r)
        calls: dict = {}
        for row in rows.values():
            settings = self._settings(row[0])
            key = json.dumps(settings, sort_keys=True, default=str)
            calls.setdefault(key, (settings, []))[1].append(row)
        for settings, call_rows in calls.values():
            for chunk in self._chunks(settings, call_rows):
                culprits = faults.find_culprits(chunk, lambda rows: self._call(settings, rows))
                for row, exc in culprits or ():  # rows that fail alone (module docstring)
                    logger.error("beam search failed on request %s: %r", row[0].request_id, exc)
                    self.error = f"{type(exc).__name__}: {exc}"
                    for r in (r for r in row if not r.lifecycle.is_terminal):
                        self.sink.fail(r, ErrorCode.MODEL_ERROR, self.error)

    def _call(self, settings: dict, rows: list) -> None:
        live = []
        for row in rows:
            for r in row:
                if r.lifecycle.observe_cancel():
                    self.sink.end_cancelled(r)
            row = [r for r in row if not r.lifecycle.is_terminal]
            if row:
                live.append(row)
        if not live:
            return
        widths = [row[0].sampling.num_beams for row in live]
        for row in live:
            for r in row:
                r.lifecycle.try_transition(RequestState.PREFILLING)  # already done in a retry
                r.lifecycle.try_transition(RequestState.DECODING)  # prefill is in the call
                r.lifecycle.record("beam.started", num_beams=r.sampling.num_beams,
                                   rows=len(live))
        out = self.device(step_ops.beam([row[0].prompt_ids for row in live], widths, settings,
                                        [row[0].adapter for row in live]))
        for i, row in enumerate(live):
            for r in row:
                if r.lifecycle.observe_cancel():  # L4: the finished call's result is discarded
                    self.sink.end_cancelled(r)
                    continue
                tokens, score = out.beams[i][r.index]
                completed = (out.finish_reasons[i] is FinishReason.GRAMMAR_COMPLETE
                             if r.index == 0 else len(tokens) < settings["max_new_tokens"])
                self._deliver(r, tokens, score, completed, settings["max_new_tokens"])

    def _reason(self, r: Request, tokens: list, completed: bool, limit: int):
        """The finish reason of a beam and its tokens that show text (module docstring)."""
        sp = r.sampling
        last = tokens[-1] if tokens else None
        shown = list(tokens)
        if not sp.ignore_eos and last in self.eos_token_ids:
            shown.pop()
            return FinishReason.EOS, shown
        if last in sp.single_stop_ids:
            if not sp.include_stop_in_output:
                shown.pop()
            return FinishReason.STOP_SEQUENCE, shown
        if completed:
            return FinishReason.GRAMMAR_COMPLETE, shown
        if limit < sp.max_tokens:
            return FinishReason.CONTEXT_LIMIT, shown
        return FinishReason.MAX_OUTPUT_TOKENS, shown

    def _deliver(self, r: Request, tokens: list, score: float, completed: bool,
                 limit: int) -> None:
        """One beam -> the request's text, events, usage and terminal event."""
        r.score = score
        reason, shown = self._reason(r, tokens, completed, limit)
        kept, texts, hit = len(tokens), [], None
        try:
            for i, token in enumerate(shown):
                pushed = r.pipeline.push(token)
                texts.append(pushed.text)
                if pushed.hit is not None:
                    kept, hit = i + 1, pushed.hit
                    break
            final = r.pipeline.finish(reason)
        except ValueError as exc:  # DecodingError: strict UTF-8 (D4)
            r.token_ids = list(tokens)
            r.selected, r.processed = len(tokens), len(tokens) - 1
            self.sink.fail(r, ErrorCode.DECODING_ERROR, str(exc))
            return
        r.token_ids = list(tokens[:kept])
        r.selected, r.processed = kept, min(kept, len(tokens) - 1)
        for step, token in enumerate(r.token_ids, 1):
            r.lifecycle.record("token.selected", step=step, token=token)
        r.lifecycle.record("beam.result", rank=r.index, score=score, length=len(tokens))
        hit = hit or final.hit
        if hit is not None:
            r.lifecycle.record("stop.hit", stop=hit.stop, index=hit.index)
        stop = hit.stop if hit is not None else (
            tokens[-1] if reason is FinishReason.STOP_SEQUENCE else None)
        self.sink.complete(r, "".join(texts) + final.text, final.finish_reason, stop)
