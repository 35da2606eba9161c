"""Text-level and id-level stop matching (contract §5: S1-S7).

`StopMatcher` watches the detokenized text, `StopSequenceMatcher` the selected id stream.
Both run one Aho-Corasick automaton (full transition table, built once per matcher) over
their symbols -- characters or token ids -- so a push costs one dict lookup per symbol.
(Matching complete characters is equivalent to matching their UTF-8 bytes, because the
detokenizer only releases complete characters.)

Rules
-----
- S1: the automaton state carries over pushes, so a stop may span any number of tokens.
- S2: minimal hold-back -- the held text is exactly the longest suffix of the output that is
  still a prefix of some stop (the depth of the automaton state); everything before it is
  released. With no stop that can still match, nothing is held; an empty stop list costs
  nothing.
- S3: the first hit is absorbing: the matched text and everything after it are never released,
  and every later push returns nothing (``StopResult("", None)``; the first hit stays in
  ``matcher.hit``). With ``include_in_output`` the stop itself is released, nothing after it.
- S5 (tie rule, version ``STOP_RULE_VERSION = "v1"``): the hit that ends earliest wins; at the
  same end the longest; then the first in the request's list. Symbols are scanned left to
  right and the scan stops at the first position where any stop ends, so no text that could
  belong to an earlier-ending match is ever released.
- S7: ``StopHit.index`` is the position in the request's list; for duplicates the first wins.

``flush()`` releases the held text when the request ends for another reason; it also ends the
matcher (a later push returns nothing), because the held text is then final.
"""

from __future__ import annotations

import functools
from collections import deque
from typing import Dict, Hashable, List, NamedTuple, Optional, Sequence, Tuple, Union

__all__ = [
    "STOP_RULE_VERSION",
    "StopHit",
    "StopResult",
    "StopMatcher",
    "StopSequenceMatcher",
    "IdStopResult",
]

STOP_RULE_VERSION = "v1"  # earliest end, then longest, then list order (contract S5)


class StopHit(NamedTuple):
    """The stop that ended the output: the stop string (or id tuple) and its list index (S7)."""

    stop: Union[str, Tuple[int, ...]]
    index: int


class StopResult(NamedTuple):
    """What a `StopMatcher.push` releases: text safe to show, and the hit if one completed."""

    safe: str
    hit: Optional[StopHit]


class IdStopResult(NamedTuple):
    """What a `StopSequenceMatcher.push` releases: ids safe to detokenize, and the hit."""

    safe: Tuple[int, ...]
    hit: Optional[StopHit]


class _Automaton:
    """Aho-Corasick over arbitrary hashable symbols with a lazily completed transition table.

    ``trans[state]`` starts as the trie edges and memoises every resolved (state, symbol) pair
    of the pattern alphabet, so the hot loop is one dict lookup per symbol; a symbol outside
    the alphabet always leads to the root (state 0). ``depth[state]`` is the length of the
    longest suffix of the input that is a prefix of some pattern; ``best[state]`` is
    ``(length, index, pattern)`` of the longest pattern ending here (smallest index among equal
    patterns), or None. Automata are immutable apart from the memo and are shared between
    requests with the same patterns (`_automaton`).
    """

    __slots__ = ("goto", "fail", "trans", "depth", "best", "alphabet")

    def __init__(self, patterns: Sequence[Sequence[Hashable]]):
        goto: List[Dict[Hashable, int]] = [{}]
        depth = [0]
        own: List[Optional[Tuple[int, int, object]]] = [None]
        for index, pat in enumerate(patterns):
            s = 0
            for sym in pat:
                nxt = goto[s].get(sym)
                if nxt is None:
                    nxt = len(goto)
                    goto[s][sym] = nxt
                    goto.append({})
                    depth.append(depth[s] + 1)
                    own.append(None)
                s = nxt
            if own[s] is None:  # duplicates: the first index wins (S7)
                own[s] = (len(pat), index, pat)
        n = len(goto)
        fail = [0] * n
        best: List[Optional[Tuple[int, int, object]]] = list(own)
        queue = deque(goto[0].values())
        while queue:
            s = queue.popleft()
            if own[s] is None:
                best[s] = best[fail[s]]
            for sym, child in goto[s].items():
                if s != 0:
                    f = fail[s]
                    while f and sym not in goto[f]:
                        f = fail[f]
                    fail[child] = goto[f].get(sym, 0)
                queue.append(child)
        self.goto = goto
        self.fail = fail
        self.trans: List[Dict[Hashable, int]] = [dict(g) for g in goto]
        self.depth = depth
        self.best = best
        self.alphabet = frozenset(sym for g in goto for sym in g)

    def step(self, state: int, sym: Hashable) -> int:
        """Transition on a memo miss."""
        if sym not in self.alphabet:
            return 0
        goto, fail = self.goto, self.fail
        s = state
        while s and sym not in goto[s]:
            s = fail[s]
        nxt = goto[s].get(sym, 0)
        self.trans[state][sym] = nxt
        return nxt


@functools.lru_cache(maxsize=256)
def _automaton(patterns: Tuple[Tuple[Hashable, ...], ...]) -> _Automaton:
    return _Automaton(patterns)


class StopMatcher:
    """Stop strings over the detokenized text with minimal hold-back (contract S1-S7).

    ``push(text) -> StopResult(safe, hit)``; ``flush() -> str`` at a non-stop ending;
    ``discard()`` at a cancel. ``held`` is the text currently held back; ``hit_span`` the
    absolute character offsets ``(start, end)`` of the match in all text pushed.
    """

    __slots__ = (
        "stops",
        "include_in_output",
        "_auto",
        "_trans",
        "_best",
        "_depth",
        "_state",
        "_held",
        "_pos",
        "_done",
        "_hit",
        "_hit_span",
        "_empty",
    )

    def __init__(self, stops: Sequence[str] = (), include_in_output: bool = False):
        if isinstance(stops, str):
            stops = (stops,)
        stops = tuple(stops)
        for s in stops:
            if not isinstance(s, str):
                raise TypeError(f"stop strings must be str, got {type(s).__name__}")
            if not s:
                raise ValueError("stop strings must not be empty")
        self.stops = stops
        self.include_in_output = bool(include_in_output)
        self._empty = not stops
        self._auto = _automaton(stops) if stops else None
        self._trans = self._auto.trans if stops else None
        self._best = self._auto.best if stops else None
        self._depth = self._auto.depth if stops else None
        self._state = 0
        self._held = ""
        self._pos = 0
        self._done = False
        self._hit: Optional[StopHit] = None
        self._hit_span: Optional[Tuple[int, int]] = None

    @property
    def held(self) -> str:
        return self._held

    @property
    def hit(self) -> Optional[StopHit]:
        return self._hit

    @property
    def hit_span(self) -> Optional[Tuple[int, int]]:
        return self._hit_span

    @property
    def done(self) -> bool:
        return self._done

    @property
    def consumed(self) -> int:
        """Characters pushed so far (up to the end of the hit, after a hit)."""
        return self._pos

    def push(self, text: str) -> StopResult:
        if self._done:
            return StopResult("", None)
        if self._empty:
            self._pos += len(text)
            return StopResult(text, None)
        if not text:
            return StopResult("", None)
        trans = self._trans
        best = self._best
        state = self._state
        i = 0
        step = self._auto.step
        for ch in text:
            nxt = trans[state].get(ch)
            state = step(state, ch) if nxt is None else nxt
            if best[state] is not None:
                return self._on_hit(text, i, state)
            i += 1
        self._state = state
        d = self._depth[state]
        held = self._held
        self._pos += len(text)
        if d == 0:
            self._held = ""
            return StopResult(held + text if held else text, None)
        if d <= len(text):
            self._held = text[len(text) - d :]
            return StopResult(held + text[: len(text) - d], None)
        combined = held + text
        self._held = combined[len(combined) - d :]
        return StopResult(combined[: len(combined) - d], None)

    def _on_hit(self, text: str, i: int, state: int) -> StopResult:
        length, index, stop = self._best[state]
        combined = self._held + text[: i + 1]
        start = len(combined) - length
        safe = combined[:start]
        if self.include_in_output:
            safe += stop
        base = self._pos - len(self._held)
        self._hit = StopHit(stop, index)
        self._hit_span = (base + start, base + start + length)
        self._pos += i + 1
        self._held = ""
        self._state = 0
        self._done = True
        return StopResult(safe, self._hit)

    def flush(self) -> str:
        """Release the held text (non-stop ending) and end the matcher."""
        if self._done:
            return ""
        out = self._held
        self._held = ""
        self._state = 0
        self._done = True
        return out

    def discard(self) -> None:
        """Drop the held text (cancel) and end the matcher."""
        self._held = ""
        self._state = 0
        self._done = True

    def __repr__(self) -> str:
        return f"StopMatcher({list(self.stops)!r}, include_in_output={self.include_in_output})"


def _as_id_tuple(entry: Union[int, Sequence[int]]) -> Tuple[int, ...]:
    if isinstance(entry, int) or hasattr(entry, "__index__"):
        return (int(entry),)
    seq = tuple(int(x) for x in entry)
    if not seq:
        raise ValueError("stop token sequences must not be empty")
    return seq


class StopSequenceMatcher:
    """Stop token-id sequences on the selected id stream (contract S8), with minimal hold-back.

    ``sequences``: single ids or tuples of ids. ``push(token_id) -> IdStopResult(safe, hit)``
    where ``safe`` are the ids that can no longer be part of a match (pass them on to the
    detokenizer, in order) and ``hit.stop`` is the matched id tuple. On a hit the matched ids are
    dropped (or, with ``include_in_output``, released with the ids before them). ``flush()``
    releases the held ids at a non-stop ending. Same tie rule as `StopMatcher` (S5, S7).
    """

    __slots__ = ("sequences", "include_in_output", "_auto", "_trans", "_best", "_depth", "_state",
                 "_held", "_done", "_hit", "_empty")

    def __init__(self, sequences: Sequence[Union[int, Sequence[int]]] = (),
                 include_in_output: bool = False):
        seqs = tuple(_as_id_tuple(s) for s in sequences)
        self.sequences = seqs
        self.include_in_output = bool(include_in_output)
        self._empty = not seqs
        auto = _automaton(seqs) if seqs else None
        self._auto = auto
        self._trans = auto.trans if auto else None
        self._best = auto.best if auto else None
        self._depth = auto.depth if auto else None
        self._state = 0
        self._held: Tuple[int, ...] = ()
        self._done = False
        self._hit: Optional[StopHit] = None

    @property
    def held(self) -> Tuple[int, ...]:
        return self._held

    @property
    def hit(self) -> Optional[StopHit]:
        return self._hit

    @property
    def done(self) -> bool:
        return self._done

    def push(self, token_id: int) -> IdStopResult:
        if self._done:
            return IdStopResult((), None)
        if self._empty:
            return IdStopResult((token_id,), None)
        token_id = int(token_id)
        state = self._trans[self._state].get(token_id)
        if state is None:
            state = self._auto.step(self._state, token_id)
        held = self._held + (token_id,)
        best = self._best[state]
        if best is not None:
            length, index, seq = best
            safe = held if self.include_in_output else held[: len(held) - length]
            self._hit = StopHit(seq, index)
            self._held = ()
            self._state = 0
            self._done = True
            return IdStopResult(safe, self._hit)
        self._state = state
        d = self._depth[state]
        self._held = held[len(held) - d :] if d else ()
        return IdStopResult(held[: len(held) - d], None)

    def flush(self) -> Tuple[int, ...]:
        if self._done:
            return ()
        out = self._held
        self._held = ()
        self._state = 0
        self._done = True
        return out

    def discard(self) -> None:
        self._held = ()
        self._state = 0
        self._done = True
