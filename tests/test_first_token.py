"""A prompt's first token is streamed as soon as its prefill ends (engine/core.py `_prefill`,
`chunks.start_rows`), before the decode step that selects it again: the same completions as
without it (contract X1: the same selection on the same row state), and the step's copy of the
token is checked, never shown twice."""

import jax
import pytest

import jaxdecode as jd
from jaxdecode.engine.backend import PlainBackend, _Rows
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
    if not early:  # row by row, as a speculative engine starts its rows: no first tokens
        monkeypatch.setattr(PlainBackend, "start", _Rows.start)
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
    real = PlainBackend.start

    def off_by_one(self, *args):
        state, out = real(self, *args)
        return state, out.replace(token=jax.numpy.where(
            jax.numpy.arange(out.token.shape[0]) == 0, (out.token + 1) % 250, out.token))

    sp = _settings(temperature=0.0, max_tokens=6, ignore_eos=True)
    with jd.LLM(model, params, tok, max_slots=4, max_len=128, decode_steps=1) as llm:
        want = llm.generate([[5, 6, 7]], sp)[0]
        monkeypatch.setattr(PlainBackend, "start", off_by_one)
        got = llm.generate([[5, 6, 7]], sp)[0]
        monkeypatch.undo()
        after = llm.generate([[5, 6, 7]], sp)[0]
    assert got.error == jd.ErrorCode.MODEL_ERROR
    failed = [e for e in got.events if e.kind == "failed"]
    assert "streamed from the prefill" in failed[0].data["message"]
    assert got.token_ids == ((want.token_ids[0] + 1) % 250,)  # what its client saw
    assert after.token_ids == want.token_ids and len(want.token_ids) == 6


def test_start_rows_X1_one_call_equals_row_by_row(llama, monkeypatch):
    """A chunk call's new rows -- a request with a sample sharing its prompt pages, a request
    rebuilt after a failed step (resume), a constrained row -- start in one device call
    (`chunks.start_rows`), leaving the state bit for bit as the row-by-row path (three calls a
    row) leaves it; the first tokens it returns are those the first step then selects."""
    import numpy as np

    from jaxdecode.device import chunks, decode
    from jaxdecode.device.state import RowParams
    from jaxdecode.engine import runner, step_ops

    model, params, _ = llama
    vocab, eos = model.config.vocab_size, (0,)
    ctx = runner.Context(model, params, 6, 64, eos)
    sps = [jd.SamplingParams(temperature=0.9, seed=4, top_k=7),
           jd.SamplingParams(temperature=0.9, seed=5, presence_penalty=0.7),
           jd.SamplingParams(temperature=0.0, repetition_penalty=1.5),
           jd.SamplingParams(temperature=1.2, seed=9, logprobs=3)]
    keys = np.arange(8, dtype=np.uint32).reshape(4, 2) + 1
    prompts = [[5, 6, 7, 5], [9, 9, 40], [1, 2, 3, 4, 5, 6, 7, 8, 9]]
    rows = RowParams.build(sps, vocab, eos, keys=keys)
    part = lambda i, j: RowParams(**{k: v[i:j] for k, v in vars(rows).items()})  # noqa: E731
    pages = lambda *p: np.array([list(x) + [0] * (4 - len(x)) for x in p], np.int32)  # noqa: E731
    counts = np.zeros((1, vocab), np.int32)
    counts[0, [8, 9]] = 1
    finals = [
        step_ops.NewRows(np.array(prompts[0] + [0] * 12, np.int32), 4, np.array([0, 3]),
                         pages([1], [2]), part(0, 2), np.array([-1, -1], np.int32),
                         copies=(np.array([1], np.int32), np.array([2], np.int32))),
        step_ops.NewRows(np.array(prompts[1] + [0] * 13, np.int32), 3, np.array([5]),
                         pages([3]), part(2, 3), np.array([2], np.int32),
                         resume=(np.array([2], np.int32), counts, np.array([9], np.int32),
                                 np.array([1], np.int32))),
        step_ops.NewRows(np.array(prompts[2] + [0] * 7, np.int32), 9, np.array([1]),
                         pages([4]), part(3, 4), np.array([-1], np.int32))]
    tokens = np.zeros((3, 16), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, :len(p)] = p
    op = step_ops.chunk(tokens, np.zeros(3), np.array([4, 3, 9]), pages([1], [3], [4]), 128,
                        [(0, finals[0]), (1, finals[1]), (2, finals[2])], top_k=3)

    def run(path):
        monkeypatch.setattr(PlainBackend, "start", path)
        state, _ = runner.apply(ctx, None, step_ops.init(6, 64, eos, ctx.num_pages, 16))
        state = state.replace(grammar_state=np.full((6,), -1, np.int32))
        calls = []
        for name in ("start_rows", "new_rows"):
            real = getattr(chunks, name)
            monkeypatch.setattr(chunks, name, lambda *a, _r=real, _n=name, **k: (
                calls.append(_n), _r(*a, **k))[1])
        state, first = runner.apply(ctx, state, op)
        monkeypatch.undo()
        return jax.device_get(state), first, calls

    fused, first, calls = run(PlainBackend.start)
    rowwise, none, calls_rowwise = run(_Rows.start)
    assert calls == ["start_rows"] and calls_rowwise == ["new_rows"] * 4 and none is None
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(fused),
                            jax.tree_util.tree_leaves(rowwise)):
        assert np.array_equal(a, b), jax.tree_util.keystr(path)
    assert fused.step[5] == 2 and fused.counts[5, 9] == 1 and fused.last_token[5] == 9
    state = fused.replace(done=fused.done | ~np.isin(np.arange(6), [0, 3, 5, 1]))
    _, out = decode.decode_step_jit(state, params, config=decode.StepConfig(model, 3, 128))
    want = np.asarray(out.token)[[0, 3, 5, 1]]
    assert np.asarray(first.token)[:4].tolist() == want.tolist()
    assert np.array_equal(np.asarray(first.top_ids)[:4], np.asarray(out.top_ids)[[0, 3, 5, 1]])
