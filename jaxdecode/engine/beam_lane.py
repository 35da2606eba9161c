"""The engine's beam lane: `SamplingParams(num_beams > 1)` through `jd.LLM` (SPEC §10).

A beam request is not streamed token by token: beams reorder until the search ends, so (as in
HF `generate` and vLLM's beam search) its results are final. The engine thread takes the beam
requests out of the admission queue at its next safe point (after the queue sweep, before slot
admission) and runs them here, on the same thread, as `jd.beam_search` device calls (each a
BEAM step op through `LLM._device`, so multi-host followers make the same call):

- One row per prompt: `LLM.generate` links the `n` handles of a prompt (`link_rows`), which
  share one row and take its beams by rank (`Completion.index`); a handle from `submit` or
  `run_record` is a row of its own and takes beam `index` of `n` (rank 0 for `submit`).
- Rows queued together that share the call's scalar settings -- n, early_stopping,
  length_penalty, max new tokens, min new tokens, the ending ids and the response_format --
  run as one call (at most `max_slots` rows, and within the engine's KV budget,
  `admission.EngineLimits.kv_positions`, counting `admission.beam_positions` per row; a row
  alone always runs); `num_beams` may differ per row (beam_search pads to the widest width), so
  widths do not split calls. `beam_search` compiles per width, output
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

Usage (SPEC §9), as if the request had selected its tokens one by one: selected = kept tokens;
processed = those the search wrote into the cache (all but the hypothesis' last token);
returned = the pipeline's count. Cancels and deadlines are observed before the call (queued
requests: `LLM._sweep_queue`); a cancel that arrives during the call discards its result
(L4, CANCELLED). The deadline is not checked after the call: it cannot stop midway, and its
result is complete. A call that raises is retried without each half of its rows
(`faults.find_culprits`): the rows that fail alone end FAILED (`model_error`, the engine's
`error` records it), the others get their results; the slot state is untouched throughout. Records pin num_beams, length_penalty, early_stopping and n with the
other settings and the beam rank as `sample_index`, so `jd.replay` reruns the search.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from jaxdecode.engine import admission, faults, step_ops
from jaxdecode.types import ErrorCode, FinishReason, RequestState

logger = logging.getLogger(__name__)


def is_beam(handle: Any) -> bool:
    return handle.sampling.num_beams > 1


def link_rows(handles: list) -> None:
    """`LLM.generate`: the n handles of each beam prompt share one beam-search row."""
    rows: dict = {}
    for h in handles:
        if is_beam(h):
            h.beam_row = rows.setdefault(h.prompt_index, [])
            h.beam_row.append(h)


def ending_ids(engine: Any, sp: Any) -> tuple:
    """The ids that end a beam: the engine's EOS ids (none with ignore_eos) and the single
    stop ids (the grammar vocabulary excludes them too)."""
    eos = () if sp.ignore_eos else tuple(engine.eos_token_ids)
    return tuple(dict.fromkeys(eos + sp.single_stop_ids))


def _settings(engine: Any, h: Any) -> dict:
    sp = h.sampling
    limit = h.device_sampling.max_tokens  # capped to the room left in max_len
    return dict(num_return_sequences=sp.n, early_stopping=sp.early_stopping,
                length_penalty=sp.length_penalty, max_new_tokens=limit,
                min_new_tokens=min(sp.min_tokens, limit), eos_token_ids=ending_ids(engine, sp),
                response_format=sp.response_format)


def _chunks(engine: Any, settings: dict, rows: list) -> list:
    """Consecutive rows of one call setting, split so that each call has at most max_slots rows
    and fits the KV budget (module docstring)."""
    out: list = []
    for row in rows:
        trial = (out[-1] if out else []) + [row]
        need = len(trial) * admission.beam_positions(
            engine.limits, max(r[0].sampling.num_beams for r in trial),
            max(len(r[0].prompt_ids) for r in trial), settings["max_new_tokens"])
        if out and len(trial) <= engine.max_slots and need <= engine.limits.kv_positions:
            out[-1] = trial
        else:
            out.append([row])
    return out


def run(engine: Any, handles: list) -> None:
    """Run queued beam requests (taken out of the queue by the engine thread) to their end."""
    rows: dict = {}
    for h in handles:
        rows.setdefault(id(h.beam_row), []).append(h)
    calls: dict = {}
    for row in rows.values():
        settings = _settings(engine, row[0])
        key = json.dumps(settings, sort_keys=True, default=str)
        calls.setdefault(key, (settings, []))[1].append(row)
    for settings, call_rows in calls.values():
        for chunk in _chunks(engine, settings, call_rows):
            culprits = faults.find_culprits(chunk, lambda rows: _run_call(engine, settings, rows))
            for row, exc in culprits or ():  # rows that fail alone (module docstring)
                logger.error("beam search failed on request %s: %r", row[0].request_id, exc)
                engine.error = f"{type(exc).__name__}: {exc}"
                for h in (h for h in row if not h.lifecycle.is_terminal):
                    engine._fail(h, ErrorCode.MODEL_ERROR, engine.error)


def _run_call(engine: Any, settings: dict, rows: list) -> None:
    live = []
    for row in rows:
        for h in row:
            if h.lifecycle.observe_cancel():
                engine._end_cancelled(h)
        row = [h for h in row if not h.lifecycle.is_terminal]
        if row:
            live.append(row)
    if not live:
        return
    widths = [row[0].sampling.num_beams for row in live]
    for row in live:
        for h in row:
            h.lifecycle.try_transition(RequestState.PREFILLING)  # already done in a retry
            h.lifecycle.try_transition(RequestState.DECODING)  # prefill is inside the one call
            h.lifecycle.record("beam.started", num_beams=h.sampling.num_beams, rows=len(live))
    out = engine._device(step_ops.beam([row[0].prompt_ids for row in live], widths, settings))
    for r, row in enumerate(live):
        for h in row:
            if h.lifecycle.observe_cancel():  # L4: the finished call's result is discarded
                engine._end_cancelled(h)
                continue
            tokens, score = out.beams[r][h.index]
            completed = (out.finish_reasons[r] is FinishReason.GRAMMAR_COMPLETE if h.index == 0
                         else len(tokens) < settings["max_new_tokens"])
            _deliver(engine, h, tokens, score, completed, settings["max_new_tokens"])


def _deliver(engine: Any, h: Any, tokens: list, score: float, completed: bool,
             limit: int) -> None:
    """One beam -> the request's text, events, usage and terminal event (module docstring)."""
    sp, lc = h.sampling, h.lifecycle
    h.score = score
    last = tokens[-1] if tokens else None
    shown = list(tokens)
    if not sp.ignore_eos and last in engine.eos_token_ids:
        reason = FinishReason.EOS
        shown.pop()
    elif last in sp.single_stop_ids:
        reason = FinishReason.STOP_SEQUENCE
        if not sp.include_stop_in_output:
            shown.pop()
    elif completed:
        reason = FinishReason.GRAMMAR_COMPLETE
    elif limit < sp.max_tokens:
        reason = FinishReason.CONTEXT_LIMIT
    else:
        reason = FinishReason.MAX_OUTPUT_TOKENS
    kept, texts, hit = len(tokens), [], None
    try:
        for i, token in enumerate(shown):
            pushed = h.pipeline.push(token)
            texts.append(pushed.text)
            if pushed.hit is not None:
                kept, hit = i + 1, pushed.hit
                break
        final = h.pipeline.finish(reason)
    except ValueError as exc:  # DecodingError: strict UTF-8 (D4)
        h.token_ids = list(tokens)
        h.selected, h.processed = len(tokens), len(tokens) - 1
        engine._fail(h, ErrorCode.DECODING_ERROR, str(exc))
        return
    h.token_ids = list(tokens[:kept])
    h.selected, h.processed = kept, min(kept, len(tokens) - 1)
    for step, token in enumerate(h.token_ids, 1):
        lc.record("token.selected", step=step, token=token)
    lc.record("beam.result", rank=h.index, score=score, length=len(tokens))
    hit = hit or final.hit
    if hit is not None:
        lc.record("stop.hit", stop=hit.stop, index=hit.index)
    lc.try_transition(RequestState.DRAINING)
    lc.emit_delta("".join(texts) + final.text)
    lc.complete(final.finish_reason, usage=h.usage())
    engine._release_slot(h)
