"""`SamplingParams.response_format`: shape validation and conversion to one regular expression.

Accepted shapes (OpenAI's `response_format`, plus `regex` and `choice` as vLLM/SGLang offer them):

    {"type": "text"}                                       no constraint (same as None)
    {"type": "json_schema", "json_schema": {"schema": S, "name": ..., "strict": ...,
                                            "description": ...}}
    {"type": "json_object"}                                any JSON object (bounded nesting)
    {"type": "regex", "pattern": P}                        the whole output fullmatches P
    {"type": "choice", "choices": ["a", "b", ...]}         the output is exactly one choice

Every shape but "text" also accepts `"whitespace_pattern": str` (JSON kinds only: the regex
used between JSON tokens; default outlines-core's `[ ]?`).

`validate_response_format` runs at `SamplingParams` construction and checks the shape only (cheap,
no tokenizer), including its size: at most `MAX_DEPTH` dict/list levels and `MAX_NODES` values
(a schema sent as a JSON string is parsed and held to the same limits). `regex_for` turns a
valid format into the regex that outlines-core compiles; it runs at submission
(`generate`/the engine), where a schema outlines-core cannot translate -- or one using a
keyword it would silently ignore (`jaxdecode.json_schema`: integer bounds are enforced, the
rest refused) -- raises `ValueError("response_format: ...")`. The regex dialect is Rust's
`regex` crate (outlines-core); a `regex` pattern must fullmatch the output (it is anchored at
both ends).

`json_object` is outlines-core's translation of `{"type": "object"}`: a JSON object whose
values nest objects/arrays a bounded number of levels deep (a regular language cannot express
unbounded nesting).
"""

from __future__ import annotations

import json
from typing import Any, Optional

from jaxdecode import json_schema

FIELD = "response_format"
MAX_DEPTH = 64      # dict/list levels of a response_format (a JSON schema ~30 levels deep)
MAX_NODES = 20_000  # values in a response_format (keys not counted)
KINDS = ("text", "json_schema", "json_object", "regex", "choice")
_JSON_SCHEMA_KEYS = ("schema", "name", "strict", "description")
_ALLOWED_KEYS = {
    "text": {"type"},
    "json_schema": {"type", "json_schema", "whitespace_pattern"},
    "json_object": {"type", "whitespace_pattern"},
    "regex": {"type", "pattern"},
    "choice": {"type", "choices"},
}
# Punctuation escaped for outlines-core's (Rust) regex dialect; letters, digits, space are literal.
_META = set("\\.+*?()|[]{}^$#&-~")


def fail(message: str) -> None:
    raise ValueError(f"{FIELD}: {message}")


def validate_response_format(rf: Any) -> Optional[dict]:
    """Check the shape of a response_format; returns it (None for None / {"type": "text"}).

    Raises ValueError whose message starts with `response_format`."""
    if rf is None:
        return None
    if not isinstance(rf, dict):
        fail(f"must be a dict or None, got {type(rf).__name__}")
    check_nesting(rf, "the response_format")
    kind = rf.get("type")
    if kind not in KINDS:
        fail(f"'type' must be one of {KINDS}, got {kind!r}")
    extra = set(rf) - _ALLOWED_KEYS[kind]
    if extra:
        fail(f"unknown key(s) {sorted(extra)} for type {kind!r} "
             f"(allowed: {sorted(_ALLOWED_KEYS[kind])})")
    if "whitespace_pattern" in rf and not isinstance(rf["whitespace_pattern"], str):
        fail(f"'whitespace_pattern' must be a string, got {rf['whitespace_pattern']!r}")
    if kind == "text":
        return None
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict):
            fail("type 'json_schema' needs a 'json_schema' dict holding 'schema'")
        extra = set(js) - set(_JSON_SCHEMA_KEYS)
        if extra:
            fail(f"unknown key(s) {sorted(extra)} in 'json_schema' (allowed: {_JSON_SCHEMA_KEYS})")
        schema = js.get("schema")
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except RecursionError:
                fail(f"'json_schema.schema' nests deeper than {MAX_DEPTH} levels")
            except ValueError as exc:
                fail(f"'json_schema.schema' is a string that is not JSON: {exc}")
            check_nesting(schema, "'json_schema.schema'")
        if not isinstance(schema, dict):
            fail(f"'json_schema.schema' must be a JSON-schema object, got {type(schema).__name__}")
        if "name" in js and not isinstance(js["name"], str):
            fail("'json_schema.name' must be a string")
        if "strict" in js and not isinstance(js["strict"], (bool, type(None))):
            fail("'json_schema.strict' must be a boolean")
    elif kind == "regex":
        pattern = rf.get("pattern")
        if not isinstance(pattern, str) or not pattern:
            fail("type 'regex' needs a non-empty string 'pattern'")
    elif kind == "choice":
        choices = rf.get("choices")
        if not isinstance(choices, (list, tuple)) or not choices:
            fail("type 'choice' needs a non-empty list 'choices'")
        for c in choices:
            if not isinstance(c, str) or not c:
                fail(f"'choices' entries must be non-empty strings, got {c!r}")
    return rf


def check_nesting(value: Any, what: str) -> None:
    """ValueError naming the field when `value` nests deeper than MAX_DEPTH dict/list levels or
    holds more than MAX_NODES values; iterative, so no input raises RecursionError."""
    todo, nodes = [(value, 1)], 0
    while todo:
        item, depth = todo.pop()
        nodes += 1
        if nodes > MAX_NODES:
            fail(f"{what} holds more than {MAX_NODES} values")
        children = (item.values() if isinstance(item, dict)
                    else item if isinstance(item, (list, tuple)) else ())
        if children and depth >= MAX_DEPTH:
            fail(f"{what} nests deeper than {MAX_DEPTH} levels")
        todo.extend((child, depth + 1) for child in children)


def escape(text: str) -> str:
    """A literal for outlines-core's regex dialect."""
    return "".join("\\" + ch if ch in _META else ch for ch in text)


def regex_for(rf: dict) -> str:
    """The regex a validated response_format compiles to (ValueError naming the field if none)."""
    kind = rf["type"]
    if kind == "regex":
        return rf["pattern"]
    if kind == "choice":
        return "(" + "|".join(escape(c) for c in rf["choices"]) + ")"
    from outlines_core.json_schema import build_regex_from_schema

    if kind == "json_object":
        schema, ranges = {"type": "object"}, {}
    else:
        schema = rf["json_schema"]["schema"]
        if isinstance(schema, str):
            schema = json.loads(schema)
        schema, ranges = json_schema.prepare(schema, fail)
    try:
        text = json.dumps(schema, sort_keys=False)
        ws = rf.get("whitespace_pattern")
        regex = (build_regex_from_schema(text, ws) if ws is not None
                 else build_regex_from_schema(text))
    except Exception as exc:  # outlines-core raises ValueError / TypeError / its own errors
        fail(f"outlines-core cannot translate this JSON schema to a regex: {exc}")
    return json_schema.regex_with_ranges(regex, ranges)
