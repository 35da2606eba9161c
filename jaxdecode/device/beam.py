"""Beam search on device (SPEC §10), with Hugging Face transformers 5.x beam semantics.

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
6. the cache is reordered by a gather along the batch axis (`jnp.take` on k, v and lengths) and
   the chosen tokens are written (one forward of B * W rows, T = 1).

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

Structured output (`response_format`, jaxdecode/constraints): the shared tables stay outside
the beams; each beam carries its grammar state, gathered with the same parent indices as the
cache; the grammar mask is applied to the log-probabilities (as a logits processor, like the
min_new_tokens mask); a hypothesis whose grammar completes is finished like one ending on EOS
(finish reason `grammar_complete`). HF has no counterpart, so this part has no parity test.

Custom processors (`processors=[jd.LogitProcessor, ...]`, jaxdecode/research.py) run after
those masks on each beam's log-probabilities, every position in order, without renormalising
(HF applies its logits processors to the log-softmax the same way). Each beam carries its own
processor states, gathered with the same parent indices as the cache, and a finished
hypothesis keeps the states it had when it finished (returned for the best one). A beam's
context has no random key of its own: ctx.key derives from key data 0 and the step.
"""

from __future__ import annotations

import functools
from typing import Any, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np

from jaxdecode.device import constraints, decode, numerics
from jaxdecode.device import research as research_lib
from jaxdecode.config import SamplingParams
from jaxdecode.device.decode import GenerateOutput, bucket
from jaxdecode.model_api import DecoderModel, KVCache
from jaxdecode.prompts import token_rows
from jaxdecode.types import FinishReason

Array = jax.Array
EarlyStopping = Union[bool, str]
NEG = -1.0e9  # HF's "very large negative" marker; added, never multiplied, as HF does


def take_cache_rows(cache: KVCache, index: Array) -> KVCache:
    """Rows `index` of a cache (gather along the batch axis): beam reorder and broadcast."""
    return cache.replace(k=jnp.take(cache.k, index, axis=1), v=jnp.take(cache.v, index, axis=1),
                         lengths=jnp.take(cache.lengths, index, axis=0))


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


@functools.partial(jax.jit, static_argnums=(0, 4, 5, 6, 7), static_argnames=("research",))
def _beam_loop(model: DecoderModel, params: Any, cache: KVCache, logits: Array,
               width: int, buffer_len: int, num_candidates: int, early_stopping: EarlyStopping,
               widths: Array, max_new: Array, min_new: Array, length_penalty: Array,
               eos_mask: Array, gtables=None, gstate=None, row_eos=None, research=None,
               rstate=None):
    b, v = logits.shape
    constrained = gtables is not None   # static: a response_format was given
    w, nb, k = width, buffer_len, num_candidates
    es_true = early_stopping is True
    es_never = early_stopping == "never"
    lp = length_penalty.astype(jnp.float32)
    valid = jnp.arange(w)[None, :] < widths[:, None]                      # [B, W]
    top_mask = jnp.arange(k)[None, :] < widths[:, None]                   # [B, K]

    # Prompt cache broadcast to B * W rows (prefill happened once per prompt).
    cache = take_cache_rows(cache, jnp.repeat(jnp.arange(b), w))
    logits = jnp.repeat(logits, w, axis=0)

    run_score = jnp.where(jnp.arange(w)[None, :] == 0, 0.0, NEG) * jnp.ones((b, 1))
    run_score = jnp.where(valid, run_score, -jnp.inf).astype(jnp.float32)
    carry = dict(
        t=jnp.int32(0), go=jnp.bool_(True), cache=cache, logits=logits,
        run_tok=jnp.full((b, w, nb), -1, jnp.int32), run_lp=jnp.zeros((b, w, nb), jnp.float32),
        run_score=run_score,
        pool_tok=jnp.full((b, w, nb), -1, jnp.int32), pool_lp=jnp.zeros((b, w, nb), jnp.float32),
        pool_score=jnp.where(valid, NEG, -jnp.inf).astype(jnp.float32),
        pool_len=jnp.zeros((b, w), jnp.int32), pool_fin=jnp.zeros((b, w), bool),
        unsat=jnp.ones((b,), bool), pool_complete=jnp.zeros((b, w), bool))
    if constrained:  # per beam; gathered with the same parent indices as the cache
        carry["gstate"] = jnp.repeat(gstate[:, None], w, axis=1)
        beam_eos = jnp.repeat(row_eos, w, axis=0)
    custom = research is not None and bool(research.processors)  # static
    if custom:  # per beam [B, W, ...]; gathered like the cache; the pool keeps its own
        beam_rs = jax.tree.map(lambda x: jnp.repeat(x, w, axis=0), rstate)
        carry["pstates"] = jax.tree.map(lambda x: x.reshape((b, w) + x.shape[1:]),
                                        beam_rs.states)
        carry["pool_pstates"] = carry["pstates"]

    def body(c):
        t = c["t"]
        logp = numerics.log_softmax(c["logits"].astype(jnp.float32)).reshape(b, w, v)
        masked = jnp.where((t < min_new) & eos_mask[None, None, :], -jnp.inf, logp)
        if constrained:  # the grammar mask, on the log-probabilities like min_new_tokens
            masked = constraints.mask_logits(masked.reshape(b * w, v), gtables,
                                             c["gstate"].reshape(-1), beam_eos).reshape(b, w, v)
        if custom:  # custom processors, every position in order, on the log-probabilities
            flat = jax.tree.map(lambda x: x.reshape((b * w,) + x.shape[2:]), c["pstates"])
            bound = research_lib.Bound(
                research.processors,
                _custom_context(beam_rs, v, c["run_tok"], t, valid.reshape(-1)), flat)
            masked = bound.all_positions(masked.reshape(b * w, v)).reshape(b, w, v)
            after = jax.tree.map(lambda x: x.reshape((b, w) + x.shape[1:]), tuple(bound.states))
        acc = (masked + c["run_score"][:, :, None]).reshape(b, w * v)
        cand_score, cand_idx = jax.lax.top_k(acc, k)                      # [B, K], sorted
        src = (cand_idx // v).astype(jnp.int32)
        tok = (cand_idx % v).astype(jnp.int32)
        tok_lp = jnp.take_along_axis(logp.reshape(b, w * v), cand_idx, axis=1)
        cand_tok = _gather(c["run_tok"], src).at[:, :, t].set(tok)         # [B, K, NB]
        cand_lp = _gather(c["run_lp"], src).at[:, :, t].set(tok_lp)
        cand_ps = jax.tree.map(lambda x: _gather(x, src), after) if custom else None
        fin = eos_mask[tok] | (t + 1 >= max_new)
        complete = jnp.zeros_like(fin)
        if constrained:  # a completed grammar ends the hypothesis like EOS
            cand_g = constraints.next_state(gtables, _gather(c["gstate"], src).reshape(-1),
                                            tok.reshape(-1)).reshape(b, k)
            complete = constraints.completes(gtables, cand_g.reshape(-1)).reshape(b, k)
            fin = fin | complete

        # running beams: the W best unfinished candidates
        run_cand = cand_score + jnp.where(fin, NEG, 0.0)
        run_score, sel = jax.lax.top_k(run_cand, w)
        run_score = jnp.where(valid, run_score, -jnp.inf)
        run_tok, run_lp, run_src = _gather(cand_tok, sel), _gather(cand_lp, sel), _gather(src, sel)

        # finished pool: merge the finished top-W candidates, keep the W best
        length = (t + 1).astype(jnp.float32)
        did = fin & top_mask
        full = jnp.all(c["pool_fin"] | ~valid, axis=1) & es_true
        score = cand_score / length ** lp
        score = score + jnp.where(full, NEG, 0.0)[:, None]
        score = score + jnp.where(c["unsat"], 0.0, NEG)[:, None]
        score = score + jnp.where(did, 0.0, NEG)
        m_score = jnp.concatenate([c["pool_score"], score], axis=1)
        pool_score, pick = jax.lax.top_k(m_score, w)
        pool_score = jnp.where(valid, pool_score, -jnp.inf)
        m_len = jnp.concatenate([c["pool_len"], jnp.broadcast_to(t + 1, (b, k))], axis=1)
        pool_tok = _gather(jnp.concatenate([c["pool_tok"], cand_tok], axis=1), pick)
        pool_lp = _gather(jnp.concatenate([c["pool_lp"], cand_lp], axis=1), pick)
        pool_len = _gather(m_len, pick)
        pool_fin = _gather(jnp.concatenate([c["pool_fin"], did], axis=1), pick) & valid
        pool_complete = _gather(jnp.concatenate([c["pool_complete"], complete], axis=1), pick)

        # can a running beam still beat the worst finished one? (HF's heuristic, cumulative)
        hyp_len = jnp.where(es_never & (lp > 0), max_new.astype(jnp.float32), length)
        best = run_score[:, 0] / hyp_len ** lp
        all_fin = jnp.all(pool_fin | ~valid, axis=1)
        worst = jnp.where(all_fin, jnp.min(jnp.where(valid, pool_score, jnp.inf), axis=1), NEG)
        unsat = c["unsat"] & (best > worst)
        frozen = ~unsat | (all_fin & es_true)
        go = (t + 1 < max_new) & ~jnp.all(frozen)

        def advance(cache):
            index = (jnp.arange(b)[:, None] * w + run_src).reshape(-1)
            cache = take_cache_rows(cache, index)
            toks = run_tok[:, :, t].reshape(-1, 1)
            new_logits, cache = model.forward(params, toks, cache.lengths[:, None], cache,
                                              lengths=jnp.ones((b * w,), jnp.int32))
            return cache, new_logits[:, 0].astype(jnp.float32)

        cache, new_logits = jax.lax.cond(go, advance, lambda cache: (cache, c["logits"]),
                                         c["cache"])
        out = dict(t=t + 1, go=go, cache=cache, logits=new_logits, run_tok=run_tok,
                   run_lp=run_lp, run_score=run_score, pool_tok=pool_tok, pool_lp=pool_lp,
                   pool_score=pool_score, pool_len=pool_len, pool_fin=pool_fin, unsat=unsat,
                   pool_complete=pool_complete)
        if constrained:
            out["gstate"] = _gather(cand_g, sel)
        if custom:
            out["pstates"] = jax.tree.map(lambda x: _gather(x, sel), cand_ps)
            out["pool_pstates"] = jax.tree.map(
                lambda old, new: _gather(jnp.concatenate([old, new], axis=1), pick),
                c["pool_pstates"], cand_ps)
        return out

    c = jax.lax.while_loop(lambda c: c["go"], body, carry)
    best_states = jax.tree.map(lambda x: x[:, 0], c["pool_pstates"]) if custom else None
    return (c["pool_tok"], c["pool_lp"], c["pool_score"], c["pool_len"], c["pool_complete"],
            best_states)


def beam_search(model: DecoderModel, params: Any, prompt_ids: Sequence[Sequence[int]], *,
                num_beams: Union[int, Sequence[int]], length_penalty: float = 1.0,
                early_stopping: EarlyStopping = False, max_new_tokens: int,
                num_return_sequences: int = 1, min_new_tokens: int = 0,
                eos_token_ids: Optional[Sequence[int]] = None,
                response_format: Optional[dict] = None, tokenizer: Any = None,
                processors: Sequence[Any] = ()) -> GenerateOutput:
    """Beam search over ragged prompts, entirely on device (DESIGN.md `jd.beam_search`).

    num_beams: one width for every row, or one per row (padded to the widest and masked).
    length_penalty, early_stopping (True / False / "never"), max_new_tokens, min_new_tokens and
    num_return_sequences mean what they mean in HF `generate`; EOS ids default to
    `model.config.eos_token_ids`. Returns a GenerateOutput with the best hypothesis per row and
    `beams[row] = [(token ids, score), ...]` (num_return_sequences of them, best first).
    `response_format` (with `tokenizer`, as in `generate`) constrains every row: the grammar
    mask applies to the log-probabilities, each beam carries its own grammar state, and a
    hypothesis whose grammar completes is finished like one that ends on EOS.
    `processors`: custom jd.LogitProcessor (the module docstring); the best hypothesis'
    final states come back in `processor_states`.
    """
    prompt_ids = token_rows(prompt_ids)
    b = len(prompt_ids) if prompt_ids else 0
    widths = [num_beams] * b if isinstance(num_beams, (int, np.integer)) else list(num_beams)
    if len(widths) != b or any(isinstance(x, bool) or int(x) < 1 for x in widths):
        raise ValueError(f"num_beams: expected a width >= 1, or one per row ({b} rows), "
                         f"got {num_beams!r}")
    widths = [int(x) for x in widths]
    if early_stopping not in (True, False, "never"):
        raise ValueError(f"early_stopping: must be True, False or 'never', got {early_stopping!r}")
    n = int(max_new_tokens)
    if n < 1:
        raise ValueError(f"max_new_tokens: must be >= 1, got {max_new_tokens}")
    if not 0 <= int(min_new_tokens) <= n:
        raise ValueError(f"min_new_tokens: must be in [0, max_new_tokens], got {min_new_tokens}")
    if not 1 <= num_return_sequences <= min(widths or [1]):
        raise ValueError(f"num_return_sequences: must be in [1, num_beams], "
                         f"got {num_return_sequences}")
    cfg = model.config
    longest = max((len(p) for p in prompt_ids), default=0)
    if longest and longest + n - 1 > cfg.max_len:
        raise ValueError(f"max_new_tokens: prompt ({longest}) + {n} new tokens exceed the "
                         f"model's max_len {cfg.max_len}")
    eos = tuple(cfg.eos_token_ids if eos_token_ids is None else eos_token_ids)
    eos = tuple(dict.fromkeys(int(i) for i in eos if 0 <= int(i) < cfg.vocab_size))

    # validation of the prompts and the prefill (once per prompt) are `generate`'s
    sp = SamplingParams(temperature=0.0, max_tokens=n, response_format=response_format)
    setup = research_lib.configure(model, processors=processors)
    state, _, _ = decode.prepare(model, params, prompt_ids, sp, n, None, eos_token_ids=eos,
                                 tokenizer=tokenizer, research=setup)
    eos_mask = np.zeros((cfg.vocab_size,), bool)
    eos_mask[list(eos)] = True
    # a lone width-1 row searches with a masked second beam (numerics.MIN_ROWS: no program of
    # one row); its results are those of width 1 (the padding of per-row widths)
    width = max(widths) if b * max(widths) >= numerics.MIN_ROWS else numerics.MIN_ROWS
    num_candidates = max(2, 1 + len(eos)) * width
    buffer_len = bucket(n)
    grammar = {} if state.grammar is None else dict(
        gtables=state.grammar, gstate=state.grammar_state, row_eos=state.rows.eos_mask)
    tok, lps, score, length, complete, best_states = _beam_loop(
        model, params, state.cache, state.logits, width, buffer_len, num_candidates,
        early_stopping, np.asarray(widths, np.int32), np.int32(n), np.int32(min_new_tokens),
        np.float32(length_penalty), eos_mask, **grammar,
        research=None if setup is None else setup.config, rstate=state.research)
    tok, lps, score, length, complete = (np.asarray(x) for x in (tok, lps, score, length,
                                                                  complete))

    token_ids = np.full((b, n), -1, np.int32)
    logprobs = np.zeros((b, n), np.float32)
    lengths = length[:, 0].astype(np.int32)
    beams, reasons = [], []
    for r in range(b):
        ln = int(lengths[r])
        token_ids[r, :ln] = tok[r, 0, :ln]
        logprobs[r, :ln] = lps[r, 0, :ln]
        beams.append([(tok[r, j, : length[r, j]].tolist(), float(score[r, j]))
                      for j in range(num_return_sequences)])
        ended_on_eos = ln > 0 and int(tok[r, 0, ln - 1]) in eos
        reasons.append(FinishReason.EOS if ended_on_eos else FinishReason.GRAMMAR_COMPLETE
                       if complete[r, 0] else FinishReason.MAX_OUTPUT_TOKENS)
    custom = {} if setup is None else dict(
        processor_order=research_lib.describe_order(setup.config.processors, beam=True),
        processor_states=research_lib.final_states(setup.config, best_states))
    return GenerateOutput(token_ids=token_ids, lengths=lengths, finish_reasons=reasons,
                          errors=[None] * b, logprobs=logprobs, beams=beams, **custom)
