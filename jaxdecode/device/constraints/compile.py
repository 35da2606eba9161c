"""outlines-core `Index` -> host numpy tables (`CompiledIndex`), with a bounded LRU cache.

A `CompiledIndex` is one constraint's token-level automaton over a `TokenVocab`:

    states are renumbered 0..S-1 in BFS order from the initial state (initial = 0);
    accepting:  bool[S]   the output may end here (EOS allowed, contract §5 grammar acceptance)
    indptr:     int32[S+1], tokens: int32[E] (sorted within a state), targets: int32[E]
                the CSR transition list: state s on token tokens[k] goes to targets[k],
                k in [indptr[s], indptr[s+1]). EOS is never an edge (outlines-core's EOS
                self-loops on final states are dropped; `tables.py` adds EOS from `accepting`).

outlines-core refuses patterns with a state the vocabulary cannot leave (its Index build fails);
we turn that, and a pattern that does not parse, into `ValueError("response_format: ...")`.
A non-accepting state with no edge (which outlines-core should never produce) is also rejected,
so every dead end at run time comes from other masks (banned ids, min_tokens), contract P2.

Bounded work: every compile first passes `limits.check_pattern` (length and an automaton-size
estimate against the state cap). With a `CompileBudget` (the engine always gives one) the Index
is built in a worker process within its time, memory and state limits (worker.py); without one
(`jd.generate` and the other research calls) it is built in the calling thread under the
default state cap `limits.MAX_STATES`.

Cache: keyed by (regex, vocab hash), LRU-bounded by entry count and table bytes; every entry
records its compile time (`CompiledIndex.compile_seconds`); `cache_info()` reports hits,
misses, entries and total compile seconds.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from typing import Callable, Optional

import numpy as np

from jaxdecode.device.constraints import limits
from jaxdecode.response_format import fail, regex_for, validate_response_format
from jaxdecode.device.constraints.index_worker import end_marked, index_tables
from jaxdecode.device.constraints.vocab import TokenVocab
from jaxdecode.device.constraints.worker import CompileBudget, compile_in_worker


@dataclasses.dataclass(frozen=True, eq=False)
class CompiledIndex:
    key: tuple            # (regex, vocab hash)
    regex: str
    vocab_size: int
    accepting: np.ndarray  # bool[S]
    indptr: np.ndarray     # int32[S+1]
    tokens: np.ndarray     # int32[E]
    targets: np.ndarray    # int32[E]
    outlines_states: np.ndarray  # int64[S]: our state i is outlines-core's state outlines_states[i]
    compile_seconds: float

    @property
    def num_states(self) -> int:
        return int(self.accepting.shape[0])

    @property
    def num_edges(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def has_next(self) -> np.ndarray:
        """bool[S]: some (non-EOS) token continues from the state."""
        return np.diff(self.indptr) > 0

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.accepting, self.indptr, self.tokens, self.targets,
                                      self.outlines_states))

    def packed_mask(self, vocab_size: Optional[int] = None) -> np.ndarray:
        """uint32[S, ceil(V/32)]: bit (t % 32) of word t // 32 is set when token t is allowed
        (EOS excluded). V defaults to the vocabulary's size."""
        v = self.vocab_size if vocab_size is None else vocab_size
        words = (v + 31) // 32
        out = np.zeros((self.num_states, words), np.uint32)
        rows = np.repeat(np.arange(self.num_states), np.diff(self.indptr))
        keep = self.tokens < v
        np.bitwise_or.at(out, (rows[keep], self.tokens[keep] // 32),
                         np.left_shift(np.uint32(1), (self.tokens[keep] % 32).astype(np.uint32)))
        return out

    def walk(self, tokens) -> int:
        """The state after `tokens` from the initial state (-1 once a token is not allowed)."""
        state = 0
        for token in tokens:
            if state < 0:
                break
            state = self.next_state(state, token)
        return state

    def next_state(self, state: int, token: int) -> int:
        """Host reference lookup: the next state, or -1 when the token is not allowed."""
        lo, hi = self.indptr[state], self.indptr[state + 1]
        k = lo + np.searchsorted(self.tokens[lo:hi], token)
        return int(self.targets[k]) if k < hi and self.tokens[k] == token else -1


def _build(regex: str, vocab: TokenVocab, budget: Optional[CompileBudget] = None,
           cancelled: Optional[Callable[[], bool]] = None) -> CompiledIndex:
    """Compile after the cheap pre-checks (`limits.check_pattern`): in a worker process within
    `budget` (worker.py), or -- without one -- here, in this thread, unbounded in time."""
    t0 = time.perf_counter()
    max_states = budget.max_states if budget is not None else limits.MAX_STATES
    limits.check_pattern(regex, max_states)
    if budget is not None:
        tables = compile_in_worker(regex, vocab, budget, cancelled)
    else:
        from outlines_core import Index

        try:
            index = Index(end_marked(regex, vocab.end_char), vocab.outlines())
        except Exception as exc:  # outlines-core raises ValueError for both failures
            msg = str(exc)
            if "incompatible" in msg:
                fail(f"the pattern cannot be matched with this tokenizer's vocabulary ({msg})")
            fail(f"outlines-core cannot compile the pattern {regex[:200]!r}: {msg}")
        try:
            tables = index_tables(index, vocab.outlines_eos, vocab.outlines_end, max_states)
        except ValueError as exc:
            fail(str(exc))
    return CompiledIndex(key=(regex, vocab.hash), regex=regex, vocab_size=vocab.size,
                         compile_seconds=time.perf_counter() - t0, **tables)


class IndexCache:
    """LRU of CompiledIndex keyed by (regex, vocab hash), bounded by entries and bytes."""

    def __init__(self, max_entries: int = 64, max_bytes: int = 1 << 30):
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self._entries: "collections.OrderedDict[tuple, CompiledIndex]" = collections.OrderedDict()
        self._lock = threading.Lock()
        self.hits = self.misses = 0
        self.compile_seconds = 0.0

    def get(self, regex: str, vocab: TokenVocab, budget: Optional[CompileBudget] = None,
            cancelled: Optional[Callable[[], bool]] = None) -> CompiledIndex:
        key = (regex, vocab.hash)
        with self._lock:
            hit = self._entries.get(key)
            if hit is not None:
                self._entries.move_to_end(key)
                self.hits += 1
                return hit
            self.misses += 1
        compiled = _build(regex, vocab, budget, cancelled)  # outside the lock: compiles may run concurrently
        with self._lock:
            self.compile_seconds += compiled.compile_seconds
            self._entries[key] = compiled
            self._entries.move_to_end(key)
            while len(self._entries) > 1 and (
                    len(self._entries) > self.max_entries
                    or sum(e.nbytes for e in self._entries.values()) > self.max_bytes):
                self._entries.popitem(last=False)
        return compiled

    def info(self) -> dict:
        with self._lock:
            return {"entries": len(self._entries), "hits": self.hits, "misses": self.misses,
                    "compile_seconds_total": self.compile_seconds,
                    "bytes": sum(e.nbytes for e in self._entries.values()),
                    "compiled": [{"regex": k[0][:80], "vocab": k[1], "states": e.num_states,
                                  "edges": e.num_edges, "compile_seconds": e.compile_seconds}
                                 for k, e in self._entries.items()]}

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.hits = self.misses = 0
            self.compile_seconds = 0.0


CACHE = IndexCache()


def compile_regex(regex: str, vocab: TokenVocab, cache: Optional[IndexCache] = None,
                  budget: Optional[CompileBudget] = None,
                  cancelled: Optional[Callable[[], bool]] = None) -> CompiledIndex:
    return (cache or CACHE).get(regex, vocab, budget, cancelled)


def compile_format(response_format: dict, vocab: TokenVocab,
                   cache: Optional[IndexCache] = None, budget: Optional[CompileBudget] = None,
                   cancelled: Optional[Callable[[], bool]] = None) -> Optional[CompiledIndex]:
    """Validate + translate + compile (cached). None for an unconstrained format. With a
    `budget`, compiled in a worker process within it (worker.py; `cancelled()` true abandons)."""
    rf = validate_response_format(response_format)
    if rf is None:
        return None
    return compile_regex(regex_for(rf), vocab, cache, budget, cancelled)


def cache_info() -> dict:
    return CACHE.info()
