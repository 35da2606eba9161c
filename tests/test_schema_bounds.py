"""Schemas mean what they say (jaxdecode/json_schema.py, contract §12 "Schemas mean what they
say"): integer bounds become regexes of exactly the allowed integers; keywords outlines-core
would silently ignore are refused naming the keyword; on the demo model every generated
integer lies within its bounds over many seeds."""

from __future__ import annotations

import json
import os
import re

import pytest
from hypothesis import given, settings, strategies as st

import jaxdecode as jd
from jaxdecode.json_schema import int_range_regex
from jaxdecode.response_format import regex_for
from jaxdecode.tokenization import encode

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("outlines_core")

DEMO_DIR = os.path.join(os.path.dirname(__file__), "..", "models", "demo")
BOUNDED = {"type": "object",
           "properties": {"day": {"type": "integer", "minimum": 1, "maximum": 14},
                          "delta": {"type": "integer", "exclusiveMinimum": -3,
                                    "exclusiveMaximum": 3},
                          "big": {"type": "integer", "minimum": 100, "maximum": 99999},
                          "neg": {"type": "integer", "minimum": -1000, "maximum": -7.0}},
           "required": ["day", "delta", "big", "neg"], "additionalProperties": False}
SEEDS = 24


def schema_format(schema):
    return {"type": "json_schema", "json_schema": {"name": "t", "schema": schema}}


ends = st.one_of(st.none(), st.integers(-10 ** 6, 10 ** 6), st.integers(-10 ** 30, 10 ** 30))


@settings(max_examples=300, deadline=None)
@given(ends, ends, st.lists(st.integers(-10 ** 7, 10 ** 7), min_size=1, max_size=20))
def test_int_range_regex_matches_exactly_the_canonical_integers_of_the_range(lo, hi, values):
    if lo is not None and hi is not None and lo > hi:
        lo, hi = hi, lo
    pattern = re.compile(int_range_regex(lo, hi))
    near = [v for e in (lo, hi) if e is not None for v in (e - 1, e, e + 1)]
    for v in values + near + [0, 1, -1]:
        inside = (lo is None or v >= lo) and (hi is None or v <= hi)
        assert bool(pattern.fullmatch(str(v))) == inside, (lo, hi, v)
    for text in ("-0", "00", "01", "+1", "1.0", "1e2", " 1", ""):
        assert not pattern.fullmatch(text), (lo, hi, text)


def test_bounded_integers_compile_into_the_schema_regex():
    regex = regex_for(schema_format({"type": "integer", "minimum": 1, "maximum": 14}))
    assert [v for v in range(-20, 200) if re.fullmatch(regex, str(v))] == list(range(1, 15))
    # a $ref used twice repeats the range
    regex = regex_for(schema_format({"$defs": {"d": {"type": "integer", "minimum": 0,
                                                     "maximum": 9}},
                                     "type": "array", "prefixItems": [{"$ref": "#/$defs/d"},
                                                                      {"$ref": "#/$defs/d"}]}))
    assert re.fullmatch(regex, "[3,9]") and not re.fullmatch(regex, "[3,10]")


@pytest.mark.parametrize("schema,keyword", [
    ({"type": "number", "minimum": 0}, "minimum"),
    ({"type": "integer", "multipleOf": 3}, "multipleOf"),
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems"),
    ({"type": "object", "minProperties": 1}, "minProperties"),
    ({"type": "object", "patternProperties": {"a": {}}}, "patternProperties"),
    ({"type": "object", "properties": {"x": {"not": {"type": "null"}}}}, "not"),
    ({"allOf": [{"type": "object"}, {"type": "object"}]}, "allOf"),
    ({"type": "string", "pattern": "a+", "maxLength": 3}, "pattern"),
    ({"type": "integer", "minimum": 5, "maximum": 4}, "no integer"),
    ({"type": "integer", "minimum": 1.5}, "minimum"),
    ({"type": "integer", "minimum": 1, "maxDigits": 3}, "maxDigits"),
    ({"type": "string", "maxDigits": 3}, "maxDigits"),
    ({"minimum": 1}, "minimum"),
    ({"type": "object", "properties": {"a": {"type": "integer", "exclusiveMaximum": True}}},
     "exclusiveMaximum"),
])
def test_keywords_the_compiler_would_ignore_are_refused_naming_them(schema, keyword):
    with pytest.raises(ValueError, match=f"^response_format:.*{re.escape(keyword)}"):
        regex_for(schema_format(schema))


def test_annotations_and_supported_keywords_pass():
    schema = {"title": "t", "description": "d", "type": "object",
              "properties": {"a": {"type": "string", "format": "date", "examples": ["x"]},
                             "b": {"type": "array", "items": {"enum": [1, 2]}, "minItems": 1,
                                   "maxItems": 2},
                             "c": {"anyOf": [{"type": "null"}, {"const": "z"}]},
                             "d": {"type": "integer", "maxDigits": 2}},
              "required": ["a"], "additionalProperties": False}
    assert regex_for(schema_format(schema))


@pytest.fixture(scope="module")
def demo():
    if not os.path.exists(os.path.join(DEMO_DIR, "main.safetensors")):
        pytest.skip("demo weights (models/demo/main.safetensors) are not present")
    import models

    return models.demo()


def test_demo_model_integers_stay_within_their_bounds_over_many_seeds(demo):
    model, params, tok = demo
    sps = [jd.SamplingParams(seed=s, max_tokens=96, temperature=1.0,
                             response_format=schema_format(BOUNDED)) for s in range(SEEDS)]
    out = jd.generate(model, params, [encode(tok, "x = ")] * SEEDS, sps, tokenizer=tok)
    values = []
    for r in range(SEEDS):
        assert out.finish_reasons[r] in (jd.FinishReason.GRAMMAR_COMPLETE, jd.FinishReason.EOS)
        value = json.loads(tok.decode(list(out.tokens(r))))
        jsonschema.validate(value, BOUNDED)
        assert 1 <= value["day"] <= 14 and -3 < value["delta"] < 3
        assert 100 <= value["big"] <= 99999 and -1000 <= value["neg"] <= -7
        values.append(value["day"])
    assert len(set(values)) > 1  # sampled, not one fixed answer
