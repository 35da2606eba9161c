"""The speculative round's state and outputs (contract §10), its static configuration, and the
pieces the proposal and the verification share: per-purpose keys, selection, processing."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import jax
import jax.numpy as jnp
from flax import struct

from jaxdecode.device import processors, sampling
from jaxdecode.device import research as research_lib
from jaxdecode.device.outputs import GenerateOutput
from jaxdecode.device.state import RowParams, RowState
from jaxdecode.model_api import DecoderModel

Array = jax.Array
PROMPT_LOOKUP = "prompt_lookup"
DRAFT, ACCEPT, RESAMPLE = 0, 1, 2  # key purposes
COUNTERS = ("proposed", "accepted", "target_tokens", "iterations")  # SpeculativeOutput.stats


@dataclasses.dataclass(frozen=True)
class RoundConfig:
    """Static part of a round: the target, the draft (None: prompt lookup), k proposals, the
    lookup n-gram sizes (longest first), the attention bucket (None: the whole cache), raw top
    log-probabilities per position, branches per row, research options (custom processors)."""

    target: DecoderModel
    draft: Optional[DecoderModel]
    k: int
    ngrams: tuple
    kv_len: Optional[int] = None
    top_logprobs: int = 0
    num_branches: int = 1
    research: Optional[research_lib.ResearchConfig] = None

    @property
    def custom(self) -> bool:
        return self.research is not None and bool(self.research.processors)


@dataclasses.dataclass(frozen=True)
class SpeculativeOutput(GenerateOutput):
    """GenerateOutput plus acceptance counters, per row (int64[B]):

    proposed: draft tokens proposed (k per branch per verify pass); accepted: draft tokens emitted;
    target_tokens: tokens drawn from the target (residual or bonus); iterations: verify passes.
    accepted + target_tokens == number of tokens selected. `mean_accepted_length`: tokens
    selected per verify pass over all rows (1.0 = no speed-up from the draft)."""

    stats: Optional[dict] = None


@struct.dataclass
class SpecState(RowState):
    """The carry of a speculative round (contract §10), B rows, H history width: the per-row fields
    of `RowState` (`step` counts output tokens) and, for s = prompt + output so far (length L,
    the invariant of the package docstring):

    tcache:        the target's KVCache holding s[:-1] (lengths = L - 1); s[-1] is pending
    hist:          int32[B, H] s, then garbage
    lpbuf:         f32[B, H] the raw target log-probability of each output token, where it
                   sits in `hist`
    length:        int32[B] L
    proposed, accepted, target_tokens, iterations: int32[B] counters (SpeculativeOutput)
    dcache:        the draft's KVCache holding s[:-1], or s[:-2] where `lag` (None: lookup)
    lag:           bool[B] the last round accepted all k proposals, so d_k is not in the draft
                   cache yet (None: lookup)
    grammar_state: int32[B] automaton state after s (-1 = unconstrained), or None
    grammar:       constraints.GrammarTables shared by all rows, or None
    research:      research.ResearchState (prompt_length and custom processor states; its ids
                   are None: the context is built from `hist`), or None
    """

    tcache: Any
    hist: Array
    lpbuf: Array
    length: Array
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
              position (N = the round's top_logprobs, may be 0)
    """

    tokens: Array
    count: Array
    finish: Array
    accepted: Array
    logprob: Array
    top_ids: Array
    top_logprobs: Array


def keys(rows: RowParams, t: Array, purpose: int) -> Array:
    """Typed keys[B]: fold_in(fold_in(request key, t), purpose) (the package docstring)."""
    base = jax.vmap(jax.random.wrap_key_data)(rows.keys)
    kt = jax.vmap(jax.random.fold_in)(base, t)
    return jax.vmap(lambda k: jax.random.fold_in(k, purpose))(kt)


def all_greedy(rows: RowParams, live: Array) -> Array:
    """True when every live row is greedy (empty, ended and paused rows do not count)."""
    return jnp.all((rows.temperature == 0) | ~live)


def select(logprobs: Array, rows: RowParams, live: Array, t: Array, purpose: int) -> Array:
    """The argmax for greedy rows, else one inverse-CDF draw with the key of (t, purpose).
    The keys and the draw are skipped at run time when every live row is greedy."""
    greedy = jnp.argmax(logprobs, axis=-1).astype(jnp.int32)

    def sample(_):
        drawn = jax.vmap(sampling.inverse_cdf)(keys(rows, t, purpose), logprobs)
        return jnp.where(rows.temperature == 0, greedy, drawn.astype(jnp.int32))

    return jax.lax.cond(all_greedy(rows, live), lambda _: greedy, sample, None)


def process(s: SpecState, logits: Array, counts: Array, seen: Array, step: Array,
            grammar_state: Optional[Array], bound: Any = None) -> Array:
    """contract §3's processed log-probabilities of one position for every row, with the given
    penalty counts, step and grammar state (`bound`: custom processors)."""
    grammar = None if s.grammar is None else (s.grammar, grammar_state)
    return processors.process(logits.astype(jnp.float32), s.rows, counts, seen, step, grammar,
                              bound)


def branched(fn, num_branches: int):
    """fn over one branch; with several, vmapped over the leading branch axis of its arguments
    (what it closes over -- the caches, the rows -- is shared, in_axes None)."""
    return jax.vmap(fn) if num_branches > 1 else fn
