"""Hostile request bodies (issue #12), shared by the in-process server tests and the real
`jaxdecode serve` ones: the five measured reproductions, and the hypothesis strategy over the
request schema that the fuzz test draws from."""

from __future__ import annotations

from hypothesis import strategies as st

# (extra fields on top of {"model", "prompt"}, the param the 400 must name)
REPRODUCTIONS = [
    ({"max_tokens": 2, "top_k": 2147483648}, "top_k"),
    ({"max_tokens": 2, "num_beams": 2147483648}, "num_beams"),
    ({"max_tokens": 2, "num_beams": 100000}, "num_beams"),
    ({"max_tokens": 5000, "min_tokens": 4000}, "min_tokens"),
    ({"max_tokens": 2, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": "[" * 1000 + "]" * 1000}}}, "response_format"),
    ({"max_tokens": 2, "response_format": {"type": "regex", "pattern": "a{2147483648}"}},
     "response_format"),
    ({"max_tokens": 2, "response_format": {"type": "regex", "pattern": "a{100000}"}},
     "response_format"),
    ({"max_tokens": 2, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "string", "maxLength": 100000}}}}, "response_format"),
]

HUGE = st.sampled_from([2**31, 2**31 - 1, -2**31 - 1, 2**32, 2**63, 2**64, 10**30])
WRONG = st.one_of(st.none(), st.booleans(), st.text(max_size=4),
                  st.lists(st.integers(-2, 3), max_size=2),
                  st.dictionaries(st.text(max_size=2), st.integers(-1, 2), max_size=2))
BIG_FLOATS = st.sampled_from([1e39, -1e39, 3.5e38, 1e308, 1e-45, 1e-300, -0.0])


def _nested(depth: int, leaf):
    for _ in range(depth):
        leaf = {"type": "array", "items": leaf}
    return leaf


# well-formed values: cheap to serve (a few tokens, small n, cached constraints)
VALID = {
    "max_tokens": st.integers(1, 6), "min_tokens": st.integers(0, 2),
    "temperature": st.floats(0.0, 2.0), "top_p": st.floats(0.05, 1.0),
    "top_k": st.sampled_from([-1, 0, 1, 5, 257]), "min_p": st.floats(0.0, 1.0),
    "repetition_penalty": st.floats(0.5, 2.0), "presence_penalty": st.floats(-2.0, 2.0),
    "frequency_penalty": st.floats(-2.0, 2.0), "n": st.integers(1, 3),
    "seed": st.integers(0, 2**63 - 1), "stop": st.lists(st.text(min_size=1, max_size=3),
                                                       max_size=3),
    "logit_bias": st.dictionaries(st.integers(0, 256).map(str), st.floats(-100, 100),
                                  max_size=3),
    "logprobs": st.integers(0, 3), "top_logprobs": st.integers(0, 3),
    "num_beams": st.sampled_from([1, 2]), "length_penalty": st.floats(-2.0, 2.0),
    "early_stopping": st.sampled_from([True, False, "never"]), "ignore_eos": st.booleans(),
    "stream": st.booleans(), "include_stop_str_in_output": st.booleans(),
    "stream_options": st.just({"include_usage": True}),
    "response_format": st.sampled_from([
        {"type": "text"}, {"type": "regex", "pattern": "[ab]{1,4}"},
        {"type": "choice", "choices": ["yes", "no"]},
        {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "integer"}}},
        {"type": "json_schema", "json_schema": {"schema": {"enum": ["a", "b"]}}}]),
}

# hostile values: out of range, past the device dtypes, wrong types, too large, too deep
HOSTILE = {
    "max_tokens": st.one_of(HUGE, st.integers(-3, 0), st.just(5000), WRONG),
    "min_tokens": st.one_of(HUGE, st.integers(-3, -1), st.integers(9, 4000), WRONG),
    "temperature": st.one_of(st.floats(-3, -1e-9), BIG_FLOATS, WRONG),
    "top_p": st.one_of(st.floats(-1, 0), st.floats(1.0001, 3), BIG_FLOATS, WRONG),
    "top_k": st.one_of(HUGE, st.integers(-5, -2), st.integers(258, 10**6), WRONG),
    "min_p": st.one_of(st.floats(-1, -1e-9), st.floats(1.0001, 5), BIG_FLOATS, WRONG),
    "repetition_penalty": st.one_of(st.floats(-5, 0.0099), st.floats(100.01, 1e6), BIG_FLOATS,
                                    WRONG),
    "presence_penalty": st.one_of(st.floats(2.0001, 1e6), BIG_FLOATS, WRONG),
    "frequency_penalty": st.one_of(st.floats(-1e6, -2.0001), BIG_FLOATS, WRONG),
    "n": st.one_of(HUGE, st.integers(-3, 0), st.integers(9, 10**4), WRONG),
    "seed": st.one_of(st.sampled_from([2**63, 2**64, -1]), WRONG),
    "stop": st.one_of(st.lists(st.text(max_size=2), min_size=65, max_size=70),
                      st.just(["x" * 1025]), st.just([""]), WRONG),
    "logit_bias": st.one_of(
        st.dictionaries(st.one_of(HUGE.map(str), st.integers(257, 10**6).map(str),
                                  st.text(max_size=3)), st.floats(-100, 100),
                        min_size=1, max_size=3),
        st.dictionaries(st.integers(0, 256).map(str), st.one_of(BIG_FLOATS, st.floats(100.1, 1e6)),
                        min_size=1, max_size=3), WRONG),
    "logprobs": st.one_of(HUGE, st.integers(21, 100), st.integers(-3, -1), WRONG),
    "top_logprobs": st.one_of(HUGE, st.integers(21, 100), WRONG),
    "num_beams": st.one_of(HUGE, st.just(100000), st.integers(5, 64), st.integers(-2, 0), WRONG),
    "length_penalty": st.one_of(BIG_FLOATS, WRONG),
    "early_stopping": st.one_of(st.text(max_size=4), st.integers()),
    "stream": WRONG, "ignore_eos": WRONG, "stream_options": WRONG,
    "response_format": st.one_of(
        st.sampled_from([
            {"type": "json_schema", "json_schema": {"schema": {"type": "string",
                                                               "maxLength": 100000}}},
            {"type": "json_schema", "json_schema": {"schema": {
                "type": "array", "minItems": 10**6, "items": {"type": "integer"}}}},
            {"type": "regex", "pattern": "(("}, {"type": "regex", "pattern": ""},
            {"type": "bogus"}, {"type": "json_schema"}, {"type": "regex"},
            {"type": "choice", "choices": []},
            {"type": "json_schema", "json_schema": {"schema": 5}}]),
        st.one_of(st.integers(20_001, 2**40), st.sampled_from([2**31, 10**30])).map(
            lambda n: {"type": "regex", "pattern": f"a{{{n}}}"}),
        st.integers(65, 2000).map(lambda d: {"type": "json_schema", "json_schema": {
            "schema": "[" * d + "]" * d}}),
        st.integers(64, 400).map(lambda d: {"type": "json_schema", "json_schema": {
            "schema": _nested(d, {"type": "integer"})}}),
        WRONG),
    "echo": st.just(True), "best_of": st.integers(4, 10), "suffix": st.just("x"),
    "tools": st.just([{"type": "function"}]),
    "prompt": st.one_of(st.just("x" * 300), st.lists(st.integers(257, 2**40), min_size=1,
                                                        max_size=3),
                        st.just([]), st.just(""), st.lists(st.text(max_size=3), min_size=2,
                                                           max_size=3), WRONG),
    "messages": st.one_of(
        st.just([]), st.just([{"role": "wizard", "content": "x"}]),
        st.integers(201, 600).map(lambda d: [{"role": "user", "content": "hi",
                                              "extra": _nested(d, 1)}]),
        st.just([{"role": "user", "content": "x"}] * 2049), WRONG),
}

CHAT_ONLY = {"top_logprobs", "tools", "messages"}
COMPLETIONS_ONLY = {"logprobs", "echo", "best_of", "suffix", "prompt"}


def _request(path: str, base: dict, chat: bool):
    other = COMPLETIONS_ONLY if chat else CHAT_ONLY
    fields = {k: v for k, v in VALID.items() if k not in other}
    if chat:  # chat's logprobs is a flag (top_logprobs the count)
        fields["logprobs"] = st.booleans()
    hostile = st.sampled_from(sorted(k for k in HOSTILE if k not in other)).flatmap(
        lambda k: HOSTILE[k].map(lambda v: (k, v)))
    bad = st.one_of(st.none(), hostile, hostile, hostile)
    return st.tuples(st.fixed_dictionaries(base, optional=fields), bad).map(
        lambda pair: (path, {**pair[0], **dict([pair[1]] if pair[1] else [])}))


def bodies(model: str):
    """(path, body): a completions or chat request with any subset of well-formed fields
    and, three times in four, one hostile field (which may collide with the others: min_tokens
    over max_tokens, beams with sampling settings, ...)."""
    completions = {"model": st.just(model), "prompt": st.one_of(
        st.text(min_size=1, max_size=16), st.lists(st.integers(0, 255), min_size=1,
                                                   max_size=6))}
    chat = {"model": st.just(model), "messages": st.lists(st.fixed_dictionaries({
        "role": st.sampled_from(["user", "system", "assistant"]),
        "content": st.text(max_size=12)}), min_size=1, max_size=3)}
    return st.one_of(_request("/v1/completions", completions, chat=False),
                     _request("/v1/chat/completions", chat, chat=True))
