"""Speculative decoding on device (SPEC §10): a draft proposes k tokens, the target verifies them
in one forward pass of k + 1 positions.

One loop body, two drivers: `spec_round` is one verify round over a `SpecState` (a pure
function); `speculative_generate` runs it inside one `lax.while_loop` (the whole generation is
one dispatch), and the engine (`jd.LLM(..., speculative=...)`, jaxdecode/speculative_engine.py)
runs one jitted round per engine step over its slots.

Draft kinds
-----------
- a draft model (any `DecoderModel` with the target's vocabulary): k proposals from a
  `lax.scan` of its own single-token steps, sampled from its processed distribution q;
- `draft="prompt_lookup"` (no draft model): the continuation of the most recent earlier match of
  the last n-gram (n from `ngram_max` down to `ngram_min`) in prompt + output, extended
  periodically when the match is close to the end; the last token repeated when nothing matches.
  It is a deterministic proposal, q = one-hot.

Verification (Leviathan et al. / Chen et al.)
---------------------------------------------
p_i and q_i are the PROCESSED distributions of SPEC §3 (`processors.process`: penalties, bias,
bans, min_tokens, temperature, top-k/p, min-p), each evaluated with the penalty counts and the
step index of its own position -- the counts are advanced token by token through the proposed
run, so penalties are exact, not only in penalty-free settings. Draft token d_i is accepted with
probability min(1, p_i(d_i) / q_i(d_i)); at the first rejection the token is drawn from
normalize(max(0, p_i - q_i)) (from p_i where that vanishes numerically); when all k are accepted
a bonus token is drawn from p_{k+1}. Greedy rows (temperature 0) accept a draft token exactly
when it is the target's argmax, and take the argmax at the first mismatch: their output equals
plain greedy decoding token for token. A sampled row's output follows the target's distribution
exactly, but is not the same sample as `jd.generate` with the same seed (different streams).

Keys (SPEC X1)
--------------
The token at output index t (1-based) of a row uses `kt = fold_in(request_key, t)` and then
`fold_in(kt, 0)` to sample the draft proposal, `fold_in(kt, 1)` for the acceptance uniform and
`fold_in(kt, 2)` to sample from the residual or bonus distribution (draws by inverse CDF,
one uniform each, as `sampling.py`; skipped when every row is greedy). Each output index is
decided in exactly one iteration; proposals for later indices that a rejection discards never
influence an emitted token, so reusing their keys afterwards keeps the streams independent.
The stream depends only on the seed and the output index, never on the batch slot.

State, rollback and stops
-------------------------
Invariant at the start of an iteration, for s = prompt + output so far (length L): the target
cache holds s[:-1] (lengths = L - 1) and s[-1] is the pending token -- the verify forward is
[s[-1], d_1 .. d_k] at positions L-1 .. L-1+k. The draft cache holds s[:-1], or s[:-2] after an
iteration that accepted all k tokens (its d_k was never written; the next draft call writes two
tokens). Rollback is setting both caches' `lengths` (never copying). The penalty counts, the
step index (the RNG cursor) and the history advance only by the emitted tokens.
Structured output (jaxdecode/constraints): the draft proposes under the grammar mask with its
own copy of the row's state; the verifier masks position i with the state after d_1 .. d_{i-1}
(`constraints.state_path`); after the pass the row's state is the one after its last emitted
token -- rolled back exactly like `cache.lengths` (an int32 per row, tables never copied).
Within an accepted run every emitted token passes the device stop checks of `decode.py` in the
same priority (model error, grammar dead end / all masked, EOS, stop id, grammar completion,
max_tokens, context limit): the first token that ends the row ends the run, and no token past
it is ever emitted.

Branches (`num_branches`, greedy rows only)
-------------------------------------------
`num_branches = N > 1` proposes N continuations per row and verifies them together. Proposals:
prompt lookup -- branch b continues the b-th most recent earlier match whose proposal differs
from branches 0..b-1 (longest n-gram first, then the shorter ones, then the last token
repeated: `_lookup`); a draft model -- branch b starts with the draft's b-th most likely first
token under its processed (masked) q and continues greedily, the draft's scan `vmap`ped over
the branch axis. Branch 0 is the single-branch proposal. Verification: `target.forward` is
`vmap`ped over the branch axis with the cache shared (in_axes None), so each branch writes its
own k + 1 positions into its own copy of the cache, and the grammar path and counts are per
branch. Greedy rule: branch b accepts j_b = the number of leading d_i equal to the target's
argmax; the row takes the branch with the largest j_b (ties: the lowest b, so N = 1 is today's
round) and emits its j_b tokens plus the argmax at j_b + 1 -- tokens that plain greedy decoding
emits, so the output still equals it token for token. Stops, max_tokens, counts and grammar
state then follow the chosen branch exactly as above. Cost: the chosen branch's caches (target
and draft) are taken by a gather after the choice, one copy of each cache per round -- the
price of beam search's reorder by gather; a research option, not a free speed-up.
Sampled rows (temperature > 0) with N > 1 raise ValueError naming num_branches: the
min(1, p/q) test is exact for ONE proposal per position; with several, accepting the best of N
independently-tested branches over-represents drafted tokens. Exactness there needs a
multi-draft rule (SpecInfer's / recursive rejection sampling: test the branches in turn against
successively updated residuals), not implemented.

Custom processors (`processors=`, jaxdecode/research.py)
--------------------------------------------------------
They are part of p: the verifier runs them position by position through the proposed run
(a `lax.scan`), position i seeing prompt + output + d_1 .. d_i and step + i, each row's
processor states threaded from one position to the next. After the pass a row keeps the
states after its last emitted token; those of rejected draft positions are dropped -- rolled
back like `cache.lengths`. The draft proposes without them (q stays the draft's own processed
distribution): acceptance min(1, p/q) and the residual keep the output distributed exactly
as p, whatever q is.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxdecode.device import constraints, decode, numerics, processors, sampling
from jaxdecode.device import research as research_lib
from jaxdecode.config import SamplingParams
from jaxdecode.device.decode import ERRORS, FAILED_CODES, FINISH_REASONS, GenerateOutput, bucket
from jaxdecode.model_api import DecoderModel
from jaxdecode.prompts import token_rows
from jaxdecode.device.state import (ALL_MASKED, CONTEXT_LIMIT, EOS, GRAMMAR_COMPLETE, GRAMMAR_DEAD_END,
                             MAX_TOKENS, MODEL_ERROR, RUNNING, STOP_TOKEN, RowParams)

Array = jax.Array
PROMPT_LOOKUP = "prompt_lookup"
DRAFT, ACCEPT, RESAMPLE = 0, 1, 2  # key purposes


@dataclasses.dataclass(frozen=True)
class SpeculativeOutput(GenerateOutput):
    """GenerateOutput plus acceptance counters, per row (int64[B]):

    proposed: draft tokens proposed (k per branch per verify pass); accepted: draft tokens emitted;
    target_tokens: tokens drawn from the target (residual or bonus); iterations: verify passes.
    accepted + target_tokens == number of tokens selected. `mean_accepted_length`: tokens
    selected per verify pass over all rows (1.0 = no speed-up from the draft)."""

    stats: Optional[dict] = None


def _keys(rows: RowParams, t: Array, purpose: int) -> Array:
    base = jax.vmap(jax.random.wrap_key_data)(rows.keys)
    kt = jax.vmap(jax.random.fold_in)(base, t)
    return jax.vmap(lambda k: jax.random.fold_in(k, purpose))(kt)


def _all_greedy(rows: RowParams, live: Array) -> Array:
    """True when every live row is greedy (empty, ended and paused rows do not count)."""
    return jnp.all((rows.temperature == 0) | ~live)


def _select(logprobs: Array, rows: RowParams, live: Array, t: Array, purpose: int) -> Array:
    """The argmax for greedy rows, else one inverse-CDF draw with the key of (t, purpose).
    The keys and the draw are skipped at run time when every live row is greedy."""
    greedy = jnp.argmax(logprobs, axis=-1).astype(jnp.int32)

    def sample(_):
        drawn = jax.vmap(sampling.inverse_cdf)(_keys(rows, t, purpose), logprobs)
        return jnp.where(rows.temperature == 0, greedy, drawn.astype(jnp.int32))

    return jax.lax.cond(_all_greedy(rows, live), lambda _: greedy, sample, None)


def _accept_uniforms(rows: RowParams, live: Array, t_idx: Array) -> Array:
    """u f32[B, k] for the acceptance tests at output indices t_idx int32[B, k]; zeros, with no
    key derived, when every live row is greedy (greedy rows compare with the argmax instead)."""
    def draw(_):
        keys = jax.vmap(lambda t: _keys(rows, t, ACCEPT), in_axes=1, out_axes=1)(t_idx)
        return jax.vmap(jax.vmap(jax.random.uniform))(keys)

    return jax.lax.cond(_all_greedy(rows, live),
                        lambda _: jnp.zeros(t_idx.shape, jnp.float32), draw, None)


def _pick(x: Array, chosen: Array, axis: int = 0) -> Array:
    """x[chosen[r]] for every row r: x has a leading branch axis, then its own shape with the
    rows on `axis`."""
    x = jnp.moveaxis(x, axis + 1, 1)
    return jnp.moveaxis(x[chosen, jnp.arange(x.shape[1])], 0, axis)


def _pick_cache(cache: Any, chosen: Array) -> Any:
    """The chosen branch's KVCache of each row (k, v: rows on axis 1) -- a gather, so one copy
    of the cache per round, the price of beam search's reorder."""
    return cache.replace(k=_pick(cache.k, chosen, 1), v=_pick(cache.v, chosen, 1),
                         lengths=_pick(cache.lengths, chosen))


def _lookup(hist: Array, length: Array, k: int, ngrams: tuple, branches: int = 1) -> Array:
    """Prompt-lookup proposals int32[branches, B, k] from the history (prompt + output, length L).

    A candidate is a position c < L right after an earlier occurrence of the last n tokens
    (n in `ngrams`), ranked by its longest such n, then by recency (the largest c); its proposal
    is s[c:L] repeated periodically to k tokens. Branch b takes the best candidate whose proposal
    differs from those of branches 0..b-1 (the b-th most recent distinct match, longest n-gram
    first), the last token repeated when none is left; branch 0 is the single-branch proposal."""
    b, h = hist.shape
    c = jnp.arange(h)[None, :]
    rank = jnp.zeros((b, h), jnp.int32)      # the longest n matching right before c, 0: none
    for n in ngrams:                         # longest n-gram first
        gram = jnp.take_along_axis(hist, jnp.clip(length[:, None] - n + jnp.arange(n), 0), 1)
        shifted = jnp.pad(hist, ((0, 0), (n, 0)), constant_values=-1)
        match = c <= (length - 1)[:, None]   # an earlier occurrence only
        for a in range(n):
            match &= shifted[:, a: a + h] == gram[:, a: a + 1]
        rank = jnp.where((rank == 0) & match, n, rank)
    score = jnp.where(rank > 0, rank * h + c, -1)

    def proposal(start):                     # int32[B, ...] -> [B, ..., k]
        period = jnp.maximum(length.reshape((b,) + (1,) * (start.ndim - 1)) - start, 1)
        idx = start[..., None] + jnp.arange(k) % period[..., None]
        return jnp.take_along_axis(hist, jnp.clip(idx, 0, h - 1).reshape(b, -1),
                                   axis=1).reshape(idx.shape)

    every = proposal(jnp.broadcast_to(c, (b, h))) if branches > 1 else None   # [B, H, k]
    out = []
    for _ in range(branches):
        start = jnp.where(jnp.max(score, 1) >= 0, jnp.argmax(score, 1), length - 1)
        out.append(proposal(start))
        if every is not None:                # later branches skip this proposal
            score = jnp.where(jnp.all(every == out[-1][:, None, :], -1), -1, score)
    return jnp.stack(out)


@struct.dataclass
class SpecState:
    """The carry of a speculative round (SPEC §10), B rows, H history width, V vocabulary.

    For s = prompt + output so far (length L) -- the invariant of the module docstring:
    rows:          RowParams (SPEC P3; `keys` are the per-request base keys, SPEC X1)
    tcache:        the target's KVCache holding s[:-1] (lengths = L - 1); s[-1] is pending
    hist:          int32[B, H] s, then garbage
    lpbuf:         f32[B, H] the raw target log-probability of each output token, where it
                   sits in `hist`
    length:        int32[B] L
    step:          int32[B] output tokens selected so far (the RNG cursor)
    counts:        int32[B, V] output occurrences (frequency / presence penalties)
    seen:          bool[B, V] ids in prompt or output (repetition penalty)
    done:          bool[B] the row has ended (or its slot is empty): a round leaves it as it is
    paused:        bool[B] the row skips rounds, unchanged (back-pressure, SPEC B1)
    finish:        int32[B] device finish code (RUNNING while live)
    proposed, accepted, target_tokens, iterations: int32[B] counters (SpeculativeOutput)
    dcache:        the draft's KVCache holding s[:-1], or s[:-2] where `lag` (None: lookup)
    lag:           bool[B] the last round accepted all k proposals, so d_k is not in the draft
                   cache yet (None: lookup)
    grammar_state: int32[B] automaton state after s (-1 = unconstrained), or None
    grammar:       constraints.GrammarTables shared by all rows, or None
    research:      research.ResearchState (prompt_length and custom processor states; its ids
                   are None: the context is built from `hist`), or None
    """

    rows: RowParams
    tcache: Any
    hist: Array
    lpbuf: Array
    length: Array
    step: Array
    counts: Array
    seen: Array
    done: Array
    paused: Array
    finish: Array
    proposed: Array
    accepted: Array
    target_tokens: Array
    iterations: Array
    dcache: Optional[Any] = None
    lag: Optional[Array] = None
    grammar_state: Optional[Array] = None
    grammar: Optional[Any] = None
    research: Optional[Any] = None


@struct.dataclass
class RoundOutput:
    """What one round decided per row, K = k + 1 candidate positions.

    tokens:   int32[B, K] the emitted tokens in order, -1 past `count`
    count:    int32[B] tokens emitted (1..k+1 for a live row, 0 for a done or paused one)
    finish:   int32[B] the finish code of the last emitted token (RUNNING: the row goes on);
              every earlier token of the round is RUNNING
    accepted: int32[B] how many of them are accepted draft tokens (the rest come from the target)
    logprob:  f32[B, K] the raw target log-probability of each emitted token (before processors)
    top_ids, top_logprobs: int32/f32[B, K, N] the N most likely ids on the same raw scale at each
              position (N = `spec_round`'s top_logprobs, may be 0)
    """

    tokens: Array
    count: Array
    finish: Array
    accepted: Array
    logprob: Array
    top_ids: Array
    top_logprobs: Array


def spec_round(target: DecoderModel, tparams: Any, draft: Optional[DecoderModel], dparams: Any,
               k: int, ngrams: tuple, s: SpecState, kv_len: Optional[int] = None,
               top_logprobs: int = 0, num_branches: int = 1,
               research: Optional[research_lib.ResearchConfig] = None
               ) -> tuple[SpecState, RoundOutput]:
    """One verify round over every live row (the module docstring's algorithm): propose k
    tokens (the draft model, or prompt lookup when `draft` is None), verify them in one target
    forward of k + 1 positions, emit 1..k+1 tokens per row, roll back caches and grammar state.

    The body of `speculative_generate`'s `lax.while_loop` and, jitted, one engine step
    (`jaxdecode.speculative_engine`): one loop body, two drivers. `kv_len` (static) bounds
    attention to the first kv_len cache positions, as in `decode.decode_step`; the caller
    guarantees every live row's L + k stays below it. `top_logprobs` (static): how many raw
    top log-probabilities to report per position. `num_branches` (static): draft continuations
    per row verified together (the module docstring); above 1 every live row must be greedy
    (`speculative_generate` and the engine check it). `research` (static): custom processors
    on the target's distribution (the module docstring)."""
    rows = s.rows
    nb = num_branches
    b, v = s.counts.shape
    greedy = rows.temperature == 0
    max_len = s.tcache.max_len
    gtables = s.grammar
    constrained = gtables is not None   # static: some row has a response_format
    live = ~s.done & ~s.paused
    length, step = s.length, s.step

    def extra(model):
        return {"kv_len": kv_len} if kv_len is not None and decode.accepts_kv_len(
            type(model)) else {}

    def process_one(lg, counts, seen, at_step, g):
        return processors.process(lg, rows, counts, seen, at_step,
                                  (gtables, g) if constrained else None)

    process_each = jax.vmap(process_one, in_axes=(1, 1, 1, 1, 1 if constrained else None),
                            out_axes=1)
    custom = research is not None and bool(research.processors)  # static

    def process_run(tlogits, counts_all, seen_all, steps_all, path, d):
        """Custom processors: position i of the run sees s + d_1 .. d_i; each row's states
        are threaded through the positions. Returns p [B, k+1, V] and the states after each
        position (leaves [k+1, B, ...])."""
        hist_d = s.hist.at[jnp.arange(b)[:, None], length[:, None] + jnp.arange(k)].set(
            d, mode="drop")
        cols = jnp.arange(s.hist.shape[1])[None, :]

        def one(states, i):
            ctx = research_lib.ProcessorContext(
                step=step + i, ids=jnp.where(cols < (length + i)[:, None], hist_d, -1),
                length=length + i, prompt_length=s.research.prompt_length,
                counts=counts_all[:, i], key=research_lib.processor_keys(rows.keys, step + i + 1),
                live=live)
            bound = research_lib.Bound(research.processors, ctx, states)
            lp = processors.process(tlogits[:, i], rows, counts_all[:, i], seen_all[:, i],
                                    steps_all[:, i], (gtables, path[:, i]) if constrained
                                    else None, bound)
            return tuple(bound.states), (lp, tuple(bound.states))

        _, (lp, states) = jax.lax.scan(one, s.research.states, jnp.arange(k + 1))
        return jnp.moveaxis(lp, 0, 1), states

    def branched(fn):
        """fn over one branch; with several, vmapped over the leading branch axis of its
        arguments (what it closes over -- the caches, the rows -- is shared, in_axes None)."""
        return jax.vmap(fn) if nb > 1 else fn

    def propose_with_model():
        hist, lag = s.hist, s.lag & live
        last = jnp.take_along_axis(hist, (length - 1)[:, None], 1)[:, 0]
        before = jnp.take_along_axis(hist, jnp.maximum(length - 2, 0)[:, None], 1)[:, 0]
        toks = jnp.where(lag[:, None], jnp.stack([before, last], 1),
                         jnp.stack([last, jnp.zeros_like(last)], 1))
        pos = (length - 1 - lag)[:, None] + jnp.arange(2)[None, :]
        n_in = jnp.where(live, 1 + lag, 0).astype(jnp.int32)
        logits, dcache = draft.forward(dparams, toks, pos, s.dcache, lengths=n_in, **extra(draft))
        logit = jnp.take_along_axis(logits, jnp.maximum(n_in - 1, 0)[:, None, None], 1)[:, 0]
        # the draft proposes under the grammar mask, with its own copy of the state
        lq_1 = process_one(logit.astype(jnp.float32), s.counts, s.seen, step, s.grammar_state)
        if nb == 1:
            d_1 = _select(lq_1, rows, live, step + 1, DRAFT)
        else:  # greedy rows only: branch b starts with the draft's b-th most likely token
            d_1 = jax.lax.top_k(lq_1, nb)[1].T.astype(jnp.int32)         # [nb, B]

        def advance(d, counts, seen, g):
            counts = counts.at[jnp.arange(b), d].add(live.astype(jnp.int32))
            seen = seen.at[jnp.arange(b), d].max(live)
            return counts, seen, constraints.next_state(gtables, g, d) if constrained else g

        def draft_step(carry, i):  # write d_i, propose d_{i+1}
            d, counts, seen, g, dcache = carry
            logits, dcache = draft.forward(dparams, d[:, None], (length + i - 1)[:, None],
                                           dcache, lengths=live.astype(jnp.int32),
                                           **extra(draft))
            lq = process_one(logits[:, 0].astype(jnp.float32), counts, seen, step + i, g)
            d = _select(lq, rows, live, step + i + 1, DRAFT)
            return (d, *advance(d, counts, seen, g), dcache), (d, lq)

        def continue_branch(d_1):  # d_2 .. d_k after d_1, the draft cache shared on entry
            carry = (d_1, *advance(d_1, s.counts, s.seen, s.grammar_state), dcache)
            carry, (ds, lqs) = jax.lax.scan(draft_step, carry, jnp.arange(1, k, dtype=jnp.int32))
            d = jnp.concatenate([d_1[:, None], ds.T.reshape(b, k - 1)], 1)
            lq = jnp.concatenate([lq_1[:, None], lqs.transpose(1, 0, 2).reshape(b, k - 1, v)], 1)
            return d, lq, carry[-1]

        return branched(continue_branch)(d_1)

    if draft is None:
        d = _lookup(s.hist, length, k, ngrams, nb)
        d, lq, dcache = d[0] if nb == 1 else d, None, None
    else:
        d, lq, dcache = propose_with_model()

    last = jnp.take_along_axis(s.hist, (length - 1)[:, None], 1)[:, 0]

    def verify(d):
        """One branch: the target forward of [s[-1], d_1 .. d_k] (writing its k + 1 positions)
        and the processed p_1 .. p_{k+1}, with counts advanced through the proposed run."""
        toks = jnp.concatenate([last[:, None], d], 1)
        pos = (length - 1)[:, None] + jnp.arange(k + 1)[None, :]
        tlogits, tcache = target.forward(tparams, toks, pos, s.tcache,
                                         lengths=jnp.where(live, k + 1, 0).astype(jnp.int32),
                                         **extra(target))
        tlogits = tlogits.astype(jnp.float32)
        onehot = jax.nn.one_hot(d, v, dtype=jnp.int32)
        before = jnp.concatenate([jnp.zeros((b, 1, v), jnp.int32), jnp.cumsum(onehot, 1)], 1)
        counts_all = s.counts[:, None] + before
        seen_all = s.seen[:, None] | (before > 0)
        steps_all = step[:, None] + jnp.arange(k + 1)[None, :]
        # grammar: position i is masked with the state after d_1 .. d_{i-1}
        path = constraints.state_path(gtables, s.grammar_state, d) if constrained else None
        if custom:
            lp, states = process_run(tlogits, counts_all, seen_all, steps_all, path, d)
        else:
            lp, states = process_each(tlogits, counts_all, seen_all, steps_all, path), None
        return tlogits, tcache, lp, path, jnp.argmax(lp, -1).astype(jnp.int32), states

    tlogits, tcache, lp, path, best, states = branched(verify)(d)
    if nb > 1:  # greedy: the branch with the longest accepted run (ties: the lowest b)
        runs = jnp.sum(jnp.cumprod((d == best[..., :k]).astype(jnp.int32), -1), -1)  # [nb, B]
        chosen = jnp.argmax(runs, 0)
        d, lq, tlogits, lp, path, best = jax.tree.map(
            lambda x: _pick(x, chosen), (d, lq, tlogits, lp, path, best))
        states = jax.tree.map(lambda x: _pick(x, chosen, 1), states)
        tcache = _pick_cache(tcache, chosen)
        dcache = None if dcache is None else _pick_cache(dcache, chosen)

    if lq is None:  # prompt lookup: q = one-hot
        lq_d = jnp.zeros((b, k), jnp.float32)
        q_at = lambda j: jax.nn.one_hot(jnp.take_along_axis(  # noqa: E731
            jnp.pad(d, ((0, 0), (0, 1)), constant_values=v), j[:, None], 1)[:, 0], v)
    else:
        lq_d = jnp.take_along_axis(lq, d[:, :, None], 2)[:, :, 0]
        q_at = lambda j: jnp.exp(jnp.take_along_axis(  # noqa: E731
            jnp.pad(lq, ((0, 0), (0, 1), (0, 0)), constant_values=-jnp.inf),
            j[:, None, None], 1)[:, 0])

    # accept / reject
    lp_d = jnp.take_along_axis(lp[:, :k], d[:, :, None], 2)[:, :, 0]
    t_idx = step[:, None] + jnp.arange(1, k + 1)[None, :]
    u = _accept_uniforms(rows, live, t_idx)                                    # [B, k]
    ratio = jnp.exp(jnp.minimum(lp_d - lq_d, 0.0))
    ok = jnp.where(greedy[:, None], d == best[:, :k], (u < ratio) & jnp.isfinite(lq_d))
    j = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1)     # accepted, 0..k

    # the token at position j + 1: residual (j < k) or bonus (j == k) from the target
    best_j = jnp.take_along_axis(best, j[:, None], 1)[:, 0]

    def resample(_):
        p_log = jnp.take_along_axis(lp, j[:, None, None], 1)[:, 0]
        resid = jnp.maximum(jnp.exp(p_log) - q_at(j), 0.0)
        resid_log = jnp.where(jnp.sum(resid, -1, keepdims=True) > 0, jnp.log(resid), p_log)
        drawn = jax.vmap(sampling.inverse_cdf)(_keys(rows, step + j + 1, RESAMPLE), resid_log)
        return jnp.where(greedy, best_j, drawn.astype(jnp.int32))

    corr = jax.lax.cond(_all_greedy(rows, live), lambda _: best_j, resample, None)
    i0 = jnp.arange(k + 1)[None, :]
    emit = jnp.where(i0 < j[:, None], jnp.pad(d, ((0, 0), (0, 1))), corr[:, None])

    # device stops on every candidate token, in decode.finish_codes' priority
    all_masked = jnp.all(jnp.isneginf(lp), -1)
    grammar = []
    if constrained:  # decode.finish_codes' grammar conditions, per position
        g_next = constraints.next_state(gtables, path.reshape(-1),
                                        emit.reshape(-1)).reshape(b, k + 1)
        bound = path >= 0
        grammar = [(GRAMMAR_DEAD_END, bound & all_masked),
                   (GRAMMAR_DEAD_END, bound & (g_next == constraints.DEAD)),
                   (GRAMMAR_COMPLETE, constraints.completes(
                       gtables, g_next.reshape(-1)).reshape(b, k + 1))]
    conds = [(MODEL_ERROR, jnp.any(jnp.isnan(tlogits), -1)),
             *grammar[:1],
             (ALL_MASKED, all_masked),
             (EOS, jnp.take_along_axis(rows.eos_mask, emit, axis=1)),
             (STOP_TOKEN, jnp.take_along_axis(rows.stop_mask, emit, axis=1)),
             *grammar[1:],
             (MAX_TOKENS, step[:, None] + i0 + 1 >= rows.max_tokens[:, None]),
             (CONTEXT_LIMIT, length[:, None] + i0 >= max_len - 1)]
    code = jnp.full((b, k + 1), RUNNING, jnp.int32)
    for value, cond in reversed(conds):
        code = jnp.where(cond, value, code)
    code = jnp.where(i0 <= j[:, None], code, RUNNING)
    stops = code != RUNNING
    first = jnp.argmax(stops, axis=1)
    ended = jnp.any(stops, axis=1) & live
    n_emit = jnp.where(ended, first + 1, j + 1)
    n_emit = jnp.where(live, n_emit, 0)
    finish = jnp.where(ended, jnp.take_along_axis(code, first[:, None], 1)[:, 0], RUNNING)

    # commit the emitted tokens; roll back caches by lengths
    emitted = i0 < n_emit[:, None]
    h = s.hist.shape[1]
    where_to = jnp.where(emitted, length[:, None] + i0, h)
    hist = s.hist.at[jnp.arange(b)[:, None], where_to].set(emit, mode="drop")
    raw_all = numerics.log_softmax(tlogits)
    raw = jnp.take_along_axis(raw_all, emit[:, :, None], 2)[..., 0]
    lpbuf = s.lpbuf.at[jnp.arange(b)[:, None], where_to].set(raw, mode="drop")
    add = jnp.sum(jax.nn.one_hot(emit, v, dtype=jnp.int32) * emitted[:, :, None], 1)
    new_length = length + n_emit
    accepted = jnp.minimum(j, n_emit)
    tcache = tcache.replace(lengths=jnp.where(live, new_length - 1, s.tcache.lengths))
    out = s.replace(hist=hist, lpbuf=lpbuf, length=new_length, step=step + n_emit,
                    counts=s.counts + add, seen=s.seen | (add > 0), tcache=tcache,
                    done=s.done | ended, finish=jnp.where(ended, finish, s.finish),
                    proposed=s.proposed + k * nb * live, accepted=s.accepted + accepted,
                    target_tokens=s.target_tokens + (live & (n_emit == j + 1)),
                    iterations=s.iterations + live)
    if custom:  # the states after the last emitted token; rejected positions' are dropped
        last = jnp.maximum(n_emit - 1, 0)
        kept = jax.tree.map(lambda x: x[last, jnp.arange(b)], states)
        out = out.replace(research=s.research.replace(
            states=research_lib.where_rows(n_emit > 0, kept, s.research.states)))
    if constrained:  # the state after the last emitted token; ended rows keep theirs
        after = jnp.take_along_axis(g_next, jnp.maximum(n_emit - 1, 0)[:, None], 1)[:, 0]
        out = out.replace(grammar_state=jnp.where(live & ~ended, after, s.grammar_state))
    if dcache is not None:
        lag = live & (n_emit == k + 1)
        dlen = jnp.where(lag, length + k - 1, new_length - 1)
        out = out.replace(dcache=dcache.replace(lengths=jnp.where(live, dlen, s.dcache.lengths)),
                          lag=jnp.where(live, lag, s.lag))
    top_lp, top_ids = jax.lax.top_k(raw_all, top_logprobs)
    report = RoundOutput(tokens=jnp.where(emitted, emit, -1), count=n_emit, finish=finish,
                         accepted=accepted, logprob=raw, top_ids=top_ids.astype(jnp.int32),
                         top_logprobs=top_lp)
    return out, report


@functools.partial(jax.jit, static_argnums=(0, 2, 4, 5, 8, 9))
def _spec_loop(target, tparams, draft, dparams, k: int, ngrams: tuple, init: SpecState,
               max_iters: Array, num_branches: int, research=None) -> SpecState:
    """The while-loop driver of `spec_round`: rounds until every row is done (or max_iters).
    The grammar tables are loop constants, outside the carry."""
    tables = init.grammar

    def body(carry):
        it, s = carry
        s, _ = spec_round(target, tparams, draft, dparams, k, ngrams, s.replace(grammar=tables),
                          num_branches=num_branches, research=research)
        return it + 1, s.replace(grammar=None)

    _, out = jax.lax.while_loop(lambda c: ~jnp.all(c[1].done) & (c[0] < max_iters), body,
                                (jnp.int32(0), init.replace(grammar=None)))
    return out


def check_num_branches(num_branches: Any, vocab_size: int, field: str = "num_branches") -> None:
    """ValueError naming `field` unless 1 <= num_branches <= vocab_size (an integer)."""
    if (isinstance(num_branches, bool) or not isinstance(num_branches, int)
            or not 1 <= num_branches <= vocab_size):
        raise ValueError(f"{field}: must be an integer in [1, {vocab_size}] (the vocabulary), "
                         f"got {num_branches!r}")


def check_branches_greedy(num_branches: int, sp: SamplingParams) -> None:
    """ValueError naming num_branches for a sampled row (temperature > 0) with several branches:
    min(1, p/q) is exact for one proposal per position; several need a multi-draft rule."""
    if num_branches > 1 and sp.temperature > 0:
        raise ValueError(f"num_branches: {num_branches} branches need greedy rows "
                         f"(temperature 0), got temperature {sp.temperature}; the min(1, p/q) "
                         f"acceptance is exact for one draft only (several need a multi-draft "
                         f"rule such as SpecInfer's recursive rejection sampling)")


def speculative_generate(target: DecoderModel, target_params: Any,
                         draft: Union[DecoderModel, str], draft_params: Any,
                         prompt_ids: Sequence[Sequence[int]],
                         sampling: SamplingParams | Sequence[SamplingParams], *, k: int = 4,
                         key: Optional[Array] = None, num_branches: int = 1,
                         ngram_max: int = 3, ngram_min: int = 1,
                         tokenizer: Any = None, processors: Sequence[Any] = ()
                         ) -> SpeculativeOutput:
    """Speculative decoding (DESIGN.md `jd.speculative_generate`); see the module docstring.

    draft: a DecoderModel with the target's vocabulary, or "prompt_lookup" (draft_params is then
    ignored). Each row's length comes from its max_tokens, its randomness from its seed (`key`
    serves rows with seed=None, as in `generate`); `n > 1` gives n adjacent rows as in
    `generate`; `tokenizer` is needed when a row has a response_format (as in `generate`).
    `num_branches` > 1: that many draft continuations per row verified together, greedy rows
    only (a sampled row raises ValueError; the module docstring's Branches section).
    `processors`: custom jd.LogitProcessor applied to the target's distribution (the module
    docstring); their final states come back in `processor_states`.
    Returns a SpeculativeOutput (GenerateOutput + `stats`)."""
    prompt_ids = token_rows(prompt_ids)
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k: must be an integer >= 1, got {k!r}")
    check_num_branches(num_branches, target.config.vocab_size)
    lookup = isinstance(draft, str)
    if lookup and draft != PROMPT_LOOKUP:
        raise ValueError(f"draft: a DecoderModel or {PROMPT_LOOKUP!r}, got {draft!r}")
    if not lookup and draft.config.vocab_size != target.config.vocab_size:
        raise ValueError(f"draft: vocabulary {draft.config.vocab_size} differs from the "
                         f"target's {target.config.vocab_size}")
    if not 1 <= ngram_min <= ngram_max:
        raise ValueError(f"ngram_min: must satisfy 1 <= ngram_min <= ngram_max, "
                         f"got {ngram_min}, {ngram_max}")
    rows_in = [sampling] * len(prompt_ids) if isinstance(sampling, SamplingParams) else list(sampling)
    for sp in rows_in:
        if isinstance(sp, SamplingParams):  # decode.prepare names any other bad value
            check_branches_greedy(num_branches, sp)
    setup = research_lib.configure(target, processors=processors)
    state, rows_sp, n = decode.prepare(target, target_params, prompt_ids, sampling, None, key,
                                       tokenizer=tokenizer, research=setup)
    b = len(rows_sp)
    index = np.repeat(np.arange(len(rows_in)), [s.n for s in rows_in]) if rows_in else None
    prompts = [list(prompt_ids[i]) for i in index]
    plen = np.array([len(p) for p in prompts], np.int32)
    cache_len = state.cache.max_len
    hist_len = bucket(int(plen.max()) + n)
    hist = np.zeros((b, hist_len), np.int32)
    for r, p in enumerate(prompts):
        hist[r, : len(p)] = p
    tcache = state.cache.replace(lengths=state.cache.lengths - 1)   # s[-1] is pending
    zeros = jnp.zeros((b,), jnp.int32)
    init = SpecState(rows=state.rows, tcache=tcache, hist=jnp.asarray(hist),
                     lpbuf=jnp.zeros((b, hist_len), jnp.float32), length=jnp.asarray(plen),
                     step=zeros, counts=state.counts, seen=state.seen,
                     done=jnp.zeros((b,), bool), paused=jnp.zeros((b,), bool), finish=zeros,
                     proposed=zeros, accepted=zeros, target_tokens=zeros, iterations=zeros,
                     grammar_state=state.grammar_state, grammar=state.grammar,
                     research=None if setup is None else state.research.replace(ids=None))
    if not lookup:  # each prompt alone at its own bucket, as the target's (decode.prepare)
        uniq = [list(p) for p in prompt_ids]
        dummy = RowParams.build([SamplingParams()] * len(uniq), draft.config.vocab_size)
        dcache = decode.stack_rows(decode.prefill_rows(draft, draft_params, uniq, dummy,
                                                       cache_len)).cache
        dcache = dcache.replace(k=jnp.take(dcache.k, index, axis=1),
                                v=jnp.take(dcache.v, index, axis=1),
                                lengths=jnp.take(dcache.lengths, index) - 1)
        init = init.replace(dcache=dcache, lag=jnp.zeros((b,), bool))
    ngrams = tuple(range(ngram_max, ngram_min - 1, -1))
    c = _spec_loop(target, target_params, None if lookup else draft,
                   None if lookup else draft_params, k, ngrams, decode.pad_rows(init, b),
                   jnp.int32(n + 1), num_branches, None if setup is None else setup.config)

    finish = np.asarray(c.finish)[:b]
    step = np.asarray(c.step)[:b]
    failed = np.isin(finish, FAILED_CODES)
    lengths = np.where(failed, step - 1, step).astype(np.int32)
    hist_out, lp_out = np.asarray(c.hist)[:b], np.asarray(c.lpbuf)[:b]
    token_ids = np.full((b, n), -1, np.int32)
    logprobs = np.zeros((b, n), np.float32)
    for r in range(b):
        m, ln = int(plen[r]), int(lengths[r])
        token_ids[r, :ln] = hist_out[r, m: m + ln]
        logprobs[r, :ln] = lp_out[r, m: m + ln]
    stats = {name: np.asarray(getattr(c, name))[:b].astype(np.int64)
             for name in ("proposed", "accepted", "target_tokens", "iterations")}
    stats["mean_accepted_length"] = float(
        (stats["accepted"].sum() + stats["target_tokens"].sum()) / max(1, stats["iterations"].sum()))
    custom = {} if setup is None else dict(
        processor_order=setup.processor_order,
        processor_states=research_lib.final_states(
            setup.config, jax.tree.map(lambda x: x[:b], c.research.states)))
    return SpeculativeOutput(
        token_ids=token_ids, lengths=lengths,
        finish_reasons=[FINISH_REASONS[int(x)] for x in finish],
        errors=[ERRORS.get(int(x)) for x in finish], logprobs=logprobs, stats=stats, **custom)
