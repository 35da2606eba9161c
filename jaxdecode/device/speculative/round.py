"""One speculative round (the package docstring): propose, verify, pick a branch, accept,
stop, commit. The body of `speculative_generate`'s while loop and, jitted, one engine step."""

from __future__ import annotations

from typing import Any, Optional

import jax
import jax.numpy as jnp

from jaxdecode.device import cache_ops, constraints, numerics, stops
from jaxdecode.device import research as research_lib
from jaxdecode.device.speculative import propose
from jaxdecode.device.speculative.state import RoundConfig, RoundOutput, SpecState
from jaxdecode.device.speculative.verify import Verified, accept, verify
from jaxdecode.device.state import RUNNING

Array = jax.Array


def _choose_branch(d: Array, lq: Optional[Array], v: Verified, dcache: Any):
    """Greedy branches: each row takes the branch with the longest accepted run (ties: the
    lowest index, so one branch is the plain round); its caches are picked by a gather."""
    runs = jnp.sum(jnp.cumprod((d == v.best[..., :d.shape[-1]]).astype(jnp.int32), -1), -1)
    chosen = jnp.argmax(runs, 0)                                                  # [B]
    d, lq = cache_ops.pick_branch((d, lq), chosen)
    states = None if v.states is None else cache_ops.pick_branch(v.states, chosen, axis=1)
    v = cache_ops.pick_branch(v.replace(states=None), chosen).replace(states=states)
    return d, lq, v, None if dcache is None else cache_ops.pick_branch(dcache, chosen)


def _stop(config: RoundConfig, s: SpecState, live: Array, emit: Array, j: Array, v: Verified):
    """The device stops of `stops.finish_codes` on every candidate up to position j: the first
    one that ends the row ends the run. Returns (tokens emitted n_emit int32[B], finish
    int32[B], ended bool[B], grammar state after each candidate or None)."""
    g_next = None
    grammar = None
    if s.grammar is not None:
        g_next = constraints.next_state(s.grammar, v.path.reshape(-1),
                                        emit.reshape(-1)).reshape(emit.shape)
        grammar = (s.grammar, v.path, g_next)
    code = stops.finish_codes(s.rows, emit, nan=jnp.any(jnp.isnan(v.tlogits), -1),
                              logprobs=v.lp, step=s.step, length=s.length,
                              max_len=s.tcache.max_len, grammar=grammar)
    code = jnp.where(jnp.arange(config.k + 1)[None, :] <= j[:, None], code, RUNNING)
    first = jnp.argmax(code != RUNNING, axis=1)
    ended = jnp.any(code != RUNNING, axis=1) & live
    n_emit = jnp.where(live, jnp.where(ended, first + 1, j + 1), 0)
    finish = jnp.where(ended, jnp.take_along_axis(code, first[:, None], 1)[:, 0], RUNNING)
    return n_emit, finish, ended, g_next


def _commit(config: RoundConfig, s: SpecState, live: Array, emit: Array, j: Array,
            v: Verified, dcache: Any, stopped: tuple) -> tuple[SpecState, RoundOutput]:
    """Append the emitted tokens, advance counts and counters, roll the caches back by their
    lengths (and the grammar and processor states to the last emitted token)."""
    n_emit, finish, ended, g_next = stopped
    k, b, v_size = config.k, emit.shape[0], s.counts.shape[1]
    length = s.length
    i0 = jnp.arange(k + 1)[None, :]
    emitted = i0 < n_emit[:, None]
    where_to = jnp.where(emitted, length[:, None] + i0, s.hist.shape[1])
    raw_all = numerics.log_softmax(v.tlogits)
    raw = jnp.take_along_axis(raw_all, emit[:, :, None], 2)[..., 0]
    add = jnp.sum(jax.nn.one_hot(emit, v_size, dtype=jnp.int32) * emitted[:, :, None], 1)
    new_length, accepted = length + n_emit, jnp.minimum(j, n_emit)
    rows = jnp.arange(b)[:, None]
    out = s.replace(
        hist=s.hist.at[rows, where_to].set(emit, mode="drop"),
        lpbuf=s.lpbuf.at[rows, where_to].set(raw, mode="drop"), length=new_length,
        step=s.step + n_emit, counts=s.counts + add, seen=s.seen | (add > 0),
        tcache=v.tcache.replace(lengths=jnp.where(live, new_length - 1, s.tcache.lengths)),
        done=s.done | ended, finish=jnp.where(ended, finish, s.finish),
        proposed=s.proposed + k * config.num_branches * live, accepted=s.accepted + accepted,
        target_tokens=s.target_tokens + (live & (n_emit == j + 1)),
        iterations=s.iterations + live)
    last = jnp.maximum(n_emit - 1, 0)
    if config.custom:  # the states after the last emitted token; rejected positions' dropped
        kept = jax.tree.map(lambda x: x[last, jnp.arange(b)], v.states)
        out = out.replace(research=s.research.replace(
            states=research_lib.where_rows(n_emit > 0, kept, s.research.states)))
    if g_next is not None:  # the state after the last emitted token; ended rows keep theirs
        after = jnp.take_along_axis(g_next, last[:, None], 1)[:, 0]
        out = out.replace(grammar_state=jnp.where(live & ~ended, after, s.grammar_state))
    if dcache is not None:
        lag = live & (n_emit == k + 1)
        dlen = jnp.where(lag, length + k - 1, new_length - 1)
        out = out.replace(dcache=dcache.replace(lengths=jnp.where(live, dlen, s.dcache.lengths)),
                          lag=jnp.where(live, lag, s.lag))
    top_lp, top_ids = jax.lax.top_k(raw_all, config.top_logprobs)
    return out, RoundOutput(tokens=jnp.where(emitted, emit, -1), count=n_emit, finish=finish,
                            accepted=accepted, logprob=raw, top_ids=top_ids.astype(jnp.int32),
                            top_logprobs=top_lp)


def spec_round(config: RoundConfig, tparams: Any, dparams: Any,
               s: SpecState) -> tuple[SpecState, RoundOutput]:
    """One verify round over every live row: propose k tokens (the draft model, or prompt
    lookup when `config.draft` is None), verify them in one target forward of k + 1
    positions, emit 1..k+1 tokens per row, roll back caches and grammar state.

    `config.kv_len` bounds attention to the first kv_len cache positions, as in
    `decode.decode_step`; the caller guarantees every live row's L + k stays below it.
    With `num_branches` above 1 every live row must be greedy (`speculative_generate` and the
    engine check it)."""
    live = s.live
    nb = config.num_branches
    if config.draft is None:
        d = propose.lookup(s.hist, s.length, config.k, config.ngrams, nb)
        d, lq, dcache = (d[0] if nb == 1 else d), None, None
    else:
        d, lq, dcache = propose.with_draft(config, dparams, s, live)
    v = verify(config, tparams, s, live, d)
    if nb > 1:
        d, lq, v, dcache = _choose_branch(d, lq, v, dcache)
    j, emit = accept(config, s, live, d, lq, v)
    return _commit(config, s, live, emit, j, v, dcache, _stop(config, s, live, emit, j, v))
