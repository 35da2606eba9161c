"""Ordered streaming protocol (contract §6 T1-T7) and back-pressure (§7)."""

from __future__ import annotations

import threading

import pytest

from jaxdecode.host import OrderedStream, ResumeUnavailable, Timings
from jaxdecode.types import ErrorCode, FinishReason, Usage


def drain(stream, timeout=2.0):
    return list(stream.iter(timeout))


def texts(events):
    return "".join(e.data["text"] for e in events if e.kind == "delta")


def test_stream_T1_seq_strictly_increasing_unique():
    s = OrderedStream("r1")
    s.start("snap")
    for t in ["a", "b", "", "c"]:
        s.emit(t)
    s.complete(FinishReason.EOS, Usage(1, 3, 2, 3))
    events = drain(s)
    seqs = [e.seq for e in events]
    assert seqs == list(range(len(events)))
    assert [e.kind for e in events] == ["start", "delta", "delta", "delta", "completed"]
    assert events[0].data["model_snapshot"] == "snap"
    assert all(e.request_id == "r1" for e in events)


def test_stream_T2_concatenation_by_seq_across_threads():
    s = OrderedStream("r", max_buffered=10_000)
    s.start()
    got = []

    def reader():
        got.extend(s.iter(5.0))

    th = threading.Thread(target=reader)
    th.start()
    for i in range(500):
        s.emit(f"{i},")
    s.complete(FinishReason.MAX_OUTPUT_TOKENS)
    th.join(5)
    assert [e.seq for e in got] == sorted(e.seq for e in got)
    assert texts(got) == "".join(f"{i}," for i in range(500))


def test_stream_T3_one_terminal_after_every_delta():
    s = OrderedStream("r")
    s.emit("x")  # auto-start
    assert s.complete(FinishReason.EOS) is not None
    assert s.cancel() is None
    assert s.fail(ErrorCode.MODEL_ERROR) is None
    assert s.emit("late") is None
    assert s.dropped_after_terminal == 1
    events = drain(s)
    assert [e.kind for e in events] == ["start", "delta", "completed"]
    assert s.get(0.01) is None  # end of stream


def test_stream_T4_resume_after_seq_exactly_once_with_dedup():
    s = OrderedStream("r", keep=100)
    s.start()
    for t in "abcdef":
        s.emit(t)
    first = [s.get(1) for _ in range(3)]  # start, a, b -- then the client drops
    last_seen = first[-1].seq
    s.complete(FinishReason.EOS)
    # reconnect: replay after the last seen seq
    replay = s.events_after(last_seen)
    assert [e.seq for e in replay] == list(range(last_seen + 1, s.next_seq))
    seen = {(e.request_id, e.seq): e for e in first}
    for e in replay:
        seen.setdefault((e.request_id, e.seq), e)
    ordered = [seen[k] for k in sorted(seen, key=lambda k: k[1])]
    assert texts(ordered) == "abcdef"
    assert [e.kind for e in ordered][-1] == "completed"
    # resume moves the cursor
    s.resume(last_seen)
    assert [e.seq for e in drain(s)] == [e.seq for e in replay]


def test_stream_T4_resume_unavailable_when_history_trimmed():
    s = OrderedStream("r", keep=2, max_buffered=100)
    s.start()
    for t in "abcdef":
        s.emit(t)
    drain_n = [s.get(1) for _ in range(7)]
    assert drain_n[-1].data["text"] == "f"
    with pytest.raises(ResumeUnavailable):
        s.events_after(0)
    assert [e.seq for e in s.events_after(5)] == [6]
    with pytest.raises(ResumeUnavailable):
        s.events_after(99)


def test_stream_T6_output_kind_cumulative():
    s = OrderedStream("r", output_kind="cumulative")
    for t in ["he", "ll", "o"]:
        s.emit(t)
    s.complete(FinishReason.EOS)
    deltas = [e for e in drain(s) if e.kind == "delta"]
    assert [e.data["text"] for e in deltas] == ["he", "hell", "hello"]
    assert [e.data["delta"] for e in deltas] == ["he", "ll", "o"]


def test_stream_T6_output_kind_final_only():
    s = OrderedStream("r", output_kind="final_only")
    s.start()
    for t in ["he", "ll", "o"]:
        assert s.emit(t) is None
    assert s.unsent == 1  # only the start event
    s.complete(FinishReason.EOS)
    events = drain(s)
    assert [e.kind for e in events] == ["start", "delta", "completed"]
    assert events[1].data["text"] == "hello"


def test_stream_T6_unknown_output_kind_rejected():
    with pytest.raises(ValueError):
        OrderedStream("r", output_kind="stream")
    with pytest.raises(ValueError):
        OrderedStream("r", policy="drop")


def test_stream_backpressure_buffer_overflow_fails_never_completes():
    s = OrderedStream("r", max_buffered=4, policy="buffer")
    s.start()
    accepted = [s.emit(c) for c in "abcdef"]
    assert [a is not None for a in accepted] == [True, True, True, False, False, False]
    assert s.overflowed and s.lost_deltas == 3
    ev = s.complete(FinishReason.EOS, Usage(0, 6, 5, 6))
    assert ev.kind == "failed" and ev.data["error"] is ErrorCode.OUTPUT_BUFFER_OVERFLOW
    events = drain(s)
    assert events[-1].kind == "failed"
    assert not any(e.kind == "completed" for e in events)


def test_stream_backpressure_fail_policy_same_bound():
    s = OrderedStream("r", max_buffered=3, policy="fail")
    s.start()
    s.emit("a")
    s.emit("b")
    assert s.emit("c") is None and s.overflowed


def test_stream_backpressure_pause_signals_and_loses_nothing():
    s = OrderedStream("r", max_buffered=4, policy="pause")
    s.start()
    n = 0
    while not s.should_pause:
        s.emit("x")
        n += 1
    assert s.unsent == 4 and n == 3
    # a step already in flight may still deliver; nothing is lost below the hard cap
    assert s.emit("y") is not None
    assert not s.overflowed
    s.get(1)
    s.get(1)
    assert not s.should_pause
    assert s.wait_for_space(0.01)
    s.complete(FinishReason.EOS)
    rest = drain(s)
    assert texts(rest) == "xxy"
    assert rest[-1].kind == "completed"


def test_stream_backpressure_pause_hard_cap_bounds_memory():
    s = OrderedStream("r", max_buffered=4, policy="pause")
    for _ in range(100):
        s.emit("x")
    assert s.unsent <= 8
    assert s.overflowed


def test_stream_consumer_timeout_and_listener():
    s = OrderedStream("r")
    calls = []
    s.add_listener(lambda: calls.append(1))
    with pytest.raises(TimeoutError):
        s.get(0.01)
    s.start()
    assert calls == [1]
    assert s.get_nowait().kind == "start"
    assert s.get_nowait() is None


def test_stream_blocking_get_wakes_on_emit():
    s = OrderedStream("r")
    out = []
    th = threading.Thread(target=lambda: out.append(s.get(5)))
    th.start()
    s.start()
    th.join(5)
    assert out and out[0].kind == "start"


def test_stream_T7_timings_record_send_time():
    now = [0.0]
    s = OrderedStream("r", clock=lambda: now[0])
    s.start()
    now[0] = 0.5
    s.get(1)
    assert s.timings.send_s == pytest.approx(0.5)
    t = Timings(queue_s=1, prefill_s=2, decode_s=3, stop_buffer_wait_s=4, send_s=5)
    assert t.as_dict() == {"queue_s": 1, "prefill_s": 2, "decode_s": 3, "stop_buffer_wait_s": 4, "send_s": 5}


def test_stream_T5_reader_closed_is_a_flag_not_eos():
    s = OrderedStream("r")
    s.start()
    s.close_reader()
    assert s.reader_closed and not s.finished
