"""The engine `jd.LLM` (contract §1, §2 events, §5 S8/S9, §6, §8, §9) on hand-computable models."""

import random
import threading
import time

import jax
import pytest

import jaxdecode as jd
from tests.host_fixtures import s4_tokenizer
from tests.scripted import HOOKS, HookedModel, ScriptedModel

EOS = 0
V = 258  # the S4 tokenizer: 256 byte tokens + 101 -> "AB", 102 -> "CD"


@pytest.fixture(scope="module")
def tok():
    return s4_tokenizer()


def byte_id(tok, ch):
    from jaxdecode.host.detokenizer import bytes_to_unicode
    return tok.token_to_id(bytes_to_unicode()[ord(ch)])


def engine(script, tok, **kw):
    model = ScriptedModel.make(script, vocab_size=V, max_len=kw.pop("model_max_len", 64),
                               eos_token_ids=(EOS,))
    return jd.LLM(model, {}, tok, max_slots=kw.pop("max_slots", 4), max_len=kw.pop("max_len", 64),
                  **kw)


def kinds(events, keep=("token.selected", "delta", "decode.completed", "stop.hit", "completed",
                         "cancelled", "failed")):
    return [e for e in events if e.kind in keep]


def greedy(n, **kw):
    return jd.SamplingParams(temperature=0.0, max_tokens=n, **kw)


def test_stop_S4_seed_experiment_A_event_order(tok):
    with engine([0, 101, 102, 5, 5, 5], tok) as llm:
        c = llm.submit([7, 8], greedy(10, stop=["BCD"])).result(timeout=30)
    assert c.text == "A"
    assert c.finish_reason == jd.FinishReason.STOP_SEQUENCE
    ev = kinds(c.events)
    assert [(e.kind, e.data.get("token", e.data.get("text"))) for e in ev] == [
        ("token.selected", 101), ("delta", "A"), ("decode.completed", None),
        ("token.selected", 102), ("stop.hit", None), ("completed", None)]
    assert ev[2].data["step"] == 1 and ev[0].data["step"] == 1 and ev[3].data["step"] == 2
    assert c.usage == jd.Usage(prompt_tokens=2, selected_tokens=2, processed_tokens=1,
                               returned_tokens=1)


def test_usage_R1_counts_eos_and_max_tokens(tok):
    a, b = byte_id(tok, "a"), byte_id(tok, "b")
    with engine([0, a, b, EOS, a], tok) as llm:
        eos, length = llm.generate([[7, 8], [7, 8]], [greedy(10), greedy(3, ignore_eos=True)])
    assert (eos.text, eos.finish_reason) == ("ab", jd.FinishReason.EOS)  # EOS never shown (D6)
    assert eos.usage == jd.Usage(2, 3, 2, 2)
    assert length.finish_reason == jd.FinishReason.MAX_OUTPUT_TOKENS
    assert length.usage == jd.Usage(2, 3, 2, 3)


def test_stop_S9_stop_string_on_last_allowed_token_wins(tok):
    with engine([0, 101, 102, 5], tok) as llm:
        c = llm.generate([[7, 8]], greedy(2, stop=["BCD"]))[0]
    assert (c.text, c.finish_reason) == ("A", jd.FinishReason.STOP_SEQUENCE)


def test_stop_S2_max_tokens_finish_releases_the_held_back_text(tok):
    with engine([0, 101, 102, 5], tok) as llm:
        c = llm.generate([[7, 8]], greedy(2, stop=["CDX"]))[0]
    assert (c.text, c.finish_reason) == ("ABCD", jd.FinishReason.MAX_OUTPUT_TOKENS)


def test_stop_S8_stop_token_id_and_sequences_on_the_engine(tok):
    a = byte_id(tok, "a")
    with engine([0, a, 101, 102, a, a], tok) as llm:
        single, shown, seq = llm.generate(
            [[7, 8]] * 3, [greedy(10, stop_token_ids=(102,)),
                           greedy(10, stop_token_ids=(102,), include_stop_in_output=True),
                           greedy(10, stop_token_ids=((101, 102),))])
    assert (single.text, single.finish_reason) == ("aAB", jd.FinishReason.STOP_SEQUENCE)
    assert shown.text == "aABCD"
    assert (seq.text, seq.finish_reason) == ("a", jd.FinishReason.STOP_SEQUENCE)


def test_stream_T1_T3_sixteen_concurrent_streams_keep_order(tok):
    script = [0] + [101, 102, byte_id(tok, "x")] * 10
    with engine(script, tok, max_slots=4) as llm:
        handles = [llm.submit([7, 8], greedy(12 + i % 5)) for i in range(16)]
        results = {}

        def read(h):
            results[h.request_id] = list(h.events(timeout=60))

        threads = [threading.Thread(target=read, args=(h,)) for h in handles]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    for h in handles:
        events = results[h.request_id]
        seqs = [e.seq for e in events]
        assert seqs == sorted(set(seqs)) and events[0].kind == "start"
        assert events[-1].kind == "completed" and sum(e.kind == "completed" for e in events) == 1
        text = "".join(e.data["text"] for e in events if e.kind == "delta")
        assert text == h.result().text == ("ABCDx" * 10)[: len(text)]
        assert h.result().usage.selected_tokens == 12 + int(h.request_id.split("-")[1]) % 5


def test_lifecycle_L2_fifty_cancel_complete_races_one_terminal_each(tok):
    rng = random.Random(0)
    with engine([0] + [byte_id(tok, "z")] * 40, tok, max_slots=8) as llm:
        handles = [llm.submit([7, 8], greedy(rng.randint(1, 20))) for _ in range(50)]
        for h in handles:
            time.sleep(rng.random() * 0.002)
            if rng.random() < 0.7:
                h.cancel()
        outs = [h.result(timeout=60) for h in handles]
    for c in outs:
        terminals = [e for e in c.events if e.kind in ("completed", "cancelled", "failed")]
        assert len(terminals) == 1
        after = c.events[c.events.index(terminals[0]) + 1:]
        assert not any(e.kind == "delta" for e in after)  # L3
        assert c.state in (jd.RequestState.FINISHED, jd.RequestState.CANCELLED)
        assert sum(e.kind == "resources.released" for e in c.events) <= 1


def test_cancel_C2_seed_experiment_B_cancel_while_step_3_in_flight(tok):
    entered, release = threading.Event(), threading.Event()
    prompt = [7, 8]

    def hook(positions, lengths):
        if positions.shape[1] == 1 and lengths[0] == 1 and positions[0, 0] == len(prompt) + 2:
            entered.set()
            release.wait(30)

    HOOKS["c2"] = hook
    model = HookedModel.make([0] + [byte_id(tok, "q")] * 40, "c2", vocab_size=V,
                             eos_token_ids=(EOS,))
    # one decode step per call: the experiment's steps are device calls
    with jd.LLM(model, {}, tok, max_slots=2, max_len=64, decode_steps=1) as llm:
        h = llm.submit(prompt, greedy(30))
        assert entered.wait(30)
        sent_before = "".join(e.data["text"] for e in h.trace() if e.kind == "delta")
        t0 = time.perf_counter()
        h.cancel()
        assert time.perf_counter() - t0 < 0.05  # C4: cancel never waits for the device
        h.cancel()  # idempotent
        release.set()
        c = h.result(timeout=30)
    assert c.state == jd.RequestState.CANCELLED and c.finish_reason == jd.FinishReason.CANCELLED
    steps = [e.data["step"] for e in c.events if e.kind == "token.selected"]
    assert 4 not in steps and max(steps) <= 3
    kinds_ = [e.kind for e in c.events]
    assert kinds_.index("cancel.requested") < kinds_.index("cancel.observed") < kinds_.index("cancelled")
    assert "delta" not in kinds_[kinds_.index("cancelled"):]
    assert kinds_.count("resources.released") == 1
    assert c.text == sent_before == "q" * len(sent_before)  # the sent prefix is unchanged
    h.cancel()  # a no-op on an ended request
    assert h.state == jd.RequestState.CANCELLED


def test_deadline_C3_is_its_own_reason_and_flushes_held_text(tok):
    def slow(positions, lengths):
        time.sleep(0.01)

    HOOKS["slow"] = slow
    model = HookedModel.make([0] + [101, 102] * 60, "slow", vocab_size=V, max_len=256,
                             eos_token_ids=(EOS,))
    with jd.LLM(model, {}, tok, max_slots=2, max_len=256) as llm:
        # The same request without a deadline first, so that every program it needs (the KV
        # bucket of 2 + 200 tokens among them) is compiled: the deadline is for decoding only.
        llm.generate([[7, 8]], greedy(200, stop=["ABCDX"]))
        c = llm.generate([[7, 8]], greedy(200, stop=["ABCDX"], deadline_s=0.5))[0]
    assert c.finish_reason == jd.FinishReason.DEADLINE_EXCEEDED
    assert c.state == jd.RequestState.FINISHED
    path = [e.data["to"] for e in c.events if e.kind == "lifecycle"]
    assert path[-3:] == [jd.RequestState.DECODING, jd.RequestState.DRAINING,
                         jd.RequestState.FINISHED]
    assert 1 < c.usage.selected_tokens < 200
    # every selected token's text is returned: the held-back "AB..." is flushed, not dropped
    assert c.text == ("ABCD" * 100)[: 2 * c.usage.selected_tokens]
    assert c.usage.returned_tokens == c.usage.selected_tokens


def test_failure_P2_one_request_fails_others_continue(tok):
    a = byte_id(tok, "a")
    with engine([0, a, a, a, a], tok) as llm:
        bad, good = llm.generate([[7, 8], [7, 8]],
                                 [greedy(3, banned_token_ids=tuple(range(V))), greedy(3)])
    assert bad.state == jd.RequestState.FAILED and bad.error == jd.ErrorCode.ALL_TOKENS_MASKED
    assert (good.text, good.finish_reason) == ("aaa", jd.FinishReason.MAX_OUTPUT_TOKENS)


def test_engine_rejects_bad_input_naming_the_field(tok):
    with engine([0, 5], tok, max_queue=1) as llm:
        with pytest.raises(ValueError, match="^prompt"):
            llm.submit("")
        with pytest.raises(ValueError, match="^prompt"):
            llm.submit([1] * 64)
        with pytest.raises(ValueError, match="^prompt"):
            llm.submit([V + 5])
        with pytest.raises(ValueError, match="^banned_token_ids"):
            llm.submit([1], jd.SamplingParams(banned_token_ids=(V,)))
        with pytest.raises(ValueError, match="^n"):
            llm.submit([1], jd.SamplingParams(n=2))
        assert llm.generate([[7, 8]], greedy(1))[0].finish_reason == jd.FinishReason.MAX_OUTPUT_TOKENS
    with pytest.raises(ValueError, match="^max_len"):
        engine([0], tok, max_len=1000)


def test_engine_generate_flat_n_and_X1_matches_device_generate():
    from models import Llama, LlamaConfig
    from tests.host_fixtures import byte_level_tokenizer

    tok = byte_level_tokenizer()
    cfg = LlamaConfig(vocab_size=tok.get_vocab_size(), num_layers=2, num_heads=4, num_kv_heads=2,
                      head_dim=8, max_len=128, hidden_size=32, intermediate_size=64,
                      eos_token_ids=(0,))
    model = Llama(cfg)
    params = model.init_params(jax.random.key(1), scale=0.3)
    sp = jd.SamplingParams(temperature=1.0, top_k=50, seed=11, max_tokens=12, ignore_eos=True,
                           utf8_errors="replace")  # random weights emit invalid UTF-8
    ref = jd.generate(model, params, [[5, 6, 7]], sp).tokens(0)
    other = jd.SamplingParams(temperature=0.7, seed=3, max_tokens=20, ignore_eos=True,
                              utf8_errors="replace")
    with jd.LLM(model, params, tok, max_slots=3, max_len=128) as llm:
        outs = llm.generate([[9, 9], [5, 6, 7], [1, 2, 3, 4]], [other, sp, other])
        nsamp = llm.generate([[5, 6, 7]], jd.SamplingParams(n=3, seed=4, max_tokens=6,
                                                            utf8_errors="replace"))
    assert list(outs[1].token_ids) == ref  # X1: same tokens in the engine, in any slot
    assert [(c.prompt_index, c.index) for c in nsamp] == [(0, 0), (0, 1), (0, 2)]
    assert len({c.token_ids for c in nsamp}) > 1


def test_engine_queue_full_and_close(tok):
    llm = engine([0] + [5] * 60, tok, max_slots=1, max_queue=2)
    handles = []
    try:
        with pytest.raises(jd.QueueFull):
            for _ in range(4):  # 1 slot + 2 queued at most: the 4th cannot fit
                handles.append(llm.submit([7], greedy(50)))
        assert 2 <= len(handles) <= 3
    finally:
        llm.close()
    # close() waits 10 s; a step still compiling on a loaded machine may outlast that
    llm._core._thread.join(120)
    assert not llm._core._thread.is_alive() and llm._core._thread.daemon
    assert all(h.result(timeout=10).state in (jd.RequestState.FINISHED, jd.RequestState.CANCELLED)
               for h in handles)
    with pytest.raises(jd.EngineClosed):
        llm.submit([7])


def test_engine_no_recompile_after_warmup_across_mixed_requests(tok):
    rng = random.Random(1)
    with engine([0] + [byte_id(tok, "w")] * 80, tok, max_slots=4, max_len=128,
                model_max_len=128) as llm:
        assert llm.warmup(max_prompt_len=40) > 0
        before = jd.compilation_count()
        handles = []
        for i in range(40):
            prompt = [rng.randrange(1, V) for _ in range(rng.randint(1, 40))]
            sp = jd.SamplingParams(max_tokens=rng.randint(1, 60), seed=i,
                                   temperature=rng.choice([0.0, 0.8]),
                                   top_k=rng.choice([0, 5]), stop=rng.choice([(), ("ww",)]))
            handles.append(llm.submit(prompt, sp))
            if rng.random() < 0.3:
                time.sleep(0.005)
        assert all(h.result(timeout=60).finish_reason is not None for h in handles)
        assert jd.compilation_count() == before


def test_backpressure_B1_paused_request_resumes_at_the_same_token(tok):
    script = [0] + [byte_id(tok, c) for c in "the quick brown fox jumps over the lazy dog"]
    sp = jd.SamplingParams(temperature=0.9, seed=5, max_tokens=40)  # sampled: RNG cursor matters
    with engine(script, tok, max_len=64) as llm:
        reference = llm.submit([7, 8], sp).result(timeout=30)
    with engine(script, tok, max_len=64, max_buffered=2, backpressure="pause") as llm:
        h = llm.submit([7, 8], sp)
        events = []
        for event in h.events(timeout=30):
            events.append(event)
            time.sleep(0.02)  # a slow reader
        c = h.result(timeout=30)
    assert any(e.kind == "backpressure.paused" for e in c.events)
    assert c.token_ids == reference.token_ids and c.text == reference.text
    assert "".join(e.data["text"] for e in events if e.kind == "delta") == c.text
    assert c.finish_reason == jd.FinishReason.MAX_OUTPUT_TOKENS


def test_stream_T4_resume_after_seq_from_the_engine(tok):
    with engine([0] + [101, 102] * 20, tok) as llm:
        h = llm.submit([7, 8], greedy(20))
        c = h.result(timeout=30)
        later = h.events_after(3)
    assert [e.seq for e in later] == list(range(4, later[-1].seq + 1))
    assert later[-1].kind == "completed"
    full = [e for e in c.events if e.seq is not None]
    assert [(e.seq, e.kind) for e in full if e.seq > 3] == [(e.seq, e.kind) for e in later]


def test_engine_max_tokens_past_max_len_is_clamped_not_a_failure(tok):
    """max_tokens larger than the room left in max_len is clamped to it (it once reached
    SamplingParams as np.int32, failed the prefill and orphaned the admitted batch)."""
    a = byte_id(tok, "a")
    with engine([a] * 64, tok, max_len=32) as llm:
        c = llm.submit([7, 8], greedy(1000)).result(timeout=30)
        assert llm.error is None
    assert c.error is None and c.finish_reason in (jd.FinishReason.MAX_OUTPUT_TOKENS,
                                                   jd.FinishReason.CONTEXT_LIMIT)
    assert c.usage.selected_tokens == 30 and c.text == "a" * 30


def test_events_O2_selected_exceeds_written_by_at_most_one(tok):
    a = byte_id(tok, "a")
    with engine([0, a, a, a, EOS], tok) as llm:
        c = llm.submit([7, 8], greedy(10)).result(timeout=30)
    selected = written = 0
    for e in c.events:
        if e.kind == "token.selected":
            selected += 1
            assert e.data["step"] == selected
        elif e.kind == "decode.completed":
            written += 1
            assert e.data["step"] == selected == written  # y_t written right after it was chosen
            assert e.data["cache_length"] == 2 + written
        assert selected - written in (0, 1)
    assert (selected, written) == (4, 3)  # the EOS is selected, never written (O1)
    assert c.usage.selected_tokens == 4 and c.usage.processed_tokens == 3
