"""contract §10 beam search: parity with Hugging Face `generate(num_beams=...)` (transformers 5.x
beam semantics), greedy equivalence, per-row widths and a hand-computable bigram example."""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np
import pytest

import jaxdecode as jd
import models
from jaxdecode.model_api import ModelConfig
from tests.scripted import Bigram

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

PROMPTS = ["the quick brown fox", "hello world this is a test"]

# (num_beams, length_penalty, early_stopping, max_new_tokens, num_return_sequences[, min_new])
CONFIGS = {
    "llama": [(3, 1.0, False, 7, 2), (4, 2.0, True, 6, 4, 3)],
    "llama3": [(2, 0.5, "never", 6, 2), (4, 1.0, False, 5, 1)],
    "mistral": [(3, -0.5, False, 7, 3), (2, 1.0, True, 6, 2)],
    "qwen2": [(4, 1.5, "never", 6, 2), (3, 0.0, False, 6, 1)],
    "gpt2": [(3, 1.0, False, 7, 2), (2, 2.0, "never", 5, 2)],
}


@pytest.fixture(autouse=True)
def _full_f32_matmuls():
    with jax.default_matmul_precision("highest"):
        yield


@functools.lru_cache(maxsize=None)
def _hf_model(path):
    return transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager").eval()


@functools.lru_cache(maxsize=None)
def _family(tiny_path):
    model, params, tok = models.load(tiny_path)
    prompts = [tok(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]
    # The two most frequent greedy tokens as EOS ids, so that beams really finish at different
    # lengths (the finished pool, length penalty and early stopping all matter) and HF keeps
    # 3 * num_beams candidates.
    greedy = jd.generate(model, params, prompts,
                         jd.SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    ids, counts = np.unique(greedy.token_ids, return_counts=True)
    eos = tuple(int(i) for i in ids[np.argsort(-counts, kind="stable")[:2]])
    return model, params, prompts, eos


def hf_beams(path, prompt, eos, num_beams, lp, es, n, nrs, min_new=0):
    hf = _hf_model(str(path))
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt),
                                                                             dtype=torch.long),
                          do_sample=False, num_beams=num_beams, length_penalty=lp,
                          min_new_tokens=min_new,
                          early_stopping=es, max_new_tokens=n, num_return_sequences=nrs,
                          eos_token_id=list(eos), pad_token_id=0, return_dict_in_generate=True,
                          output_scores=True)
    lens = (out.beam_indices >= 0).sum(1).tolist()
    seqs = [out.sequences[j, len(prompt): len(prompt) + lens[j]].tolist() for j in range(nrs)]
    return seqs, out.sequences_scores.tolist()


@pytest.mark.parametrize("name", list(CONFIGS))
def test_beam_search_matches_hf(tiny_hf_checkpoint, name):
    path = tiny_hf_checkpoint(name)
    model, params, prompts, eos = _family(str(path))
    finished_early = 0
    for num_beams, lp, es, n, nrs, *min_new in CONFIGS[name]:
        min_new = min_new[0] if min_new else 0
        out = jd.beam_search(model, params, prompts, num_beams=num_beams, length_penalty=lp,
                             early_stopping=es, max_new_tokens=n, num_return_sequences=nrs,
                             eos_token_ids=eos, min_new_tokens=min_new)
        for r, prompt in enumerate(prompts):
            seqs, scores = hf_beams(path, prompt, eos, num_beams, lp, es, n, nrs, min_new)
            assert all(len(s) > min_new for s in seqs)
            where = f"{name} beams={num_beams} lp={lp} es={es} prompt {r}"
            assert out.tokens(r) == seqs[0], where
            assert [t for t, _ in out.beams[r]] == seqs, where
            np.testing.assert_allclose([s for _, s in out.beams[r]], scores, atol=1e-4,
                                       err_msg=where)
            assert scores == sorted(scores, reverse=True)
            finished_early += any(len(s) < n for s in seqs)
            reason = jd.FinishReason.EOS if seqs[0][-1] in eos else jd.FinishReason.MAX_OUTPUT_TOKENS
            assert out.finish_reasons[r] == reason
    assert finished_early, f"{name}: no beam ended on EOS; the test lost its bite"


def test_beam_search_one_beam_equals_greedy(tiny_hf_checkpoint):
    model, params, prompts, eos = _family(str(tiny_hf_checkpoint("llama")))
    sp = jd.SamplingParams(temperature=0.0, max_tokens=8)
    for eos_ids in [eos, (127,)]:
        greedy = jd.generate(dataclasses.replace(
            model, config=dataclasses.replace(model.config, eos_token_ids=eos_ids)),
            params, prompts, sp)
        beam = jd.beam_search(model, params, prompts, num_beams=1, max_new_tokens=8,
                              eos_token_ids=eos_ids)
        for r in range(len(prompts)):
            assert beam.tokens(r) == greedy.tokens(r)
        assert beam.finish_reasons == greedy.finish_reasons
        np.testing.assert_allclose(beam.logprobs, greedy.logprobs, atol=1e-5)


def test_beam_search_per_row_width_equals_separate_calls(tiny_hf_checkpoint):
    model, params, prompts, eos = _family(str(tiny_hf_checkpoint("llama")))
    kw = dict(length_penalty=1.0, max_new_tokens=6, eos_token_ids=eos)
    mixed = jd.beam_search(model, params, prompts, num_beams=[2, 4], **kw)
    for r, width in enumerate([2, 4]):
        alone = jd.beam_search(model, params, [prompts[r]], num_beams=width, **kw)
        assert mixed.tokens(r) == alone.tokens(0)
        np.testing.assert_allclose(mixed.beams[r][0][1], alone.beams[0][0][1], atol=1e-6)


# -- a hand-computable example -------------------------------------------------------------------



def bigram(probs: dict, vocab=4, eos=(3,)):
    table = np.full((vocab, vocab), -1e4, np.float64)
    for x, row in probs.items():
        for y, p in row.items():
            table[x, y] = np.log(p)
    cfg = ModelConfig(vocab_size=vocab, num_layers=1, num_heads=1, num_kv_heads=1, head_dim=1,
                      max_len=32, eos_token_ids=eos)
    return Bigram(cfg, tuple(map(tuple, table.tolist())))


def test_beam_search_finds_what_greedy_misses():
    # From 0: greedy takes 1 (0.5) then 1->EOS 0.3 at best; 2 (0.4) then 2->EOS 0.9.
    # Sequences: [1, 3] logp = ln .5 + ln .3 = -1.897; [2, 3] = ln .4 + ln .9 = -1.022.
    model = bigram({0: {1: 0.5, 2: 0.4, 0: 0.1}, 1: {3: 0.3, 1: 0.35, 2: 0.35},
                    2: {3: 0.9, 1: 0.05, 2: 0.05}})
    greedy = jd.generate(model, {}, [[0]], jd.SamplingParams(temperature=0.0, max_tokens=2))
    assert greedy.tokens(0) == [1, 1]
    out = jd.beam_search(model, {}, [[0]], num_beams=2, max_new_tokens=2, length_penalty=1.0,
                         num_return_sequences=2)
    assert out.tokens(0) == [2, 3] and out.finish_reasons == [jd.FinishReason.EOS]
    (best, s0), (second, s1) = out.beams[0]
    assert best == [2, 3] and s0 == pytest.approx((np.log(.4) + np.log(.9)) / 2, abs=1e-5)
    # Last step's candidates: [2, 3] -1.022, [1, 1] and [1, 2] -1.743 (a tie), [1, 3] -1.897;
    # all end (EOS or max length) and only the top 2 positions enter the pool (HF semantics).
    assert second in ([1, 1], [1, 2]) and s1 == pytest.approx(
        (np.log(.5) + np.log(.35)) / 2, abs=1e-5)


def test_beam_search_length_penalty_prefers_longer():
    # [3] now (logp ln .6) against [1, 3] (ln .4 + ln .99): length_penalty decides.
    model = bigram({0: {3: 0.6, 1: 0.4}, 1: {3: 0.99, 2: 0.01}, 2: {3: 1.0}})
    short = jd.beam_search(model, {}, [[0]], num_beams=2, max_new_tokens=3, length_penalty=0.0)
    assert short.tokens(0) == [3]
    long = jd.beam_search(model, {}, [[0]], num_beams=2, max_new_tokens=3, length_penalty=2.0)
    assert long.tokens(0) == [1, 3]
    assert long.beams[0][0][1] == pytest.approx((np.log(.4) + np.log(.99)) / 4, abs=1e-5)


def test_beam_search_bad_arguments_name_the_field():
    model = bigram({0: {1: 1.0}})
    with pytest.raises(ValueError, match="^num_beams"):
        jd.beam_search(model, {}, [[0]], num_beams=0, max_new_tokens=2)
    with pytest.raises(ValueError, match="^num_return_sequences"):
        jd.beam_search(model, {}, [[0]], num_beams=2, max_new_tokens=2, num_return_sequences=3)
    with pytest.raises(ValueError, match="^early_stopping"):
        jd.beam_search(model, {}, [[0]], num_beams=2, max_new_tokens=2, early_stopping="yes")


def test_beam_search_no_recompile_for_new_requests_in_seen_bucket():
    model = bigram({0: {1: 0.5, 2: 0.4, 0: 0.1}, 1: {3: 0.3, 1: 0.35, 2: 0.35},
                    2: {3: 0.9, 1: 0.05, 2: 0.05}})
    jd.beam_search(model, {}, [[0], [1, 2]], num_beams=[2, 3], max_new_tokens=5)
    before = jd.compilation_count()
    for i in range(3):
        jd.beam_search(model, {}, [[2, 1], [0]], num_beams=[3, 1 + i], max_new_tokens=3 + i,
                       length_penalty=0.5 * i, min_new_tokens=i)
    assert jd.compilation_count() == before


def test_beam_search_structured_output():
    pytest.importorskip("outlines_core")
    import re

    from models import Llama, LlamaConfig

    tiny_bytes = [None, None, b"a", b"b", b"ab", b"x", b"y", b"1", b"2"] + [None] * 7
    regex = {"type": "regex", "pattern": "(a|b|x)+[12]"}
    cfg = LlamaConfig(vocab_size=16, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                      max_len=64, hidden_size=32, intermediate_size=64, eos_token_ids=(1,))
    model = Llama(cfg)
    params = model.init_params(jax.random.key(3), scale=0.6)
    prompts = [[3, 4, 5], [6, 2]]
    greedy = jd.generate(model, params, prompts, jd.SamplingParams(
        temperature=0.0, max_tokens=10, response_format=regex), tokenizer=tiny_bytes)
    one = jd.beam_search(model, params, prompts, num_beams=1, max_new_tokens=10,
                         response_format=regex, tokenizer=tiny_bytes)
    assert [one.tokens(r) for r in range(2)] == [greedy.tokens(r) for r in range(2)]
    assert one.finish_reasons == greedy.finish_reasons
    assert jd.FinishReason.GRAMMAR_COMPLETE in one.finish_reasons
    out = jd.beam_search(model, params, prompts, num_beams=3, max_new_tokens=10,
                         num_return_sequences=3, response_format=regex, tokenizer=tiny_bytes)
    for r in range(2):
        for tokens, _ in out.beams[r]:
            text = b"".join(tiny_bytes[t] for t in tokens if t != 1).decode()
            assert re.fullmatch("(a|b|x|ab)+[12]?", text), text
            if len(tokens) < 10:      # ended early: by completion or EOS, in the language
                assert re.fullmatch(regex["pattern"], text), text
