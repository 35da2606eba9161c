"""Validation is complete and happens once, before admission (issue #12): SamplingParams holds
every value to its device dtype and range, `jd.LLM` checks the engine limits on the values it
will use (`jaxdecode/engine/admission.py`), and a constraint is held to size limits and compiled
within a time / memory / state budget (`jaxdecode/device/constraints/limits.py`, `worker.py`). Every
violation is a ValueError naming the field, and a request already running is not touched."""

from __future__ import annotations

import time

import pytest

import jaxdecode as jd
from jaxdecode.device import constraints
from jaxdecode.device.constraints import limits
from jaxdecode.response_format import MAX_NODES
from jaxdecode.device.constraints.worker import CompileBudget, WorkerPool
from tests.host_fixtures import byte_tokenizer
from tests.scripted import ScriptedModel

BIG = 2**31

# -- SamplingParams: device dtypes and ranges ----------------------------------------------------

BAD_PARAMS = [
    (dict(top_k=BIG), "top_k"), (dict(max_tokens=BIG), "max_tokens"),
    (dict(min_tokens=BIG, max_tokens=5), "min_tokens"), (dict(n=BIG), "n"),
    (dict(num_beams=BIG), "num_beams"), (dict(num_beams=100000, n=BIG), "n"),
    (dict(temperature=1e39), "temperature"), (dict(temperature=float("inf")), "temperature"),
    (dict(top_p=1e-50), "top_p"), (dict(top_p=1.5), "top_p"),
    (dict(frequency_penalty=2.5), "frequency_penalty"), (dict(presence_penalty=-3), "presence_penalty"),
    (dict(repetition_penalty=1e-3), "repetition_penalty"),
    (dict(repetition_penalty=1e39), "repetition_penalty"),
    (dict(logit_bias={5: 101.0}), "logit_bias"), (dict(logit_bias={BIG: 1.0}), "logit_bias"),
    (dict(logit_bias={"x": 1.0}), "logit_bias"),
    (dict(stop=["x"] * 65), "stop"), (dict(stop=["x" * 1025]), "stop"), (dict(stop=5), "stop"),
    (dict(stop_token_ids=[[1] * 1025]), "stop_token_ids"), (dict(stop_token_ids=7.5), "stop_token_ids"),
    (dict(banned_token_ids=[BIG]), "banned_token_ids"), (dict(length_penalty=1e39), "length_penalty"),
    (dict(seed=2**63), "seed"),
    (dict(response_format={"type": "json_schema", "json_schema": {"schema": "[" * 1000 + "]" * 1000}}),
     "response_format"),
]


@pytest.mark.parametrize("kwargs,field", BAD_PARAMS, ids=[f for _, f in BAD_PARAMS])
def test_sampling_params_every_value_fits_its_device_dtype_and_range(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field}: "):
        jd.SamplingParams(**kwargs)


def test_sampling_params_ranges_keep_their_edges_and_tiny_temperatures_are_greedy():
    sp = jd.SamplingParams(top_k=BIG - 1, max_tokens=BIG - 1, min_tokens=BIG - 1, top_p=1e-30,
                           frequency_penalty=2, presence_penalty=-2, repetition_penalty=0.01,
                           logit_bias={BIG - 1: -100, 0: 100}, stop=["x" * 1024] * 64)
    assert sp.top_k == BIG - 1 and sp.logit_bias[0] == 100.0
    assert jd.SamplingParams(temperature=1e-6).temperature == 0.0  # greedy, like vLLM
    assert jd.SamplingParams(temperature=1e-5).temperature == 1e-5


def _nest(depth):
    value: dict = {"type": "integer"}
    for _ in range(depth):
        value = {"type": "array", "items": value}
    return value


def test_response_format_nesting_and_size_limits_raise_no_recursion_error():
    deep = {"type": "json_schema", "json_schema": {"schema": _nest(70)}}  # 72 dict levels
    with pytest.raises(ValueError, match="^response_format: .*nests deeper than 64"):
        jd.SamplingParams(response_format=deep)
    jd.SamplingParams(response_format={"type": "json_schema", "json_schema": {"schema": _nest(60)}})
    wide = {"type": "choice", "choices": ["a"] * MAX_NODES}
    with pytest.raises(ValueError, match=f"more than {MAX_NODES} values"):
        jd.SamplingParams(response_format=wide)
    loop: dict = {"type": "json_schema", "json_schema": {}}
    loop["json_schema"]["schema"] = loop  # a cycle is just too deep
    with pytest.raises(ValueError, match="^response_format: "):
        jd.SamplingParams(response_format=loop)
    for text in ("[" * 100000, "{\"a\":" * 3000 + "1" + "}" * 3000):
        with pytest.raises(ValueError, match="^response_format: 'json_schema.schema' nests"):
            jd.SamplingParams(response_format={"type": "json_schema",
                                               "json_schema": {"schema": text}})


# -- constraints: the size estimate and the compile budget ---------------------------------------

@pytest.mark.parametrize("regex,size", [
    ("a{10}", 10), ("(ab){3}", 6), ("(a{10}){10}", 100), ("a|b|c", 3), ("[a-z]{1000}", 1000),
    (r"\d{3}-\d{4}", 8), ("(?P<x>ab)+", 2), ("(?i)abc", 3), ("[[:alpha:]]{5}", 5),
    (r"\p{L}{4}", 4), (r"\x{41}{3}", 3), ("[]a]{2}", 2), ("a{,5}", 5), ("a{2,}", 3),
    ("a{2147483648}", 2147483648), ("((a{1000}){1000}){1000}", 10**9)])
def test_constraint_pattern_size_estimate(regex, size):
    assert limits.pattern_size(regex) == size


@pytest.fixture(scope="module")
def vocab():
    return constraints.vocab_for(byte_tokenizer(), 257, exclude_ids=(256,))


def test_constraint_over_the_state_cap_is_refused_before_compiling(vocab):
    cache = constraints.IndexCache()
    for regex in ("a{2147483648}", "a{100000}", "(" * 10 + "a{10}){10}" * 10):
        t0 = time.perf_counter()
        with pytest.raises(ValueError, match="^response_format: the pattern needs more than 20000 "
                                             "automaton states"):
            constraints.compile_regex(regex, vocab, cache, CompileBudget())
        assert time.perf_counter() - t0 < 1.0  # a scan of the text, no automaton
    schema = {"type": "json_schema", "json_schema": {"schema": {"type": "string",
                                                                "maxLength": 100000}}}
    with pytest.raises(ValueError, match="automaton states"):
        constraints.compile_format(schema, vocab, cache, CompileBudget())
    with pytest.raises(ValueError, match="characters; at most"):
        constraints.compile_regex("a" * (limits.MAX_PATTERN_CHARS + 1), vocab, cache)
    assert cache.info()["misses"] == 5 and cache.info()["entries"] == 0


def test_constraint_compile_budget_time_memory_states_and_cancel(vocab):
    pool, small = WorkerPool(2048 << 20), WorkerPool(120 << 20)
    budget = CompileBudget(seconds=0.5, memory_mb=2048)
    # time: a JSON string pattern whose determinisation takes many seconds
    slow = constraints.regex_for({"type": "json_object"})
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match=r"^response_format: .*longer than 0.5 s"):
        pool.compile(slow, vocab, budget)
    assert time.perf_counter() - t0 < 3.0
    # memory: a pattern that needs more than 120 MiB (the same budget compiles a small one)
    with pytest.raises(ValueError, match="needed more than 120 MiB"):
        small.compile("[a-z]{0,4000}x", vocab, CompileBudget(seconds=30, memory_mb=120))
    assert small.compile("ab", vocab, CompileBudget(memory_mb=120))["accepting"].tolist() == [
        False, False, True]
    # states: under the estimate, over the cap once built
    assert limits.pattern_size("(a|b)*a(a|b){6}") < 100
    with pytest.raises(ValueError, match="^response_format: the automaton has .* states, more "
                                         "than the limit 100"):
        pool.compile("(a|b)*a(a|b){6}", vocab, CompileBudget(max_states=100, memory_mb=2048))
    # cancel: abandoned within the poll interval, the worker killed
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match="abandoned: the client went away"):
        pool.compile(slow, vocab, CompileBudget(seconds=30, memory_mb=2048),
                     cancelled=lambda: time.perf_counter() - t0 > 0.3)
    assert time.perf_counter() - t0 < 2.0
    assert pool.counts == {"started": 2, "compiled": 0, "timeout": 1, "cancelled": 1,
                           "memory": 0}  # the refused state cap kept its worker
    assert small.counts == {"started": 2, "compiled": 1, "timeout": 0, "cancelled": 0,
                            "memory": 1}
    pool.close()
    small.close()


# -- the engine: limits on the values it will use, a running request untouched -------------------

V = 257
SCRIPT = [ord(c) for c in ("The quick brown fox jumps over the lazy dog. " * 3)]


@pytest.fixture(scope="module")
def llm():
    model = ScriptedModel.make(SCRIPT, vocab_size=V, max_len=128, eos_token_ids=(256,))
    with jd.LLM(model, {}, byte_tokenizer(), max_slots=2, max_len=128, max_num_beams=4,
                max_n=3, max_constraint_compile_s=5.0) as engine:
        yield engine


BAD_SUBMITS = [
    (dict(top_k=V + 1), "top_k"), (dict(logit_bias={V: 1.0}), "logit_bias"),
    (dict(stop_token_ids=[V]), "stop_token_ids"), (dict(num_beams=5), "num_beams"),
    (dict(num_beams=100000), "num_beams"),
    (dict(max_tokens=5000, min_tokens=4000), "min_tokens"),
    (dict(max_tokens=200, min_tokens=126), "min_tokens"),  # 125 positions left by 3 tokens
    (dict(response_format={"type": "regex", "pattern": "a{2147483648}"}), "response_format"),
    (dict(response_format={"type": "json_schema",
                           "json_schema": {"schema": {"type": "string", "maxLength": 100000}}}),
     "response_format"),
]


def test_engine_limits_checked_at_submission_and_a_running_request_is_untouched(llm):
    greedy = jd.SamplingParams(temperature=0.0, max_tokens=100)
    want = llm.generate("The", greedy)[0]
    running = llm.submit("The", greedy)
    for kwargs, field in BAD_SUBMITS:
        t0 = time.perf_counter()
        with pytest.raises(ValueError, match=f"^{field}: "):
            llm.submit("The", jd.SamplingParams(**kwargs))
        assert time.perf_counter() - t0 < 1.0, kwargs
    with pytest.raises(ValueError, match="^n: at most 3"):
        llm.generate("The", jd.SamplingParams(n=4))
    got = running.result(30)
    assert (got.token_ids, got.finish_reason) == (want.token_ids, want.finish_reason)
    assert llm.health()["status"] == "ok" and llm.error is None
    # the capped value is the one checked: min_tokens up to the room left is fine
    c = llm.generate("The", jd.SamplingParams(temperature=0.0, max_tokens=5000,
                                              min_tokens=125, ignore_eos=True))[0]
    assert c.error is None and len(c.token_ids) == 125


def test_engine_options_are_validated():
    model = ScriptedModel.make(SCRIPT, vocab_size=V, max_len=128)
    for kwargs, field in ((dict(max_num_beams=0), "max_num_beams"), (dict(max_n=True), "max_n"),
                          (dict(max_constraint_compile_s=0), "max_constraint_compile_s"),
                          (dict(max_constraint_states=-1), "max_constraint_states")):
        with pytest.raises(ValueError, match=f"^{field}: "):
            jd.LLM(model, {}, byte_tokenizer(), max_len=128, **kwargs)


def test_engine_config_is_validated_once_and_given_or_built_from_keywords():
    """engine/config.py: an EngineConfig raises its construction errors itself (ValueError
    naming the field); what needs the model (its context) is checked by the LLM; the LLM takes
    it as `config=` or builds it from the same keywords, not both."""
    model = ScriptedModel.make(SCRIPT, vocab_size=V, max_len=128)
    for kwargs, field in ((dict(max_slots=0), "max_slots"), (dict(max_queue=0), "max_queue"),
                          (dict(page_size=0), "page_size"), (dict(prefill_chunk=24),
                                                             "prefill_chunk"),
                          (dict(kv_pages=1), "kv_pages"), (dict(decode_steps=0),
                                                           "decode_steps"),
                          (dict(max_n=0), "max_n")):
        with pytest.raises(ValueError, match=f"^{field}: "):
            jd.EngineConfig(max_len=128, **kwargs)
    config = jd.EngineConfig(max_slots=2, max_len=128)
    with pytest.raises(ValueError, match="^max_len: "):  # the model's context is 128
        jd.LLM(model, {}, byte_tokenizer(), config=jd.EngineConfig(max_len=4096))
    with pytest.raises(ValueError, match="^config: "):
        jd.LLM(model, {}, byte_tokenizer(), config=config, max_slots=4)
    sp = jd.SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    with jd.LLM(model, {}, byte_tokenizer(), config=config) as given, \
            jd.LLM(model, {}, byte_tokenizer(), max_slots=2, max_len=128) as built:
        assert given.config == built.config and given.kv == config.kv
        assert given.generate("The", sp)[0].token_ids == built.generate("The", sp)[0].token_ids


def test_engine_beam_calls_are_formed_within_the_kv_budget(llm):
    """Budget: max(max_slots 2, max_num_beams 4) x 128 = 512 positions. Width 4 with 20 new
    tokens allocates 4 x 64 per row (two rows per call); with 60, 4 x 128 (one per call)."""
    assert llm.limits.kv_positions == 512
    for max_tokens, rows in ((20, 2), (60, 1)):
        out = llm.generate(["The", "A"], jd.SamplingParams(num_beams=4, max_tokens=max_tokens))
        started = [e for c in out for e in c.events if e.kind == "beam.started"]
        assert {e.data["rows"] for e in started} == {rows}
        assert all(c.finish_reason is not None for c in out)
