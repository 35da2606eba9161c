"""outlines-core `Index` -> host numpy tables (`CompiledIndex`), with a bounded LRU cache.

A `CompiledIndex` is one constraint's token-level automaton over a `TokenVocab`:

    states are renumbered 0..S-1 in BFS order from the initial state (initial = 0);
    accepting:  bool[S]   the output may end here (EOS allowed, SPEC §5 grammar acceptance)
    indptr:     int32[S+1], tokens: int32[E] (sorted within a state), targets: int32[E]
                the CSR transition list: state s on token tokens[k] goes to targets[k],
                k in [indptr[s], indptr[s+1]). EOS is never an edge (outlines-core's EOS
                self-loops on final states are dropped; `tables.py` adds EOS from `accepting`).

outlines-core refuses patterns with a state the vocabulary cannot leave (its Index build fails);
we turn that, and a pattern that does not parse, into `ValueError("response_format: ...")`.
A non-accepting state with no edge (which outlines-core should never produce) is also rejected,
so every dead end at run time comes from other masks (banned ids, min_tokens), SPEC P2.

Cache: keyed by (regex, vocab hash), LRU-bounded by entry count and table bytes; every entry
records its compile time (`CompiledIndex.compile_seconds`); `cache_info()` reports hits,
misses, entries and total compile seconds.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from typing import Optional

import numpy as np

from jaxdecode.constraints.formats import fail, regex_for, validate_response_format
from jaxdecode.constraints.vocab import TokenVocab


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

    def next_state(self, state: int, token: int) -> int:
        """Host reference lookup: the next state, or -1 when the token is not allowed."""
        lo, hi = self.indptr[state], self.indptr[state + 1]
        k = lo + np.searchsorted(self.tokens[lo:hi], token)
        return int(self.targets[k]) if k < hi and self.tokens[k] == token else -1


def _build(regex: str, vocab: TokenVocab) -> CompiledIndex:
    from outlines_core import Index

    t0 = time.perf_counter()
    try:
        index = Index(regex, vocab.outlines())
    except Exception as exc:  # outlines-core raises ValueError for both failures
        msg = str(exc)
        if "incompatible" in msg:
            fail(f"the pattern cannot be matched with this tokenizer's vocabulary ({msg})")
        fail(f"outlines-core cannot compile the pattern {regex[:200]!r}: {msg}")
    transitions = index.get_transitions()
    finals = set(index.get_final_states())
    initial = index.get_initial_state()
    eos = vocab.outlines_eos
    order = [initial]
    number = {initial: 0}
    edges: list = []
    for src in order:  # BFS; `order` grows while we walk it
        out = sorted((tok, dst) for tok, dst in transitions.get(src, {}).items() if tok != eos)
        for _, dst in out:
            if dst not in number:
                number[dst] = len(order)
                order.append(dst)
        edges.append(out)
    s = len(order)
    indptr = np.zeros(s + 1, np.int64)
    indptr[1:] = np.cumsum([len(e) for e in edges])
    tokens = np.fromiter((t for e in edges for t, _ in e), np.int32, count=int(indptr[-1]))
    targets = np.fromiter((number[d] for e in edges for _, d in e), np.int32,
                          count=int(indptr[-1]))
    accepting = np.array([st in finals for st in order], bool)
    dead = ~accepting & (np.diff(indptr) == 0)
    if dead.any():
        fail(f"the pattern has {int(dead.sum())} state(s) that no token of this vocabulary can "
             "leave and that do not accept")
    if indptr[-1] >= 2**31:
        fail("the automaton is too large (over 2**31 transitions)")
    return CompiledIndex(key=(regex, vocab.hash), regex=regex, vocab_size=vocab.size,
                         accepting=accepting, indptr=indptr.astype(np.int32), tokens=tokens,
                         targets=targets, outlines_states=np.array(order, np.int64),
                         compile_seconds=time.perf_counter() - t0)


class IndexCache:
    """LRU of CompiledIndex keyed by (regex, vocab hash), bounded by entries and bytes."""

    def __init__(self, max_entries: int = 64, max_bytes: int = 1 << 30):
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self._entries: "collections.OrderedDict[tuple, CompiledIndex]" = collections.OrderedDict()
        self._lock = threading.Lock()
        self.hits = self.misses = 0
        self.compile_seconds = 0.0

    def get(self, regex: str, vocab: TokenVocab) -> CompiledIndex:
        key = (regex, vocab.hash)
        with self._lock:
            hit = self._entries.get(key)
            if hit is not None:
                self._entries.move_to_end(key)
                self.hits += 1
                return hit
            self.misses += 1
        compiled = _build(regex, vocab)  # outside the lock: compiles may run concurrently
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


def compile_regex(regex: str, vocab: TokenVocab, cache: Optional[IndexCache] = None) -> CompiledIndex:
    return (cache or CACHE).get(regex, vocab)


def compile_format(response_format: dict, vocab: TokenVocab,
                   cache: Optional[IndexCache] = None) -> Optional[CompiledIndex]:
    """Validate + translate + compile (cached). None for an unconstrained format."""
    rf = validate_response_format(response_format)
    if rf is None:
        return None
    return compile_regex(regex_for(rf), vocab, cache)


def cache_info() -> dict:
    return CACHE.info()
