"""The constraint compiler's child process (`worker.py`), and the Index -> tables renumbering.

Run as a script -- `python -I index_worker.py MEMORY_BYTES` -- it imports only numpy and
outlines-core (never jax or the jaxdecode package), limits its own address space to
MEMORY_BYTES (RLIMIT_AS), and serves requests read from stdin, one at a time, answering on
stdout; each message is a 4-byte big-endian length and a pickle (the parent is the only peer):

    ("vocab", key, size, {token bytes: [ids]})   -> ("ok",)
    ("compile", regex, key, eos, end, max_states) -> ("ok", index_tables(...)) | ("error", text)
                                                    | ("refused", index_tables' reason)

It exits when stdin closes (the parent went away). A compile that needs more memory than the
limit dies (Rust aborts on a failed allocation) or answers a MemoryError; the parent reports
either as over budget, and kills it when its deadline passes.

`index_tables` also serves the in-process path (`compile._build`).
"""

from __future__ import annotations

import pickle
import struct
import sys

import numpy as np


def end_marked(regex: str, end_char: str) -> str:
    """The pattern the Index is built for: `regex`, then the vocabulary's end mark (its own
    token, `TokenVocab.outlines_end`): no state of `regex` is final for outlines-core, so it
    keeps every edge (vocab.py), and the end token's edges say where `regex` may end."""
    return f"(?:{regex}){end_char}"


def index_tables(index, eos: int, end: int, max_states: int) -> dict:
    """An outlines-core Index of an `end_marked` pattern as our tables (compile.py's
    CompiledIndex fields): `accepting` where the end token may follow; the CSR transition list
    without EOS and end edges, and without the edges of real tokens that spell the mark (a
    byte-level vocabulary can); then trimmed to the states from which an accepting one can be
    reached (a dead end is never a state), renumbered 0..S-1 in BFS order from the initial
    state; `outlines_states` (ours -> outlines-core's). ValueError (text without the field name)
    for more than `max_states` states, or when no output of the pattern can be spelled."""
    transitions = index.get_transitions()
    if len(transitions) > max_states:
        raise ValueError(f"the automaton has {len(transitions)} states, more than the limit "
                         f"{max_states}")
    ids = np.array(list(transitions), np.int64)  # outlines-core's states, indexed 0..N-1 here
    rank = np.argsort(ids)
    counts = np.fromiter((len(e) for e in transitions.values()), np.int64, count=len(ids))
    n_edges = int(counts.sum())
    toks = np.fromiter((t for e in transitions.values() for t in e), np.int64, count=n_edges)
    raw = np.fromiter((d for e in transitions.values() for d in e.values()), np.int64,
                      count=n_edges)
    dsts = rank[np.searchsorted(ids, raw, sorter=rank)]
    srcs = np.repeat(np.arange(len(ids)), counts)
    accepting = np.zeros(len(ids), bool)
    accepting[srcs[toks == end]] = True
    finals = set(index.get_final_states())  # reached through the whole end mark only
    marked = np.fromiter((int(i) in finals for i in ids), bool, count=len(ids))
    keep = (toks != eos) & (toks != end) & ~marked[dsts]
    srcs, toks, dsts = srcs[keep], toks[keep], dsts[keep]
    live = _reaching(accepting, srcs, dsts)
    initial = int(rank[np.searchsorted(ids, index.get_initial_state(), sorter=rank)])
    if not live[initial]:
        raise ValueError("the pattern cannot be matched with this tokenizer's vocabulary (no "
                         "output of it can be spelled with its tokens)")
    keep = live[dsts]
    srcs, toks, dsts = srcs[keep], toks[keep], dsts[keep]
    by_src = np.lexsort((toks, srcs))
    srcs, toks, dsts = srcs[by_src], toks[by_src], dsts[by_src]
    starts = np.searchsorted(srcs, np.arange(len(ids) + 1))
    number = np.full(len(ids), -1, np.int64)
    number[initial], order = 0, [initial]
    for src in order:  # BFS; `order` grows while we walk it; new states in token order
        out = dsts[starts[src]:starts[src + 1]]
        # in first-seen order; no np.unique here, nor below: it imports numpy.ma, which the
        # worker's memory limit may not leave room for
        new = list(dict.fromkeys(out[number[out] < 0].tolist()))
        number[new] = np.arange(len(order), len(order) + len(new))
        order.extend(new)
    reached = number[srcs] >= 0
    srcs, toks, dsts = number[srcs[reached]], toks[reached], number[dsts[reached]]
    by_number = np.lexsort((toks, srcs))
    indptr = np.zeros(len(order) + 1, np.int64)
    indptr[1:] = np.cumsum(np.bincount(srcs, minlength=len(order)))
    if indptr[-1] >= 2**31:
        raise ValueError("the automaton is too large (over 2**31 transitions)")
    return {"accepting": accepting[order], "indptr": indptr.astype(np.int32),
            "tokens": toks[by_number].astype(np.int32),
            "targets": dsts[by_number].astype(np.int32), "outlines_states": ids[order]}


def _reaching(accepting: np.ndarray, srcs: np.ndarray, dsts: np.ndarray) -> np.ndarray:
    """bool[N]: the states from which an accepting one can be reached along the edges."""
    live = accepting.copy()
    by_dst = np.argsort(dsts, kind="stable")
    into, starts = srcs[by_dst], np.searchsorted(dsts[by_dst], np.arange(len(live) + 1))
    frontier = list(np.flatnonzero(live))
    while frontier:  # backwards from the accepting states
        dst = frontier.pop()
        came = into[starts[dst]:starts[dst + 1]]
        came = set(came[~live[came]].tolist())
        live[list(came)] = True
        frontier.extend(came)
    return live


def read_message(stream):
    """One message from a binary stream, or None at its end."""
    header = stream.read(4)
    if len(header) < 4:
        return None
    size = struct.unpack(">I", header)[0]
    body = stream.read(size)
    return None if len(body) < size else pickle.loads(body)


def write_message(stream, message) -> None:
    body = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(struct.pack(">I", len(body)) + body)
    stream.flush()


def _serve(memory_bytes: int) -> None:
    import resource

    from outlines_core import Index, Vocabulary

    if memory_bytes > 0:
        resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    vocabs: dict = {}
    inp, out = sys.stdin.buffer, sys.stdout.buffer
    while True:
        msg = read_message(inp)
        if msg is None:
            return
        try:
            if msg[0] == "vocab":
                _, key, size, mapping = msg
                vocabs[key] = Vocabulary(size, mapping)
                reply = ("ok",)
            else:
                _, regex, key, eos, end, max_states = msg
                index = Index(regex, vocabs[key])
                try:
                    reply = ("ok", index_tables(index, eos, end, max_states))
                except ValueError as exc:  # ours: over the state cap, a dead state
                    reply = ("refused", str(exc))
        except MemoryError:
            reply = ("error", "memory")
        except Exception as exc:  # outlines-core's ValueError, ours
            reply = ("error", str(exc))
        write_message(out, reply)


if __name__ == "__main__":
    _serve(int(sys.argv[1]))
