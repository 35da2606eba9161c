"""Request lifecycle (contract §1 L1-L4), cancellation moments (§8 C1, C4), release-once (R1)."""

from __future__ import annotations

import itertools
import random
import sys
import threading

import pytest

from jaxdecode.host import (
    TERMINAL_STATES,
    TRANSITIONS,
    IllegalTransition,
    Lifecycle,
    OrderedStream,
    TextPipeline,
)
from jaxdecode.types import ErrorCode, FinishReason, RequestState, Usage
from tests.host_fixtures import s4_tokenizer

S = RequestState

ALLOWED = {
    (S.CREATED, S.QUEUED), (S.QUEUED, S.PREFILLING), (S.PREFILLING, S.DECODING),
    (S.DECODING, S.DRAINING), (S.DRAINING, S.FINISHED), (S.CREATED, S.FAILED),
    (S.QUEUED, S.DRAINING), (S.PREFILLING, S.DRAINING),
    (S.QUEUED, S.FAILED), (S.PREFILLING, S.FAILED), (S.DECODING, S.FAILED), (S.DRAINING, S.FAILED),
    (S.QUEUED, S.CANCEL_REQUESTED), (S.PREFILLING, S.CANCEL_REQUESTED),
    (S.DECODING, S.CANCEL_REQUESTED), (S.CANCEL_REQUESTED, S.CANCELLED),
}

PATH = {
    S.CREATED: [],
    S.QUEUED: [S.QUEUED],
    S.PREFILLING: [S.QUEUED, S.PREFILLING],
    S.DECODING: [S.QUEUED, S.PREFILLING, S.DECODING],
    S.DRAINING: [S.QUEUED, S.PREFILLING, S.DECODING, S.DRAINING],
    S.CANCEL_REQUESTED: [S.QUEUED, S.CANCEL_REQUESTED],
}


def at(state, **kw):
    lc = Lifecycle("r", **kw)
    for s in PATH[state]:
        lc.transition(s)
    return lc


def test_lifecycle_transition_table_is_the_spec():
    got = {(a, b) for a, targets in TRANSITIONS.items() for b in targets}
    assert got == ALLOWED
    assert set(TRANSITIONS) == set(RequestState)


@pytest.mark.parametrize("frm,to", list(itertools.product([s for s in S if s not in TERMINAL_STATES], list(S))))
def test_lifecycle_illegal_transitions_raise(frm, to):
    lc = at(frm)
    if (frm, to) not in ALLOWED:
        with pytest.raises(IllegalTransition):
            if to in TERMINAL_STATES:
                lc.transition_and_emit_terminal(to, finish_reason=FinishReason.EOS, error=ErrorCode.MODEL_ERROR)
            else:
                lc.transition(to)
        assert lc.state is frm
    elif to in TERMINAL_STATES:
        ev = lc.transition_and_emit_terminal(to, finish_reason=FinishReason.EOS, error=ErrorCode.MODEL_ERROR)
        assert ev is not None and lc.state is to
    else:
        lc.transition(to)
        assert lc.state is to


def test_lifecycle_L1_terminal_irreversible():
    for terminal in TERMINAL_STATES:
        lc = Lifecycle("r")
        if terminal is S.FAILED:
            lc.fail(ErrorCode.INVALID_REQUEST)
        elif terminal is S.FINISHED:
            lc.transition(S.QUEUED)
            lc.complete(FinishReason.EOS)
        else:
            lc.transition(S.QUEUED)
            lc.request_cancel()
            lc.observe_cancel()
            lc.cancel()
        assert lc.state is terminal
        for s in S:
            if s in TERMINAL_STATES:
                assert lc.transition_and_emit_terminal(s, finish_reason=FinishReason.EOS, error=ErrorCode.MODEL_ERROR) is None
            else:
                with pytest.raises(IllegalTransition):
                    lc.transition(s)
        assert lc.state is terminal


def test_lifecycle_L2_plain_transition_to_terminal_refused():
    lc = at(S.DRAINING)
    with pytest.raises(IllegalTransition, match="transition_and_emit_terminal"):
        lc.transition(S.FINISHED)


def test_lifecycle_L2_terminal_event_in_stream_and_trace():
    stream = OrderedStream("r")
    lc = Lifecycle("r", stream=stream)
    lc.transition(S.QUEUED)
    lc.transition(S.PREFILLING)
    lc.emit_start("snap")
    lc.transition(S.DECODING)
    lc.emit_delta("hi")
    lc.transition(S.DRAINING)
    ev = lc.transition_and_emit_terminal(S.FINISHED, finish_reason=FinishReason.EOS, usage=Usage(2, 3, 2, 2))
    assert ev.kind == "completed" and ev.data["finish_reason"] is FinishReason.EOS
    assert ev is stream.terminal_event is lc.terminal_event
    kinds = [e.kind for e in stream.iter(1)]
    assert kinds == ["start", "delta", "completed"]
    trace = lc.trace.kinds()
    assert trace.count("completed") == 1 and trace.index("delta") < trace.index("completed")
    lifecycle_moves = [(e.data["from"], e.data["to"]) for e in lc.trace.of_kind("lifecycle")]
    assert lifecycle_moves[-1] == (S.DRAINING, S.FINISHED)


def _spin(n):
    for _ in range(n):
        pass


@pytest.fixture
def fast_switching():
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # let the two threads really interleave
    yield
    sys.setswitchinterval(old)


@pytest.mark.parametrize("start_state", [S.DECODING, S.PREFILLING, S.QUEUED])
def test_lifecycle_L2_cancel_complete_race_exactly_one_terminal(start_state, fast_switching):
    rng = random.Random(start_state.value)
    outcomes = set()
    for _ in range(50):
        stream = OrderedStream("r")
        lc = at(start_state, stream=stream)
        lc.emit_start()
        barrier = threading.Barrier(2)
        spin_a, spin_b = rng.randrange(0, 2000), rng.randrange(0, 20000)
        errors = []

        def completer():
            try:
                barrier.wait()
                _spin(spin_a)
                lc.emit_delta("x")
                lc.complete(FinishReason.MAX_OUTPUT_TOKENS)
                lc.emit_delta("late")
            except Exception as exc:  # pragma: no cover - reported below
                errors.append(exc)

        def canceller():
            try:
                barrier.wait()
                _spin(spin_b)
                lc.request_cancel()
                if lc.observe_cancel():
                    lc.cancel()
            except Exception as exc:  # pragma: no cover - reported below
                errors.append(exc)

        threads = [threading.Thread(target=completer), threading.Thread(target=canceller)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(5)
        assert errors == []
        events = list(stream.iter(1))
        terminals = [e for e in events if e.kind in ("completed", "cancelled", "failed")]
        assert len(terminals) == 1
        assert events[-1] is terminals[0]  # L3: no delta after the terminal event
        assert {"completed": S.FINISHED, "cancelled": S.CANCELLED}[terminals[0].kind] is lc.state
        assert "late" not in "".join(e.data.get("text", "") for e in events)
        assert lc.trace.kinds().count(terminals[0].kind) == 1
        outcomes.add(terminals[0].kind)
    assert outcomes  # usually both "completed" and "cancelled" occur


def test_lifecycle_L2_concurrent_terminal_attempts_one_winner(fast_switching):
    for _ in range(50):
        lc = at(S.DRAINING, stream=OrderedStream("r"))
        results = []
        barrier = threading.Barrier(4)

        def attempt(to):
            barrier.wait()
            results.append(lc.transition_and_emit_terminal(to, finish_reason=FinishReason.EOS, error=ErrorCode.MODEL_ERROR))

        threads = [threading.Thread(target=attempt, args=(to,)) for to in (S.FINISHED, S.FAILED, S.FINISHED, S.FAILED)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(5)
        assert sum(r is not None for r in results) == 1
        assert sum(1 for e in lc.stream.iter(1) if e.kind in ("completed", "failed")) == 1


def test_lifecycle_L3_no_delta_after_terminal():
    lc = at(S.DECODING, stream=OrderedStream("r"))
    lc.emit_delta("a")
    lc.complete(FinishReason.EOS)
    assert lc.emit_delta("b") is None
    assert lc.dropped_after_terminal == 1
    assert [e.kind for e in lc.stream.iter(1)] == ["start", "delta", "completed"]


def test_lifecycle_L4_cancel_moments_recorded_C1():
    lc = at(S.DECODING)
    assert lc.request_cancel() is True
    assert lc.request_cancel() is True  # idempotent
    assert lc.state is S.DECODING  # requested, not yet observed
    lc.record("decode.completed", step=3, cache_length=10)  # the in-flight step finishes
    assert lc.observe_cancel()
    assert lc.state is S.CANCEL_REQUESTED
    lc.release_once("cache_slot", lambda: None)
    ev = lc.cancel(usage=Usage(1, 3, 3, 2))
    assert ev.kind == "cancelled" and lc.state is S.CANCELLED
    kinds = lc.trace.kinds()
    assert kinds.count("cancel.requested") == 1
    assert kinds.index("cancel.requested") < kinds.index("decode.completed") < kinds.index("cancel.observed")
    assert kinds.index("resources.released") < kinds.index("cancelled")


def test_lifecycle_C4_cancel_noop_after_end_and_while_draining():
    lc = at(S.DRAINING)
    assert lc.request_cancel() is False
    assert lc.observe_cancel() is False
    assert lc.cancel() is None
    lc.complete(FinishReason.EOS)
    assert lc.request_cancel() is False
    assert lc.state is S.FINISHED


def test_lifecycle_L4_no_delta_once_cancel_observed_and_complete_loses():
    lc = at(S.DECODING, stream=OrderedStream("r"))
    lc.emit_delta("a")
    lc.request_cancel()
    lc.observe_cancel()
    assert lc.emit_delta("in-flight step") is None
    ev = lc.complete(FinishReason.MAX_OUTPUT_TOKENS)
    assert ev.kind == "cancelled" and lc.state is S.CANCELLED
    assert [e.kind for e in lc.stream.iter(1)] == ["start", "delta", "cancelled"]


def test_lifecycle_fail_during_cancel_ends_cancelled():
    lc = at(S.CANCEL_REQUESTED)
    ev = lc.fail(ErrorCode.MODEL_ERROR, message="boom")
    assert ev.kind == "cancelled" and lc.state is S.CANCELLED and ev.data["error"] is ErrorCode.MODEL_ERROR


def test_lifecycle_overflowed_stream_never_finishes():
    stream = OrderedStream("r", max_buffered=2)
    lc = at(S.DECODING, stream=stream)
    for c in "abcd":
        lc.emit_delta(c)
    assert stream.overflowed
    ev = lc.complete(FinishReason.EOS)
    assert ev.kind == "failed" and ev.data["error"] is ErrorCode.OUTPUT_BUFFER_OVERFLOW
    assert lc.state is S.FAILED


def test_lifecycle_R1_release_once_even_when_cleanup_fails():
    lc = at(S.DECODING)
    calls = []
    assert lc.release_once("cache_slot", lambda: calls.append("cache")) is True
    assert lc.release_once("cache_slot", lambda: calls.append("again")) is False

    def boom():
        raise RuntimeError("device gone")

    assert lc.release_once("batch_slot", boom) is True
    assert lc.release_once("batch_slot", boom) is False
    assert calls == ["cache"]
    assert lc.released == {"cache_slot": True, "batch_slot": False}
    rel = lc.trace.of_kind("resources.released")
    assert [e.data["resource"] for e in rel] == ["cache_slot", "batch_slot"]
    assert rel[1].data["ok"] is False
    lc.complete(FinishReason.EOS)
    assert lc.state is S.FINISHED


def test_lifecycle_trace_disabled_is_empty_but_stream_works():
    stream = OrderedStream("r")
    lc = Lifecycle("r", stream=stream, trace=False)
    lc.transition(S.QUEUED)
    lc.emit_delta("x")
    lc.complete(FinishReason.EOS)
    assert len(lc.trace) == 0
    assert [e.kind for e in stream.iter(1)] == ["start", "delta", "completed"]


def test_lifecycle_streamless_events_carry_seq():
    lc = at(S.DECODING)
    lc.emit_delta("a")
    lc.emit_delta("b")
    ev = lc.complete(FinishReason.EOS)
    seqs = [e.seq for e in lc.trace.events if e.kind in ("start", "delta", "completed")]
    assert seqs == [0, 1, 2, 3] and ev.seq == 3


def test_lifecycle_engine_style_pipeline_S4_trace():
    """The architecture's pipeline end to end on the S4 fixture: the contract's event order (S4)."""
    tok = s4_tokenizer()
    stream = OrderedStream("r")
    lc = Lifecycle("r", stream=stream)
    pipe = TextPipeline(tok, stop=["BCD"])
    lc.transition(S.QUEUED)
    lc.transition(S.PREFILLING)
    lc.emit_start()
    lc.transition(S.DECODING)
    finish = None
    for step, token in enumerate([101, 102], start=1):
        lc.record("token.selected", step=step, token=token)
        out = pipe.push(token)
        lc.emit_delta(out.text)
        if out.hit is not None:
            lc.record("stop.hit", stop=out.hit.stop)
            finish = pipe.finish(FinishReason.MAX_OUTPUT_TOKENS)
            break
        lc.record("decode.completed", step=step, cache_length=step)
    lc.transition(S.DRAINING)
    lc.release_once("cache_slot")
    lc.transition_and_emit_terminal(
        S.FINISHED, finish_reason=finish.finish_reason, usage=Usage(0, 2, 1, pipe.returned_tokens)
    )
    kinds = [e.kind for e in lc.trace.events if e.kind != "lifecycle"]
    assert kinds == ["start", "token.selected", "delta", "decode.completed", "token.selected",
                     "stop.hit", "resources.released", "completed"]
    events = list(stream.iter(1))
    assert "".join(e.data["text"] for e in events if e.kind == "delta") == "A"
    assert events[-1].data["finish_reason"] is FinishReason.STOP_SEQUENCE
    assert events[-1].data["usage"].returned_tokens == 1
    t = lc.timings(pipe)
    assert t.queue_s >= 0 and t.decode_s >= 0 and t.stop_buffer_wait_s >= 0
