"""Per-token logprobs through the engine (`SamplingParams.logprobs`, `Completion.logprobs`, the
`logprobs` of delta events): equal to `jd.generate`'s, one per returned token, no recompiles."""

import math
import random

import numpy as np
import pytest

import jaxdecode as jd
from tests.host_fixtures import s4_tokenizer
from tests.scripted import Bigram, ScriptedModel

V = 258  # the S4 tokenizer: 256 byte tokens + 101 -> "AB", 102 -> "CD"
EOS = 0


@pytest.fixture(scope="module")
def tok():
    return s4_tokenizer()


@pytest.fixture(scope="module")
def bigram():
    return Bigram.random(3, vocab=V, scale=2.0)


def byte_id(tok, ch):
    from jaxdecode.host.detokenizer import bytes_to_unicode
    return tok.token_to_id(bytes_to_unicode()[ord(ch)])


def scripted(script, tok, **kw):
    model = ScriptedModel.make(script, vocab_size=V, max_len=64, eos_token_ids=(EOS,))
    return jd.LLM(model, {}, tok, max_slots=4, max_len=64, **kw)


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_logprobs_equal_generate(tok, bigram, temperature):
    """Same seed, same tokens: the engine reports jd.generate's raw logprobs and top ids."""
    sp = jd.SamplingParams(temperature=temperature, seed=7, max_tokens=12, logprobs=5,
                           utf8_errors="replace")
    prompt = [65, 66, 67]
    ref = jd.generate(bigram, {}, [prompt], sp)
    with jd.LLM(bigram, {}, tok, max_slots=4, max_len=64) as llm:
        c = llm.generate(prompt, sp)[0]
    n = int(ref.lengths[0])
    assert list(c.token_ids) == ref.tokens(0) and n == 12
    assert len(c.logprobs) == c.usage.returned_tokens == n
    top_ids, top_lps = ref.top_logprobs
    for t, e in enumerate(c.logprobs):
        assert e.token_id == c.token_ids[t]
        assert e.logprob == pytest.approx(float(ref.logprobs[0, t]), abs=1e-5)
        assert [i for i, _ in e.top] == top_ids[0, t].tolist()
        np.testing.assert_allclose([lp for _, lp in e.top], top_lps[0, t], atol=1e-5)
        assert all(lp <= 0 for _, lp in e.top)
        assert [lp for _, lp in e.top] == sorted((lp for _, lp in e.top), reverse=True)
        if temperature == 0:  # greedy: the chosen token is the most likely one
            assert e.top[0][0] == e.token_id and e.top[0][1] == pytest.approx(e.logprob)


def test_logprobs_none_when_not_asked(tok, bigram):
    with jd.LLM(bigram, {}, tok, max_slots=2, max_len=64) as llm:
        c = llm.generate([65], jd.SamplingParams(max_tokens=4, seed=1, utf8_errors="replace"))[0]
        events = list(llm.stream([65], jd.SamplingParams(max_tokens=4, seed=1,
                                                          utf8_errors="replace")))
    assert c.logprobs is None
    assert all("logprobs" not in e.data for e in events if e.kind == "delta")


def test_logprobs_stop_string_hides_its_tokens(tok):
    """S4: 101 "AB", 102 "CD", stop "BCD" -> text "A": only 101 is returned and reported; the
    stream's delta "A" carries it."""
    with scripted([0, 101, 102, 5, 5], tok) as llm:
        sp = jd.SamplingParams(temperature=0.0, max_tokens=10, stop=["BCD"], logprobs=2)
        events = list(llm.stream([7, 8], sp))
        c = llm.generate([7, 8], sp)[0]
    assert c.text == "A" and c.token_ids == (101, 102)
    assert [e.token_id for e in c.logprobs] == [101] and c.usage.returned_tokens == 1
    deltas = [e for e in events if e.kind == "delta"]
    assert [(e.data["text"], [x.token_id for x in e.data["logprobs"]]) for e in deltas] == [
        ("A", [101])]
    entry = c.logprobs[0]
    assert entry.logprob == pytest.approx(-math.log1p(257 * math.exp(-10.0)), abs=1e-5)
    assert entry.top[0] == (101, pytest.approx(entry.logprob))
    assert len(entry.top) == 2


def test_logprobs_eos_is_not_reported_and_deltas_concatenate(tok):
    a, b = byte_id(tok, "a"), byte_id(tok, "b")
    with scripted([0, a, b, a, EOS], tok) as llm:
        sp = jd.SamplingParams(temperature=0.0, max_tokens=10, logprobs=1)
        events = list(llm.stream([7, 8], sp))
        h = llm.submit([7, 8], sp)
        c = h.result(timeout=30)
    assert c.text == "aba" and c.token_ids == (a, b, a, EOS)
    assert [e.token_id for e in c.logprobs] == [a, b, a]  # the EOS is selected, not returned
    streamed = [x for e in events if e.kind == "delta" for x in e.data["logprobs"]]
    assert tuple(streamed) == c.logprobs
    assert all(len(e.top) == 1 for e in c.logprobs)


def test_logprobs_no_recompile_after_warmup_mixed_requests(tok):
    rng = random.Random(2)
    model = ScriptedModel.make([0] + [byte_id(tok, "w")] * 80, vocab_size=V, max_len=128,
                               eos_token_ids=(EOS,))
    with jd.LLM(model, {}, tok, max_slots=4, max_len=128) as llm:
        llm.warmup(max_prompt_len=16)  # may compile nothing: an earlier test saw these shapes
        before = jd.compilation_count()
        handles = []
        for i in range(16):
            prompt = [rng.randrange(1, V) for _ in range(rng.randint(1, 16))]
            sp = jd.SamplingParams(max_tokens=rng.randint(1, 30), seed=i,
                                   temperature=rng.choice([0.0, 0.8]),
                                   logprobs=rng.choice([0, 0, 1, 5, 20]))
            handles.append((sp, llm.submit(prompt, sp)))
        for sp, h in handles:
            c = h.result(timeout=60)
            if sp.logprobs:
                assert len(c.logprobs) == c.usage.returned_tokens
                assert all(len(e.top) == sp.logprobs for e in c.logprobs)
            else:
                assert c.logprobs is None
        assert jd.compilation_count() == before


def test_logprobs_final_only_and_cumulative_kinds(tok):
    a = byte_id(tok, "a")
    with scripted([0, a, a, a, EOS], tok) as llm:
        cum = jd.SamplingParams(temperature=0.0, max_tokens=10, logprobs=1,
                                output_kind="cumulative")
        events = list(llm.stream([7, 8], cum))
        fin = list(llm.stream([7, 8], jd.SamplingParams(temperature=0.0, max_tokens=10,
                                                         logprobs=1, output_kind="final_only")))
    assert sum(len(e.data["logprobs"]) for e in events if e.kind == "delta") == 3
    [last] = [e for e in fin if e.kind == "delta"]
    assert last.data["text"] == "aaa" and len(last.data["logprobs"]) == 3


def test_logprobs_survive_save_and_restore(tok, tmp_path):
    """A restored request keeps the logprobs selected before the save, aligned with its ids."""
    import time

    from tests.scripted import HOOKS, HookedModel

    HOOKS["logprobs-slow"] = lambda positions, lengths: time.sleep(0.01)
    script = [0] + [byte_id(tok, c) for c in "the quick brown fox jumps over the lazy dog"]
    model = HookedModel.make(script, "logprobs-slow", vocab_size=V, max_len=64,
                             eos_token_ids=(EOS,))
    sp = jd.SamplingParams(temperature=0.0, max_tokens=30, logprobs=2)
    with jd.LLM(model, {}, tok, max_slots=2, max_len=64) as llm:
        reference = llm.submit([7, 8], sp).result(timeout=60)
        h = llm.submit([7, 8], sp)
        while h.selected < 5:
            time.sleep(0.001)
        llm.save_request(h, str(tmp_path / "req"))
        h.cancel()
        restored = llm.restore_request(str(tmp_path / "req")).result(timeout=60)
    assert restored.token_ids == reference.token_ids
    assert restored.logprobs == reference.logprobs and len(restored.logprobs) == 30


def test_logprobs_held_text_released_later_brings_no_new_entries(tok):
    """101 "AB" with stop "BX": "A" goes out with 101's entry, "B" is held; max_tokens ends the
    request and the flushed "B" comes in a delta with no new entries (101 was already sent)."""
    with scripted([0, 101, 5, 5], tok) as llm:
        sp = jd.SamplingParams(temperature=0.0, max_tokens=1, stop=["BX"], logprobs=1)
        events = [e for e in llm.stream([7, 8], sp) if e.kind == "delta"]
    assert [(e.data["text"], [x.token_id for x in e.data["logprobs"]]) for e in events] == [
        ("A", [101]), ("B", [])]
