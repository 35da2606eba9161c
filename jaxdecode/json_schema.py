"""JSON schemas that mean what they say: the keywords outlines-core honours, integer bounds
made into regexes, everything else refused (contract §12 "Schemas mean what they say";
docs/serving.md "Structured output: the JSON-schema keywords").

outlines-core 0.2.14 translates a schema into one regex but silently drops some keywords
(`minimum` / `maximum` on integers, `multipleOf`, `uniqueItems`, `minProperties`, `pattern`
next to a length bound, ...) and concatenates the branches of `allOf`. `prepare(schema)` walks
the schema first:

- an integer with `minimum` / `maximum` / `exclusiveMinimum` / `exclusiveMaximum` is replaced
  by a unique string constant (a marker); `regex_with_ranges` swaps each marker's regex
  (`"marker"` in outlines-core's output) for `int_range_regex(lo, hi)`, the canonical decimal
  integers of the range (no leading zeros, no ``-0``);
- a keyword outside `KEYWORDS`, a bound (or outlines-core's `minDigits` / `maxDigits`) on
  anything but ``"type": "integer"``, `allOf` with more
  than one branch, `pattern` with `minLength` / `maxLength` raise ValueError naming the keyword.

`oneOf` is generated as `anyOf` (an output matches at least one branch: exact when the
branches are disjoint); `properties` without `additionalProperties: false` still generates only
the listed properties (valid output, a narrower set).
"""

from __future__ import annotations

import uuid
from typing import Any, Callable, Optional

ANNOTATIONS = frozenset({"title", "description", "default", "examples", "$schema", "$id",
                         "$comment", "deprecated", "readOnly", "writeOnly"})
# keyword -> how its value holds sub-schemas (None: it holds none)
_SUBSCHEMAS = {
    "properties": "dict", "$defs": "dict", "definitions": "dict", "items": "one",
    "additionalProperties": "one", "prefixItems": "list", "anyOf": "list", "oneOf": "list",
    "allOf": "list",
}
KEYWORDS = frozenset({"type", "enum", "const", "required", "minItems", "maxItems",
                      "minLength", "maxLength", "pattern", "format", "$ref", *_SUBSCHEMAS,
                      "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
                      "minDigits", "maxDigits"}) | ANNOTATIONS
BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
_MARKER = "jaxdecodeintrange"


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _integer_range(node: dict, where: str, fail: Callable[[str], None]) -> tuple:
    """(lo, hi) of an integer node's bounds, None for an open end (ValueError naming them)."""
    lo = hi = None
    for key in BOUNDS:
        if key not in node:
            continue
        value = node[key]
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if not _is_int(value):
            fail(f"'{key}' at {where} must be an integer for an integer schema, got {value!r}")
        if key == "minimum":
            lo = value if lo is None else max(lo, value)
        elif key == "exclusiveMinimum":
            lo = value + 1 if lo is None else max(lo, value + 1)
        elif key == "maximum":
            hi = value if hi is None else min(hi, value)
        else:
            hi = value - 1 if hi is None else min(hi, value - 1)
    if lo is not None and hi is not None and lo > hi:
        fail(f"the bounds at {where} admit no integer ([{lo}, {hi}])")
    return lo, hi


def prepare(schema: Any, fail: Callable[[str], None]) -> tuple[Any, dict]:
    """(the schema with every bounded integer replaced by a marker constant, {marker: regex});
    `fail(message)` raises for what outlines-core would ignore."""
    ranges: dict[str, str] = {}
    token = uuid.uuid4().hex

    def walk(node: Any, where: str) -> Any:
        if isinstance(node, bool):
            return node
        if not isinstance(node, dict):
            fail(f"the schema at {where} must be an object or a boolean, got "
                 f"{type(node).__name__}")
        unknown = sorted(set(node) - KEYWORDS)
        if unknown:
            fail(f"JSON-schema keyword(s) {unknown} at {where} are not supported (the "
                 f"compiler would ignore them; supported: docs/serving.md)")
        bounds = [k for k in BOUNDS if k in node]
        if bounds:
            if node.get("type") != "integer":
                fail(f"'{bounds[0]}' at {where} is supported on \"type\": \"integer\" only, "
                     f"not on {node.get('type', 'a schema without a type')!r}")
            mixed = [k for k in ("enum", "const", "minDigits", "maxDigits") if k in node]
            if mixed:
                fail(f"'{bounds[0]}' at {where} cannot be combined with '{mixed[0]}'")
            marker = f"{_MARKER}{len(ranges)}x{token}"
            ranges[marker] = int_range_regex(*_integer_range(node, where, fail))
            return {"const": marker}
        digits = [k for k in ("minDigits", "maxDigits") if k in node]
        if digits and node.get("type") != "integer":
            fail(f"'{digits[0]}' at {where} is supported on \"type\": \"integer\" only")
        if "pattern" in node and ("minLength" in node or "maxLength" in node):
            fail(f"'pattern' at {where} cannot be combined with 'minLength' / 'maxLength' "
                 "(put the length into the pattern)")
        if len(node.get("allOf", ())) > 1:
            fail(f"'allOf' at {where} with more than one branch is not supported")
        out = {}
        for key, value in node.items():
            shape = _SUBSCHEMAS.get(key)
            path = f"{where}/{key}"
            if shape == "dict" and isinstance(value, dict):
                value = {k: walk(v, f"{path}/{k}") for k, v in value.items()}
            elif shape == "list" and isinstance(value, list):
                value = [walk(v, f"{path}/{i}") for i, v in enumerate(value)]
            elif shape == "one" and not isinstance(value, list):
                value = walk(value, path)
            out[key] = value
        return out

    return walk(schema, "#"), ranges


def regex_with_ranges(regex: str, ranges: dict) -> str:
    """outlines-core's regex with each marker constant (every use: a `$ref` may repeat one)
    replaced by its integer range."""
    for marker, pattern in ranges.items():
        regex = regex.replace(f'"{marker}"', pattern)
    return regex


# -- integer ranges ------------------------------------------------------------------------------

def int_range_regex(lo: Optional[int], hi: Optional[int]) -> str:
    """A regex whose full matches are exactly the canonical decimal integers in [lo, hi]
    (None: unbounded on that side); `lo <= hi` when both are given."""
    alts = []
    if lo is None or lo < 0:  # the negatives: "-" then a magnitude in [max(1, -hi), -lo]
        alts.append("-" + _positive(1 if hi is None or hi >= 0 else -hi,
                                    None if lo is None else -lo))
    if (lo is None or lo <= 0) and (hi is None or hi >= 0):
        alts.append("0")
    if hi is None or hi > 0:
        alts.append(_positive(max(1, 0 if lo is None else lo), hi))
    return "(" + "|".join(alts) + ")"


def _positive(a: int, b: Optional[int]) -> str:
    """Integers in [a, b] (b None: unbounded), a >= 1."""
    alts = []
    top = len(str(a)) if b is None else len(str(b))
    for length in range(len(str(a)), top + 1):
        lo = max(a, 10 ** (length - 1))
        hi = 10 ** length - 1 if b is None else min(b, 10 ** length - 1)
        if lo <= hi:
            alts.append(_same_length(str(lo), str(hi)))
    if b is None:
        alts.append(f"[1-9][0-9]{{{len(str(a))},}}")
    return "(" + "|".join(alts) + ")"


def _digit(lo: str, hi: str) -> str:
    return lo if lo == hi else f"[{lo}-{hi}]"


def _same_length(lo: str, hi: str) -> str:
    """Digit strings of one length in [lo, hi] (lo <= hi)."""
    if len(lo) == 1:
        return _digit(lo, hi)
    rest = len(lo) - 1
    if lo[0] == hi[0]:
        return lo[0] + _same_length(lo[1:], hi[1:])
    if lo[1:] == "0" * rest and hi[1:] == "9" * rest:
        return f"{_digit(lo[0], hi[0])}[0-9]{{{rest}}}"
    alts = []
    first, last = int(lo[0]), int(hi[0])
    if lo[1:] != "0" * rest:
        alts.append(lo[0] + _same_length(lo[1:], "9" * rest))
        first += 1
    if hi[1:] != "9" * rest:
        tail = hi[0] + _same_length("0" * rest, hi[1:])
        last -= 1
    else:
        tail = None
    if first <= last:
        alts.append(f"{_digit(str(first), str(last))}[0-9]{{{rest}}}")
    if tail is not None:
        alts.append(tail)
    return "(" + "|".join(alts) + ")"
