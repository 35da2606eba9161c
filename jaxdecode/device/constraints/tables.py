"""Device tables for the constraints of one batch, and the lookups the jitted step runs.

`build_tables(compiled, vocab_size)` concatenates several `CompiledIndex`es into one
`GrammarTables` (constraint c's state i becomes global state offsets[c] + i) and pads the state
and edge counts to powers of two (>= 16), so a new set of constraints of similar size reuses the
compiled step. A row's grammar state is that global int32, or -1 for an unconstrained row.

    allowed:   uint32[S, ceil(V/32)]  bit-packed allowed tokens (EOS never set)
    accepting: bool[S]                EOS is allowed exactly here (for rows whose EOS ends them)
    has_next:  bool[S]                some token continues; accepting & ~has_next = complete
    next-state lookup, one of:
      dense:   int32[S, V]            next[s, t], -1 when t is not allowed   (S*V <= dense_max)
      CSR:     indptr int32[S+1], tokens int32[E] (sorted per state), targets int32[E]
               found by a fixed-iteration binary search inside [indptr[s], indptr[s+1])

Padding states have no edges and do not accept; no row ever reaches one.

Costs: `mask_logits` and `next_state` sit behind `lax.cond(any row constrained)`, so a batch
whose rows are all unconstrained skips them (under `vmap`, e.g. beams, the cond becomes a
select and both branches run). A batch with no constraint at all carries no tables
(`StepState.grammar is None`) and traces exactly the unconstrained step.
"""

from __future__ import annotations

import collections
import threading
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxdecode.device.constraints.compile import CompiledIndex

Array = jax.Array

DENSE_MAX_ENTRIES = 1 << 22  # 16 MiB of int32: above it the next-state table is CSR
MIN_STATES = 16
DEAD = -2  # next state of a constrained row on a token its grammar does not allow


def bucket(n: int, minimum: int = MIN_STATES) -> int:
    return max(minimum, 1 << max(0, int(n) - 1).bit_length())


@struct.dataclass
class GrammarTables:
    allowed: Array
    accepting: Array
    has_next: Array
    dense_next: Optional[Array] = None
    indptr: Optional[Array] = None
    tokens: Optional[Array] = None
    targets: Optional[Array] = None
    vocab_size: int = struct.field(pytree_node=False, default=0)

    @property
    def num_states(self) -> int:
        return self.accepting.shape[0]

    @property
    def dense(self) -> bool:
        return self.dense_next is not None


class TableBundle:
    """Host record of one `build_tables` result: the device tables plus where each constraint
    starts. `initial_state(compiled)` is the global state a new row of that constraint starts
    in. Constraints passed in a stable order with new ones appended keep their offsets."""

    def __init__(self, tables: GrammarTables, offsets: dict, num_states: int, num_edges: int):
        self.tables, self.offsets = tables, offsets
        self.num_states, self.num_edges = num_states, num_edges

    def initial_state(self, compiled: Optional[CompiledIndex]) -> int:
        return -1 if compiled is None else self.offsets[compiled.key]


def _build(unique: Sequence[CompiledIndex], vocab_size: int, dense_max_entries: int) -> TableBundle:
    offsets, s_total, e_total = {}, 0, 0
    for c in unique:
        offsets[c.key] = s_total
        s_total += c.num_states
        e_total += c.num_edges
    s_b, e_b = bucket(s_total), bucket(e_total)
    words = (vocab_size + 31) // 32
    allowed = np.zeros((s_b, words), np.uint32)
    accepting = np.zeros(s_b, bool)
    has_next = np.zeros(s_b, bool)
    indptr = np.full(s_b + 1, 0, np.int32)
    tokens = np.full(e_b, np.iinfo(np.int32).max, np.int32)
    targets = np.full(e_b, -1, np.int32)
    e_at = 0
    for c in unique:
        o, n = offsets[c.key], c.num_states
        if c.vocab_size > vocab_size and (c.tokens >= vocab_size).any():
            raise ValueError(f"response_format: compiled over {c.vocab_size} tokens, model has "
                             f"{vocab_size}")
        allowed[o:o + n] = c.packed_mask(vocab_size)
        accepting[o:o + n] = c.accepting
        has_next[o:o + n] = c.has_next
        indptr[o:o + n + 1] = c.indptr + e_at
        tokens[e_at:e_at + c.num_edges] = c.tokens
        targets[e_at:e_at + c.num_edges] = c.targets + o
        e_at += c.num_edges
    indptr[s_total:] = e_at
    if s_b * vocab_size <= dense_max_entries:
        dense = np.full((s_b, vocab_size), -1, np.int32)
        rows = np.repeat(np.arange(s_b), np.diff(indptr))
        dense[rows, tokens[:e_at]] = targets[:e_at]
        tables = GrammarTables(allowed=jnp.asarray(allowed), accepting=jnp.asarray(accepting),
                               has_next=jnp.asarray(has_next), dense_next=jnp.asarray(dense),
                               vocab_size=vocab_size)
    else:
        tables = GrammarTables(allowed=jnp.asarray(allowed), accepting=jnp.asarray(accepting),
                               has_next=jnp.asarray(has_next), indptr=jnp.asarray(indptr),
                               tokens=jnp.asarray(tokens), targets=jnp.asarray(targets),
                               vocab_size=vocab_size)
    return TableBundle(tables, offsets, s_total, e_total)


_bundles: "collections.OrderedDict[tuple, TableBundle]" = collections.OrderedDict()
_bundles_lock = threading.Lock()
BUNDLE_CACHE_SIZE = 8


def build_tables(compiled: Sequence[Optional[CompiledIndex]], vocab_size: int,
                 dense_max_entries: int = DENSE_MAX_ENTRIES) -> TableBundle:
    """One table set for every distinct constraint in `compiled` (None entries are skipped).
    Results are cached (small LRU) by the constraints' keys, so repeated batches reuse the
    device arrays."""
    unique: dict = {}
    for c in compiled:
        if c is not None:
            unique.setdefault(c.key, c)
    key = (tuple(unique), int(vocab_size), int(dense_max_entries))
    with _bundles_lock:
        if key in _bundles:
            _bundles.move_to_end(key)
            return _bundles[key]
    bundle = _build(list(unique.values()), int(vocab_size), int(dense_max_entries))
    with _bundles_lock:
        _bundles[key] = bundle
        while len(_bundles) > BUNDLE_CACHE_SIZE:
            _bundles.popitem(last=False)
    return bundle


# -- device lookups (run inside the jitted step) -----------------------------------------------

def allowed_tokens(tables: GrammarTables, state: Array, eos_mask: Array) -> Array:
    """bool[B, V]: tokens the grammar allows each row (all True for unconstrained rows).

    eos_mask bool[B, V] marks ids that end the row with `eos` (RowParams.eos_mask: empty when the
    row ignores EOS); they are allowed exactly in accepting states."""
    v = eos_mask.shape[-1]
    s = jnp.maximum(state, 0)
    words = tables.allowed[s]                                   # [B, W]
    shifts = jnp.arange(32, dtype=jnp.uint32)
    bits = (words[:, :, None] >> shifts) & jnp.uint32(1)        # [B, W, 32]
    allowed = bits.reshape(state.shape[0], -1)[:, :v].astype(bool)
    allowed = allowed | (tables.accepting[s][:, None] & eos_mask)
    return jnp.where((state >= 0)[:, None], allowed, True)


def mask_logits(logits: Array, tables: GrammarTables, state: Array, eos_mask: Array) -> Array:
    """contract §3 step 2 (grammar mask): -inf where a constrained row's grammar forbids a token."""

    def masked(x):
        return jnp.where(allowed_tokens(tables, state, eos_mask), x, -jnp.inf)

    return jax.lax.cond(jnp.any(state >= 0), masked, lambda x: x, logits)


def _lookup_dense(tables: GrammarTables, s: Array, token: Array) -> Array:
    t = jnp.clip(token, 0, tables.dense_next.shape[1] - 1)
    hit = tables.dense_next[s, t]
    return jnp.where((token >= 0) & (token < tables.dense_next.shape[1]), hit, -1)


def _lookup_csr(tables: GrammarTables, s: Array, token: Array) -> Array:
    e = tables.tokens.shape[0]
    lo, end = tables.indptr[s], tables.indptr[s + 1]

    def body(_, carry):  # lower_bound of `token` in tokens[lo:hi]
        lo, hi = carry
        active = lo < hi
        mid = (lo + hi) // 2
        right = tables.tokens[jnp.clip(mid, 0, e - 1)] < token
        return (jnp.where(active & right, mid + 1, lo), jnp.where(active & ~right, mid, hi))

    lo, _ = jax.lax.fori_loop(0, max(1, e.bit_length()) + 1, body, (lo, end))
    k = jnp.clip(lo, 0, e - 1)
    found = (lo < end) & (tables.tokens[k] == token)
    return jnp.where(found, tables.targets[k], -1)


def lookup(tables: GrammarTables, state: Array, token: Array) -> Array:
    """int32[B]: the next global state for (state, token), -1 when the edge does not exist."""
    s = jnp.maximum(state, 0)
    return (_lookup_dense if tables.dense else _lookup_csr)(tables, s, token)


def next_state(tables: GrammarTables, state: Array, token: Array) -> Array:
    """Grammar state after selecting `token`: -1 stays -1 (unconstrained); a constrained row
    on a token its grammar has no edge for (EOS, or a token of a failed step) gets DEAD."""

    def advance(_):
        found = lookup(tables, state, token)
        return jnp.where(state < 0, -1, jnp.where(found < 0, DEAD, found)).astype(jnp.int32)

    return jax.lax.cond(jnp.any(state >= 0), advance, lambda _: state, None)


def completes(tables: GrammarTables, state: Array) -> Array:
    """bool[B]: the state accepts and nothing can follow (the row ends: grammar_complete)."""
    s = jnp.maximum(state, 0)
    return (state >= 0) & tables.accepting[s] & ~tables.has_next[s]


def state_path(tables: GrammarTables, state: Array, tokens: Array) -> Array:
    """int32[B, k+1]: the grammar states before and after each of k proposed tokens
    (tokens int32[B, k]), for speculative verification: position i is masked with path[:, i],
    and a rejection at i rolls the row back to path[:, i]. DEAD after a disallowed token."""

    def body(s, t):
        n = jnp.where(s < 0, s, jnp.where(lookup(tables, s, t) < 0, DEAD, lookup(tables, s, t)))
        n = jnp.where(state < 0, -1, n).astype(jnp.int32)
        return n, n

    _, rest = jax.lax.scan(body, state, tokens.T)
    return jnp.concatenate([state[:, None], rest.T], axis=1)
