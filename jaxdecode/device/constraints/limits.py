"""Bounds on the work one constraint may cause, checked before anything is compiled.

(The shape limits -- nesting depth and size of a response_format -- are `formats.py`'s.)

- `pattern_size(regex)`: an upper estimate of the automaton states a regex needs, from one scan
  of its text: counted repetitions multiply (`a{1000}` needs 1000 states, `(ab){3}` 6,
  `(a{10}){10}` 100), alternatives and sequences add, `*` / `+` / `?` add nothing (a loop
  reuses its states). `check_pattern` rejects a regex longer than `MAX_PATTERN_CHARS` or whose
  estimate exceeds the state cap before outlines-core sees it, so `a{2147483648}` or a
  `maxLength` of 100000 is refused at once instead of growing the process for minutes. The
  estimate is a bound on the NFA; determinisation can still cost more (outlines-core's time grows
  exponentially with some bounded repetitions of multi-byte classes), which the compile
  budget's deadline and memory limit catch (`worker.py`).

Every refusal is `ValueError("response_format: ...")`.
"""

from __future__ import annotations

import re

from jaxdecode.response_format import fail

MAX_STATES = 20_000          # the default automaton state cap (CompileBudget.max_states)
MAX_PATTERN_CHARS = 1 << 18  # characters of the regex handed to outlines-core
_COUNTED = re.compile(r"\{(\d*)(,?)(\d*)\}")


def check_pattern(regex: str, max_states: int) -> None:
    """Refuse a regex that is too long or whose `pattern_size` exceeds `max_states`."""
    if len(regex) > MAX_PATTERN_CHARS:
        fail(f"the pattern has {len(regex)} characters; at most {MAX_PATTERN_CHARS} are "
             "compiled")
    size = pattern_size(regex, stop_above=max_states)
    if size > max_states:
        fail(f"the pattern needs more than {max_states} automaton states (counted "
             "repetitions such as a{n}, maxLength, minItems or maxItems multiply); lower the "
             "counts")


def pattern_size(regex: str, stop_above: int = 1 << 62) -> int:
    """The state estimate of the module docstring; stops early (returning a value above
    `stop_above`) once the estimate passes it."""
    stack = [[0, 0, 0]]  # per open group: alternatives so far, current sequence, last atom
    i, n = 0, len(regex)
    while i < n:
        c, frame, atom = regex[i], stack[-1], 0
        if c == "\\":
            i, atom = _skip_escape(regex, i), 1
        elif c == "[":
            i, atom = _skip_class(regex, i), 1
        elif c == "(":
            i += 1
            if regex.startswith("?", i):  # (?:...), (?P<name>...), (?<name>...), (?flags)
                j = i + 1
                while j < n and regex[j] not in ":)>":
                    j += 1
                i = j + 1
                if j < n and regex[j] == ")":
                    continue  # flags only: no group
            stack.append([0, 0, 0])
            continue
        elif c == ")" and len(stack) > 1:
            done = stack.pop()
            i, atom = i + 1, done[0] + done[1]
            frame = stack[-1]
        elif c == "|":
            frame[0], frame[1], frame[2] = frame[0] + frame[1], 0, 0
            i += 1
            continue
        elif c in "*+?":
            i += 1
            continue
        elif c == "{" and (m := _COUNTED.match(regex, i)) and (m.group(1) or m.group(3)):
            factor = _count(m.group(1), m.group(2), m.group(3))
            frame[1] += frame[2] * (factor - 1)
            frame[2] *= factor
            if frame[1] > stop_above:
                return stop_above + 1
            i = m.end()
            continue
        else:
            i, atom = i + 1, 1
        frame[1] += atom
        frame[2] = atom
    return sum(f[0] + f[1] for f in stack)


def _count(low: str, comma: str, high: str) -> int:
    """The largest count a repetition {low}, {low,} or {low,high} spells (at least 1)."""
    if len(low) > 18 or len(high) > 18:
        return 1 << 62
    lo = int(low or 0)
    hi = int(high) if high else (lo + 1 if comma else lo)
    return max(lo, hi, 1)


def _skip_escape(regex: str, i: int) -> int:
    """The index after the escape starting at regex[i] == '\\'."""
    nxt = regex[i + 1:i + 2]
    if nxt in ("x", "u", "U", "p", "P") and regex.startswith("{", i + 2):
        end = regex.find("}", i + 3)
        return len(regex) if end < 0 else end + 1
    if nxt == "x":
        return i + 4
    if nxt in ("p", "P"):
        return i + 3
    return i + 2


def _skip_class(regex: str, i: int) -> int:
    """The index after the character class starting at regex[i] == '[' (classes nest)."""
    j, n, depth = i + 1, len(regex), 1
    if regex.startswith("^", j):
        j += 1
    if regex.startswith("]", j):  # a leading ] is literal
        j += 1
    while j < n:
        c = regex[j]
        if c == "\\":
            j = _skip_escape(regex, j)
            continue
        if c == "[":
            depth += 1
        elif c == "]":
            depth -= 1
            if depth == 0:
                return j + 1
        j += 1
    return n
