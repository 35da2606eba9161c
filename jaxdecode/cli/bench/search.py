"""Search and speculation (contract §10): beam search against greedy decoding, speculative decoding
(a draft model and prompt lookup, several k) against plain decoding."""

from __future__ import annotations

from typing import Optional, Sequence

from jaxdecode.cli.bench.timing import BenchConfig, prompts, timed
from jaxdecode.config import SamplingParams
from jaxdecode.device.decode import generate


def time_beam_search(model, params, cfg: BenchConfig, batch: int = 1, num_beams: int = 4,
                     prompt_ids: Optional[Sequence[Sequence[int]]] = None) -> dict:
    """Beam search against greedy decoding on the same prompts and model.

    EOS is disabled for both (every beam runs to `new_tokens`), so the work is fixed:
    tokens_per_s counts output tokens of the returned sequences (batch * new_tokens / s);
    beam_row_tokens_per_s counts every beam's tokens (x num_beams)."""
    from jaxdecode.device.beam import beam_search

    ids = [list(p) for p in prompt_ids] if prompt_ids is not None else prompts(
        batch, cfg.prompt_len, model.config.vocab_size, cfg.seed)
    n = cfg.new_tokens
    sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    greedy_s, _ = timed(lambda: generate(model, params, ids, sp).token_ids, cfg.repeats)
    beam_s, _ = timed(lambda: beam_search(model, params, ids, num_beams=num_beams,
                                           max_new_tokens=n, eos_token_ids=()).token_ids,
                       cfg.repeats)
    b = len(ids)
    return {"batch": b, "num_beams": num_beams, "new_tokens": n,
            "greedy_tokens_per_s": b * n / greedy_s, "beam_tokens_per_s": b * n / beam_s,
            "beam_row_tokens_per_s": b * num_beams * n / beam_s,
            "beam_vs_greedy": greedy_s / beam_s}


# A code-editing prompt: a function, then the start of its edited copy. The continuation can
# reuse long spans of the prompt, the case prompt lookup and small drafts are made for.
CODE_EDIT_PROMPT = '''def moving_average(values, window):
    """Return the moving average of values over window items."""
    result = []
    total = 0
    for index, value in enumerate(values):
        total += value
        if index >= window:
            total -= values[index - window]
        if index >= window - 1:
            result.append(total / window)
    return result


# The same function, with values renamed to items.
def moving_average(items, window):'''


def time_speculative(target, target_params, draft=None, draft_params=None,
                     cfg: Optional[BenchConfig] = None, ks: Sequence[int] = (2, 4, 6),
                     batch: int = 1, prompt_ids: Optional[Sequence[Sequence[int]]] = None,
                     temperature: float = 0.0) -> dict:
    """Speculative decoding (a draft model when given, and prompt lookup) for each k in `ks`
    against plain decoding of the target: same prompts, same settings (greedy by default, so
    the outputs must be identical), one process. Plain decoding is timed before and after the
    speculative runs and the faster of the two is the baseline (drift shows as their gap).

    Reports tokens/s of each, the speed-up, the mean accepted length (tokens per target verify
    pass; 1.0 means the draft never helps) and the acceptance rate (accepted / proposed)."""
    from jaxdecode.device.speculative import PROMPT_LOOKUP, speculative_generate

    cfg = cfg or BenchConfig()
    ids = [list(p) for p in prompt_ids] if prompt_ids is not None else prompts(
        batch, cfg.prompt_len, target.config.vocab_size, cfg.seed)
    n = cfg.new_tokens
    sp = SamplingParams(temperature=temperature, max_tokens=n, ignore_eos=True, seed=cfg.seed)
    plain = lambda: generate(target, target_params, ids, sp)  # noqa: E731
    first_s, base = timed(plain, cfg.repeats)
    b = len(ids)
    kinds = [(PROMPT_LOOKUP, PROMPT_LOOKUP, None)]
    if draft is not None:
        kinds.insert(0, ("draft_model", draft, draft_params))
    rows = []
    for name, d, dp in kinds:
        for k in ks:
            secs, out = timed(lambda: speculative_generate(target, target_params, d, dp, ids,
                                                            sp, k=k), cfg.repeats)
            s = out.stats
            rows.append({"draft": name, "k": k, "seconds": secs,
                         "mean_accepted_length": s["mean_accepted_length"],
                         "acceptance_rate": float(s["accepted"].sum() / max(1, s["proposed"].sum())),
                         "same_tokens_as_plain": bool((out.token_ids == base.token_ids).all())})
    last_s, _ = timed(plain, cfg.repeats)
    base_s = min(first_s, last_s)
    for r in rows:
        secs = r.pop("seconds")
        r.update(tokens_per_s=b * n / secs, speedup=base_s / secs)
    best = max(rows, key=lambda r: r["speedup"])
    return {"batch": b, "ks": list(ks), "new_tokens": n, "temperature": temperature,
            "prompt_tokens": [len(p) for p in ids], "plain_tokens_per_s": b * n / base_s,
            "plain_drift": max(first_s, last_s) / base_s - 1, "rows": rows,
            "best": {"draft": best["draft"], "k": best["k"], "speedup": best["speedup"]}}
