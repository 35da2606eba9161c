"""A prompt's first token is streamed as soon as its prefill ends (engine/core.py `_prefill`,
`decode.first_tokens`), before the decode step that selects it again: the same completions as
without it (SPEC X1: the same selection on the same row state), and the step's copy of the
token is checked, never shown twice."""

import jax
import pytest

import jaxdecode as jd
from jaxdecode.engine.backend import PlainBackend
from tests.test_engine_steps import llama  # noqa: F401 (the fixture: a tiny random Llama)


def _settings(**kw):
    return jd.SamplingParams(utf8_errors="replace", **kw)


PROMPTS = [[5, 6, 7], [9, 9], [1, 2, 3, 4], [40, 41], [70, 71, 72], [12], [33, 34], [8, 8, 8]]
SETTINGS = [
    _settings(temperature=0.0, max_tokens=9),
    _settings(temperature=1.0, seed=11, max_tokens=12, ignore_eos=True, logprobs=2),
    _settings(temperature=0.8, top_k=20, top_p=0.9, min_p=0.02, seed=3, max_tokens=10),
    _settings(temperature=0.9, seed=8, max_tokens=8, ignore_eos=True, n=2),
    _settings(temperature=1.3, seed=21, max_tokens=11, repetition_penalty=1.4,
              frequency_penalty=0.5, presence_penalty=0.3, logit_bias={65: 4.0, 66: -3.0}),
    _settings(temperature=0.0, max_tokens=1),
    _settings(temperature=0.7, seed=5, max_tokens=7, min_tokens=5, banned_token_ids=(97, 98)),
    _settings(temperature=0.0, max_tokens=10,
              response_format={"type": "regex", "pattern": "(ab|x)+[12]"}),
]


def _first_selected_before_second_step(c: jd.Completion) -> bool:
    """Whether token 1 reached the host before the engine dispatched step 2."""
    kinds = [(e.kind, e.data.get("step")) for e in c.events
             if e.kind in ("token.selected", "decode.started")]
    return kinds.index(("token.selected", 1)) < kinds.index(("decode.started", 2))


def _run(llama, early: bool, monkeypatch) -> list:
    model, params, tok = llama
    if not early:
        monkeypatch.setattr(PlainBackend, "first_tokens", lambda self, *a: None)
    with jd.LLM(model, params, tok, max_slots=4, max_len=128, decode_steps=1) as llm:
        out = llm.generate(PROMPTS, SETTINGS)
    monkeypatch.undo()
    return out


def test_first_token_streams_from_the_prefill_X1_same_completions(llama, monkeypatch):
    pytest.importorskip("outlines_core")
    early, late = _run(llama, True, monkeypatch), _run(llama, False, monkeypatch)
    assert len(early) == len(late) == len(PROMPTS) + 1  # n = 2 gives two
    for e, w in zip(early, late):
        assert (e.token_ids, e.text, e.finish_reason, e.usage) == (
            w.token_ids, w.text, w.finish_reason, w.usage)
        assert e.logprobs == w.logprobs
        assert tuple(x.data["token"] for x in e.events if x.kind == "token.selected") == e.token_ids
    going_on = [i for i, c in enumerate(late) if len(c.token_ids) > 1]
    assert len(going_on) >= 6
    for i in going_on:  # the first token left one step earlier, and only then
        assert _first_selected_before_second_step(early[i])
        assert not _first_selected_before_second_step(late[i])


def test_first_token_O2_written_when_its_step_is_processed(llama):
    """O2: a first token streamed from the prefill is selected at once, and counted as written
    (`decode.completed`) only when the step that writes it is processed."""
    model, params, tok = llama
    with jd.LLM(model, params, tok, max_slots=2, max_len=128, decode_steps=1) as llm:
        c = llm.generate([[5, 6, 7]], _settings(temperature=0.0, max_tokens=6,
                                                ignore_eos=True))[0]
    order = [(e.kind, e.data.get("step")) for e in c.events
             if e.kind in ("token.selected", "decode.started", "decode.completed")]
    assert (order.index(("token.selected", 1)) < order.index(("decode.started", 2))
            < order.index(("decode.completed", 1)))
    selected = written = 0
    for kind, step in order:
        selected += kind == "token.selected"
        written += kind == "decode.completed"
        assert selected - written in (0, 1)
    assert (c.usage.selected_tokens, c.usage.processed_tokens) == (6, 5)


def test_first_token_a_step_that_selects_another_fails_the_request_loudly(llama, monkeypatch):
    """The step's copy of a streamed first token is compared, not trusted: were the two
    selections ever to differ, the request fails (model_error) rather than go on from a token
    its client never saw; the other requests go on."""
    model, params, tok = llama
    real = PlainBackend.first_tokens

    def off_by_one(self, state, slots, top_k):
        out = real(self, state, slots, top_k)
        return out.replace(token=jax.numpy.where(jax.numpy.arange(out.token.shape[0]) == 0,
                                                 (out.token + 1) % 250, out.token))

    sp = _settings(temperature=0.0, max_tokens=6, ignore_eos=True)
    with jd.LLM(model, params, tok, max_slots=4, max_len=128, decode_steps=1) as llm:
        want = llm.generate([[5, 6, 7]], sp)[0]
        monkeypatch.setattr(PlainBackend, "first_tokens", off_by_one)
        got = llm.generate([[5, 6, 7]], sp)[0]
        monkeypatch.undo()
        after = llm.generate([[5, 6, 7]], sp)[0]
    assert got.error == jd.ErrorCode.MODEL_ERROR
    failed = [e for e in got.events if e.kind == "failed"]
    assert "streamed from the prefill" in failed[0].data["message"]
    assert got.token_ids == ((want.token_ids[0] + 1) % 250,)  # what its client saw
    assert after.token_ids == want.token_ids and len(want.token_ids) == 6
