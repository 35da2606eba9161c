"""contract §10 beam search through the engine (`SamplingParams(num_beams > 1)`, the beam lane of
jaxdecode/engine/beam_lane.py): the same beams and scores as `jd.beam_search`, alongside running slot
requests, stop strings on beams, cancellation and deadlines before the call, replay."""

import threading

import numpy as np
import pytest

import jaxdecode as jd
from jaxdecode.model_api import ModelConfig
from tests.host_fixtures import s4_tokenizer
from tests.scripted import Bigram

EOS = 0
V = 258  # the S4 tokenizer: 256 byte tokens + 101 -> "AB", 102 -> "CD"


@pytest.fixture(scope="module")
def tok():
    return s4_tokenizer()


def config(max_len=64):
    return ModelConfig(vocab_size=V, num_layers=1, num_heads=1, num_kv_heads=1, head_dim=1,
                       max_len=max_len, eos_token_ids=(EOS,))


@pytest.fixture(scope="module")
def model():
    """A random bigram whose EOS is likely enough that beams end at different lengths."""
    table = np.asarray(Bigram.random(0, vocab=V).table)
    table[:, EOS] += 3.5
    return Bigram(config(), tuple(map(tuple, table.tolist())))


def beams(**kw):
    return jd.SamplingParams(utf8_errors="replace", **kw)  # random bytes are not UTF-8


def as_beams(completions):
    return [(list(c.token_ids), c.score) for c in completions]


def check_same(completions, ref, row):
    assert [t for t, _ in as_beams(completions)] == [t for t, _ in ref.beams[row]]
    np.testing.assert_allclose([s for _, s in as_beams(completions)],
                               [s for _, s in ref.beams[row]], atol=1e-6)
    for c in completions:
        ends_on_eos = c.token_ids[-1] == EOS
        assert c.finish_reason == (jd.FinishReason.EOS if ends_on_eos
                                   else jd.FinishReason.MAX_OUTPUT_TOKENS)
        assert c.usage.selected_tokens == len(c.token_ids)
        assert c.usage.processed_tokens == len(c.token_ids) - 1
        assert c.usage.returned_tokens == len(c.token_ids) - ends_on_eos


def test_beam_engine_S10_matches_beam_search_n_beams_and_two_requests(model, tok):
    prompts = [[7, 8], [9], [40, 41, 42]]
    a = beams(num_beams=3, n=3, max_tokens=6, length_penalty=0.5)
    b = beams(num_beams=4, n=2, max_tokens=7, early_stopping=True)
    with jd.LLM(model, {}, tok, max_slots=4, max_len=64) as llm:
        out = llm.generate(prompts, [a, b, a])
        alone = llm.submit([9], beams(num_beams=4, max_tokens=7, early_stopping=True))
        best = alone.result(timeout=60)
        handles = llm.submit_beams([9], b, request_id="b")
        ranked = [h.result(timeout=60) for h in handles]
        assert [e.data["rows"] for e in ranked[0].events if e.kind == "beam.started"] == [1]
    assert [(c.prompt_index, c.index) for c in out] == [
        (0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (2, 0), (2, 1), (2, 2)]
    ref_a = jd.beam_search(model, {}, [prompts[0], prompts[2]], num_beams=3, max_new_tokens=6,
                           length_penalty=0.5, num_return_sequences=3)
    ref_b = jd.beam_search(model, {}, [prompts[1]], num_beams=4, max_new_tokens=7,
                           early_stopping=True, num_return_sequences=2)
    check_same(out[0:3], ref_a, 0)
    check_same(out[3:5], ref_b, 0)
    check_same(out[5:8], ref_a, 1)
    assert as_beams([best]) == as_beams(out[3:4])  # submit(): the best beam
    assert as_beams(ranked) == as_beams(out[3:5])  # submit_beams(): the n best, one row
    assert [h.request_id for h in handles] == ["b-0", "b-1"]
    assert any(len(c.token_ids) < 6 for c in out), "no beam ended on EOS: the test lost its bite"
    # prompts 0 and 2 share every call setting: one device call, one row each
    assert [e.data["rows"] for e in out[0].events if e.kind == "beam.started"] == [2]
    kinds = [e.kind for e in out[0].events if e.seq is not None]
    assert kinds == ["start", "delta", "completed"]


def test_beam_engine_S10_alongside_running_slot_requests(model, tok):
    sp = jd.SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True,
                           utf8_errors="replace")
    ref = jd.generate(model, {}, [[5], [6, 7]], sp)
    ref_beam = jd.beam_search(model, {}, [[11, 12]], num_beams=3, max_new_tokens=8,
                              num_return_sequences=2)
    # one decode step per call: the slot rows are still decoding when the beam call comes
    with jd.LLM(model, {}, tok, max_slots=2, max_len=64, decode_steps=1) as llm:
        slots = [llm.submit([5], sp), llm.submit([6, 7], sp)]
        first = slots[0].events(timeout=60)
        while next(first).kind != "delta":  # the slot rows are decoding
            pass
        out = llm.generate([[11, 12]], beams(num_beams=3, n=2, max_tokens=8))
        done = [h.result(timeout=60) for h in slots]
    # the beam call ran between the slot rows' steps: they ended after it
    assert all(c.events[-1].time > out[0].events[-1].time for c in done)
    check_same(out, ref_beam, 0)
    for r, c in enumerate(done):
        assert list(c.token_ids) == ref.tokens(r)


def test_beam_engine_one_beam_is_greedy(model, tok):
    greedy = jd.SamplingParams(temperature=0.0, max_tokens=8, num_beams=1)
    ref = jd.beam_search(model, {}, [[7, 8]], num_beams=1, max_new_tokens=8)
    with jd.LLM(model, {}, tok, max_slots=2, max_len=64) as llm:
        c = llm.generate([[7, 8]], greedy)[0]
    assert list(c.token_ids) == ref.tokens(0) and c.score is None  # a slot request


def test_beam_engine_bad_fields_name_the_field(model, tok):
    for field, kw in [("num_beams", dict(num_beams=0)), ("num_beams", dict(num_beams="4")),
                      ("length_penalty", dict(num_beams=2, length_penalty=float("nan"))),
                      ("early_stopping", dict(num_beams=2, early_stopping="yes")),
                      ("early_stopping", dict(early_stopping=1)),
                      ("n", dict(num_beams=2, n=3)),
                      ("temperature", dict(num_beams=2, temperature=0.7)),
                      ("top_k", dict(num_beams=2, top_k=5)),
                      ("repetition_penalty", dict(num_beams=2, repetition_penalty=1.2)),
                      ("logprobs", dict(num_beams=2, logprobs=2))]:
        with pytest.raises(ValueError, match=f"^{field}:"):
            jd.SamplingParams(**kw)
    jd.SamplingParams(num_beams=2, temperature=0.0, seed=3, early_stopping="never")
    with jd.LLM(model, {}, tok, max_slots=2, max_len=64) as llm:
        with pytest.raises(ValueError, match="^n:"):
            llm.submit([7], beams(num_beams=2, n=2))
        with pytest.raises(ValueError, match="^num_beams:"):
            llm.submit_beams([7], beams(n=2))


def test_beam_engine_C3_C4_cancel_and_deadline_before_the_call(model, tok):
    started, release = threading.Event(), threading.Event()
    with jd.LLM(model, {}, tok, max_slots=2, max_len=64) as llm:
        blocker = threading.Thread(target=llm._core.on_thread,
                                   args=(lambda: (started.set(), release.wait(30)),))
        blocker.start()
        assert started.wait(30)  # the engine thread waits at a safe point
        cancelled = llm.submit([7, 8], beams(num_beams=2, max_tokens=5))
        late = llm.submit([7, 8], beams(num_beams=2, max_tokens=5, deadline_s=0.01))
        kept = llm.submit([7, 8], beams(num_beams=2, max_tokens=5))
        cancelled.cancel()
        threading.Event().wait(0.05)  # past the deadline
        release.set()
        blocker.join(30)
        results = [h.result(timeout=60) for h in (cancelled, late, kept)]
    assert results[0].state == jd.RequestState.CANCELLED and results[0].token_ids == ()
    assert results[1].finish_reason == jd.FinishReason.DEADLINE_EXCEEDED
    assert results[1].token_ids == () and results[1].usage.selected_tokens == 0
    assert results[2].finish_reason in (jd.FinishReason.EOS, jd.FinishReason.MAX_OUTPUT_TOKENS)
    for c in results[:2]:
        assert "beam.started" not in [e.kind for e in c.events]


def test_beam_engine_S3_stop_string_cuts_a_beam(tok):
    # From 7: [101, 102, EOS] ("ABCD", score ln .54 / 3) beats [102, EOS] ("CD", ln .4 / 2).
    table = np.full((V, V), -1e4)
    for x, row in {7: {101: 0.6, 102: 0.4}, 101: {102: 0.9, EOS: 0.1}, 102: {EOS: 1.0}}.items():
        for y, p in row.items():
            table[x, y] = np.log(p)
    model = Bigram(config(), tuple(map(tuple, table.tolist())))
    with jd.LLM(model, {}, tok, max_slots=2, max_len=64) as llm:
        out = llm.generate([[7]], jd.SamplingParams(num_beams=2, n=2, max_tokens=3,
                                                    stop=["BCD"]))
    first, second = out
    assert (first.text, first.finish_reason) == ("A", jd.FinishReason.STOP_SEQUENCE)
    assert first.token_ids == (101, 102)  # cut at the token that completed the stop
    assert first.score == pytest.approx(np.log(0.54) / 3, abs=1e-5)
    assert first.usage == jd.Usage(prompt_tokens=1, selected_tokens=2, processed_tokens=2,
                                   returned_tokens=1)
    assert (second.text, second.finish_reason, second.token_ids) == (
        "CD", jd.FinishReason.EOS, (102, EOS))
    # 102 as a stop id ends beams like EOS (S8): [101, 102] (ln .54 / 2), then [102] (ln .4)
    for shown in (False, True):
        sp = jd.SamplingParams(num_beams=2, n=2, max_tokens=3, stop_token_ids=[102],
                               include_stop_in_output=shown)
        with jd.LLM(model, {}, tok, max_slots=2, max_len=64) as llm:
            out = llm.generate([[7]], sp)
        assert [(c.text, c.token_ids) for c in out] == (
            [("ABCD", (101, 102)), ("CD", (102,))] if shown else [("AB", (101, 102)), ("", (102,))])
        assert {c.finish_reason for c in out} == {jd.FinishReason.STOP_SEQUENCE}
        assert out[0].score == pytest.approx(np.log(0.54) / 2, abs=1e-5)


def test_beam_engine_X_replay_reruns_a_beam_record(model, tok):
    with jd.LLM(model, {}, tok, max_slots=2, max_len=64) as llm:
        out = llm.generate([[7, 8]], beams(num_beams=3, n=2, max_tokens=6, length_penalty=2.0))
        record = jd.GenerationRecord.from_json(out[1].record.to_json())
        assert record.data["sampling"]["num_beams"] == 3
        assert record.data["rng"]["sample_index"] == 1
        report = jd.replay(record, llm)
    assert report.identical, report.describe()
    assert report.completion.token_ids == out[1].token_ids


def test_beam_engine_failed_call_fails_its_requests_only(model, tok, monkeypatch):
    from jaxdecode.engine import runner

    def broken(*args, **kw):
        raise RuntimeError("injected device failure")

    monkeypatch.setattr(runner, "beam_search", broken)  # the beam lane's BEAM op calls it
    sp = jd.SamplingParams(temperature=0.0, max_tokens=5, utf8_errors="replace")
    with jd.LLM(model, {}, tok, max_slots=2, max_len=64) as llm:
        slot, beam = llm.generate([[5], [7, 8]], [sp, beams(num_beams=2, max_tokens=5)])
        assert "injected device failure" in llm.error
    assert beam.state == jd.RequestState.FAILED and beam.error == jd.ErrorCode.MODEL_ERROR
    assert slot.state == jd.RequestState.FINISHED and len(slot.token_ids) > 0


def test_beam_engine_structured_output_matches_beam_search():
    pytest.importorskip("outlines_core")
    import re

    import jax
    from models import Llama, LlamaConfig
    from tests.host_fixtures import byte_level_tokenizer

    tok = byte_level_tokenizer()
    cfg = LlamaConfig(vocab_size=tok.get_vocab_size(), num_layers=2, num_heads=4, num_kv_heads=2,
                      head_dim=8, max_len=128, hidden_size=32, intermediate_size=64,
                      eos_token_ids=(0,))
    model = Llama(cfg)
    params = model.init_params(jax.random.key(1), scale=0.3)
    regex = {"type": "regex", "pattern": "(a|b|x)+[12]"}
    with jd.LLM(model, params, tok, max_slots=2, max_len=128) as llm:
        out = llm.generate([[5, 6, 7]], jd.SamplingParams(num_beams=3, n=3, max_tokens=10,
                                                          response_format=regex))
    ref = jd.beam_search(model, params, [[5, 6, 7]], num_beams=3, max_new_tokens=10,
                         num_return_sequences=3, response_format=regex, tokenizer=tok)
    assert as_beams(out) == [(t, pytest.approx(s, abs=1e-6)) for t, s in ref.beams[0]]
    for c in out:
        assert re.fullmatch("(a|b|x)+[12]?", c.text), c.text
        if c.finish_reason == jd.FinishReason.GRAMMAR_COMPLETE:
            assert re.fullmatch(regex["pattern"], c.text), c.text
    assert jd.FinishReason.GRAMMAR_COMPLETE in {c.finish_reason for c in out}
