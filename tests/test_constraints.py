"""Structured output (jaxdecode/device/constraints): contract §3 step 2 (grammar masks), P2 (dead end),
§5 (grammar acceptance), P3/X1 (constrained neighbours change nothing), and the device tables
against outlines-core's Index.

Model tests use the demo model at temperature 1 with random seeds; they run as ONE mixed batch
(every kind of constraint, a dead end and free rows) so that the whole file compiles the decode
loop only a few times.
"""

from __future__ import annotations

import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxdecode as jd
from jaxdecode.device import constraints, decode
from jaxdecode.device import state as codes
from jaxdecode.device.constraints.index_worker import end_marked
from jaxdecode.device.constraints import tables as ctables
from jaxdecode.tokenization import encode
from tests.scripted import ScriptedModel

jsonschema = pytest.importorskip("jsonschema")
outlines_core = pytest.importorskip("outlines_core")

DEMO_DIR = os.path.join(os.path.dirname(__file__), "..", "models", "demo")

FLAT = {"type": "object",
        "properties": {"name": {"type": "string", "maxLength": 8},
                       "age": {"type": "integer", "maxDigits": 3},
                       "ok": {"type": "boolean"}},
        "required": ["name", "age", "ok"], "additionalProperties": False}
ENUM = {"enum": ["red", "green", "blue", 42, None]}
NESTED = {"type": "object",
          "properties": {"id": {"type": "integer", "maxDigits": 4},
                         "tags": {"type": "array", "items": {"type": "integer", "maxDigits": 3},
                                  "maxItems": 4},
                         "meta": {"type": "object",
                                  "properties": {"k": {"type": "string", "maxLength": 5}},
                                  "required": ["k"], "additionalProperties": False}},
          "required": ["id", "tags", "meta"], "additionalProperties": False}
SCHEMAS = {"flat": FLAT, "enum": ENUM, "nested": NESTED}
PATTERN = r"[a-z]{2,6}-[0-9]{1,3}"
CHOICES = ["yes", "no", "maybe so", "a-b (c)?"]
MAX_TOKENS = 128  # > the longest output any of these constraints allows, in bytes


def schema_format(schema):
    return {"type": "json_schema", "json_schema": {"name": "t", "schema": schema}}


# -- response_format validation (construction) and rejection (submission) -------------------

@pytest.mark.parametrize("rf", [
    "json", {"type": "xml"}, {"type": "json_schema"}, {"type": "json_schema", "json_schema": {}},
    {"type": "json_schema", "json_schema": {"schema": 3}}, {"type": "regex"},
    {"type": "regex", "pattern": ""}, {"type": "choice", "choices": []},
    {"type": "choice", "choices": ["a", 1]}, {"type": "json_object", "extra": 1},
    {"type": "json_object", "whitespace_pattern": 3},
])
def test_grammar_response_format_shape_names_the_field(rf):
    with pytest.raises(ValueError, match="^response_format"):
        jd.SamplingParams(response_format=rf)


def test_grammar_response_format_text_is_unconstrained():
    assert jd.SamplingParams(response_format={"type": "text"}).response_format is None
    sp = jd.SamplingParams(response_format=schema_format(FLAT))
    assert sp.response_format["json_schema"]["schema"] is FLAT


TINY_BYTES = [None, None, b"a", b"b", b"ab", b"x", b"y", b"1", b"2"] + [None] * 7  # vocab 16


@pytest.mark.parametrize("rf,match", [
    ({"type": "regex", "pattern": "ac"}, "cannot be matched"),          # no token has "c"
    ({"type": "regex", "pattern": "a("}, "cannot compile"),
    (schema_format({"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}),
     "cannot translate"),
])
def test_grammar_rejected_at_submission_says_why(rf, match):
    model = ScriptedModel.make([2] * 8, vocab_size=16, eos_token_ids=(1,))
    sp = jd.SamplingParams(temperature=0.0, max_tokens=4, response_format=rf)
    with pytest.raises(ValueError, match=f"^response_format.*{match}"):
        jd.generate(model, {}, [[3]], sp, tokenizer=TINY_BYTES)


@pytest.mark.parametrize("pattern,text", [("ab(x)?", b"abx"), ("ab|abxy", b"abxy"),
                                          ("1(y2)?", b"1y2"), ("a*(b1)?", b"aab1")])
def test_grammar_keeps_the_ways_on_from_where_the_pattern_may_end(pattern, text):
    """A state where the pattern may end keeps its edges (outlines-core 0.2.14 alone drops
    those into states where it may not: `ab(x)?` never wrote `abx`); EOS stays allowed there."""
    vocab = constraints.vocab_for(TINY_BYTES, 16)
    c = constraints.compile_format({"type": "regex", "pattern": pattern}, vocab)
    ids = {b: i for i, b in enumerate(TINY_BYTES) if b}
    state, seen = 0, [0]
    for ch in text:
        state = c.next_state(state, ids[bytes([ch])])
        assert state >= 0, (pattern, text)
        seen.append(state)
    assert c.accepting[state] and any(c.accepting[s] for s in seen[1:-1])


def test_grammar_needs_a_tokenizer():
    model = ScriptedModel.make([2] * 8, vocab_size=16, eos_token_ids=(1,))
    sp = jd.SamplingParams(max_tokens=4, response_format={"type": "regex", "pattern": "a"})
    with pytest.raises(ValueError, match="^response_format.*tokenizer"):
        jd.generate(model, {}, [[3]], sp)


# -- exact semantics on a scripted model (contract §5, O1, P2) ------------------------------------

def _scripted_run(script, rf, **kw):
    model = ScriptedModel.make(script, vocab_size=16, eos_token_ids=(1,))
    sp = jd.SamplingParams(temperature=0.0, max_tokens=kw.pop("max_tokens", 6), response_format=rf,
                           **kw)
    state, _, _ = decode.prepare(model, {}, [[3, 3]], sp, None, None, tokenizer=TINY_BYTES)
    outs = []
    for _ in range(6):
        state, out = decode.decode_step_jit(state, {}, config=decode.StepConfig(model))
        outs.append((int(out.token[0]), int(out.finish[0]), int(state.cache.lengths[0])))
    return outs


def test_grammar_complete_ends_row_and_last_token_not_written():
    # after the prompt (positions 0, 1) the model wants 2 ("a"), then 3 ("b"), then 3 ...
    outs = _scripted_run([0, 2, 3, 3, 3, 3, 3, 3], {"type": "regex", "pattern": "ab"})
    assert outs[0] == (2, codes.RUNNING, 3)
    assert outs[1] == (3, codes.GRAMMAR_COMPLETE, 3)  # selected, not written (O1)
    assert outs[2][0] == -1


def test_grammar_S9_completion_on_last_allowed_token_reports_grammar_complete():
    outs = _scripted_run([0, 2, 3, 3, 3, 3, 3, 3], {"type": "regex", "pattern": "ab"},
                         max_tokens=2)
    assert [o[:2] for o in outs[:2]] == [(2, codes.RUNNING), (3, codes.GRAMMAR_COMPLETE)]


def test_grammar_one_body_two_drivers_same_tokens():
    model = ScriptedModel.make([0, 2, 3, 5, 6, 7, 8, 2], vocab_size=16, eos_token_ids=(1,))
    rows = [jd.SamplingParams(seed=s, max_tokens=8,
                              response_format={"type": "regex", "pattern": "(a|b|x)+[12]"})
            for s in (1, 2)] + [jd.SamplingParams(seed=3, max_tokens=5)]
    a = jd.generate(model, {}, [[3, 3]] * 3, rows, tokenizer=TINY_BYTES)
    b = jd.generate(model, {}, [[3, 3]] * 3, rows, tokenizer=TINY_BYTES, trace=False)
    np.testing.assert_array_equal(a.token_ids, b.token_ids)
    assert a.finish_reasons == b.finish_reasons


def test_grammar_eos_allowed_exactly_in_accepting_states():
    # the model wants EOS at once; "ab?" does not accept the empty output, so "a" is forced;
    # after "a" the state accepts (and "b" could follow): EOS is allowed and ends the row.
    outs = _scripted_run([0, 1, 1, 1, 1, 1, 1, 1], {"type": "regex", "pattern": "ab?"})
    assert [o[:2] for o in outs[:2]] == [(2, codes.RUNNING), (1, codes.EOS)]
    # ignore_eos: EOS is never allowed by the grammar; "b" completes it
    outs = _scripted_run([0, 1, 1, 1, 1, 1, 1, 1], {"type": "regex", "pattern": "ab?"},
                         ignore_eos=True)
    assert [o[:2] for o in outs[:2]] == [(2, codes.RUNNING), (3, codes.GRAMMAR_COMPLETE)]


def test_grammar_P2_dead_end_scripted():
    outs = _scripted_run([0, 2, 2, 2, 2, 2, 2, 2], {"type": "regex", "pattern": "x[12]"},
                         banned_token_ids=(7, 8))
    assert outs[0][:2] == (5, codes.RUNNING)               # "x"
    assert outs[1][1] == codes.GRAMMAR_DEAD_END             # "1" and "2" are banned


def test_grammar_no_recompile_for_new_constraints_in_seen_buckets():
    model = ScriptedModel.make([0, 2, 3, 5, 6, 7, 8, 2], vocab_size=16, eos_token_ids=(1,))
    run = lambda pattern: jd.generate(  # noqa: E731
        model, {}, [[3, 3], [4]],
        [jd.SamplingParams(seed=1, max_tokens=6, response_format={"type": "regex",
                                                                  "pattern": pattern}),
         jd.SamplingParams(seed=2, max_tokens=6)], tokenizer=TINY_BYTES)
    run("(a|b)x")
    before = jd.compilation_count()
    for pattern in ("a?b?y", "[xy]1", "(ab|x)2"):
        out = run(pattern)
        text = b"".join(TINY_BYTES[t] for t in out.tokens(0) if TINY_BYTES[t]).decode()
        assert re.fullmatch(pattern, text), (pattern, text)
    assert jd.compilation_count() == before


def test_grammar_json_object_regex_accepts_nested_objects():
    regex = constraints.regex_for({"type": "json_object"})
    assert re.fullmatch(regex, '{"a": [1, {"b": null}], "c": "d"}')
    assert not re.fullmatch(regex, '[1, 2]')


def test_grammar_vocab_of_a_metaspace_transformers_tokenizer(hf_tokenizer_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(hf_tokenizer_dir)
    vocab = constraints.vocab_for(tok, 128, exclude_ids=(2,))
    the = tok.convert_tokens_to_ids("\u2581the")
    assert vocab.token_bytes[the] == b" the"
    assert all(vocab.token_bytes[i] is None for i in range(4))  # <pad> <s> </s> <unk>


# -- tables vs outlines-core's Index ----------------------------------------------------------

@pytest.fixture(scope="module")
def demo_tokenizer():
    from tokenizers import Tokenizer

    return Tokenizer.from_file(os.path.join(DEMO_DIR, "tokenizer.json"))


@pytest.mark.parametrize("dense", [True, False], ids=["dense", "csr"])
def test_grammar_tables_agree_with_outlines_index(demo_tokenizer, dense):
    v = 4096
    vocab = constraints.vocab_for(demo_tokenizer, v, exclude_ids=(0,))
    fmts = [schema_format(NESTED), {"type": "regex", "pattern": PATTERN}, schema_format(FLAT)]
    compiled = [constraints.compile_format(f, vocab) for f in fmts]
    bundle = constraints.build_tables(compiled, v, dense_max_entries=1 << 30 if dense else 0)
    tables = bundle.tables
    assert tables.dense == dense
    assert tables.allowed.dtype == jnp.uint32 and tables.allowed.shape[1] == v // 32
    eos_mask = jnp.zeros((1, v), bool).at[0, 0].set(True)
    allowed_fn = jax.jit(lambda s: ctables.allowed_tokens(tables, s, jnp.repeat(eos_mask, s.shape[0], 0)))
    lookup_fn = jax.jit(lambda s, t: ctables.lookup(tables, s, t))
    rng = np.random.default_rng(0)
    for c in compiled:
        # the pattern is compiled end-marked (index_worker.end_marked): EOS where the mark may
        # follow; a token is allowed where it leads to a state we kept (trimmed: a dead end
        # or a state inside the mark is none)
        index = outlines_core.Index(end_marked(c.regex, vocab.end_char), vocab.outlines())
        off = bundle.offsets[c.key]
        ours = {int(o): i for i, o in enumerate(c.outlines_states)}
        states = rng.choice(c.num_states, size=min(12, c.num_states), replace=False)
        got = np.asarray(allowed_fn(jnp.asarray(states + off, jnp.int32)))
        for row, s in enumerate(states):
            o = int(c.outlines_states[s])
            allowed = set(index.get_allowed_tokens(o))
            want = {t for t in allowed - {vocab.outlines_eos, vocab.outlines_end}
                    if index.get_next_state(o, t) in ours}
            assert set(np.flatnonzero(got[row])) - {0} == want
            assert bool(got[row, 0]) == (vocab.outlines_end in allowed)  # EOS iff accepting
            toks = rng.choice(sorted(want), size=min(8, len(want)), replace=False).tolist()
            bad = [t for t in rng.integers(1, v, size=8).tolist() if t not in want]
            nxt = np.asarray(lookup_fn(jnp.full(len(toks) + len(bad), s + off, jnp.int32),
                                       jnp.asarray(toks + bad, jnp.int32)))
            assert nxt[:len(toks)].tolist() == [ours[index.get_next_state(o, t)] + off
                                                for t in toks]
            assert (nxt[len(toks):] == -1).all()
            assert [c.next_state(int(s), t) + off for t in toks] == nxt[:len(toks)].tolist()


def test_grammar_state_path_for_speculative_rollback():
    vocab = constraints.vocab_for(TINY_BYTES, 16)
    c = constraints.compile_format({"type": "regex", "pattern": "(ab|x)1"}, vocab)
    bundle = constraints.build_tables([c], 16)
    tokens = jnp.asarray([[2, 3, 7], [5, 7, 7], [5, 5, 7]], jnp.int32)  # a b 1 | x 1 1 | x x 1
    start = jnp.asarray([0, 0, 0], jnp.int32) + bundle.offsets[c.key]
    path = np.asarray(constraints.state_path(bundle.tables, start, tokens))
    want = [[0, c.next_state(0, 2), c.next_state(c.next_state(0, 2), 3)],
            [0, c.next_state(0, 5), c.next_state(c.next_state(0, 5), 7)]]
    assert path[0, :3].tolist() == want[0] and path[1, :3].tolist() == want[1]
    assert bool(c.accepting[path[0, 3]]) and path[1, 3] == constraints.DEAD
    assert path[2, 2] == constraints.DEAD and path[2, 3] == constraints.DEAD


def test_grammar_index_cache_is_lru_and_records_compile_time(demo_tokenizer):
    vocab = constraints.vocab_for(demo_tokenizer, 4096, exclude_ids=(0,))
    cache = constraints.IndexCache(max_entries=2)
    a = cache.get("[ab]+", vocab)
    assert cache.get("[ab]+", vocab) is a and a.compile_seconds > 0
    cache.get("x+", vocab), cache.get("y+", vocab)
    info = cache.info()
    assert info["entries"] == 2 and info["hits"] == 1 and info["misses"] == 3
    assert [e["regex"] for e in info["compiled"]] == ["x+", "y+"]
    assert info["compile_seconds_total"] > 0


# -- the demo model at temperature 1: one mixed batch ----------------------------------------

@pytest.fixture(scope="module")
def demo():
    if not os.path.exists(os.path.join(DEMO_DIR, "main.safetensors")):
        pytest.skip("demo weights (models/demo/main.safetensors) are not present")
    import models

    return models.demo()


def _rows(tokenizer):
    vocab = constraints.vocab_for(tokenizer, 4096, exclude_ids=(0,))
    digits = tuple(i for i, b in enumerate(vocab.token_bytes) if b and re.search(rb"[0-9]", b))
    rows = []  # (kind, prompt, SamplingParams)
    seed = iter(range(1000, 2000, 7))
    for name, schema in SCHEMAS.items():
        for _ in range(3 if name != "enum" else 2):
            rows.append((name, "config = ", jd.SamplingParams(
                seed=next(seed), max_tokens=MAX_TOKENS, response_format=schema_format(schema))))
    for _ in range(3):
        rows.append(("regex", "name = '", jd.SamplingParams(
            seed=next(seed), max_tokens=MAX_TOKENS,
            response_format={"type": "regex", "pattern": PATTERN})))
    for _ in range(2):
        rows.append(("choice", "answer = ", jd.SamplingParams(
            seed=next(seed), max_tokens=MAX_TOKENS,
            response_format={"type": "choice", "choices": CHOICES})))
    rows.append(("dead_end", "value = ", jd.SamplingParams(
        seed=next(seed), max_tokens=MAX_TOKENS, banned_token_ids=digits,
        response_format={"type": "regex", "pattern": "x[0-9]"})))
    for s in (11, 12):
        rows.append(("free", "def main():\n", jd.SamplingParams(seed=s, max_tokens=20,
                                                                 ignore_eos=True)))
    return rows, vocab


@pytest.fixture(scope="module")
def mixed(demo):
    model, params, tok = demo
    rows, vocab = _rows(tok)
    prompts = [encode(tok, p) for _, p, _ in rows]
    out = jd.generate(model, params, prompts, [sp for _, _, sp in rows], tokenizer=tok)
    texts = [b"".join(vocab.token_bytes[t] or b"" for t in out.tokens(r)) for r in range(len(rows))]
    return rows, prompts, out, texts


def _of(mixed, kind):
    rows, _, out, texts = mixed
    return [(r, texts[r]) for r, (k, _, _) in enumerate(rows) if k == kind]


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_grammar_json_schema_outputs_parse_and_validate(mixed, name):
    out = mixed[2]
    for r, text in _of(mixed, name):
        assert out.finish_reasons[r] in (jd.FinishReason.GRAMMAR_COMPLETE, jd.FinishReason.EOS)
        assert out.errors[r] is None
        value = json.loads(text.decode("utf-8"))
        jsonschema.validate(value, SCHEMAS[name])


def test_grammar_regex_outputs_fullmatch(mixed):
    out = mixed[2]
    for r, text in _of(mixed, "regex"):
        assert re.fullmatch(PATTERN, text.decode("utf-8")), text
        assert out.finish_reasons[r] == jd.FinishReason.GRAMMAR_COMPLETE


def test_grammar_choice_outputs_one_choice(mixed):
    out = mixed[2]
    for r, text in _of(mixed, "choice"):
        assert text.decode("utf-8") in CHOICES
        assert out.finish_reasons[r] in (jd.FinishReason.GRAMMAR_COMPLETE, jd.FinishReason.EOS)


def test_grammar_P2_dead_end(mixed):
    out = mixed[2]
    [(r, text)] = _of(mixed, "dead_end")
    assert out.errors[r] == jd.ErrorCode.GRAMMAR_DEAD_END
    assert text == b"x" and out.lengths[r] == 1  # the failed step selects nothing
    assert not np.isnan(out.logprobs[r]).any()


def test_grammar_P3_mixed_batch_free_rows_unchanged(demo, mixed):
    """Free rows get the same tokens as when their neighbours are unconstrained (contract P3, X1)."""
    model, params, tok = demo
    rows, prompts, out, _ = mixed
    plain = [jd.SamplingParams(seed=sp.seed, max_tokens=sp.max_tokens, ignore_eos=sp.ignore_eos)
             for _, _, sp in rows]
    ref = jd.generate(model, params, prompts, plain, tokenizer=tok)
    free = [r for r, (k, _, _) in enumerate(rows) if k == "free"]
    for r in free:
        assert out.tokens(r) == ref.tokens(r)
        assert out.finish_reasons[r] == ref.finish_reasons[r] == jd.FinishReason.MAX_OUTPUT_TOKENS


def test_grammar_in_the_engine_matches_device_generate(demo, mixed):
    """The engine carries the grammar state per slot: the same rows, arriving a few at a time
    into fewer slots (the table set is rebuilt and live rows rebased), give the device loop's
    tokens, endings and errors."""
    import time

    model, params, tok = demo
    rows, prompts, out, _ = mixed
    with jd.LLM(model, params, tok, max_slots=4, max_len=256) as llm:
        handles = []
        for r, (_, _, sp) in enumerate(rows):
            handles.append(llm.submit(prompts[r], sp))
            if r % 3 == 2:
                time.sleep(0.05)
        done = [h.result(timeout=300) for h in handles]
    for r, c in enumerate(done):
        assert list(c.token_ids) == out.tokens(r), rows[r][0]
        if out.errors[r] is not None:
            assert c.error == out.errors[r] == jd.ErrorCode.GRAMMAR_DEAD_END
        else:
            assert c.finish_reason == out.finish_reasons[r]
    flat = [c for c, (kind, _, _) in zip(done, rows) if kind == "flat"]
    for c in flat:
        jsonschema.validate(json.loads(c.text), FLAT)
