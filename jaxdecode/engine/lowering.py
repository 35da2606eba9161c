"""Lowering: the device work of one scheduler `Iteration` as step ops (step_ops.py).

Pure: each function reads the scheduler's decisions and placements (and the runner's context)
and returns an op, changing nothing; the core (core.py) hands the ops to the runner (runner.py)
in the iteration's order:

    RESTORE  a placed request that was restored from disk (`restore`)
    CHUNK    one per chunk batch (`chunk`): the chunks' tokens at their positions, and for a
             prompt's last chunk the rows that start decoding after it (`new_rows`)
    FLAGS    the plan's release / pause masks, when they changed (`flags`)
    STEP     the decode step over the live rows (`step`)

The grammar initial states of new rows come from the runner's table set (`initial` below:
`Runner.grammar_tables`, which may send a GRAMMAR op first).
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np

from jaxdecode.device import decode
from jaxdecode.device.state import RowParams
from jaxdecode.engine import step_ops
from jaxdecode.engine.request import Request
from jaxdecode.engine.scheduler import Chunk, Scheduler, StepPlan


def top_k(started: list, logprobs_k: int) -> int:
    """The top log-probabilities the first tokens of `started` come with (0 unless one asked)."""
    return logprobs_k if any(r.logprobs is not None for r in started) else 0


def chunk(ctx: Any, s: Scheduler, batch: list[Chunk], initial: Optional[np.ndarray],
          k: int) -> step_ops.StepOp:
    """One batch of chunks of one program shape; `initial`: the grammar initial state of each
    request in the batch's `started` rows, in order (None: no tables)."""
    tokens = np.zeros((len(batch), batch[0].t), np.int32)
    for i, c in enumerate(batch):
        tokens[i, :c.length] = s.placements.prefill_inputs(c.request)[c.start:c.start + c.length]
    finals, at = [], 0
    for i, c in enumerate(batch):
        if c.final:
            own = None if initial is None else initial[at:at + len(c.started)]
            finals.append((i, new_rows(ctx, s, c.request, list(c.started), own)))
            at += len(c.started)
    return step_ops.chunk(
        tokens, np.array([c.start for c in batch], np.int32),
        np.array([c.length for c in batch], np.int32),
        np.stack([s.placements.table(c.request) for c in batch]), batch[0].kv_len, finals, k,
        np.array([c.request.adapter for c in batch], np.int32))


def new_rows(ctx: Any, s: Scheduler, r: Request, group: list,
             initial: Optional[np.ndarray]) -> step_ops.NewRows:
    """The rows that start decoding after r's prompt: `group` is r and the samples sharing its
    prompt pages (each its own copy of the partial last page). A request that already selected
    tokens (requeued by recovery, faults.py) goes on at its own step: its penalty counts, RNG
    step and grammar state are those it had, so it selects what it would have selected."""
    inputs = r.prompt_ids + r.token_ids
    n, vocab, ps = len(inputs), ctx.model.config.vocab_size, ctx.page_size
    prompt = np.zeros((decode.bucket(n, ctx.max_len),), np.int32)
    prompt[:n] = inputs
    rows = RowParams.build([x.device_sampling for x in group], vocab, ctx.eos_token_ids,
                           keys=np.stack([x.key_data for x in group]),
                           adapters=[x.adapter for x in group])
    states = None
    if initial is not None:
        states = np.array([i + x.grammar.walk(x.token_ids) if x.grammar is not None else i
                           for i, x in zip(initial, group)], np.int32)
    resume = None
    if r.token_ids:  # step, counts, last token, prompt length (only r selected any)
        counts = np.zeros((1, vocab), np.int32)
        np.add.at(counts[0], r.token_ids, 1)
        resume = (np.array([len(r.token_ids)], np.int32), counts,
                  np.array([r.token_ids[-1]], np.int32),
                  np.array([len(r.prompt_ids)], np.int32))
    written = len(s.placements.prefill_inputs(r))  # positions the prefill wrote
    placed = [s.placements[x] for x in group]
    partial = [(placed[0].pages[written // ps], p.pages[written // ps]) for p in placed[1:]
               if written % ps]
    copies = tuple(np.array(c, np.int32) for c in zip(*partial)) if partial else (
        np.zeros((0,), np.int32), np.zeros((0,), np.int32))
    return step_ops.NewRows(prompt, n, np.array([p.slot for p in placed], np.int32),
                            np.stack([s.placements.table(x) for x in group]), rows, states,
                            resume, copies)


def restore(ctx: Any, s: Scheduler, r: Request, initial: Optional[np.ndarray]) -> step_ops.StepOp:
    """A restored request's saved row into its pages and slot (`initial`: its grammar initial
    state, None: no tables)."""
    a, p = r.restored, s.placements[r]
    state = None
    if initial is not None:
        local = int(a["grammar_local"]) if "grammar_local" in a else 0
        state = int(initial[0]) + local if r.grammar is not None else -1
    pages = p.pages[:-(-int(a["length"]) // ctx.page_size)]
    return step_ops.restore(a, p.slot, np.asarray(pages, np.int32), s.placements.table(r),
                            state)


def flags(plan: StepPlan) -> Optional[step_ops.StepOp]:
    """The plan's release / pause masks (None: unchanged, no op)."""
    return None if plan.flags is None else step_ops.flags(*plan.flags)


def step(plan: StepPlan) -> step_ops.StepOp:
    return step_ops.step(plan.kv_len, plan.top_k, plan.steps, plan.rows)
