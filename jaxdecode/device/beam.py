"""Beam search on device (contract §10), with Hugging Face transformers 5.x beam semantics.

`beam_search` prefills each prompt once (B rows), broadcasts the cache to B * W rows (W = the
widest beam width) and runs the whole search in one `lax.while_loop`. Beams are a batched axis:
every array is [B, W, ...] (the model sees B * W rows), and a step is

1. log-softmax of each running beam's raw logits (no temperature or sampling processors: HF
   beam search with `do_sample=False` applies only logits processors; here only the
   `min_new_tokens` EOS mask, applied to the log-probabilities without renormalising, as HF's
   `MinNewTokensLengthLogitsProcessor` does), plus the beam's cumulative score;
2. the top K = max(2, 1 + #EOS ids) * W candidates over beams x vocabulary (HF's
   `beams_to_keep`), each marked finished when its token is an EOS id or it is the
   `max_new_tokens`-th token;
3. the W best unfinished candidates become the running beams;
4. the finished candidates among the top W (by position in the candidate list, HF's
   `top_num_beam_mask`) enter the row's pool of W finished hypotheses with score
   `sum_logprob / generated_len ** length_penalty`, where generated_len counts the new token
   (EOS included) -- exactly `_update_finished_beams` (`cur_len + 1 - decoder_prompt_len`);
   nothing enters a pool that is full under `early_stopping=True`, or whose row can no longer
   improve;
5. the improvement heuristic of HF's `_check_early_stop_heuristic`: the best running beam's
   cumulative score divided by (generated length) ** length_penalty -- or by
   max_new_tokens ** length_penalty when `early_stopping="never"` and length_penalty > 0 --
   against the worst finished score once the pool is full;
6. the cache is reordered by a gather along the batch axis (`cache_ops.take_rows`) and the
   chosen tokens are written (one forward of B * W rows, T = 1).

The search stops when every row can no longer change (its improvement heuristic failed, or its
pool is full under `early_stopping=True`) or after `max_new_tokens` tokens. HF stops the whole
batch on the same per-row conditions; a row that cannot change contributes nothing more there
either, so every row's result is the one it would get alone.

`num_beams` may be one width per row (a list): rows are padded to the widest width W and the
extra beams masked (their scores are -inf, their pool slots unused); a row of width w then
follows HF with `num_beams=w` exactly (K candidates are taken for W; the best w unfinished
among them are the same as among HF's top 2w, since those always hold at least w unfinished).

Results: the pool is kept sorted, so `token_ids` is the best hypothesis of each row and
`beams[row]` lists (token ids, score) of the first `num_return_sequences` hypotheses (HF's
`sequences` / `sequences_scores` order). Token lists include the EOS id that ended a beam.
`logprobs` holds the raw model log-probability of each token of the best beam.

Structured output (`response_format`, jaxdecode/device/constraints): the shared tables stay outside
the beams; each beam carries its grammar state, gathered with the same parent indices as the
cache; the grammar mask is applied to the log-probabilities (as a logits processor, like the
min_new_tokens mask); a hypothesis whose grammar completes is finished like one ending on EOS
(finish reason `grammar_complete`). HF has no counterpart, so this part has no parity test.

Custom processors (`processors=[jd.LogitProcessor, ...]`, jaxdecode/device/research.py) run after
those masks on each beam's log-probabilities, every position in order, without renormalising
(HF applies its logits processors to the log-softmax the same way). Each beam carries its own
processor states, gathered with the same parent indices as the cache, and a finished
hypothesis keeps the states it had when it finished (returned for the best one). A beam's
context has no random key of its own: ctx.key derives from key data 0 and the step.

The search state is one typed pytree, `BeamState`; its static configuration one frozen
`BeamConfig`; the per-row settings (widths, limits, length penalty, ending ids, grammar,
processor states) one `BeamRows`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxdecode import invariance
from jaxdecode.config import SamplingParams
from jaxdecode.device import cache_ops, constraints, decode, numerics
from jaxdecode.device import research as research_lib
from jaxdecode.device.decode import bucket
from jaxdecode.device.outputs import GenerateOutput
from jaxdecode.model_api import DecoderModel, KVCache
from jaxdecode.prompts import token_rows
from jaxdecode.types import FinishReason

Array = jax.Array
EarlyStopping = Union[bool, str]
NEG = -1.0e9  # HF's "very large negative" marker; added, never multiplied, as HF does


@dataclasses.dataclass(frozen=True)
class BeamConfig:
    """Static part of a search: the model, the beam width W (the widest row's), the output
    buffer NB, the candidates per step K, HF's early_stopping, research options."""

    model: DecoderModel
    width: int
    buffer_len: int
    num_candidates: int
    early_stopping: EarlyStopping
    research: Optional[research_lib.ResearchConfig] = None

    @property
    def custom(self) -> bool:
        return self.research is not None and bool(self.research.processors)


@struct.dataclass
class BeamRows:
    """Per-row settings, B rows: widths int32[B]; max_new, min_new int32 and length_penalty f32
    (scalars shared by the call); eos_mask bool[V] the ending ids; grammar tables, the initial
    grammar state int32[B] and each beam's EOS mask bool[B * W, V] (None: unconstrained); each
    beam's ResearchState from the prefill (None without custom processors). `_beam_loop`
    broadcasts the last two from the B rows to the beams. adapter int32[B]: each row's LoRA
    adapter index (0: the base; contract R6), the same for all its beams (None: no adapters)."""

    widths: Array
    max_new: Array
    min_new: Array
    length_penalty: Array
    eos_mask: Array
    gtables: Optional[Any] = None
    gstate: Optional[Array] = None
    row_eos: Optional[Array] = None
    rstate: Optional[Any] = None
    adapter: Optional[Array] = None


@struct.dataclass
class BeamState:
    """The search carry, B rows of W beams, NB output positions, V vocabulary.

    t: int32[] tokens chosen so far; go: bool[] the search goes on; cache: KVCache of B * W rows;
    logits: f32[B * W, V] each running beam's next-token logits;
    run_tok / run_lp: int32 / f32[B, W, NB] each running beam's tokens and their raw
    log-probabilities; run_score: f32[B, W] cumulative log-probability (-inf: padding beam);
    pool_tok / pool_lp / pool_score / pool_len / pool_complete: the W best finished hypotheses
    per row (sorted), their HF scores, generated lengths and whether their grammar completed;
    pool_fin: bool[B, W] the pool entry is a real hypothesis; unsat: bool[B] the row can still
    improve; gstate: int32[B, W] each beam's grammar state (None: unconstrained); pstates /
    pool_pstates: custom processor states per running beam / pool entry (None without them).
    """

    t: Array
    go: Array
    cache: KVCache
    logits: Array
    run_tok: Array
    run_lp: Array
    run_score: Array
    pool_tok: Array
    pool_lp: Array
    pool_score: Array
    pool_len: Array
    pool_fin: Array
    pool_complete: Array
    unsat: Array
    gstate: Optional[Array] = None
    pstates: Optional[Any] = None
    pool_pstates: Optional[Any] = None


@struct.dataclass
class _Candidates:
    """The K best (beam, token) continuations of one step, per row: scores, source beams,
    tokens, their full token and raw log-probability buffers, processor states, finished /
    grammar-complete flags and grammar states."""

    score: Array
    src: Array
    tok: Array
    toks: Array
    lps: Array
    fin: Array
    complete: Array
    gstate: Optional[Array] = None
    pstates: Optional[Any] = None


def _gather(x: Array, idx: Array) -> Array:
    """x [B, M, ...] gathered along axis 1 by idx [B, N]."""
    idx = idx.reshape(idx.shape + (1,) * (x.ndim - 2))
    return jnp.take_along_axis(x, idx, axis=1)


def _custom_context(rs: Any, vocab: int, run_tok: Array, t: Array,
                    live: Array) -> research_lib.ProcessorContext:
    """The processor context of every beam ([B * W] rows) before choosing its token t + 1:
    its prompt (from the prefill's ids, rs: ResearchState of B * W rows) then run_tok[:t]."""
    bw, nb = live.shape[0], run_tok.shape[-1]
    toks = run_tok.reshape(bw, nb)
    plen = rs.prompt_length
    j = jnp.arange(rs.ids.shape[1])[None, :] - plen[:, None]
    out_tok = jnp.take_along_axis(toks, jnp.clip(j, 0, nb - 1), axis=1)
    ids = jnp.where(j < 0, rs.ids, jnp.where(j < t, out_tok, -1))
    written = jnp.where(jnp.arange(nb)[None, :] < t, toks, vocab)
    counts = jnp.zeros((bw, vocab), jnp.int32).at[jnp.arange(bw)[:, None], written].add(
        1, mode="drop")
    step = jnp.full((bw,), t, jnp.int32)
    return research_lib.ProcessorContext(
        step=step, ids=ids, length=plen + t, prompt_length=plen, counts=counts,
        key=research_lib.processor_keys(jnp.zeros((bw, 2), jnp.uint32), step + 1), live=live)


def _valid(config: BeamConfig, rows: BeamRows) -> Array:
    return jnp.arange(config.width)[None, :] < rows.widths[:, None]            # [B, W]


def _initial(config: BeamConfig, cache: KVCache, logits: Array, rows: BeamRows) -> BeamState:
    """The prompt cache broadcast to B * W rows (prefill happened once per prompt), beam 0 of
    each row running with score 0, the pool empty."""
    b, w, nb = logits.shape[0], config.width, config.buffer_len
    valid = _valid(config, rows)
    run_score = jnp.where(jnp.arange(w)[None, :] == 0, 0.0, NEG) * jnp.ones((b, 1))
    state = BeamState(
        t=jnp.int32(0), go=jnp.bool_(True),
        cache=cache_ops.take_rows(cache, jnp.repeat(jnp.arange(b), w)),
        logits=jnp.repeat(logits, w, axis=0),
        run_tok=jnp.full((b, w, nb), -1, jnp.int32), run_lp=jnp.zeros((b, w, nb), jnp.float32),
        run_score=jnp.where(valid, run_score, -jnp.inf).astype(jnp.float32),
        pool_tok=jnp.full((b, w, nb), -1, jnp.int32), pool_lp=jnp.zeros((b, w, nb), jnp.float32),
        pool_score=jnp.where(valid, NEG, -jnp.inf).astype(jnp.float32),
        pool_len=jnp.zeros((b, w), jnp.int32), pool_fin=jnp.zeros((b, w), bool),
        pool_complete=jnp.zeros((b, w), bool), unsat=jnp.ones((b,), bool))
    if rows.gtables is not None:  # per beam; gathered with the same parent indices as the cache
        state = state.replace(gstate=jnp.repeat(rows.gstate[:, None], w, axis=1))
    if config.custom:  # per beam [B, W, ...]; gathered like the cache; the pool keeps its own
        pstates = jax.tree.map(lambda x: x.reshape((b, w) + x.shape[1:]), rows.rstate.states)
        state = state.replace(pstates=pstates, pool_pstates=pstates)
    return state


def _masked_logprobs(config: BeamConfig, rows: BeamRows, c: BeamState):
    """Each running beam's log-probabilities (raw, f32[B, W, V]) and the same after the
    min_new_tokens EOS mask, the grammar mask and custom processors, with the processor states
    after them (None without)."""
    b, w = rows.widths.shape[0], config.width
    v = c.logits.shape[-1]
    logp = numerics.log_softmax(c.logits.astype(jnp.float32)).reshape(b, w, v)
    masked = jnp.where((c.t < rows.min_new) & rows.eos_mask[None, None, :], -jnp.inf, logp)
    if rows.gtables is not None:  # the grammar mask, on the log-probabilities
        masked = constraints.mask_logits(masked.reshape(b * w, v), rows.gtables,
                                         c.gstate.reshape(-1), rows.row_eos).reshape(b, w, v)
    after = None
    if config.custom:  # custom processors, every position in order, on the log-probabilities
        flat = jax.tree.map(lambda x: x.reshape((b * w,) + x.shape[2:]), c.pstates)
        ctx = _custom_context(rows.rstate, v, c.run_tok, c.t, _valid(config, rows).reshape(-1))
        bound = research_lib.Bound(config.research.processors, ctx, flat)
        masked = bound.all_positions(masked.reshape(b * w, v)).reshape(b, w, v)
        after = jax.tree.map(lambda x: x.reshape((b, w) + x.shape[1:]), tuple(bound.states))
    return logp, masked, after


def _candidates(config: BeamConfig, rows: BeamRows, c: BeamState) -> _Candidates:
    """Step 2 of the module docstring: the top K over beams x vocabulary."""
    logp, masked, after = _masked_logprobs(config, rows, c)
    b, w, v = logp.shape
    acc = (masked + c.run_score[:, :, None]).reshape(b, w * v)
    score, idx = jax.lax.top_k(acc, config.num_candidates)                  # [B, K], sorted
    src, tok = (idx // v).astype(jnp.int32), (idx % v).astype(jnp.int32)
    tok_lp = jnp.take_along_axis(logp.reshape(b, w * v), idx, axis=1)
    fin = rows.eos_mask[tok] | (c.t + 1 >= rows.max_new)
    cand = _Candidates(score=score, src=src, tok=tok,
                       toks=_gather(c.run_tok, src).at[:, :, c.t].set(tok),
                       lps=_gather(c.run_lp, src).at[:, :, c.t].set(tok_lp),
                       fin=fin, complete=jnp.zeros_like(fin),
                       pstates=None if after is None else jax.tree.map(
                           lambda x: _gather(x, src), after))
    if rows.gtables is not None:  # a completed grammar ends the hypothesis like EOS
        g = constraints.next_state(rows.gtables, _gather(c.gstate, src).reshape(-1),
                                   tok.reshape(-1)).reshape(tok.shape)
        complete = constraints.completes(rows.gtables, g.reshape(-1)).reshape(tok.shape)
        cand = cand.replace(gstate=g, complete=complete, fin=fin | complete)
    return cand


def _merge_pool(config: BeamConfig, rows: BeamRows, c: BeamState, cand: _Candidates) -> dict:
    """Step 4: the finished top-W candidates enter the pool, which keeps the W best."""
    valid = _valid(config, rows)
    k = config.num_candidates
    length = (c.t + 1).astype(jnp.float32)
    did = cand.fin & (jnp.arange(k)[None, :] < rows.widths[:, None])
    full = jnp.all(c.pool_fin | ~valid, axis=1) & (config.early_stopping is True)
    score = cand.score / length ** rows.length_penalty.astype(jnp.float32)
    score = score + jnp.where(full, NEG, 0.0)[:, None] + jnp.where(c.unsat, 0.0, NEG)[:, None]
    score = score + jnp.where(did, 0.0, NEG)
    pool_score, pick = jax.lax.top_k(jnp.concatenate([c.pool_score, score], axis=1),
                                     config.width)
    merge = lambda old, new: _gather(jnp.concatenate([old, new], axis=1), pick)  # noqa: E731
    pool = dict(pool_score=jnp.where(valid, pool_score, -jnp.inf),
                pool_tok=merge(c.pool_tok, cand.toks), pool_lp=merge(c.pool_lp, cand.lps),
                pool_len=merge(c.pool_len, jnp.broadcast_to(c.t + 1, cand.fin.shape)),
                pool_fin=merge(c.pool_fin, did) & valid,
                pool_complete=merge(c.pool_complete, cand.complete))
    if config.custom:
        pool["pool_pstates"] = jax.tree.map(merge, c.pool_pstates, cand.pstates)
    return pool


def _goes_on(config: BeamConfig, rows: BeamRows, c: BeamState, run_score: Array,
             pool: dict) -> tuple[Array, Array]:
    """Step 5, HF's improvement heuristic (cumulative): can a running beam still beat the
    worst finished one? Returns (unsat per row, go)."""
    valid = _valid(config, rows)
    lp = rows.length_penalty.astype(jnp.float32)
    length = (c.t + 1).astype(jnp.float32)
    never = (config.early_stopping == "never") & (lp > 0)
    best = run_score[:, 0] / jnp.where(never, rows.max_new.astype(jnp.float32), length) ** lp
    all_fin = jnp.all(pool["pool_fin"] | ~valid, axis=1)
    worst = jnp.where(all_fin, jnp.min(jnp.where(valid, pool["pool_score"], jnp.inf), axis=1),
                      NEG)
    unsat = c.unsat & (best > worst)
    frozen = ~unsat | (all_fin & (config.early_stopping is True))
    return unsat, (c.t + 1 < rows.max_new) & ~jnp.all(frozen)


def _body(config: BeamConfig, params: Any, rows: BeamRows, c: BeamState) -> BeamState:
    """One search step (the module docstring's 1-6)."""
    b, w = rows.widths.shape[0], config.width
    cand = _candidates(config, rows, c)
    # step 3, running beams: the W best unfinished candidates
    run_score, sel = jax.lax.top_k(cand.score + jnp.where(cand.fin, NEG, 0.0), w)
    run_score = jnp.where(_valid(config, rows), run_score, -jnp.inf)
    run_tok, run_src = _gather(cand.toks, sel), _gather(cand.src, sel)
    pool = _merge_pool(config, rows, c, cand)
    unsat, go = _goes_on(config, rows, c, run_score, pool)

    def advance(cache):  # step 6: reorder, then write the chosen tokens
        cache = cache_ops.take_rows(cache, (jnp.arange(b)[:, None] * w + run_src).reshape(-1))
        adapters = None if rows.adapter is None else jnp.repeat(rows.adapter, w)
        new_logits, cache = config.model.forward(params, run_tok[:, :, c.t].reshape(-1, 1),
                                                 cache.lengths[:, None], cache,
                                                 lengths=jnp.ones((b * w,), jnp.int32),
                                                 **decode.adapter_keyword(config.model,
                                                                          adapters))
        return cache, new_logits[:, 0].astype(jnp.float32)

    cache, logits = jax.lax.cond(go, advance, lambda cache: (cache, c.logits), c.cache)
    out = c.replace(t=c.t + 1, go=go, cache=cache, logits=logits, run_tok=run_tok,
                    run_lp=_gather(cand.lps, sel), run_score=run_score, unsat=unsat, **pool)
    if rows.gtables is not None:
        out = out.replace(gstate=_gather(cand.gstate, sel))
    if config.custom:
        out = out.replace(pstates=jax.tree.map(lambda x: _gather(x, sel), cand.pstates))
    return out


@numerics.jit(static_argnums=(0,))
def _beam_loop(config: BeamConfig, params: Any, cache: KVCache, logits: Array,
               rows: BeamRows) -> BeamState:
    """The search: B prefilled rows -> the final BeamState. The per-row grammar EOS masks and
    processor states are broadcast to B * W beams once, outside the loop."""
    per_beam = lambda x: jnp.repeat(x, config.width, axis=0)  # noqa: E731
    rows = rows.replace(row_eos=None if rows.row_eos is None else per_beam(rows.row_eos),
                        rstate=None if rows.rstate is None else jax.tree.map(per_beam,
                                                                               rows.rstate))
    state = _initial(config, cache, logits, rows)
    return jax.lax.while_loop(lambda c: c.go, functools.partial(_body, config, params, rows),
                              state)


def _check(prompt_ids: list, num_beams: Any, early_stopping: Any, n: int, min_new: int,
           num_return: int, max_len: int) -> list[int]:
    """The widths per row; ValueError naming the field for a bad argument."""
    b = len(prompt_ids)
    widths = [num_beams] * b if isinstance(num_beams, (int, np.integer)) else list(num_beams)
    if len(widths) != b or any(isinstance(x, bool) or int(x) < 1 for x in widths):
        raise ValueError(f"num_beams: expected a width >= 1, or one per row ({b} rows), "
                         f"got {num_beams!r}")
    widths = [int(x) for x in widths]
    if early_stopping not in (True, False, "never"):
        raise ValueError(f"early_stopping: must be True, False or 'never', got {early_stopping!r}")
    if n < 1:
        raise ValueError(f"max_new_tokens: must be >= 1, got {n}")
    if not 0 <= int(min_new) <= n:
        raise ValueError(f"min_new_tokens: must be in [0, max_new_tokens], got {min_new}")
    if not 1 <= num_return <= min(widths or [1]):
        raise ValueError(f"num_return_sequences: must be in [1, num_beams], got {num_return}")
    longest = max((len(p) for p in prompt_ids), default=0)
    if longest and longest + n - 1 > max_len:
        raise ValueError(f"max_new_tokens: prompt ({longest}) + {n} new tokens exceed the "
                         f"model's max_len {max_len}")
    return widths


def _results(c: BeamState, b: int, n: int, num_return: int, eos: tuple) -> dict:
    """The host result fields: the best hypothesis per row, its finish reason, the returned
    beams (token ids, score), best first."""
    tok, lps, score, length, complete = (np.asarray(x) for x in (
        c.pool_tok, c.pool_lp, c.pool_score, c.pool_len, c.pool_complete))
    token_ids = np.full((b, n), -1, np.int32)
    logprobs = np.zeros((b, n), np.float32)
    lengths = length[:b, 0].astype(np.int32)
    beams, reasons = [], []
    for r in range(b):
        ln = int(lengths[r])
        token_ids[r, :ln] = tok[r, 0, :ln]
        logprobs[r, :ln] = lps[r, 0, :ln]
        beams.append([(tok[r, j, : length[r, j]].tolist(), float(score[r, j]))
                      for j in range(num_return)])
        ended_on_eos = ln > 0 and int(tok[r, 0, ln - 1]) in eos
        reasons.append(FinishReason.EOS if ended_on_eos else FinishReason.GRAMMAR_COMPLETE
                       if complete[r, 0] else FinishReason.MAX_OUTPUT_TOKENS)
    return dict(token_ids=token_ids, lengths=lengths, finish_reasons=reasons, errors=[None] * b,
                logprobs=logprobs, beams=beams)


def beam_search(model: DecoderModel, params: Any, prompt_ids: Sequence[Sequence[int]], *,
                num_beams: Union[int, Sequence[int]], length_penalty: float = 1.0,
                early_stopping: EarlyStopping = False, max_new_tokens: int,
                num_return_sequences: int = 1, min_new_tokens: int = 0,
                eos_token_ids: Optional[Sequence[int]] = None,
                response_format: Optional[dict] = None, tokenizer: Any = None,
                processors: Sequence[Any] = (), batch_invariant: bool = True,
                kv_cache_dtype: str = "auto",
                adapters: Optional[Sequence[int]] = None) -> GenerateOutput:
    """Beam search over ragged prompts, entirely on device (docs/architecture.md `jd.beam_search`).

    num_beams: one width for every row, or one per row (padded to the widest and masked).
    length_penalty, early_stopping (True / False / "never"), max_new_tokens, min_new_tokens and
    num_return_sequences mean what they mean in HF `generate`; EOS ids default to
    `model.config.eos_token_ids`. Returns a GenerateOutput with the best hypothesis per row and
    `beams[row] = [(token ids, score), ...]` (num_return_sequences of them, best first).
    `response_format` (with `tokenizer`, as in `generate`) constrains every row: the grammar
    mask applies to the log-probabilities, each beam carries its own grammar state, and a
    hypothesis whose grammar completes is finished like one that ends on EOS.
    `processors`: custom jd.LogitProcessor (the module docstring); the best hypothesis'
    final states come back in `processor_states`. `batch_invariant=False`: the model's plain
    XLA numerics, and `kv_cache_dtype="int8"` an int8 cache, as in `generate`. `adapters`: each
    row's LoRA adapter index into the stack `params["lora"]` (0: the base; the engine's beam
    lane passes them, contract R6).
    """
    model = invariance.configure(model, batch_invariant)
    prompt_ids = token_rows(prompt_ids)
    cfg, n = model.config, int(max_new_tokens)
    widths = _check(prompt_ids, num_beams, early_stopping, n, min_new_tokens,
                    num_return_sequences, cfg.max_len)
    b = len(prompt_ids)
    eos = tuple(cfg.eos_token_ids if eos_token_ids is None else eos_token_ids)
    eos = tuple(dict.fromkeys(int(i) for i in eos if 0 <= int(i) < cfg.vocab_size))
    # validation of the prompts and the prefill (once per prompt) are `generate`'s
    sp = SamplingParams(temperature=0.0, max_tokens=n, response_format=response_format)
    setup = research_lib.configure(model, processors=processors)
    state, _, _ = decode.prepare(model, params, prompt_ids, sp, n, None, eos_token_ids=eos,
                                 tokenizer=tokenizer, research=setup,
                                 kv_cache_dtype=kv_cache_dtype, adapters=adapters)
    eos_mask = np.zeros((cfg.vocab_size,), bool)
    eos_mask[list(eos)] = True
    # a lone width-1 row searches with a masked second beam (numerics.min_rows: no program of
    # one row where batch invariant); its results are those of width 1 (per-row widths' padding)
    least = numerics.min_rows(model)
    width = max(widths) if b * max(widths) >= least else least
    config = BeamConfig(model, width, bucket(n), max(2, 1 + len(eos)) * width, early_stopping,
                        None if setup is None else setup.config)
    rows = BeamRows(widths=np.asarray(widths, np.int32), max_new=np.int32(n),
                    min_new=np.int32(min_new_tokens), length_penalty=np.float32(length_penalty),
                    eos_mask=eos_mask, rstate=state.research,
                    adapter=None if adapters is None else state.rows.adapter)
    if state.grammar is not None:
        rows = rows.replace(gtables=state.grammar, gstate=state.grammar_state,
                            row_eos=state.rows.eos_mask)
    c = _beam_loop(config, params, state.cache, state.logits, rows)
    custom = {} if setup is None else dict(
        processor_order=research_lib.describe_order(setup.config.processors, beam=True),
        processor_states=research_lib.final_states(
            setup.config, jax.tree.map(lambda x: x[:, 0], c.pool_pstates)))
    return GenerateOutput(**_results(c, b, n, num_return_sequences, eos), **custom)
