"""Proposals of a speculative round: k tokens per row (and branch) from prompt lookup or a
draft model (the package docstring's "Draft kinds" and "Branches")."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jaxdecode.device import constraints
from jaxdecode.device.decode import kv_len_keyword
from jaxdecode.device.speculative.state import DRAFT, RoundConfig, SpecState, branched
from jaxdecode.device.speculative.state import process, select

Array = jax.Array


def lookup(hist: Array, length: Array, k: int, ngrams: tuple, branches: int = 1) -> Array:
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


def _first_draft_logits(config: RoundConfig, dparams: Any, s: SpecState, live: Array):
    """The draft's catch-up forward: it writes s[-1] (and s[-2] where it lags) and returns the
    logits that propose d_1, with its cache."""
    length, lag = s.length, s.lag & live
    last = jnp.take_along_axis(s.hist, (length - 1)[:, None], 1)[:, 0]
    before = jnp.take_along_axis(s.hist, jnp.maximum(length - 2, 0)[:, None], 1)[:, 0]
    toks = jnp.where(lag[:, None], jnp.stack([before, last], 1),
                     jnp.stack([last, jnp.zeros_like(last)], 1))
    pos = (length - 1 - lag)[:, None] + jnp.arange(2)[None, :]
    n_in = jnp.where(live, 1 + lag, 0).astype(jnp.int32)
    logits, dcache = config.draft.forward(dparams, toks, pos, s.dcache, lengths=n_in,
                                          **kv_len_keyword(config.draft, config.kv_len))
    return jnp.take_along_axis(logits, jnp.maximum(n_in - 1, 0)[:, None, None], 1)[:, 0], dcache


def with_draft(config: RoundConfig, dparams: Any, s: SpecState, live: Array):
    """Draft-model proposals under the grammar mask (with its own copy of each row's state):
    d int32[B, k], their processed draft log-probabilities lq f32[B, k, V] and the draft cache
    after writing d_1 .. d_{k-1} -- each with a leading branch axis when num_branches > 1."""
    k, nb, draft = config.k, config.num_branches, config.draft
    b, v = s.counts.shape
    rows, tables, step, length = s.rows, s.grammar, s.step, s.length
    logit, dcache = _first_draft_logits(config, dparams, s, live)
    lq_1 = process(s, logit, s.counts, s.seen, step, s.grammar_state)
    if nb == 1:
        d_1 = select(lq_1, rows, live, step + 1, DRAFT)
    else:  # greedy rows only: branch b starts with the draft's b-th most likely token
        d_1 = jax.lax.top_k(lq_1, nb)[1].T.astype(jnp.int32)         # [nb, B]

    def advance(d, counts, seen, g):
        counts = counts.at[jnp.arange(b), d].add(live.astype(jnp.int32))
        seen = seen.at[jnp.arange(b), d].max(live)
        return counts, seen, g if tables is None else constraints.next_state(tables, g, d)

    def draft_step(carry, i):  # write d_i, propose d_{i+1}
        d, counts, seen, g, cache = carry
        logits, cache = draft.forward(dparams, d[:, None], (length + i - 1)[:, None], cache,
                                      lengths=live.astype(jnp.int32),
                                      **kv_len_keyword(draft, config.kv_len))
        lq = process(s, logits[:, 0], counts, seen, step + i, g)
        d = select(lq, rows, live, step + i + 1, DRAFT)
        return (d, *advance(d, counts, seen, g), cache), (d, lq)

    def continue_branch(d_1):  # d_2 .. d_k after d_1, the draft cache shared on entry
        carry = (d_1, *advance(d_1, s.counts, s.seen, s.grammar_state), dcache)
        carry, (ds, lqs) = jax.lax.scan(draft_step, carry, jnp.arange(1, k, dtype=jnp.int32))
        d = jnp.concatenate([d_1[:, None], ds.T.reshape(b, k - 1)], 1)
        lq = jnp.concatenate([lq_1[:, None], lqs.transpose(1, 0, 2).reshape(b, k - 1, v)], 1)
        return d, lq, carry[-1]

    return branched(continue_branch, nb)(d_1)
