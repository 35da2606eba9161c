"""Row operations on decoding states: the one gather, scatter, stack and branch pick.

A decoding state (`StepState`, the speculative `SpecState`, a `KVCache`) is a pytree whose
leaves are per row: plain arrays with the rows on axis 0, and KV caches whose `k` / `v` have
the rows on axis 1 (`[layers, rows, ...]`). The shared grammar tables (`state.grammar`) are not
per row and pass through untouched. Every move of rows -- parallel samples sharing a prompt,
a lone request padded to two rows, beam reorders, the engine's slot insert, the speculative
branch pick -- goes through `rows_map` below, so the layout rule lives in one place.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxdecode.device import numerics
from jaxdecode.model_api import KVCache, PagedKVCache

Array = jax.Array


def _is_cache(x: Any) -> bool:
    return isinstance(x, (KVCache, PagedKVCache))


def rows_map(fn: Callable[..., Array], *trees: Any) -> Any:
    """`fn(*leaves, axis=row axis)` over the per-row leaves of same-structured states: a
    KVCache's k and v (and int8 scales) at axis 1 and its lengths at axis 0; a PagedKVCache's
    page table and lengths at axis 0 (its page pool belongs to no row: the first tree's is
    kept); every other array at axis 0. The first tree's grammar tables are kept as they are."""
    def leaf(*xs):
        if isinstance(xs[0], PagedKVCache):
            return xs[0].replace(page_table=fn(*(c.page_table for c in xs), axis=0),
                                 lengths=fn(*(c.lengths for c in xs), axis=0))
        if _is_cache(xs[0]):
            fields = {name: fn(*(c.row_fields[name] for c in xs), axis=1)
                      for name in xs[0].row_fields}
            return xs[0].replace(**fields, lengths=fn(*(c.lengths for c in xs), axis=0))
        return fn(*xs, axis=0)

    stripped = [t.replace(grammar=None) if hasattr(t, "grammar") else t for t in trees]
    out = jax.tree.map(leaf, *stripped, is_leaf=_is_cache)
    return out.replace(grammar=trees[0].grammar) if hasattr(trees[0], "grammar") else out


def take_rows(state: Any, index: Any) -> Any:
    """Rows `index` (int32[n]) of a state, gathered."""
    return rows_map(lambda x, axis: jnp.take(x, index, axis=axis), state)


def scatter_rows(state: Any, rows: Any, slots: Array) -> Any:
    """`state` with row i of `rows` written into row slots[i] (an index past the last row drops
    that row: it pads a batch)."""
    def put(big, small, axis):
        index = (slice(None),) * axis + (slots,)
        return big.at[index].set(small.astype(big.dtype), mode="drop")

    return rows_map(put, state, rows)


@numerics.jit
def stack_rows(states: Sequence[Any]) -> Any:
    """The rows of several states as one batch, in order."""
    return rows_map(lambda *xs, axis: jnp.concatenate(xs, axis), *states)


def pick_branch(tree: Any, chosen: Array, axis: Optional[int] = None) -> Any:
    """x[chosen[r]] for every row r of a tree whose leaves carry a leading branch axis before
    their own layout (a KVCache's rows then sit on axis 2 of k and v; a PagedKVCache's pages
    take the branch of the row whose table holds them). `axis`: the rows' axis of every leaf
    (after the branch axis) when it is not the layout's (a tree of no cache)."""
    def pick(x, axis):
        x = jnp.moveaxis(x, axis + 1, 1)
        return jnp.moveaxis(x[chosen, jnp.arange(x.shape[1])], 0, axis)

    def leaf(x):
        if isinstance(x, PagedKVCache):
            table = pick(x.page_table, 0)
            owner = jnp.zeros((x.k.shape[3],), jnp.int32).at[table].set(
                jnp.broadcast_to(chosen[:, None], table.shape))     # page -> its row's branch
            take = lambda pool: jnp.take_along_axis(  # noqa: E731 (pages on axis 3)
                pool, owner.reshape((1, 1, 1, -1) + (1,) * (pool.ndim - 4)), axis=0)[0]
            pools = {name: take(pool) for name, pool in x.pools.items()}
            return x.replace(**pools, page_table=table, lengths=pick(x.lengths, 0))
        if isinstance(x, KVCache):
            return rows_map(pick, x)
        return pick(x, 0)

    if axis is not None:
        return jax.tree.map(lambda x: pick(x, axis), tree)
    return jax.tree.map(leaf, tree, is_leaf=_is_cache)


def pad_rows(state: Any, rows: int, research: Any = None,
             least: int = numerics.MIN_ROWS) -> Any:
    """At least `least` rows (`numerics.min_rows`): a state of fewer rows (a lone request) gets
    copies of its last row marked done, which select and write nothing (batch invariance: no
    program runs a batch of one row). Callers keep only their `rows` first outputs. Not with custom
    processors (`research` with processors): they see exactly the caller's rows, since a
    processor may couple rows (classifier-free guidance pairs them)."""
    if rows >= least or (research is not None and research.processors):
        return state
    index = np.minimum(np.arange(least), rows - 1).astype(np.int32)
    state = take_rows(state, jnp.asarray(index))
    return state.replace(done=state.done | (jnp.arange(least) >= rows))


def shared_tables(fn: Callable) -> Callable:
    """Jit `fn(state, *args, config=...)` with `state` donated -- except its grammar tables
    (`state.grammar`), which other states and the table cache share read-only like the
    params: they enter as a separate argument and come back attached, untouched. Arguments of
    the state's type lose theirs too. `config` (optional) is the static configuration, one
    frozen hashable object. `fn` returns a state or (state, output)."""
    def inner(state, tables, *args, **static):
        out = fn(state.replace(grammar=tables), *args, **static)
        if isinstance(out, tuple):
            return (out[0].replace(grammar=None),) + tuple(out[1:])
        return out.replace(grammar=None)

    jitted = numerics.jit(inner, donate_argnums=(0,), static_argnames=("config",))

    @functools.wraps(fn)
    def call(state, *args, **static):
        tables = state.grammar
        args = [a.replace(grammar=None) if isinstance(a, type(state)) else a for a in args]
        out = jitted(state.replace(grammar=None), tables, *args, **static)
        if isinstance(out, tuple):
            return (out[0].replace(grammar=tables),) + tuple(out[1:])
        return out.replace(grammar=tables)

    return call
