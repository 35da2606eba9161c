"""What one engine step runs (engine/scheduler.py): several decode steps per call
(`jd.LLM(decode_steps=...)`) -- the same tokens, text, endings and usage as one step per call
(contract X1), multi-step calls only while nothing waits, a cancel that discards the call in flight
(contract C2) -- and only the live rows' slots when they are few (compaction, the same tokens)."""

import threading
import types

import jax
import pytest

import jaxdecode as jd
from tests.host_fixtures import byte_level_tokenizer, byte_tokenizer
from tests.scripted import HOOKS, HookedModel, ScriptedModel


def _calls(c):
    """(first step, steps) of each device call that ran the request."""
    return [(e.data["step"], e.data.get("steps", 1)) for e in c.events
            if e.kind == "decode.started"]


@pytest.fixture(scope="module")
def llama():
    from models import Llama, LlamaConfig

    tok = byte_level_tokenizer()
    cfg = LlamaConfig(vocab_size=tok.get_vocab_size(), num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=8, max_len=128, hidden_size=32,
                      intermediate_size=64, eos_token_ids=(0,))
    model = Llama(cfg)
    return model, model.init_params(jax.random.key(3), scale=0.3), tok


def test_decode_steps_X1_same_completions_at_1_and_8_steps_per_call(llama):
    model, params, tok = llama
    prompts = [[5, 6, 7], [9, 9], [1, 2, 3, 4], [40, 41]]
    settings = [jd.SamplingParams(temperature=1.0, top_k=50, seed=11, max_tokens=21,
                                  ignore_eos=True, utf8_errors="replace", logprobs=2),
                jd.SamplingParams(temperature=0.0, max_tokens=13, utf8_errors="replace"),
                jd.SamplingParams(temperature=0.7, seed=3, max_tokens=30, min_tokens=9,
                                  repetition_penalty=1.3, utf8_errors="replace"),
                jd.SamplingParams(temperature=0.9, seed=8, max_tokens=17, ignore_eos=True,
                                  utf8_errors="replace", n=2)]
    runs = {}
    for steps in (1, 8):
        with jd.LLM(model, params, tok, max_slots=4, max_len=128, decode_steps=steps) as llm:
            runs[steps] = llm.generate(prompts, settings)
    for one, multi in zip(runs[1], runs[8]):
        assert (multi.token_ids, multi.text, multi.finish_reason, multi.usage) == (
            one.token_ids, one.text, one.finish_reason, one.usage)
        assert multi.logprobs == one.logprobs
    assert all(n == 1 for c in runs[1] for _, n in _calls(c))
    assert any(n == 8 for c in runs[8] for _, n in _calls(c))  # it did run several per call


def test_decode_steps_stop_string_inside_a_call_ends_where_one_step_does():
    tok = byte_tokenizer()
    text = "abcSTOPdefghijklmnop"
    model = ScriptedModel.make([0] + list(text.encode()), vocab_size=257, eos_token_ids=(256,))
    sp = jd.SamplingParams(temperature=0.0, max_tokens=16, stop=["STOP"])
    out = {}
    for steps in (1, 8):
        with jd.LLM(model, {}, tok, max_slots=2, max_len=64, decode_steps=steps) as llm:
            out[steps] = llm.submit([1, 2], sp).result(timeout=30)
    assert out[8].text == out[1].text == "abc"
    assert out[8].finish_reason == jd.FinishReason.STOP_SEQUENCE
    assert out[8].usage == out[1].usage and out[8].usage.selected_tokens == 7
    # one step first (the first token comes at once), then calls of 8: the rest never shows
    assert _calls(out[8])[:2] == [(1, 1), (2, 8)]


def test_decode_steps_one_per_call_while_a_request_waits():
    """max_slots=1: the first request runs while the second waits in the queue (single
    steps); the second runs alone (its first step alone, then multi-step calls)."""
    tok = byte_tokenizer()
    model = ScriptedModel.make([0] + [97] * 60, vocab_size=257)
    sp = jd.SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    with jd.LLM(model, {}, tok, max_slots=1, max_len=64, decode_steps=4) as llm:
        first, second = llm.generate([[1, 2], [3, 4]], sp)
    assert first.text == second.text == "a" * 20
    # (a call past the last token may be in flight when the request ends)
    assert _calls(first)[:20] == [(t, 1) for t in range(1, 21)]
    assert _calls(second)[:6] == [(1, 1), (2, 4), (6, 4), (10, 4), (14, 4), (18, 4)]


def test_decode_steps_C2_cancel_discards_the_call_in_flight():
    """A cancel while a multi-step call runs: that call's tokens are never selected for the
    request (the call is the step of C2); it ends CANCELLED with its slot released once."""
    tok = byte_tokenizer()
    entered, release = threading.Event(), threading.Event()

    def hook(positions, lengths):
        if positions.shape[1] == 1 and lengths[0] == 1 and positions[0, 0] == 4:
            entered.set()
            release.wait(30)

    HOOKS["multi"] = hook
    model = HookedModel.make([0] + [97] * 60, "multi", vocab_size=257)
    with jd.LLM(model, {}, tok, max_slots=2, max_len=64, decode_steps=8) as llm:
        h = llm.submit([1, 2], jd.SamplingParams(temperature=0.0, max_tokens=30))
        assert entered.wait(30)  # step 3: inside the second call (steps 2-9)
        h.cancel()
        release.set()
        c = h.result(timeout=30)
        assert llm.generate([[1, 2]], jd.SamplingParams(temperature=0.0, max_tokens=3))[0].text \
            == "aaa"  # the engine goes on
    assert c.state == jd.RequestState.CANCELLED
    # the first call (one step) may have been processed; the second (steps 2-9, in flight
    # at the cancel) never is
    assert [e.data["step"] for e in c.events if e.kind == "token.selected"] in ([], [1])
    assert sum(e.kind == "resources.released" for e in c.events) == 1


@pytest.mark.parametrize("value", [0, 17, 2.0, True])
def test_decode_steps_bad_values_name_the_field(value):
    model = ScriptedModel.make([0, 5], vocab_size=257)
    with pytest.raises(ValueError, match="^decode_steps"):
        jd.LLM(model, {}, byte_tokenizer(), max_slots=1, max_len=16, decode_steps=value)


def test_decode_steps_not_with_speculative():
    model = ScriptedModel.make([0, 5], vocab_size=257)
    with pytest.raises(ValueError, match="^decode_steps"):
        jd.LLM(model, {}, byte_tokenizer(), max_slots=1, max_len=16, decode_steps=2,
               speculative={"draft": "prompt_lookup", "k": 2})


class _Ops:
    """A step hook that keeps every published op."""

    def __init__(self):
        self.ops = []

    def publish(self, op):
        self.ops.append(op)


def test_compaction_X1_few_live_rows_run_alone_with_the_same_tokens(llama):
    model, params, tok = llama
    sp = jd.SamplingParams(temperature=0.8, seed=5, max_tokens=24, ignore_eos=True,
                           utf8_errors="replace", logprobs=1)
    with jd.LLM(model, params, tok, max_slots=2, max_len=128) as llm:  # every row, always
        full = llm.generate([[5, 6, 7]], sp)[0]
    hook = _Ops()
    with jd.LLM(model, params, tok, max_slots=8, max_len=128, step_hook=hook) as llm:
        alone = llm.generate([[5, 6, 7]], sp)[0]
        crowd = llm.generate([[5, 6, 7]] + [[i, i + 1] for i in range(1, 8)], sp)
    assert (alone.token_ids, alone.logprobs) == (full.token_ids, full.logprobs)
    assert (crowd[0].token_ids, crowd[0].logprobs) == (full.token_ids, full.logprobs)
    rows = [op.arrays.get("rows") for op in hook.ops if op.name == "step"]
    assert any(r is not None and list(r) == [0, 1] for r in rows)  # alone: 2 of 8 slots
    assert any(r is None for r in rows)                           # crowded: every slot


def test_compaction_rows_are_the_live_slots_and_idle_ones_to_a_power_of_two():
    from jaxdecode.engine.pages import PagePool
    from jaxdecode.engine.scheduler import Scheduler

    s = Scheduler(16, 64, 8, PagePool(64, 16, False), 64, min_rows=2)
    live = [3, 9, 14]
    assert list(s.compact_rows(live[:1])) == [0, 3]
    assert list(s.compact_rows(live)) == [0, 3, 9, 14]
    assert list(s.compact_rows(live + [4, 5])) == [0, 1, 2, 3, 4, 5, 9, 14]
    assert s.compact_rows(list(range(9))) is None


def test_prefill_chunks_of_one_iteration_are_batched_by_program_shape():
    """scheduler.chunks: one chunk per request within the `prefill_chunk` token budget, oldest
    first, grouped by (T, attention bucket), each group one device call, the shortest groups
    first; `chunk_rows` are
    the row counts such a call can have (warm-up compiles each)."""
    from jaxdecode.engine.pages import PagePool
    from jaxdecode.engine.placement import Placement
    from jaxdecode.engine.scheduler import Scheduler, chunk_rows
    from jaxdecode.shapes import row_bucket

    s = Scheduler(8, 256, 8, PagePool(64, 16, False), 64, min_rows=2)

    def prefilling(*lengths):  # requests placed with their prompts pending
        reqs = [type("Req", (), {"prompt_ids": [5] * n, "token_ids": []})() for n in lengths]
        s.placements.records.update((r, Placement([], prefilling=True, sharers=[]))
                                   for r in reqs)
        s.prefilling = list(reqs)
        return reqs

    a, b, c, d = prefilling(15, 15, 30, 100)
    shape = lambda batch: [(x.request, x.start, x.t, x.length, x.kv_len, x.final)  # noqa: E731
                           for x in batch]
    assert [shape(x) for x in s.chunks()] == [
        [(a, 0, 16, 15, 128, True), (b, 0, 16, 15, 128, True)], [(c, 0, 32, 30, 128, True)]]
    assert [shape(x) for x in s.chunks()] == [[(d, 0, 64, 64, 128, False)]]
    assert [shape(x) for x in s.chunks()] == [[(d, 64, 64, 36, 128, True)]]
    assert s.chunks() == [] and s.prefilling == []
    assert not any(s.placements[x].prefilling for x in (a, b, c, d))  # they decode now
    # the shortest chunks run first, whatever the order of arrival: their prompts' first
    # tokens stream as soon as their own call ends (core.py)
    e, f = prefilling(30, 15)
    assert [shape(x) for x in s.chunks()] == [[(f, 0, 16, 15, 128, True)],
                                              [(e, 0, 32, 30, 128, True)]]
    # row counts: powers of two and three quarters of them (shapes.row_bucket), at most one
    # chunk per slot and `prefill_chunk` tokens
    assert chunk_rows(16, 64, 8) == [1, 2, 3, 4] and chunk_rows(64, 64, 8) == [1]
    assert chunk_rows(16, 256, 3) == [1, 2, 3]
    assert chunk_rows(16, 256, 16) == [1, 2, 3, 4, 6, 8, 12, 16]
    assert [row_bucket(n) for n in range(1, 18)] == [1, 2, 3, 4, 6, 6, 8, 8, 12, 12, 12, 12,
                                                     16, 16, 16, 16, 24]


def test_save_request_of_a_request_that_ends_first_names_it(tmp_path):
    """Its steps in flight may finish a request before the pause takes effect (8 tokens per
    call here): saving it is a ValueError naming `request`, at once, not a timeout."""
    import time

    model = ScriptedModel.make([0] + [97] * 60, vocab_size=257)
    with jd.LLM(model, {}, byte_tokenizer(), max_slots=2, max_len=64) as llm:
        h = llm.submit([1, 2], jd.SamplingParams(temperature=0.0, max_tokens=3))
        next(e for e in h.events(timeout=30) if e.kind == "delta")
        # The race made certain: wait until the call that ends it (steps 2..9 >= its 3 tokens)
        # is dispatched, so the pause can only land after the end.
        placements = llm._core.scheduler.placements
        deadline = time.monotonic() + 30
        while (placed := placements.get(h._request)) is not None and placed.dispatched < 3:
            assert time.monotonic() < deadline, "the request's last step was never dispatched"
            time.sleep(0.0005)
        t0 = time.perf_counter()
        with pytest.raises(ValueError, match="^request"):
            llm.save_request(h, str(tmp_path / "saved"), timeout=30)
        assert time.perf_counter() - t0 < 10
        assert h.result(timeout=30).text == "aaa"
