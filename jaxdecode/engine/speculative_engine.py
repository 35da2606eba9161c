"""Speculative decoding in the engine (SPEC §10): `jd.LLM(..., speculative={...})` makes every
engine step one `speculative.spec_round` over all slots -- the same round as the body of
`speculative_generate`'s while loop (one loop body, two drivers).

Option: `speculative={"draft": (draft_model, draft_params) | "prompt_lookup", "k": 4,
"ngram_max": 3, "ngram_min": 1, "num_branches": 1}` (the n-gram bounds serve prompt lookup;
num_branches > 1 verifies that many draft continuations per row together, greedy requests only:
a sampled request then raises ValueError naming num_branches at submit); a bad value raises
ValueError naming the field (`speculative.draft`, `speculative.k`, ...). The draft must share
the target's vocabulary and hold at least `max_len` positions.

Device side: the engine's state is a `SpecState` of `max_slots` rows (`empty_state`: every row
done). Each admitted request is prefilled alone at its own prompt bucket (batch invariance,
docs/batch_invariance.md) -- the target and the draft each by `decode.prefill`, their caches
then rolled back by one (the last prompt token is pending, the round's convention) and the
prompt copied into the history -- and scattered into a free slot (`insert`). Ending a request
marks its row done, back-pressure and `pause()` set `paused` (`set_flags`): a paused row is not
live in a round, nothing of it advances (SPEC B1). Slot indices and masks are arrays, so
admitting a request never recompiles. A row's keys are its
request's (`fold_in(request_key, t)` per output index t, SPEC X1), so a seeded request emits
exactly what `speculative_generate` emits for it, whatever its slot and neighbours.

Host side (`SpeculativeRunner`, used by engine.py): one round per engine step; the engine feeds
each emitted token of a row through its usual per-token path in order (the earlier ones with
code RUNNING, the last with the round's finish code), so stop strings, detokenization, the
duplicate guard, cancel and deadlines work unchanged; tokens after a stop-string hit are
dropped. The attention bucket (`kv_len`) of a round bounds L + k of every live row from what the
host knows: processed tokens plus k + 1 per round in flight. Acceptance counters: engine totals
(`LLM.speculative_stats()`), per request in `Completion.timings["speculative"]`, and one
`speculative.round` trace event per round of a request (there, `decode.started`'s step counts
the row's rounds, not its tokens).

Not supported together: `mesh` (sharded state), `save_request` / `restore_request`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxdecode.device import decode
from jaxdecode.config import SamplingParams
from jaxdecode.model_api import DecoderModel
from jaxdecode.device.speculative import (PROMPT_LOOKUP, RoundOutput, SpecState, check_branches_greedy,
                                   check_num_branches, spec_round)
from jaxdecode.device.slots import keep_tables
from jaxdecode.device.state import RowParams

COUNTERS = ("proposed", "accepted", "target_tokens", "iterations")


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """A validated `speculative=` option. draft None = prompt lookup; ngrams longest first."""

    draft: Optional[DecoderModel]
    draft_params: Any
    k: int
    ngrams: tuple
    num_branches: int = 1

    @classmethod
    def parse(cls, option: Any, target: DecoderModel, max_len: int) -> "SpeculativeConfig":
        if not isinstance(option, dict):
            raise ValueError(f"speculative: expected a dict with 'draft' and 'k', got "
                             f"{type(option).__name__}")
        unknown = sorted(set(option) - {"draft", "k", "ngram_max", "ngram_min", "num_branches"})
        if unknown:
            raise ValueError(f"speculative.{unknown[0]}: unknown option (expected draft, k, "
                             f"ngram_max, ngram_min, num_branches)")
        if "draft" not in option:
            raise ValueError("speculative.draft: required, (draft_model, draft_params) or "
                             f"{PROMPT_LOOKUP!r}")
        draft, draft_params = option["draft"], None
        if isinstance(draft, str):
            if draft != PROMPT_LOOKUP:
                raise ValueError(f"speculative.draft: (draft_model, draft_params) or "
                                 f"{PROMPT_LOOKUP!r}, got {draft!r}")
            draft = None
        elif (isinstance(draft, (tuple, list)) and len(draft) == 2
              and hasattr(draft[0], "forward") and hasattr(draft[0], "config")):
            draft, draft_params = draft
            if draft.config.vocab_size != target.config.vocab_size:
                raise ValueError(f"speculative.draft: vocabulary {draft.config.vocab_size} "
                                 f"differs from the target's {target.config.vocab_size}")
            if draft.config.max_len < max_len:
                raise ValueError(f"speculative.draft: its context {draft.config.max_len} is "
                                 f"shorter than max_len {max_len}")
        else:
            raise ValueError(f"speculative.draft: (draft_model, draft_params) or "
                             f"{PROMPT_LOOKUP!r}, got {type(draft).__name__}")
        values = {"k": option.get("k", 4), "ngram_max": option.get("ngram_max", 3),
                  "ngram_min": option.get("ngram_min", 1)}
        for name, value in values.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"speculative.{name}: must be an integer >= 1, got {value!r}")
        if values["ngram_min"] > values["ngram_max"]:
            raise ValueError(f"speculative.ngram_min: must be <= ngram_max, got "
                             f"{values['ngram_min']} > {values['ngram_max']}")
        if values["k"] + 2 > max_len:
            raise ValueError(f"speculative.k: {values['k']} leaves no room in max_len {max_len}")
        num_branches = option.get("num_branches", 1)
        check_num_branches(num_branches, target.config.vocab_size, "speculative.num_branches")
        return cls(draft, draft_params, values["k"],
                   tuple(range(values["ngram_max"], values["ngram_min"] - 1, -1)), num_branches)

    def check_request(self, sp: SamplingParams) -> None:
        """ValueError naming num_branches for a sampled request when num_branches > 1."""
        check_branches_greedy(self.num_branches, sp)


# -- device side ---------------------------------------------------------------------------------

@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3, 4))
def _empty_state(target, tdtype, draft, ddtype, max_len: int, rows: RowParams) -> SpecState:
    slots, vocab = rows.bias.shape
    zeros = jnp.zeros((slots,), jnp.int32)
    state = SpecState(rows=rows, tcache=target.init_cache(slots, max_len, tdtype),
                      hist=jnp.zeros((slots, max_len), jnp.int32),
                      lpbuf=jnp.zeros((slots, max_len), jnp.float32),
                      length=jnp.ones((slots,), jnp.int32), step=zeros,
                      counts=jnp.zeros((slots, vocab), jnp.int32),
                      seen=jnp.zeros((slots, vocab), bool), done=jnp.ones((slots,), bool),
                      paused=jnp.zeros((slots,), bool), finish=zeros, proposed=zeros,
                      accepted=zeros, target_tokens=zeros, iterations=zeros)
    if draft is not None:
        state = state.replace(dcache=draft.init_cache(slots, max_len, ddtype),
                              lag=jnp.zeros((slots,), bool))
    return state


@functools.partial(jax.jit, static_argnums=(0, 2, 6))
def _prefill(target, tparams, draft, dparams, tokens, lengths, max_len: int,
             rows: RowParams) -> SpecState:
    """Freshly prefilled rows (tokens int32[n, T] right-padded, T <= max_len): caches hold
    the prompt but its last token (pending), the history holds the prompt."""
    n, t = tokens.shape
    st = decode.prefill(target, tparams, tokens, lengths, rows, max_len)
    zeros = jnp.zeros((n,), jnp.int32)
    state = SpecState(rows=rows, tcache=st.cache.replace(lengths=st.cache.lengths - 1),
                      hist=jnp.zeros((n, max_len), jnp.int32).at[:, :t].set(tokens),
                      lpbuf=jnp.zeros((n, max_len), jnp.float32), length=lengths, step=zeros,
                      counts=st.counts, seen=st.seen, done=jnp.zeros((n,), bool),
                      paused=jnp.zeros((n,), bool), finish=zeros, proposed=zeros,
                      accepted=zeros, target_tokens=zeros, iterations=zeros)
    if draft is not None:  # only the draft's cache is used: the round recomputes its logits
        dcache = decode.prefill(draft, dparams, tokens, lengths, rows, max_len).cache
        state = state.replace(dcache=dcache.replace(lengths=dcache.lengths - 1),
                              lag=jnp.zeros((n,), bool))
    return state


@keep_tables
def insert(state: SpecState, rows: SpecState, slots: jax.Array) -> SpecState:
    """Scatter freshly prefilled rows into `slots` (int32[n]; an index past the last slot drops
    that row, which pads a prefill batch). The caches' batch axis is 1 for k and v."""
    def put(axis):
        def scatter(big, small):
            index = (slice(None),) * axis + (slots,)
            return big.at[index].set(small.astype(big.dtype), mode="drop")
        return scatter

    def cache(big, small):
        return big.replace(k=put(1)(big.k, small.k), v=put(1)(big.v, small.v),
                           lengths=put(0)(big.lengths, small.lengths))

    rest = jax.tree.map(put(0), state.replace(tcache=None, dcache=None),
                        rows.replace(tcache=None, dcache=None))
    rest = rest.replace(tcache=cache(state.tcache, rows.tcache))
    if state.dcache is not None:
        rest = rest.replace(dcache=cache(state.dcache, rows.dcache))
    return rest


@keep_tables
def set_flags(state: SpecState, release: jax.Array, paused: jax.Array) -> SpecState:
    """Mark released rows done and set the paused mask (bool[slots] each)."""
    return state.replace(done=state.done | release, paused=paused)


def _round_shared_tables(target, tparams, draft, dparams, k, ngrams, state, kv_len, top_k,
                         tables, num_branches):
    state, out = spec_round(target, tparams, draft, dparams, k, ngrams,
                            state.replace(grammar=tables), kv_len, top_k, num_branches)
    return state.replace(grammar=None), out


_round_jit = jax.jit(_round_shared_tables, static_argnums=(0, 2, 4, 5, 7, 8, 10),
                     donate_argnums=(6,))


# -- host side -----------------------------------------------------------------------------------

class SpeculativeRunner:
    """The engine's speculative mode: the slot state, one round per step, the counters."""

    def __init__(self, config: SpeculativeConfig, target: DecoderModel, params: Any):
        self.config, self.target, self.params = config, target, params
        self.k = config.k
        self.totals = dict.fromkeys(COUNTERS, 0)

    def empty_state(self, slots: int, max_len: int, eos_token_ids: Sequence[int]) -> SpecState:
        """Every row done: a round over it emits and writes nothing."""
        cfg = self.config
        rows = RowParams.build([SamplingParams()] * slots, self.target.config.vocab_size,
                               eos_token_ids, keys=np.zeros((slots, 2), np.uint32))
        ddtype = None if cfg.draft is None else decode.params_dtype(cfg.draft_params)
        return _empty_state(self.target, decode.params_dtype(self.params), cfg.draft, ddtype,
                            max_len, rows)

    def prefill(self, tokens: np.ndarray, lengths: np.ndarray, rows: RowParams,
                max_len: int) -> SpecState:
        cfg = self.config
        return _prefill(self.target, self.params, cfg.draft, cfg.draft_params, tokens, lengths,
                        max_len, rows)

    def step(self, state: SpecState, kv_len: int,
             top_k: int = 0) -> tuple[SpecState, RoundOutput]:
        """One round over every slot, the state donated (the grammar tables kept); `top_k`
        raw top log-probabilities per emitted position (0 or the engine's logprobs_k)."""
        cfg = self.config
        tables = state.grammar
        state, out = _round_jit(self.target, self.params, cfg.draft, cfg.draft_params, cfg.k,
                                cfg.ngrams, state.replace(grammar=None), kv_len, top_k, tables,
                                cfg.num_branches)
        return state.replace(grammar=tables), out

    def kv_needed(self, r: Any) -> int:
        """An upper bound of L + k + 1 for request `r` in the round about to be dispatched: its
        prompt, its processed tokens and k + 1 tokens for each round in flight and this one."""
        return len(r.prompt_ids) + r.selected + (self.k + 1) * (r.in_flight + 1)

    def count(self, r: Any, out: RoundOutput, slot: int) -> None:
        """Add one processed round of `r` (host arrays) to its counters and the engine's."""
        emitted, accepted = int(out.count[slot]), int(out.accepted[slot])
        if emitted == 0:
            return
        add = {"proposed": self.k * self.config.num_branches, "accepted": accepted,
               "target_tokens": emitted - accepted, "iterations": 1}
        mine = r.speculative if r.speculative is not None else dict.fromkeys(COUNTERS, 0)
        for name, value in add.items():
            self.totals[name] += value
            mine[name] += value
        r.speculative = mine
        r.lifecycle.record("speculative.round", round=mine["iterations"], emitted=emitted,
                           accepted=accepted)

    def stats(self) -> dict:
        """Engine totals over every processed round: proposed, accepted, target_tokens,
        iterations, and mean_accepted_length = tokens per round (1.0 = no gain)."""
        out = dict(self.totals)
        out["mean_accepted_length"] = ((out["accepted"] + out["target_tokens"])
                                       / max(1, out["iterations"]))
        return out

    def warmup(self, state: SpecState, t_buckets: Sequence[int], kv_buckets: Sequence[int],
               top_ks: Sequence[int], max_len: int, eos_token_ids: Sequence[int]) -> SpecState:
        """Compile the one-row prefill + insert for each prompt bucket, the flags, and the
        round for each attention bucket and top-k."""
        slots = state.length.shape[0]
        rows = RowParams.build([SamplingParams()], self.target.config.vocab_size,
                               eos_token_ids, keys=np.zeros((1, 2), np.uint32))
        for t in t_buckets:
            fresh = self.prefill(np.zeros((1, t), np.int32), np.ones((1,), np.int32), rows,
                                 max_len)
            state = insert(state, fresh, np.full((1,), slots, np.int32))
        flags = np.zeros((slots,), bool)
        state = set_flags(state, flags, flags)
        for kv in kv_buckets:
            for top_k in top_ks:
                state, _ = self.step(state, kv, top_k)
        return state
