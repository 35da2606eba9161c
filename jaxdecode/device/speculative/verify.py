"""Verification of a speculative round: the target's forward over [s[-1], d_1 .. d_k], its
processed distributions p_1 .. p_{k+1}, and the acceptance test (the package docstring's
"Verification")."""

from __future__ import annotations

from typing import Any, Optional

import jax
import jax.numpy as jnp
from flax import struct

from jaxdecode.device import constraints, sampling
from jaxdecode.device import research as research_lib
from jaxdecode.device.decode import adapter_keyword, kv_len_keyword
from jaxdecode.device.speculative.state import (ACCEPT, RESAMPLE, RoundConfig, SpecState,
                                                all_greedy, branched, keys, process)

Array = jax.Array


@struct.dataclass
class Verified:
    """One branch's verification (a leading branch axis on every leaf when there are several):
    tlogits f32[B, k+1, V] raw target logits; tcache the target cache with the k + 1 positions
    written; lp f32[B, k+1, V] processed log-probabilities; path int32[B, k+1] the grammar state
    before each position (None: unconstrained); best int32[B, k+1] argmax of lp; states: the
    custom processors' states after each position (leaves [k+1, B, ...]), or None."""

    tlogits: Array
    tcache: Any
    lp: Array
    path: Optional[Array]
    best: Array
    states: Any = None


def _process_run(config: RoundConfig, s: SpecState, live: Array, tlogits: Array, counts: Array,
                 seen: Array, steps: Array, path: Optional[Array], d: Array):
    """Custom processors: position i of the run sees s + d_1 .. d_i; each row's states are
    threaded through the positions (a scan). Returns p [B, k+1, V] and the states after each
    position (leaves [k+1, B, ...])."""
    k, b, length, step = config.k, s.counts.shape[0], s.length, s.step
    hist_d = s.hist.at[jnp.arange(b)[:, None], length[:, None] + jnp.arange(k)].set(
        d, mode="drop")
    cols = jnp.arange(s.hist.shape[1])[None, :]

    def one(states, i):
        ctx = research_lib.ProcessorContext(
            step=step + i, ids=jnp.where(cols < (length + i)[:, None], hist_d, -1),
            length=length + i, prompt_length=s.research.prompt_length, counts=counts[:, i],
            key=research_lib.processor_keys(s.rows.keys, step + i + 1), live=live)
        bound = research_lib.Bound(config.research.processors, ctx, states)
        lp = process(s, tlogits[:, i], counts[:, i], seen[:, i], steps[:, i],
                     None if path is None else path[:, i], bound)
        return tuple(bound.states), (lp, tuple(bound.states))

    _, (lp, states) = jax.lax.scan(one, s.research.states, jnp.arange(k + 1))
    return jnp.moveaxis(lp, 0, 1), states


def verify(config: RoundConfig, tparams: Any, s: SpecState, live: Array, d: Array) -> Verified:
    """The target forward of [s[-1], d_1 .. d_k] (writing its k + 1 positions) and p_1 ..
    p_{k+1}, each evaluated with the penalty counts, step and grammar state of its own position
    (counts advanced through the proposed run); d carries a branch axis when there are
    several, and the forward is then vmapped over it with the cache shared. Each row's LoRA
    adapter (`rows.adapter`, contract R6) applies to the target; the draft has none."""
    k, v = config.k, s.counts.shape[1]
    last = jnp.take_along_axis(s.hist, (s.length - 1)[:, None], 1)[:, 0]
    process_each = jax.vmap(lambda lg, c, sn, st, g: process(s, lg, c, sn, st, g),
                            in_axes=(1, 1, 1, 1, None if s.grammar is None else 1), out_axes=1)

    def one_branch(d):
        toks = jnp.concatenate([last[:, None], d], 1)
        pos = (s.length - 1)[:, None] + jnp.arange(k + 1)[None, :]
        tlogits, tcache = config.target.forward(
            tparams, toks, pos, s.tcache, lengths=jnp.where(live, k + 1, 0).astype(jnp.int32),
            **kv_len_keyword(config.target, config.kv_len),
            **adapter_keyword(config.target, s.rows.adapter))
        tlogits = tlogits.astype(jnp.float32)
        before = jnp.concatenate([jnp.zeros((d.shape[0], 1, v), jnp.int32),
                                  jnp.cumsum(jax.nn.one_hot(d, v, dtype=jnp.int32), 1)], 1)
        counts = s.counts[:, None] + before
        seen = s.seen[:, None] | (before > 0)
        steps = s.step[:, None] + jnp.arange(k + 1)[None, :]
        # grammar: position i is masked with the state after d_1 .. d_{i-1}
        path = (None if s.grammar is None
                else constraints.state_path(s.grammar, s.grammar_state, d))
        if config.custom:
            lp, states = _process_run(config, s, live, tlogits, counts, seen, steps, path, d)
        else:
            lp, states = process_each(tlogits, counts, seen, steps, path), None
        return Verified(tlogits, tcache, lp, path, jnp.argmax(lp, -1).astype(jnp.int32),
                        states)

    return branched(one_branch, config.num_branches)(d)


def accept(config: RoundConfig, s: SpecState, live: Array, d: Array, lq: Optional[Array],
           v: Verified) -> tuple[Array, Array]:
    """The acceptance test of d_1 .. d_k and the token at position j + 1 (residual or bonus).
    Returns (j int32[B] accepted draft tokens, emit int32[B, k+1] candidate tokens: d_1 .. d_j,
    then the target's). Prompt lookup (lq None) proposes with q = one-hot."""
    k, rows, step = config.k, s.rows, s.step
    b, v_size = d.shape[0], v.lp.shape[-1]
    greedy = rows.temperature == 0
    if lq is None:
        lq_d = jnp.zeros((b, k), jnp.float32)
        q_at = lambda j: jax.nn.one_hot(jnp.take_along_axis(  # noqa: E731
            jnp.pad(d, ((0, 0), (0, 1)), constant_values=v_size), j[:, None], 1)[:, 0], v_size)
    else:
        lq_d = jnp.take_along_axis(lq, d[:, :, None], 2)[:, :, 0]
        q_at = lambda j: jnp.exp(jnp.take_along_axis(  # noqa: E731
            jnp.pad(lq, ((0, 0), (0, 1), (0, 0)), constant_values=-jnp.inf),
            j[:, None, None], 1)[:, 0])
    lp_d = jnp.take_along_axis(v.lp[:, :k], d[:, :, None], 2)[:, :, 0]
    u = _accept_uniforms(rows, live, step[:, None] + jnp.arange(1, k + 1)[None, :])
    ratio = jnp.exp(jnp.minimum(lp_d - lq_d, 0.0))
    ok = jnp.where(greedy[:, None], d == v.best[:, :k], (u < ratio) & jnp.isfinite(lq_d))
    j = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1)     # accepted, 0..k
    best_j = jnp.take_along_axis(v.best, j[:, None], 1)[:, 0]

    def resample(_):
        p_log = jnp.take_along_axis(v.lp, j[:, None, None], 1)[:, 0]
        resid = jnp.maximum(jnp.exp(p_log) - q_at(j), 0.0)
        resid_log = jnp.where(jnp.sum(resid, -1, keepdims=True) > 0, jnp.log(resid), p_log)
        drawn = jax.vmap(sampling.inverse_cdf)(keys(rows, step + j + 1, RESAMPLE), resid_log)
        return jnp.where(greedy, best_j, drawn.astype(jnp.int32))

    corr = jax.lax.cond(all_greedy(rows, live), lambda _: best_j, resample, None)
    i0 = jnp.arange(k + 1)[None, :]
    return j, jnp.where(i0 < j[:, None], jnp.pad(d, ((0, 0), (0, 1))), corr[:, None])


def _accept_uniforms(rows: Any, live: Array, t_idx: Array) -> Array:
    """u f32[B, k] for the acceptance tests at output indices t_idx int32[B, k]; zeros, with no
    key derived, when every live row is greedy (greedy rows compare with the argmax instead)."""
    def draw(_):
        ks = jax.vmap(lambda t: keys(rows, t, ACCEPT), in_axes=1, out_axes=1)(t_idx)
        return jax.vmap(jax.vmap(jax.random.uniform))(ks)

    return jax.lax.cond(all_greedy(rows, live),
                        lambda _: jnp.zeros(t_idx.shape, jnp.float32), draw, None)
