"""contract §10 speculative decoding in the engine (`jd.LLM(..., speculative={...})`): greedy output
equals the plain engine's, a seeded sampled request equals `speculative_generate`'s in any slot
(contract X1), stop strings and max_tokens never overshoot (S3), cancel frees the slot (C2), pause
resumes at the same token (B1), counters add up, bad options name the field."""

from __future__ import annotations

import threading
import time

import jax
import numpy as np
import pytest

import jaxdecode as jd
from models import Llama, LlamaConfig
from tests.host_fixtures import byte_level_tokenizer, s4_tokenizer
from tests.scripted import HOOKS, HookedModel, ScriptedModel

LOOKUP = "prompt_lookup"
V = 258  # the S4 tokenizer: 256 byte tokens + 101 -> "AB", 102 -> "CD"


@pytest.fixture(scope="module")
def tok():
    return byte_level_tokenizer()


@pytest.fixture(scope="module")
def s4():
    return s4_tokenizer()


def llama(vocab, seed, layers):
    cfg = LlamaConfig(vocab_size=vocab, num_layers=layers, num_heads=4, num_kv_heads=2,
                      head_dim=8, max_len=128, hidden_size=32, intermediate_size=64,
                      eos_token_ids=(0,))
    model = Llama(cfg)
    return model, model.init_params(jax.random.key(seed), scale=0.3)


@pytest.fixture(scope="module")
def models_(tok):
    v = tok.get_vocab_size()
    return llama(v, 1, 2), llama(v, 2, 1)


def greedy(n, **kw):
    return jd.SamplingParams(temperature=0.0, max_tokens=n, utf8_errors="replace", **kw)


def run_staggered(llm, prompts, params):
    """Submit requests at different times (some while others are decoding)."""
    handles = []
    for i, (p, sp) in enumerate(zip(prompts, params)):
        handles.append(llm.submit(p, sp))
        if i % 2:
            time.sleep(0.05)
    return [h.result(timeout=120) for h in handles]


PROMPTS = [[5, 6, 7, 5, 6, 7, 5, 6], [30, 31, 32], [9], [40, 41, 40, 41, 40], [12, 13] * 6]


@pytest.mark.parametrize("kind", ["draft", LOOKUP])
def test_engine_speculative_greedy_equals_plain_engine(tok, models_, kind):
    (tm, tp), (dm, dp) = models_
    params = [greedy(n, ignore_eos=i % 2 == 0) for i, n in enumerate([20, 13, 7, 25, 9])]
    with jd.LLM(tm, tp, tok, max_slots=3, max_len=128) as llm:
        want = run_staggered(llm, PROMPTS, params)
    option = {"draft": (dm, dp) if kind == "draft" else LOOKUP, "k": 3}
    with jd.LLM(tm, tp, tok, max_slots=3, max_len=128, speculative=option) as llm:
        got = run_staggered(llm, PROMPTS, params)
        stats = llm.speculative_stats()
    for w, g in zip(want, got):
        assert g.token_ids == w.token_ids and g.text == w.text
        assert g.finish_reason == w.finish_reason and g.usage == w.usage
    # counters add up: every selected token is an accepted proposal or a target token
    assert stats["accepted"] + stats["target_tokens"] == sum(len(c.token_ids) for c in got)
    assert stats["proposed"] == 3 * stats["iterations"]


@pytest.mark.parametrize("kind", ["draft", LOOKUP])
def test_engine_speculative_branches_greedy_equals_plain_engine(tok, models_, kind):
    """num_branches=2: greedy output unchanged, counters add up, sampled requests refused."""
    (tm, tp), (dm, dp) = models_
    params = [greedy(n, ignore_eos=i % 2 == 0) for i, n in enumerate([20, 13, 7, 25, 9])]
    with jd.LLM(tm, tp, tok, max_slots=3, max_len=128) as llm:
        want = run_staggered(llm, PROMPTS, params)
    option = {"draft": (dm, dp) if kind == "draft" else LOOKUP, "k": 3, "num_branches": 2}
    with jd.LLM(tm, tp, tok, max_slots=3, max_len=128, speculative=option) as llm:
        got = run_staggered(llm, PROMPTS, params)
        stats = llm.speculative_stats()
        with pytest.raises(ValueError, match="^num_branches.*temperature"):
            llm.submit([5, 6], jd.SamplingParams(max_tokens=4, seed=1))
    for w, g in zip(want, got):
        assert (g.token_ids, g.text, g.finish_reason) == (w.token_ids, w.text, w.finish_reason)
    assert stats["accepted"] + stats["target_tokens"] == sum(len(c.token_ids) for c in got)
    assert stats["proposed"] == 3 * 2 * stats["iterations"]
    assert stats["mean_accepted_length"] >= 1.0
    per_request = [c.timings["speculative"] for c in got]
    for name in ("proposed", "accepted", "target_tokens", "iterations"):
        assert sum(s[name] for s in per_request) == stats[name]
    rounds = [e for e in got[0].events if e.kind == "speculative.round"]
    assert len(rounds) == per_request[0]["iterations"]
    assert sum(e.data["emitted"] for e in rounds) == len(got[0].token_ids)
    if kind == LOOKUP:  # the repetitive prompts get proposals accepted
        assert stats["accepted"] > 0


@pytest.mark.parametrize("kind", ["draft", LOOKUP])
def test_engine_speculative_X1_sampled_equals_speculative_generate(tok, models_, kind):
    (tm, tp), (dm, dp) = models_
    draft, dparams = ((dm, dp) if kind == "draft" else (LOOKUP, None))
    sp = jd.SamplingParams(temperature=1.0, top_k=40, seed=11, max_tokens=16, ignore_eos=True,
                           utf8_errors="replace")
    ref = jd.speculative_generate(tm, tp, draft, dparams, [[5, 6, 7, 5, 6]], sp, k=3).tokens(0)
    nsp = jd.SamplingParams(n=3, seed=4, max_tokens=8, ignore_eos=True, utf8_errors="replace")
    nref = jd.speculative_generate(tm, tp, draft, dparams, [[9, 8]], nsp, k=3)
    other = jd.SamplingParams(temperature=0.7, seed=3, max_tokens=20, ignore_eos=True,
                              utf8_errors="replace")
    with jd.LLM(tm, tp, tok, max_slots=3, max_len=128,
                speculative={"draft": (dm, dp) if kind == "draft" else LOOKUP, "k": 3}) as llm:
        alone = llm.generate([[5, 6, 7, 5, 6]], sp)[0]
        mixed = llm.generate([[9, 9], [1, 2, 3, 4], [5, 6, 7, 5, 6]], [other, other, sp])
        samples = llm.generate([[9, 8]], nsp)
    assert list(alone.token_ids) == ref
    assert list(mixed[2].token_ids) == ref  # another slot, other neighbours: the same tokens
    assert [list(c.token_ids) for c in samples] == [nref.tokens(i) for i in range(3)]


def test_engine_speculative_S3_stop_string_and_max_tokens_never_overshoot(s4):
    script = [0, 101, 102] + [120] * 20
    model = ScriptedModel.make(script, vocab_size=V, max_len=64, eos_token_ids=(0,))
    for draft in ((model, {}), LOOKUP):
        with jd.LLM(model, {}, s4, max_slots=2, max_len=64,
                    speculative={"draft": draft, "k": 4}) as llm:
            stop, length, shown = llm.generate(
                [[7, 8]] * 3, [greedy(20, stop=["BCD"]), greedy(3),
                               greedy(20, stop=["BCD"], include_stop_in_output=True)])
        assert (stop.text, stop.finish_reason) == ("A", jd.FinishReason.STOP_SEQUENCE)
        assert stop.token_ids == (101, 102)  # the round's tokens after the hit are dropped
        assert stop.usage.selected_tokens == 2 and stop.usage.returned_tokens == 1
        assert shown.text == "ABCD" and shown.token_ids == (101, 102)
        assert length.token_ids == (101, 102, 120)
        assert length.finish_reason == jd.FinishReason.MAX_OUTPUT_TOKENS
        deltas = [e for e in stop.events if e.kind == "delta"]
        terminal = [e for e in stop.events if e.kind == "completed"]
        assert len(terminal) == 1 and stop.events.index(terminal[0]) > stop.events.index(
            deltas[-1])


def test_engine_speculative_C2_cancel_mid_way_frees_the_slot(s4):
    entered, release = threading.Event(), threading.Event()

    def hook(positions, lengths):
        if positions.shape[1] == 3 and positions[0, 0] >= 12:  # a verify pass past 10 tokens
            entered.set()
            release.wait(30)

    HOOKS["spec_c2"] = hook
    model = HookedModel.make([0] + [120] * 60, "spec_c2", vocab_size=V, eos_token_ids=(0,))
    with jd.LLM(model, {}, s4, max_slots=1, max_len=64,
                speculative={"draft": LOOKUP, "k": 2}) as llm:
        h = llm.submit([7, 8], greedy(50))
        assert entered.wait(30)
        h.cancel()
        release.set()
        c = h.result(timeout=30)
        HOOKS["spec_c2"] = lambda positions, lengths: None
        after = llm.submit([7, 8], greedy(5)).result(timeout=30)  # the one slot is free again
        assert llm.num_running == 0
    assert c.state == jd.RequestState.CANCELLED and 0 < c.usage.selected_tokens < 50
    kinds = [e.kind for e in c.events]
    assert kinds.count("resources.released") == 1
    assert "delta" not in kinds[kinds.index("cancelled"):]
    assert after.finish_reason == jd.FinishReason.MAX_OUTPUT_TOKENS
    assert len(after.token_ids) == 5


def test_engine_speculative_C3_deadline_flushes_held_text(s4):
    HOOKS["spec_slow"] = lambda positions, lengths: time.sleep(0.01)
    model = HookedModel.make([0] + [101, 102] * 60, "spec_slow", vocab_size=V, max_len=256,
                             eos_token_ids=(0,))
    with jd.LLM(model, {}, s4, max_slots=2, max_len=256,
                speculative={"draft": LOOKUP, "k": 3}) as llm:
        llm.generate([[7, 8]], greedy(2))  # compile first: the deadline is for decoding
        c = llm.generate([[7, 8]], greedy(200, stop=["ABCDX"], deadline_s=0.3))[0]
    assert c.finish_reason == jd.FinishReason.DEADLINE_EXCEEDED
    assert 1 < c.usage.selected_tokens < 200
    assert c.text == ("ABCD" * 100)[: 2 * c.usage.selected_tokens]
    assert c.usage.returned_tokens == c.usage.selected_tokens


def test_engine_speculative_B1_paused_request_resumes_at_the_same_token(s4):
    from tests.test_engine import byte_id

    script = [0] + [byte_id(s4, ch) for ch in "the quick brown fox jumps over the lazy dog"]
    model = ScriptedModel.make(script, vocab_size=V, max_len=64, eos_token_ids=(0,), peak=6.0)
    sp = jd.SamplingParams(temperature=1.0, seed=5, max_tokens=40, ignore_eos=True,
                           utf8_errors="replace")  # sampled: the RNG cursor matters
    option = {"draft": LOOKUP, "k": 3}
    with jd.LLM(model, {}, s4, max_slots=2, max_len=64, speculative=option) as llm:
        reference = llm.submit([7, 8], sp).result(timeout=30)
    with jd.LLM(model, {}, s4, max_slots=2, max_len=64, max_buffered=2, backpressure="pause",
                speculative=option) as llm:
        h = llm.submit([7, 8], sp)
        events = []
        for event in h.events(timeout=30):
            events.append(event)
            time.sleep(0.02)  # a slow reader
        c = h.result(timeout=30)
    assert any(e.kind == "backpressure.paused" for e in c.events)
    assert c.finish_reason == jd.FinishReason.MAX_OUTPUT_TOKENS and len(c.token_ids) == 40
    assert c.token_ids == reference.token_ids and c.text == reference.text
    assert "".join(e.data["text"] for e in events if e.kind == "delta") == c.text


def test_engine_speculative_no_recompile_after_warmup(s4):
    rng = np.random.default_rng(0)
    model = ScriptedModel.make([0] + [120, 121, 122] * 40, vocab_size=V, max_len=128,
                               eos_token_ids=(0,))
    with jd.LLM(model, {}, s4, max_slots=4, max_len=128,
                speculative={"draft": (model, {}), "k": 3}) as llm:
        assert llm.warmup(max_prompt_len=40) > 0
        before = jd.compilation_count()
        handles = [llm.submit([int(x) for x in rng.integers(1, V, rng.integers(1, 40))],
                              jd.SamplingParams(max_tokens=int(rng.integers(1, 60)), seed=i,
                                                temperature=float(rng.choice([0.0, 0.8]))))
                   for i in range(12)]
        assert all(h.result(timeout=60).finish_reason is not None for h in handles)
        assert jd.compilation_count() == before


def test_engine_speculative_bad_options_name_the_field(s4):
    model = ScriptedModel.make([0, 5], vocab_size=V, max_len=64)
    small = ScriptedModel.make([0, 5], vocab_size=16, max_len=64)
    short = ScriptedModel.make([0, 5], vocab_size=V, max_len=32)
    cases = [({"k": 2}, "speculative.draft"), ({"draft": "ngrams"}, "speculative.draft"),
             ({"draft": model}, "speculative.draft"),
             ({"draft": (small, {})}, "speculative.draft"),
             ({"draft": (short, {})}, "speculative.draft"),
             ({"draft": LOOKUP, "k": 0}, "speculative.k"),
             ({"draft": LOOKUP, "k": True}, "speculative.k"),
             ({"draft": LOOKUP, "ngram_min": 4}, "speculative.ngram_min"),
             ({"draft": LOOKUP, "num_branches": 0}, "speculative.num_branches"),
             ({"draft": LOOKUP, "num_branches": 2.0}, "speculative.num_branches"),
             ({"draft": LOOKUP, "depth": 2}, "speculative.depth"),
             ("prompt_lookup", "speculative")]
    for option, field in cases:
        with pytest.raises(ValueError, match=f"^{field}"):
            jd.LLM(model, {}, s4, max_slots=2, max_len=64, speculative=option)
    with pytest.raises(ValueError, match="^speculative"):
        jd.LLM(model, {}, s4, max_slots=2, max_len=64, mesh=object(),
               speculative={"draft": LOOKUP})
    with jd.LLM(model, {}, s4, max_slots=2, max_len=64) as llm, \
            pytest.raises(ValueError, match="^speculative"):
        llm.speculative_stats()


@pytest.mark.parametrize("kind", ["draft", LOOKUP])
def test_engine_speculative_grammar_greedy_equals_plain_engine(tok, models_, kind):
    """The grammar state rides in the slot state and rolls back with the caches."""
    pytest.importorskip("outlines_core")
    import re

    (tm, tp), (dm, dp) = models_
    regex = {"type": "regex", "pattern": "(ab|x)+[12]"}
    choice = {"type": "choice", "choices": ["abc", "xy", "hello world"]}
    params = [greedy(12, response_format=regex), greedy(10), greedy(12, response_format=choice),
              greedy(12, response_format=regex, ignore_eos=True)]
    prompts = [[5, 6, 7], [30, 31], [9, 9, 9, 9], [40, 41]]
    with jd.LLM(tm, tp, tok, max_slots=2, max_len=128) as llm:
        want = run_staggered(llm, prompts, params)
    option = {"draft": (dm, dp) if kind == "draft" else LOOKUP, "k": 3}
    with jd.LLM(tm, tp, tok, max_slots=2, max_len=128, speculative=option) as llm:
        got = run_staggered(llm, prompts, params)
        sampled = llm.generate([[5, 6]], jd.SamplingParams(n=4, seed=3, max_tokens=12,
                                                          response_format=regex))
    assert jd.FinishReason.GRAMMAR_COMPLETE in [c.finish_reason for c in want]
    for w, g in zip(want, got):
        assert (g.token_ids, g.text, g.finish_reason) == (w.token_ids, w.text, w.finish_reason)
    for c in sampled:
        if c.finish_reason == jd.FinishReason.GRAMMAR_COMPLETE:
            assert re.fullmatch(regex["pattern"], c.text), c.text
        else:
            assert re.fullmatch("(ab|x|a)*", c.text), c.text


def test_engine_speculative_logprobs_equal_plain_engine(tok, models_):
    """Each emitted token of a round carries its raw logprob and top N, as a plain step's."""
    (tm, tp), (dm, dp) = models_
    params = [greedy(12, logprobs=3, ignore_eos=True), greedy(9),
              greedy(10, logprobs=1, stop=["e"])]
    prompts = [[5, 6, 7, 5, 6], [30, 31], [9, 9]]
    with jd.LLM(tm, tp, tok, max_slots=3, max_len=128) as llm:
        want = llm.generate(prompts, params)
    with jd.LLM(tm, tp, tok, max_slots=3, max_len=128,
                speculative={"draft": (dm, dp), "k": 3}) as llm:
        got = llm.generate(prompts, params)
    assert got[1].logprobs is None
    for w, g in ((want[0], got[0]), (want[2], got[2])):
        assert g.token_ids == w.token_ids and len(g.logprobs) == len(w.logprobs)
        for a, b in zip(g.logprobs, w.logprobs):
            assert a.token_id == b.token_id
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
            assert [i for i, _ in a.top] == [i for i, _ in b.top]
            np.testing.assert_allclose([lp for _, lp in a.top], [lp for _, lp in b.top],
                                       atol=1e-4)
