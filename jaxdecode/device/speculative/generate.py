"""`speculative_generate`: rounds of `spec_round` in one `lax.while_loop` (the whole
generation is one dispatch), and the argument checks the engine shares."""

from __future__ import annotations

import functools
from typing import Any, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np

from jaxdecode import invariance
from jaxdecode.config import SamplingParams
from jaxdecode.device import cache_ops, decode, numerics, outputs
from jaxdecode.device import research as research_lib
from jaxdecode.device.decode import bucket
from jaxdecode.device.speculative.round import spec_round
from jaxdecode.device.speculative.state import (COUNTERS, PROMPT_LOOKUP, RoundConfig,
                                                SpecState, SpeculativeOutput)
from jaxdecode.device.state import RowParams
from jaxdecode.model_api import DecoderModel
from jaxdecode.prompts import token_rows

Array = jax.Array


@numerics.jit(static_argnums=(0,))
def _spec_loop(config: RoundConfig, tparams: Any, dparams: Any, init: SpecState,
               max_iters: Array) -> SpecState:
    """The while-loop driver of `spec_round`: rounds until every row is done (or max_iters).
    The grammar tables are loop constants, outside the carry."""
    tables = init.grammar

    def body(carry):
        it, s = carry
        s, _ = spec_round(config, tparams, dparams, s.replace(grammar=tables))
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


def check_draft(draft: Any, target: DecoderModel, field: str = "draft") -> None:
    """ValueError naming `field` unless `draft` is a model with the target's vocabulary."""
    if draft.config.vocab_size != target.config.vocab_size:
        raise ValueError(f"{field}: vocabulary {draft.config.vocab_size} differs from the "
                         f"target's {target.config.vocab_size}")


def _check(target: DecoderModel, draft: Any, k: Any, num_branches: Any, ngram_min: int,
           ngram_max: int, rows_in: Sequence[Any]) -> None:
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k: must be an integer >= 1, got {k!r}")
    check_num_branches(num_branches, target.config.vocab_size)
    if isinstance(draft, str):
        if draft != PROMPT_LOOKUP:
            raise ValueError(f"draft: a DecoderModel or {PROMPT_LOOKUP!r}, got {draft!r}")
    else:
        check_draft(draft, target)
    if not 1 <= ngram_min <= ngram_max:
        raise ValueError(f"ngram_min: must satisfy 1 <= ngram_min <= ngram_max, "
                         f"got {ngram_min}, {ngram_max}")
    for sp in rows_in:
        if isinstance(sp, SamplingParams):  # decode.prepare names any other bad value
            check_branches_greedy(num_branches, sp)


def _initial_state(state: Any, prompts: list, n: int, research: Optional[Any]) -> SpecState:
    """The round's carry from `decode.prepare`'s prefilled state: the target cache rolled back
    by one (s[-1] is pending) and the prompts in the history."""
    b = len(prompts)
    plen = np.array([len(p) for p in prompts], np.int32)
    hist_len = bucket(int(plen.max()) + n)
    hist = np.zeros((b, hist_len), np.int32)
    for r, p in enumerate(prompts):
        hist[r, : len(p)] = p
    zeros = jnp.zeros((b,), jnp.int32)
    return SpecState(rows=state.rows, tcache=state.cache.replace(lengths=state.cache.lengths - 1),
                     hist=jnp.asarray(hist), lpbuf=jnp.zeros((b, hist_len), jnp.float32),
                     length=jnp.asarray(plen), step=zeros, counts=state.counts, seen=state.seen,
                     done=jnp.zeros((b,), bool), paused=jnp.zeros((b,), bool), finish=zeros,
                     proposed=zeros, accepted=zeros, target_tokens=zeros, iterations=zeros,
                     grammar_state=state.grammar_state, grammar=state.grammar,
                     research=None if research is None else state.research.replace(ids=None))


def _draft_cache(draft: DecoderModel, dparams: Any, prompt_ids: list, index: np.ndarray,
                 cache_len: int) -> Any:
    """The draft's cache of each row: each prompt alone at its own bucket (as the target's),
    broadcast to its samples, rolled back by one."""
    dummy = RowParams.build([SamplingParams()] * len(prompt_ids), draft.config.vocab_size)
    config = decode.PrefillConfig(draft, cache_len)
    dcache = cache_ops.stack_rows(decode.prefill_rows(config, dparams, prompt_ids, dummy)).cache
    dcache = cache_ops.take_rows(dcache, jnp.asarray(index, jnp.int32))
    return dcache.replace(lengths=dcache.lengths - 1)


def _result(c: SpecState, plen: np.ndarray, n: int, b: int, custom: dict) -> SpeculativeOutput:
    """The host result: each row's output tokens and raw log-probabilities (from the history,
    after its prompt) and the acceptance counters."""
    cols = np.minimum(plen[:, None] + np.arange(n)[None, :], c.hist.shape[1] - 1)
    tokens = np.take_along_axis(np.asarray(c.hist)[:b], cols, 1)
    logprobs = np.take_along_axis(np.asarray(c.lpbuf)[:b], cols, 1)
    stats = {name: np.asarray(getattr(c, name))[:b].astype(np.int64) for name in COUNTERS}
    stats["mean_accepted_length"] = float(
        (stats["accepted"].sum() + stats["target_tokens"].sum())
        / max(1, stats["iterations"].sum()))
    return outputs.build(tokens, logprobs, np.asarray(c.finish)[:b], np.asarray(c.step)[:b], n,
                         cls=SpeculativeOutput, stats=stats, **custom)


def speculative_generate(target: DecoderModel, target_params: Any,
                         draft: Union[DecoderModel, str], draft_params: Any,
                         prompt_ids: Sequence[Sequence[int]],
                         sampling: SamplingParams | Sequence[SamplingParams], *, k: int = 4,
                         key: Optional[Array] = None, num_branches: int = 1,
                         ngram_max: int = 3, ngram_min: int = 1,
                         tokenizer: Any = None, processors: Sequence[Any] = (),
                         batch_invariant: bool = True) -> SpeculativeOutput:
    """Speculative decoding (docs/architecture.md `jd.speculative_generate`); see the package docstring.

    draft: a DecoderModel with the target's vocabulary, or "prompt_lookup" (draft_params is then
    ignored). Each row's length comes from its max_tokens, its randomness from its seed (`key`
    serves rows with seed=None, as in `generate`); `n > 1` gives n adjacent rows as in
    `generate`; `tokenizer` is needed when a row has a response_format (as in `generate`).
    `num_branches` > 1: that many draft continuations per row verified together, greedy rows
    only (a sampled row raises ValueError; the package docstring's Branches section).
    `processors`: custom jd.LogitProcessor applied to the target's distribution (the package
    docstring); their final states come back in `processor_states`.
    `batch_invariant=False`: target and draft on their plain XLA numerics, as in `generate`.
    Returns a SpeculativeOutput (GenerateOutput + `stats`)."""
    target = invariance.configure(target, batch_invariant)
    if not isinstance(draft, str):
        draft = invariance.configure(draft, batch_invariant)
    prompt_ids = token_rows(prompt_ids)
    rows_in = ([sampling] * len(prompt_ids) if isinstance(sampling, SamplingParams)
               else list(sampling))
    _check(target, draft, k, num_branches, ngram_min, ngram_max, rows_in)
    lookup = isinstance(draft, str)
    setup = research_lib.configure(target, processors=processors)
    state, rows_sp, n = decode.prepare(target, target_params, prompt_ids, sampling, None, key,
                                       tokenizer=tokenizer, research=setup)
    b = len(rows_sp)
    index = np.repeat(np.arange(len(rows_in)), [s.n for s in rows_in])
    prompts = [list(prompt_ids[i]) for i in index]
    init = _initial_state(state, prompts, n, setup)
    if not lookup:
        init = init.replace(dcache=_draft_cache(draft, draft_params, [list(p) for p in prompt_ids],
                                                index, state.cache.max_len),
                            lag=jnp.zeros((b,), bool))
    config = RoundConfig(target, None if lookup else draft, k,
                         tuple(range(ngram_max, ngram_min - 1, -1)), num_branches=num_branches,
                         research=None if setup is None else setup.config)
    c = _spec_loop(config, target_params, None if lookup else draft_params,
                   cache_ops.pad_rows(init, b, config.research, numerics.min_rows(target)),
                   jnp.int32(n + 1))
    custom = {} if setup is None else dict(
        processor_order=setup.processor_order,
        processor_states=research_lib.final_states(
            setup.config, jax.tree.map(lambda x: x[:b], c.research.states)))
    return _result(c, np.array([len(p) for p in prompts], np.int32), n, b, custom)
