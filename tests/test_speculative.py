"""contract §10 speculative decoding: greedy output equals the target's greedy output (draft model,
the target as its own draft, prompt lookup; one branch or several), the sampled distribution
equals the target's (chi-square over thousands of seeded rows), acceptance counters add up, and
no token past an ending is ever emitted."""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxdecode as jd
from models import Llama, LlamaConfig
from jaxdecode.model_api import ModelConfig
from tests.scripted import Bigram, ScriptedModel

EOS = 1
LOOKUP = "prompt_lookup"


def llama(seed, layers=2, vocab=96, scale=0.3):
    cfg = LlamaConfig(vocab_size=vocab, num_layers=layers, num_heads=4, num_kv_heads=2,
                      head_dim=8, max_len=128, hidden_size=32, intermediate_size=64,
                      eos_token_ids=(EOS,))
    model = Llama(cfg)
    return model, model.init_params(jax.random.key(seed), scale=scale)


@pytest.fixture(scope="module")
def target():
    return llama(0)


@pytest.fixture(scope="module")
def draft():
    return llama(1, layers=1)


def greedy(n, **kw):
    return jd.SamplingParams(temperature=0.0, max_tokens=n, **kw)


PROMPTS = [[5, 6, 7, 5, 6, 7, 5, 6], [30, 31, 32], [9], [40, 41, 40, 41]]
ROWS = [greedy(20), greedy(13, ignore_eos=True), greedy(7, min_tokens=3),
        greedy(11, repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.2)]


def check_counters(out, k, branches=1):
    s = out.stats
    np.testing.assert_array_equal(s["accepted"] + s["target_tokens"], out.lengths)
    np.testing.assert_array_equal(s["proposed"], k * branches * s["iterations"])
    assert np.all(s["accepted"] <= s["proposed"]) and np.all(s["target_tokens"] <= s["iterations"])


@pytest.mark.parametrize("kind", ["draft", "self", LOOKUP])
def test_speculative_greedy_equals_target_greedy(target, draft, kind):
    tm, tp = target
    dm, dp = {"draft": draft, "self": target, LOOKUP: (LOOKUP, None)}[kind]
    k = 4
    want = jd.generate(tm, tp, PROMPTS, ROWS)
    out = jd.speculative_generate(tm, tp, dm, dp, PROMPTS, ROWS, k=k)
    for r in range(len(PROMPTS)):
        assert out.tokens(r) == want.tokens(r), f"{kind} row {r}"
    assert out.finish_reasons == want.finish_reasons
    np.testing.assert_array_equal(out.token_ids, want.token_ids)
    np.testing.assert_allclose(out.logprobs, want.logprobs, atol=1e-4)
    check_counters(out, k)
    if kind == "self":   # every proposal is the target's own argmax: k + 1 tokens per pass
        np.testing.assert_array_equal(out.stats["iterations"], -(-out.lengths // (k + 1)))
        assert out.stats["mean_accepted_length"] > k
    if kind == LOOKUP:   # the repetitive first prompt gets proposals accepted
        assert out.stats["accepted"][0] > 0


@pytest.mark.parametrize("family", ["qwen3", "gemma2", "gemma3", "phi3", "mixtral",
                                    "qwen3_moe"])
def test_speculative_greedy_with_a_same_family_draft(tiny_hf_checkpoint, family):
    """A family's tiny HF checkpoint with a draft of its own family (its first layer alone):
    greedy speculative tokens equal the target's greedy tokens."""
    import dataclasses

    import models

    tm, tp, _ = models.load(tiny_hf_checkpoint(family))
    c = tm.config
    one = dict(num_layers=1, **({"layer_types": c.layer_types[:1]}
                                if isinstance(tm, models.Gemma) else {}),
               **({"sparse_layers": c.sparse_layers[:1]} if isinstance(tm, models.Moe) else {}))
    dm = dataclasses.replace(tm, config=dataclasses.replace(c, **one))
    dp = dict(tp, layers=tp["layers"][:1])
    prompts = [[5, 6, 7, 5, 6, 7], [30, 31, 32, 33, 34], [9]]
    rows = [greedy(12, ignore_eos=True), greedy(9, ignore_eos=True), greedy(5, ignore_eos=True)]
    want = jd.generate(tm, tp, prompts, rows)
    out = jd.speculative_generate(tm, tp, dm, dp, prompts, rows, k=3)
    np.testing.assert_array_equal(out.token_ids, want.token_ids)
    check_counters(out, 3)


def test_speculative_no_overshoot_past_eos_stop_or_max_tokens():
    script = [0, 5, 6, EOS, 7, 9, 7, 7, 7, 7, 7, 7]
    model = ScriptedModel.make(script, eos_token_ids=(EOS,))
    prompts = [[3, 4]] * 4
    rows = [greedy(10), greedy(2), greedy(10, ignore_eos=True, stop_token_ids=(9,)),
            greedy(10, ignore_eos=True)]
    for dm in (model, LOOKUP):
        out = jd.speculative_generate(model, {}, dm, {}, prompts, rows, k=4)
        assert out.tokens(0) == [5, 6, EOS]
        assert out.tokens(1) == [5, 6]
        assert out.tokens(2) == [5, 6, EOS, 7, 9]
        assert out.tokens(3) == [5, 6, EOS, 7, 9, 7, 7, 7, 7, 7]
        assert out.finish_reasons == [jd.FinishReason.EOS, jd.FinishReason.MAX_OUTPUT_TOKENS,
                                      jd.FinishReason.STOP_SEQUENCE,
                                      jd.FinishReason.MAX_OUTPUT_TOKENS]
        assert np.all(out.token_ids[0, 3:] == -1) and np.all(out.token_ids[1, 2:] == -1)
        check_counters(out, 4)
        if dm is model:  # an exact draft: the run up to EOS is accepted whole, no target token
            assert out.stats["accepted"][0] == 3 and out.stats["target_tokens"][0] == 0


# -- branches (greedy only) ----------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["draft", LOOKUP])
def test_speculative_branches_greedy_equals_target_greedy(target, draft, kind):
    tm, tp = target
    dm, dp = draft if kind == "draft" else (LOOKUP, None)
    want = jd.generate(tm, tp, PROMPTS, ROWS)
    one = jd.speculative_generate(tm, tp, dm, dp, PROMPTS, ROWS, k=3)
    for nb in (2, 3):
        out = jd.speculative_generate(tm, tp, dm, dp, PROMPTS, ROWS, k=3, num_branches=nb)
        np.testing.assert_array_equal(out.token_ids, want.token_ids)
        assert out.finish_reasons == want.finish_reasons
        np.testing.assert_allclose(out.logprobs, want.logprobs, atol=1e-4)
        check_counters(out, 3, nb)
        # branch 0 is the single-branch proposal: more branches never accept less per round
        assert out.stats["mean_accepted_length"] >= one.stats["mean_accepted_length"]


def test_speculative_branches_lookup_older_match_accepts_more():
    # history 2 3 4 5 2 3 6 7 | 2: the last token 2 occurred at 0 and 4. The most recent match
    # proposes 3 6 7 2 (one accepted), the older one 3 4 5 2, which the target follows.
    script = [0] * 8 + [3, 4, 5, 2, 3] + [0] * 8      # after position p the target says script[p]
    model = ScriptedModel.make(script)
    prompt = [2, 3, 4, 5, 2, 3, 6, 7, 2]
    stats = {}
    for nb in (1, 2, 3):
        out = jd.speculative_generate(model, {}, LOOKUP, None, [prompt], greedy(5), k=4,
                                      num_branches=nb)
        assert out.tokens(0) == [3, 4, 5, 2, 3]
        check_counters(out, 4, nb)
        stats[nb] = {n: int(out.stats[n][0]) for n in ("accepted", "target_tokens", "iterations")}
    # 1 branch: round 1 accepts 3, the target says 4; round 2 (3-gram 2 3 4 at 0) accepts 5 2 3
    assert stats[1] == {"accepted": 4, "target_tokens": 1, "iterations": 2}
    # 2 branches: branch 1 proposes 3 4 5 2, all accepted, plus the bonus 3: one round
    assert stats[2] == stats[3] == {"accepted": 4, "target_tokens": 1, "iterations": 1}


def test_speculative_branches_draft_second_choice_accepts_more():
    # target: x -> x + 1 (mod 8). The draft agrees except after 2, where it prefers 7 over 3.
    def bigram(table):
        cfg = ModelConfig(vocab_size=8, num_layers=1, num_heads=1, num_kv_heads=1, head_dim=1,
                          max_len=64, eos_token_ids=())
        return Bigram(cfg, tuple(map(tuple, table.tolist())))

    nxt = 5.0 * np.roll(np.eye(8), 1, axis=1)
    wrong = nxt.copy()
    wrong[2] = 0.0
    wrong[2, 7], wrong[2, 3] = 5.0, 3.0
    tm, dm = bigram(nxt), bigram(wrong)
    stats = {}
    for nb in (1, 2):
        out = jd.speculative_generate(tm, {}, dm, {}, [[2]], greedy(5), k=4, num_branches=nb)
        assert out.tokens(0) == [3, 4, 5, 6, 7]
        check_counters(out, 4, nb)
        stats[nb] = {n: int(out.stats[n][0]) for n in ("accepted", "target_tokens", "iterations")}
    # 1 branch: 7 0 1 2 is rejected at once (the target says 3), then 4 5 6 7 accepted
    assert stats[1] == {"accepted": 4, "target_tokens": 1, "iterations": 2}
    # 2 branches: branch 1 starts with the draft's second choice 3 -> 3 4 5 6, plus the bonus 7
    assert stats[2] == {"accepted": 4, "target_tokens": 1, "iterations": 1}


def test_speculative_bad_arguments_name_the_field(target):
    tm, tp = target
    with pytest.raises(ValueError, match="^num_branches.*temperature"):  # exact for greedy only
        jd.speculative_generate(tm, tp, tm, tp, [[1]], jd.SamplingParams(max_tokens=2),
                                num_branches=2)
    with pytest.raises(ValueError, match="^num_branches"):
        jd.speculative_generate(tm, tp, tm, tp, [[1]], greedy(2), num_branches=0)
    with pytest.raises(ValueError, match="^k"):
        jd.speculative_generate(tm, tp, tm, tp, [[1]], greedy(2), k=0)
    small = ScriptedModel.make([0, 1], vocab_size=8)
    with pytest.raises(ValueError, match="^draft"):
        jd.speculative_generate(tm, tp, small, {}, [[1]], greedy(2))


# -- the target distribution is preserved (chi-square) -------------------------------------------



def two_token_distribution(first_logits, second_logits, sp):
    """Exact P(y1, y2) under the contract §3 processors: first_logits [V], second_logits [V, V]
    (the logits after y1). Penalties see y1 in the output (no repetition penalty here)."""
    v = first_logits.shape[0]
    p1 = np.exp(np.asarray(jd.process_logits(first_logits[None], sp), np.float64))[0]
    p2 = np.exp(np.asarray(jd.process_logits(second_logits, [sp] * v,
                                             output_ids=np.arange(v)[:, None]), np.float64))
    return p1[:, None] * p2


def chi_square_pvalue(samples, probs):
    """samples int[N, 2]; probs [V, V]. Cells expected below 5 are pooled; a sample in a cell of
    probability 0 fails outright."""
    v = probs.shape[0]
    counts = np.bincount(samples[:, 0] * v + samples[:, 1], minlength=v * v).astype(np.float64)
    expected = probs.reshape(-1) * len(samples)
    assert counts[probs.reshape(-1) == 0].sum() == 0, "a token the target never emits appeared"
    big = expected >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    keep = exp > 0
    stat = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    dof = int(keep.sum()) - 1
    return float(jax.scipy.stats.chi2.sf(stat, dof)), dof


N_SAMPLES = 4000
SETTINGS = {
    "plain": dict(temperature=1.0),
    "processed": dict(temperature=0.7, top_p=0.9, frequency_penalty=1.5, presence_penalty=0.5),
}


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("kind,k", [("draft", 1), ("draft", 3), (LOOKUP, 2)])
def test_speculative_preserves_target_distribution(setting, kind, k):
    tm, dm = Bigram.random(0), Bigram.random(1)
    prompt = [1, 2, 3, 1, 2]                 # lookup proposes 3, 1, ...
    sp = jd.SamplingParams(n=N_SAMPLES, seed=123, max_tokens=2, **SETTINGS[setting])
    out = jd.speculative_generate(tm, {}, dm if kind == "draft" else LOOKUP, {}, [prompt], sp,
                                  k=k)
    assert out.token_ids.shape == (N_SAMPLES, 2) and np.all(out.lengths == 2)
    table = np.asarray(tm.table, np.float32)
    probs = two_token_distribution(table[prompt[-1]], table, sp)
    pvalue, dof = chi_square_pvalue(out.token_ids, probs)
    assert pvalue > 1e-3, (pvalue, dof)
    check_counters(out, k)
    s = out.stats
    assert 0 < s["accepted"].sum() < s["proposed"].sum()      # both paths were taken
    # the draft alone would give a different distribution: the test can tell them apart
    if kind == "draft" and setting == "plain":
        dtable = np.asarray(dm.table, np.float32)
        wrong = two_token_distribution(dtable[prompt[-1]], dtable, sp)
        assert chi_square_pvalue(out.token_ids, wrong)[0] < 1e-6


def test_speculative_sampling_with_rollback_on_a_real_cache():
    # k = 1 and two tokens: a rejected first proposal is written into the target's cache and
    # must be rolled back before the second pass, which then samples y2 after the residual y1.
    tm, tp = llama(3, vocab=16, scale=0.6)
    dm, dp = llama(4, layers=1, vocab=16, scale=0.6)
    prompt = [3, 4, 5]
    sp = jd.SamplingParams(n=N_SAMPLES, seed=7, max_tokens=2, top_k=10, ignore_eos=True)
    out = jd.speculative_generate(tm, tp, dm, dp, [prompt], sp, k=1)
    full = np.asarray(tm.logits(tp, jnp.asarray([prompt + [y] for y in range(16)])))
    probs = two_token_distribution(full[0, len(prompt) - 1], full[:, len(prompt)], sp)
    pvalue, dof = chi_square_pvalue(out.token_ids, probs)
    assert pvalue > 1e-3, (pvalue, dof)
    assert 0 < out.stats["accepted"].sum() < out.stats["proposed"].sum()


def test_speculative_X1_seeded_row_same_alone_and_in_batch():
    tm, dm = Bigram.random(0), Bigram.random(1)
    sp = jd.SamplingParams(seed=99, max_tokens=12)
    run = lambda prompts, rows: jd.speculative_generate(tm, {}, dm, {}, prompts, rows, k=3)  # noqa: E731
    a = run([[1, 2], [4], [5, 6, 7]], [sp, jd.SamplingParams(seed=1, max_tokens=5),
                                       jd.SamplingParams(seed=2, temperature=0.5)])
    b = run([[4], [6, 6, 6], [1, 2]], [jd.SamplingParams(seed=3, top_k=2),
                                       jd.SamplingParams(seed=4, max_tokens=3), sp])
    assert a.tokens(0) == b.tokens(2) and len(a.tokens(0)) == 12


def test_speculative_no_recompile_for_new_requests_in_seen_bucket():
    tm, dm = Bigram.random(0), Bigram.random(1)
    run = lambda prompts, rows: jd.speculative_generate(tm, {}, dm, {}, prompts, rows, k=2)  # noqa: E731
    run([[1, 2], [3]], [jd.SamplingParams(seed=0, max_tokens=6), greedy(4)])
    before = jd.compilation_count()
    for i in range(3):
        run([[4, 5, 6], [7] * (i + 1)],
            [jd.SamplingParams(seed=i, temperature=0.5 + i, top_k=i, max_tokens=3 + i,
                               repetition_penalty=1.1 + i),
             greedy(5, stop_token_ids=(i + 2,), min_tokens=i)])
    assert jd.compilation_count() == before


# -- structured output: grammar state through the proposed run and its rollback ------------------

TINY_BYTES = [None, None, b"a", b"b", b"ab", b"x", b"y", b"1", b"2"] + [None] * 7  # vocab 16
REGEX = {"type": "regex", "pattern": "(a|b|x)+[12]"}


def test_speculative_grammar_greedy_equals_target_and_samples_match():
    pytest.importorskip("outlines_core")
    tm, tp = llama(3, vocab=16, scale=0.6)
    dm, dp = llama(4, layers=1, vocab=16, scale=0.6)
    choice = {"type": "choice", "choices": ["ab1", "x2", "bbb2"]}
    prompts = [[3, 4, 5], [5, 5], [2], [6, 7, 2]]
    rows = [greedy(12, response_format=REGEX), greedy(12, response_format=choice),
            greedy(9, ignore_eos=True), greedy(12, response_format=REGEX, ignore_eos=True)]
    want = jd.generate(tm, tp, prompts, rows, tokenizer=TINY_BYTES)
    assert jd.FinishReason.GRAMMAR_COMPLETE in want.finish_reasons
    # the target as its own draft: whole runs are accepted, so every position of a pass is
    # masked with its own state along the path (a weak draft mostly tests position 1 only)
    for dm_, dp_, nb in ((tm, tp, 1), (dm, dp, 1), (LOOKUP, None, 1), (dm, dp, 2),
                         (LOOKUP, None, 2)):
        out = jd.speculative_generate(tm, tp, dm_, dp_, prompts, rows, k=3, tokenizer=TINY_BYTES,
                                      num_branches=nb)
        for r in range(len(prompts)):
            assert out.tokens(r) == want.tokens(r), r
        assert out.finish_reasons == want.finish_reasons
        check_counters(out, 3, nb)
        if dm_ is tm:
            assert out.stats["accepted"].sum() > out.stats["target_tokens"].sum()
    # sampled: every output is in the language (the residual keeps the mask), none overshoots
    sp = jd.SamplingParams(n=64, seed=5, max_tokens=12, response_format=REGEX, ignore_eos=True)
    out = jd.speculative_generate(tm, tp, tm, tp, [[3, 4]], sp, k=3, tokenizer=TINY_BYTES)
    import re
    for r in range(64):
        text = b"".join(TINY_BYTES[t] for t in out.tokens(r)).decode()
        if out.finish_reasons[r] == jd.FinishReason.GRAMMAR_COMPLETE:
            assert re.fullmatch(REGEX["pattern"], text), text
        else:
            assert out.finish_reasons[r] == jd.FinishReason.MAX_OUTPUT_TOKENS
            assert re.fullmatch("(a|b|x|ab)*", text) and out.lengths[r] == 12, text
