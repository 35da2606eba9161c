"""Stop strings and stop id sequences (contract §5), and the text pipeline endings (S4, S6, S9, §9)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.host_fixtures import byte_level_tokenizer, byte_of, s4_tokenizer
from jaxdecode.host import (
    STOP_RULE_VERSION,
    IncrementalDetokenizer,
    StopHit,
    StopMatcher,
    StopResult,
    StopSequenceMatcher,
    TextPipeline,
)
from jaxdecode.types import DecodingError, FinishReason

# ---------------------------------------------------------------------------------------------
# brute-force reference
# ---------------------------------------------------------------------------------------------


def brute_hit(text, stops):
    """(end, length, index) of the winning hit by contract S5, or None."""
    for end in range(1, len(text) + 1):
        cands = [(len(s), -i) for i, s in enumerate(stops) if text[:end].endswith(s)]
        if cands:
            length, neg = max(cands)
            return end, length, -neg
    return None


def brute_hold(text, stops):
    """Length of the longest suffix of `text` that is a prefix of some stop (contract S2)."""
    best = 0
    for s in stops:
        for k in range(1, min(len(s), len(text)) + 1):
            if s.startswith(text[len(text) - k :]):
                best = max(best, k)
    return best


def run_chunks(matcher, chunks):
    out = []
    for c in chunks:
        r = matcher.push(c)
        out.append(r.safe)
        if r.hit is not None:
            return "".join(out), r.hit
    return "".join(out) + matcher.flush(), None


# ---------------------------------------------------------------------------------------------
# fixed cases
# ---------------------------------------------------------------------------------------------


def test_stop_S4_cross_token_fixture_matcher():
    m = StopMatcher(["BCD"])
    assert m.push("AB") == StopResult(safe="A", hit=None)
    assert m.held == "B"
    assert m.push("CD") == StopResult(safe="", hit=StopHit(stop="BCD", index=0))
    assert m.flush() == ""


def test_stop_S4_cross_token_fixture_pipeline():
    tok = s4_tokenizer()
    pipe = TextPipeline(tok, stop=["BCD"])
    r1 = pipe.push(101)
    assert r1 == ("A", None)
    assert pipe.matcher.held == "B"
    r2 = pipe.push(102)
    assert r2.text == "" and r2.hit == StopHit("BCD", 0)
    final = pipe.finish(FinishReason.MAX_OUTPUT_TOKENS)
    assert final.text == "" and final.finish_reason is FinishReason.STOP_SEQUENCE
    assert pipe.text == "A"
    assert pipe.returned_tokens == 1  # contract §9: stop completing on the 2nd token -> returned 1


def test_stop_S1_spans_many_tokens():
    m = StopMatcher(["abcdef"])
    out = [m.push(c) for c in ["xa", "b", "c", "d", "e"]]
    assert "".join(r.safe for r in out) == "x"
    assert m.held == "abcde"
    r = m.push("fZZ")
    assert r == StopResult("", StopHit("abcdef", 0))


def test_stop_S2_nothing_held_when_no_prefix():
    m = StopMatcher(["xyz"])
    assert m.push("hello") == StopResult("hello", None)
    assert m.held == ""
    assert m.push("abx") == StopResult("ab", None)
    assert m.held == "x"
    assert m.push("yq") == StopResult("xyq", None)
    assert m.held == ""


def test_stop_S2_empty_stop_list_zero_holdback():
    m = StopMatcher([])
    assert m.push("anything") == StopResult("anything", None)
    assert m.held == "" and m.flush() == ""


def test_stop_S3_absorbing_first_hit():
    m = StopMatcher(["END"])
    assert m.push("abENDxyz") == StopResult("ab", StopHit("END", 0))
    assert m.push("more END") == StopResult("", None)
    assert m.hit == StopHit("END", 0)
    assert m.flush() == ""


def test_stop_S3_include_in_output():
    m = StopMatcher(["END"], include_in_output=True)
    assert m.push("abE") == StopResult("ab", None)
    assert m.push("NDtail") == StopResult("END", StopHit("END", 0))
    assert m.push("x") == StopResult("", None)


def test_stop_S5_earliest_end_wins_over_longer_later():
    # "bc" ends at position 3, "abcd" would end at 4: the shorter, earlier one wins.
    m = StopMatcher(["abcd", "bc"])
    assert m.push("ab") == StopResult("", None)  # "ab" may still become "abcd"
    r = m.push("cd")
    assert r == StopResult("a", StopHit("bc", 1))


def test_stop_S5_same_end_longest_then_list_order():
    m = StopMatcher(["c", "abc", "bc"])
    assert m.push("xabc") == StopResult("x", StopHit("abc", 1))
    m = StopMatcher(["bc", "bc"])
    assert m.push("abc").hit == StopHit("bc", 0)
    assert STOP_RULE_VERSION == "v1"


def test_stop_S5_earlier_end_inside_held_text():
    # Held "ab" (prefix of "abX"); "b" alone is no stop, but "ab?" - check a stop ending inside.
    m = StopMatcher(["abX", "bY"])
    assert m.push("ab") == StopResult("", None)
    assert m.push("Y") == StopResult("a", StopHit("bY", 1))


def test_stop_S7_index_is_request_list_position_duplicates_first():
    m = StopMatcher(["zz", "END", "END"])
    assert m.push("..END").hit == StopHit("END", 1)


def test_stop_rejects_empty_stop_string():
    with pytest.raises(ValueError):
        StopMatcher(["ok", ""])


def test_stop_unicode_characters():
    m = StopMatcher(["世界"])
    assert m.push("你好世") == StopResult("你好", None)
    assert m.push("界!") == StopResult("", StopHit("世界", 0))


# ---------------------------------------------------------------------------------------------
# property tests against the brute-force reference
# ---------------------------------------------------------------------------------------------

alpha = st.text(alphabet="abc", min_size=0, max_size=24)
stop_lists = st.lists(st.text(alphabet="abc", min_size=1, max_size=4), min_size=0, max_size=4)


@st.composite
def chunked(draw):
    text = draw(alpha)
    cuts = sorted(draw(st.lists(st.integers(0, len(text)), max_size=8)))
    pieces, prev = [], 0
    for c in cuts + [len(text)]:
        pieces.append(text[prev:c])
        prev = c
    return text, pieces


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(chunked(), stop_lists, st.booleans())
def test_stop_S2_S3_S5_matcher_equals_brute_force(tc, stops, include):
    text, chunks = tc
    m = StopMatcher(stops, include_in_output=include)
    emitted = ""
    pos = 0
    result_hit = None
    for c in chunks:
        r = m.push(c)
        emitted += r.safe
        if r.hit is not None:
            result_hit = r.hit
            pos += len(c)
            break
        pos += len(c)
        # minimal hold-back: exactly the longest suffix that is a prefix of a stop (S2)
        hold = brute_hold(text[:pos], stops)
        assert m.held == text[pos - hold : pos]
        assert emitted == text[: pos - hold]
    if result_hit is None:
        emitted += m.flush()
    want = brute_hit(text, stops)
    if want is None:
        assert result_hit is None
        assert emitted == text
    else:
        end, length, index = want
        assert result_hit == StopHit(stops[index], index)
        expected = text[: end - length] + (stops[index] if include else "")
        assert emitted == expected
        assert m.hit_span == (end - length, end)


id_seq = st.lists(st.integers(0, 3), max_size=20)


@settings(max_examples=200, deadline=None)
@given(id_seq, st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=3), max_size=3), st.booleans())
def test_stop_S8_sequence_matcher_equals_brute_force(ids, seqs, include):
    m = StopSequenceMatcher([tuple(s) for s in seqs], include_in_output=include)
    released = []
    hit = None
    for i, t in enumerate(ids):
        r = m.push(t)
        released.extend(r.safe)
        if r.hit is not None:
            hit = r.hit
            break
        # minimal hold-back on ids
        seen = ids[: i + 1]
        hold = 0
        for s in seqs:
            for k in range(1, min(len(s), len(seen)) + 1):
                if list(s[:k]) == seen[len(seen) - k :]:
                    hold = max(hold, k)
        assert list(m.held) == seen[len(seen) - hold :]
        assert released == seen[: len(seen) - hold]
    if hit is None:
        released.extend(m.flush())
    # reference on the id list
    want = None
    for end in range(1, len(ids) + 1):
        cands = [(len(s), -j) for j, s in enumerate(seqs) if len(s) <= end and ids[end - len(s) : end] == list(s)]
        if cands:
            length, neg = max(cands)
            want = (end, length, -neg)
            break
    if want is None:
        assert hit is None and released == ids
    else:
        end, length, j = want
        assert hit == StopHit(tuple(seqs[j]), j)
        assert released == ids[: end if include else end - length]


def test_stop_S8_single_ids_and_tuples():
    m = StopSequenceMatcher([7, (1, 2)])
    assert m.push(1) == ((), None)
    assert m.push(3) == ((1, 3), None)
    assert m.push(1) == ((), None)
    r = m.push(2)
    assert r.safe == () and r.hit == StopHit((1, 2), 1)


# ---------------------------------------------------------------------------------------------
# pipeline endings
# ---------------------------------------------------------------------------------------------


def test_stop_S6_finish_bytes_pass_matcher():
    # Stop "\ufffd" can only appear through finish() under errors="replace".
    tok = byte_level_tokenizer()
    a = tok.encode("ok").ids
    pipe = TextPipeline(tok, stop=["\ufffd"], errors="replace")
    text = "".join(pipe.push(t).text for t in a + [byte_of(tok, 0xE4)])
    assert text == "ok"
    final = pipe.finish(FinishReason.MAX_OUTPUT_TOKENS)
    assert final.text == "" and final.finish_reason is FinishReason.STOP_SEQUENCE
    assert final.hit == StopHit("\ufffd", 0)


def test_stop_S6_finish_flushes_held_text_on_non_stop_ending():
    tok = byte_level_tokenizer()
    pipe = TextPipeline(tok, stop=["hello there"])
    out = "".join(pipe.push(t).text for t in tok.encode("say hello").ids)
    assert out == "say "
    final = pipe.finish(FinishReason.EOS)
    assert final == ("hello", FinishReason.EOS, None)
    assert pipe.text == "say hello"
    assert pipe.returned_tokens == len(tok.encode("say hello").ids)


def test_stop_S9_stop_on_last_allowed_token_reports_stop_sequence():
    tok = s4_tokenizer()
    pipe = TextPipeline(tok, stop=["BCD"])
    pipe.push(101)
    assert pipe.push(102).hit is not None
    # the engine also knows max_tokens was reached on this token; the stop wins
    assert pipe.finish(FinishReason.MAX_OUTPUT_TOKENS).finish_reason is FinishReason.STOP_SEQUENCE


def test_stop_D5_tail_after_stop_discarded_not_error():
    tok = byte_level_tokenizer()
    ids = tok.encode("xEND").ids + [byte_of(tok, 0xE4)]
    pipe = TextPipeline(tok, stop=["END"], errors="strict")
    for t in ids:
        if pipe.push(t).hit:
            break
    # an incomplete UTF-8 tail after the stop point must not raise
    assert pipe.finish(FinishReason.EOS).finish_reason is FinishReason.STOP_SEQUENCE
    assert pipe.text == "x"


def test_stop_D4_strict_tail_raises_from_finish():
    tok = byte_level_tokenizer()
    pipe = TextPipeline(tok, errors="strict")
    pipe.push(byte_of(tok, 0xE4))
    with pytest.raises(DecodingError):
        pipe.finish(FinishReason.MAX_OUTPUT_TOKENS)
    assert pipe.error is not None and pipe.error.value == "decoding_error"


def test_stop_S8_sequence_hit_in_pipeline_hides_ids_text():
    tok = byte_level_tokenizer()
    hello = tok.encode("hello").ids
    world = tok.encode(" world").ids
    seq = tuple(world)
    pipe = TextPipeline(tok, stop_token_sequences=[seq])
    out = "".join(pipe.push(t).text for t in hello)
    assert out == "hello"
    r = None
    for t in world:
        r = pipe.push(t)
    assert r.hit == StopHit(seq, 0)
    assert pipe.finish("eos").finish_reason is FinishReason.STOP_SEQUENCE
    assert pipe.text == "hello"
    assert pipe.returned_tokens == len(hello)


def test_stop_usage_returned_tokens_examples():
    tok = byte_level_tokenizer()
    ids = tok.encode("abc def").ids
    # max_tokens ending: all pushed tokens returned
    pipe = TextPipeline(tok)
    for t in ids:
        pipe.push(t)
    pipe.finish(FinishReason.MAX_OUTPUT_TOKENS)
    assert pipe.returned_tokens == len(ids)
    # EOS is never pushed -> not counted
    pipe = TextPipeline(tok)
    for t in ids:
        pipe.push(t)
    pipe.finish(FinishReason.EOS)
    assert pipe.returned_tokens == len(ids)


def test_stop_cancel_drops_held_text():
    tok = byte_level_tokenizer()
    pipe = TextPipeline(tok, stop=["hello there"])
    out = "".join(pipe.push(t).text for t in tok.encode("say hello").ids)
    final = pipe.finish(FinishReason.CANCELLED)
    assert final == ("", FinishReason.CANCELLED, None)
    assert pipe.text == out == "say "


def test_stop_pipeline_push_after_stop_is_ignored():
    tok = s4_tokenizer()
    pipe = TextPipeline(tok, stop=["BCD"])
    pipe.push(101)
    pipe.push(102)
    assert pipe.push(101) == ("", None)


def test_stop_pipeline_with_prebuilt_detokenizer():
    tok = byte_level_tokenizer()
    d = IncrementalDetokenizer(tok, errors="replace")
    pipe = TextPipeline(detokenizer=d, stop=["world"])
    ids = tok.encode("hello world!").ids
    out = pipe.push_many(ids)
    assert out.text == "hello " and out.hit == StopHit("world", 0)
