"""Incremental detokenization (contract §4: D1-D6) on real `tokenizers` vocabularies built in-test."""

from __future__ import annotations

import itertools
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxdecode.host import IncrementalDetokenizer, bytes_to_unicode, vocab_info
from jaxdecode.types import DecodingError
from tests.host_fixtures import (
    ScriptedTokenizer,
    byte_level_from_table,
    byte_fallback_tokenizer,
    byte_level_tokenizer,
    byte_of,
    fallback_bytes,
    wordpiece_tokenizer,
)

U2B = {c: b for b, c in bytes_to_unicode().items()}
SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ---------------------------------------------------------------------------------------------
# independent references
# ---------------------------------------------------------------------------------------------


def bl_bytes(tok, ids, skip_special_tokens=True):
    """Concatenated bytes of byte-level tokens (GPT-2 map), specials skipped."""
    specials = {i for i, t in tok.get_added_tokens_decoder().items() if t.special}
    out = bytearray()
    for i in ids:
        if skip_special_tokens and i in specials:
            continue
        for ch in tok.id_to_token(i):
            out += bytes([U2B[ch]]) if ch in U2B else ch.encode()
    return bytes(out)


def incomplete_tail_len(b: bytes) -> int:
    """Trailing bytes that are a valid but unfinished UTF-8 sequence (independent of codecs)."""
    for k in (1, 2, 3):
        if len(b) < k:
            break
        tail = b[-k:]
        lead = tail[0]
        need = 2 if 0xC2 <= lead <= 0xDF else 3 if 0xE0 <= lead <= 0xEF else 4 if 0xF0 <= lead <= 0xF4 else 0
        if need <= k:
            continue
        for ext in itertools.product((0x80, 0x90, 0xA0, 0xBF), repeat=need - k):
            try:
                (tail + bytes(ext)).decode("utf-8")
                return k
            except UnicodeDecodeError:
                pass
    return 0


def run(d, ids):
    parts = [d.push(i) for i in ids]
    return parts, "".join(parts) + d.finish()


# ---------------------------------------------------------------------------------------------
# id pools for property tests
# ---------------------------------------------------------------------------------------------


def bl_pool():
    tok = byte_level_tokenizer()
    pool = list(range(tok.get_vocab_size()))  # every token: merged, single bytes, added, special
    interesting = [byte_of(tok, b) for b in (0xE4, 0xB8, 0xAD, 0xF0, 0x9F, 0x98, 0x80, 0xC3, 0xA9, 0xFF, 0xED, 0xA0, 0x41, 0x20)]
    return tok, pool, interesting


BL, BL_POOL, BL_INTERESTING = bl_pool()
bl_ids = st.lists(st.one_of(st.sampled_from(BL_POOL), st.sampled_from(BL_INTERESTING)), max_size=24)

LLAMA = byte_fallback_tokenizer("llama2")
META = byte_fallback_tokenizer("metaspace")
FB_POOL = list(range(LLAMA.get_vocab_size()))
FB_BYTES = [LLAMA.token_to_id(f"<0x{b:02X}>") for b in (0xE4, 0xB8, 0xAD, 0xF0, 0x9F, 0x98, 0x80, 0x20, 0x41, 0xFF)]
fb_ids = st.lists(st.one_of(st.sampled_from(FB_POOL), st.sampled_from(FB_BYTES)), max_size=24)


# ---------------------------------------------------------------------------------------------
# mode selection and tables
# ---------------------------------------------------------------------------------------------


def test_detok_D3_byte_level_uses_bytes_table():
    assert IncrementalDetokenizer(BL).mode == "bytes"
    assert IncrementalDetokenizer(LLAMA).mode == "bytes"
    assert IncrementalDetokenizer(META).mode == "bytes"


def test_detok_D3_not_byte_mappable_uses_window():
    info = vocab_info(wordpiece_tokenizer())
    assert info.mode == "window" and "WordPiece" in info.reason
    assert IncrementalDetokenizer(wordpiece_tokenizer()).mode == "window"


def test_detok_D3_factory_builds_one_class_per_mode():
    from jaxdecode.host.detokenizer import BytesDetokenizer, WindowDetokenizer

    assert type(IncrementalDetokenizer(BL)) is BytesDetokenizer
    assert type(IncrementalDetokenizer(BL, mode="window")) is WindowDetokenizer
    assert type(IncrementalDetokenizer(wordpiece_tokenizer())) is WindowDetokenizer
    assert isinstance(BytesDetokenizer(BL), IncrementalDetokenizer)
    with pytest.raises(ValueError, match="bytes mode is not available"):
        IncrementalDetokenizer(wordpiece_tokenizer(), mode="bytes")
    with pytest.raises(ValueError, match="bytes mode is not available"):
        BytesDetokenizer(wordpiece_tokenizer())
    with pytest.raises(ValueError, match="mode: WindowDetokenizer decodes in 'window' mode"):
        WindowDetokenizer(BL, mode="bytes")
    with pytest.raises(ValueError, match="mode must be one of"):
        IncrementalDetokenizer(BL, mode="fast")


def test_detok_vocab_info_is_cached_per_tokenizer():
    assert vocab_info(BL) is vocab_info(BL)


def test_detok_vocab_cache_does_not_keep_tokenizer_alive():
    import gc
    import weakref

    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(BL.to_str())
    d = IncrementalDetokenizer(tok)
    assert d.mode == "bytes" and run(d, tok.encode("héllo").ids)[1] == "héllo"
    ref = weakref.ref(tok)
    del tok, d
    gc.collect()
    assert ref() is None


def test_detok_transformers_tokenizer_accepted():
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_object=BL)
    d = IncrementalDetokenizer(hf)
    assert d.mode == "bytes"
    ids = hf.encode("héllo 世界 😀 hello")
    assert run(d, ids)[1] == hf.decode(ids, skip_special_tokens=True)


def test_detok_out_of_vocab_raises_value_error():
    d = IncrementalDetokenizer(BL)
    for bad in (-1, BL.get_vocab_size(), 10**9):
        with pytest.raises(ValueError, match="token id"):
            d.push(bad)
    w = IncrementalDetokenizer(wordpiece_tokenizer())
    with pytest.raises(ValueError, match="token id"):
        w.push(-5)


def test_detok_errors_argument_validated():
    with pytest.raises(ValueError):
        IncrementalDetokenizer(BL, errors="ignore")


# ---------------------------------------------------------------------------------------------
# D1 eager release, D2 invariants
# ---------------------------------------------------------------------------------------------


def test_detok_D1_partial_bytes_then_character():
    d = IncrementalDetokenizer(BL)
    e4, b8, ad, a = (byte_of(BL, b) for b in (0xE4, 0xB8, 0xAD, 0x41))
    assert d.push(e4) == ""
    assert d.pending_bytes == b"\xe4"
    assert d.push(b8) == ""
    assert d.push(ad) == "中"
    assert d.push(a) == "A"
    assert d.finish() == ""


def test_detok_D1_eager_same_token_completes_and_begins():
    zhong, wen = "中".encode(), "文".encode()
    tok = byte_level_from_table({256: zhong[:2], 257: zhong[2:] + wen[:1], 258: wen[1:] + b"!"})
    d = IncrementalDetokenizer(tok)
    assert d.mode == "bytes"
    assert d.push(256) == ""
    assert d.push(257) == "中"  # completes 中 and begins 文: 中 is released now
    assert d.pending_bytes == wen[:1]
    assert d.push(258) == "文!"
    assert d.finish() == ""


@SETTINGS
@given(bl_ids)
def test_detok_D2_D2a_byte_level_replace_matches_decode_and_codec(ids):
    d = IncrementalDetokenizer(BL, errors="replace")
    raw = bl_bytes(BL, ids)
    so_far = bytearray()
    emitted = ""
    specials = {i for i, t in BL.get_added_tokens_decoder().items() if t.special}
    for i in ids:
        emitted += d.push(i)
        if i not in specials:
            so_far += bl_bytes(BL, [i])
        # D1: eager -- everything but an unfinished trailing sequence is out
        k = incomplete_tail_len(bytes(so_far))
        assert emitted == bytes(so_far[: len(so_far) - k]).decode("utf-8", "replace")
    emitted += d.finish()
    assert emitted == raw.decode("utf-8", "replace")  # D2a reference
    assert emitted == BL.decode(ids, skip_special_tokens=True)  # D2 vs the tokenizer


@SETTINGS
@given(bl_ids)
def test_detok_D2a_strict_raises_from_revealing_push(ids):
    raw = bl_bytes(BL, ids)
    d = IncrementalDetokenizer(BL, errors="strict")
    try:
        raw.decode("utf-8")
        valid = True
    except UnicodeDecodeError as exc:
        valid = False
        reason, start, end = exc.reason, exc.start, exc.end
    if valid:
        assert run(d, ids)[1] == raw.decode("utf-8")
        return
    if reason == "unexpected end of data":
        reveal = None  # only finish() can tell
    elif reason == "invalid start byte":
        reveal = start
    else:
        reveal = end
    pos = 0
    for i in ids:
        n = len(bl_bytes(BL, [i]))
        if reveal is not None and pos <= reveal < pos + n:
            with pytest.raises(DecodingError):
                d.push(i)
            return
        d.push(i)  # must not raise before the revealing byte
        pos += n
    with pytest.raises(DecodingError):
        d.finish()


@SETTINGS
@given(fb_ids, st.sampled_from(["llama2", "metaspace"]))
def test_detok_D2_D2a_byte_fallback_matches_reference(ids, which):
    tok = LLAMA if which == "llama2" else META
    d = IncrementalDetokenizer(tok, errors="replace")
    out = run(d, ids)[1]
    raw = fallback_bytes(tok, ids)
    assert out == raw.decode("utf-8", "replace")  # D2a: the standard rule
    try:
        valid = raw.decode("utf-8")
    except UnicodeDecodeError:
        return  # HF replaces every byte of an invalid run; contract D2a chooses the codec
    assert out == valid == tok.decode(ids, skip_special_tokens=True)


def test_detok_D2_leading_space_stripped_like_hf_without_prompt():
    for tok in (LLAMA, META):
        ids = tok.encode("hello world").ids
        assert tok.id_to_token(ids[0]).startswith("▁")
        d = IncrementalDetokenizer(tok)
        assert run(d, ids)[1] == tok.decode(ids) == "hello world"


def test_detok_D2b_leading_space_kept_after_prompt():
    for tok in (LLAMA, META):
        prompt = tok.encode("hello").ids
        out = tok.encode(" world").ids
        d = IncrementalDetokenizer(tok, prompt_ids=prompt)
        text = run(d, out)[1]
        assert tok.decode(prompt + out) == tok.decode(prompt) + text
        assert text == " world"


def test_detok_D2b_bos_only_prompt_is_transparent():
    ids = LLAMA.encode("hello").ids
    d = IncrementalDetokenizer(LLAMA, prompt_ids=[1])  # <s>, skipped
    assert run(d, ids)[1] == LLAMA.decode([1] + ids) == "hello"


def test_detok_D2c_skipped_special_is_transparent():
    sp = BL.token_to_id("<|im_end|>")
    e4, b8, ad = (byte_of(BL, b) for b in (0xE4, 0xB8, 0xAD))
    ids = [e4, sp, b8, ad]
    d = IncrementalDetokenizer(BL, skip_special_tokens=True)
    assert run(d, ids)[1] == "中" == BL.decode(ids, skip_special_tokens=True)
    d = IncrementalDetokenizer(BL, skip_special_tokens=False, errors="replace")
    assert run(d, ids)[1] == BL.decode(ids, skip_special_tokens=False) == "\ufffd<|im_end|>\ufffd\ufffd"
    # non-special added tokens are always shown
    tool = BL.token_to_id("<tool>")
    d = IncrementalDetokenizer(BL, skip_special_tokens=True)
    assert run(d, [tool])[1] == "<tool>"


# ---------------------------------------------------------------------------------------------
# D2b prompt priming
# ---------------------------------------------------------------------------------------------


def test_detok_D2b_prompt_ending_mid_character():
    e4, b8, ad, a = (byte_of(BL, b) for b in (0xE4, 0xB8, 0xAD, 0x41))
    prompt = BL.encode("hi ").ids + [e4, b8]
    d = IncrementalDetokenizer(BL, prompt_ids=prompt, errors="strict")
    assert d.push(ad) == ""  # "中" began in the prompt: it belongs to the prompt
    assert d.push(a) == "A"
    assert d.finish() == ""
    # the prompt's character broken by the output: its U+FFFD is the prompt's, no strict error
    d = IncrementalDetokenizer(BL, prompt_ids=prompt, errors="strict")
    assert d.push(a) == "A"
    # never completed: not an error either
    d = IncrementalDetokenizer(BL, prompt_ids=prompt, errors="strict")
    assert d.finish() == ""


def test_detok_D2b_output_byte_after_prompt_char_still_checked():
    e4, ff = byte_of(BL, 0xE4), byte_of(BL, 0xFF)
    d = IncrementalDetokenizer(BL, prompt_ids=[e4], errors="strict")
    with pytest.raises(DecodingError):
        d.push(ff)  # 0xFF is an output byte and invalid
    d = IncrementalDetokenizer(BL, prompt_ids=[e4], errors="replace")
    assert d.push(ff) == "\ufffd"


@SETTINGS
@given(bl_ids, bl_ids)
def test_detok_D2b_prompt_priming_property(prompt, output):
    d = IncrementalDetokenizer(BL, prompt_ids=prompt, errors="replace")
    got = run(d, output)[1]
    p = bl_bytes(BL, prompt)
    o = bl_bytes(BL, output)
    k = incomplete_tail_len(p)
    tail = p[len(p) - k :]
    full = (tail + o).decode("utf-8", "replace")
    expected = full[1:] if (k and full) else full
    assert got == expected
    # no prompt text leaks: the output is a suffix of decode(prompt + output)
    assert (p + o).decode("utf-8", "replace").endswith(got)


@SETTINGS
@given(fb_ids, fb_ids, st.sampled_from(["llama2", "metaspace"]))
def test_detok_D2b_prompt_priming_byte_fallback_property(prompt, output, which):
    tok = LLAMA if which == "llama2" else META
    d = IncrementalDetokenizer(tok, prompt_ids=prompt, errors="replace")
    got = run(d, output)[1]
    full = fallback_bytes(tok, prompt + output)
    p = fallback_bytes(tok, prompt)
    assert full.startswith(p)
    o = full[len(p) :]
    k = incomplete_tail_len(p)
    rest = (p[len(p) - k :] + o).decode("utf-8", "replace")
    assert got == (rest[1:] if (k and rest) else rest)


def test_detok_D2b_long_prompt_only_tail_examined():
    prompt = BL.encode("hello world " * 2000).ids
    t0 = time.perf_counter()
    d = IncrementalDetokenizer(BL, prompt_ids=prompt)
    assert time.perf_counter() - t0 < 0.05
    assert run(d, BL.encode(" x").ids)[1] == " x"


# ---------------------------------------------------------------------------------------------
# D4, D5
# ---------------------------------------------------------------------------------------------


def test_detok_D4_finish_strict_raises_replace_gives_fffd():
    e4, b8 = byte_of(BL, 0xE4), byte_of(BL, 0xB8)
    d = IncrementalDetokenizer(BL, errors="strict")
    d.push(e4)
    d.push(b8)
    with pytest.raises(DecodingError):
        d.finish()
    d = IncrementalDetokenizer(BL, errors="replace")
    d.push(e4)
    d.push(b8)
    assert d.finish() == "\ufffd"
    assert d.finish() == ""  # idempotent


def test_detok_D5_discard_tail_is_not_an_error():
    d = IncrementalDetokenizer(BL, errors="strict")
    assert d.push(byte_of(BL, 0x41)) == "A"
    d.push(byte_of(BL, 0xE4))
    d.discard()
    assert d.finished
    with pytest.raises(RuntimeError):
        d.push(byte_of(BL, 0x41))


def test_detok_D6_special_not_shown_when_skipped():
    eot = BL.token_to_id("<|endoftext|>")
    assert IncrementalDetokenizer(BL).push(eot) == ""
    assert IncrementalDetokenizer(BL, skip_special_tokens=False).push(eot) == "<|endoftext|>"


# ---------------------------------------------------------------------------------------------
# window mode (general fallback)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("text", ["hello world, hello there", "the quick brown fox jumps", "def foo(x): return x + 1"])
def test_detok_D2_window_mode_wordpiece_matches_decode(text):
    tok = wordpiece_tokenizer()
    ids = tok.encode(text).ids
    d = IncrementalDetokenizer(tok)
    assert d.mode == "window"
    assert run(d, ids)[1] == tok.decode(ids)


@SETTINGS
@given(bl_ids)
def test_detok_D2_window_mode_forced_on_byte_level(ids):
    d = IncrementalDetokenizer(BL, errors="replace", mode="window")
    assert d.mode == "window"
    parts, out = run(d, ids)
    assert out == BL.decode(ids, skip_special_tokens=True)


def test_detok_D2b_window_mode_prompt():
    e4, b8, ad, a = (byte_of(BL, b) for b in (0xE4, 0xB8, 0xAD, 0x41))
    prompt = BL.encode("hi ").ids + [e4, b8]
    d = IncrementalDetokenizer(BL, prompt_ids=prompt, mode="window")
    assert d.push(ad) == ""
    assert d.push(a) == "A"
    prompt = BL.encode("hello").ids
    d = IncrementalDetokenizer(BL, prompt_ids=prompt, mode="window")
    assert run(d, BL.encode(" world, hello there").ids)[1] == " world, hello there"


def test_detok_D4_window_mode_strict_tail():
    d = IncrementalDetokenizer(BL, mode="window", errors="strict")
    d.push(byte_of(BL, 0xE4))
    with pytest.raises(DecodingError):
        d.finish()


def test_detok_window_mode_custom_tokenizer_object():
    tok = ScriptedTokenizer({0: b"he", 1: b"llo", 2: "中".encode()[:1], 3: "中".encode()[1:], 4: b"<eos>"}, specials=[4])
    d = IncrementalDetokenizer(tok)
    assert d.mode == "window"
    assert [d.push(i) for i in (0, 1, 2, 3, 4)] == ["he", "llo", "", "中", ""]
    assert d.finish() == ""


def test_detok_window_long_stream_slides():
    ids = BL.encode("hello world, hello there. " * 40).ids
    d = IncrementalDetokenizer(BL, mode="window")
    assert run(d, ids)[1] == BL.decode(ids)
    assert len(d._ids) == 0  # finished


# ---------------------------------------------------------------------------------------------
# cost
# ---------------------------------------------------------------------------------------------


def test_detok_push_cost_is_small():
    ids = BL.encode("héllo 世界 😀 the quick brown fox jumps over the lazy dog " * 20).ids
    d = IncrementalDetokenizer(BL)
    t0 = time.perf_counter()
    for i in ids:
        d.push(i)
    per_token = (time.perf_counter() - t0) / len(ids)
    assert per_token < 20e-6  # typically well under 1 µs
