"""The model protocol (DESIGN.md "The model protocol"): the only way `jaxdecode` reaches a model.

A model is data plus pure functions. `models/` implements this protocol and imports nothing
else from `jaxdecode`; the decoder drives any object that follows it, including the tiny
scripted models of the tests.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Optional, Protocol, Sequence, runtime_checkable

import jax
import jax.numpy as jnp
from flax import struct

Array = jax.Array


@struct.dataclass
class KVCache:
    """Per-layer keys and values for a batch of rows.

    k, v:    [layers, batch, kv_heads, max_len, head_dim]
    lengths: int32[batch] -- one past the last written position of each row.

    Heads-major (DESIGN.md first had max_len before kv_heads): each (row, kv head) is then one
    contiguous [max_len, head_dim] matrix, and decode attention on XLA:CPU runs 4-40x faster
    (measured 0.6 ms vs 26 ms per layer at batch 16, cache 512).

    Positions at or past `lengths` are garbage and must be masked by the reader. Rolling back a
    speculative or beam branch is lowering `lengths`; later writes overwrite.
    """

    k: Array
    v: Array
    lengths: Array

    @classmethod
    def zeros(cls, num_layers: int, batch: int, max_len: int, num_kv_heads: int,
              head_dim: int, dtype: Any = jnp.float32) -> "KVCache":
        shape = (num_layers, batch, num_kv_heads, max_len, head_dim)
        return cls(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype),
                   lengths=jnp.zeros((batch,), jnp.int32))

    @property
    def max_len(self) -> int:
        return self.k.shape[3]

    @property
    def batch(self) -> int:
        return self.k.shape[1]


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Static facts every model provides. Frozen and hashable: it keys jit caches."""

    vocab_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_len: int
    eos_token_ids: tuple[int, ...] = ()


@runtime_checkable
class DecoderModel(Protocol):
    """A causal decoder reached only through `forward` and `init_cache`.

    `forward(params, tokens, positions, cache, *, lengths)`:
      tokens, positions: int32[B, T], right-padded; lengths: int32[B] real tokens per row.
      Writes K/V of each real token at its absolute position (padding is never written), lets a
      query at position p attend to cache entries 0..p of its row, and returns
      (logits f32[B, T, vocab_size], cache with lengths = one past the last written position).
    Models must be hashable (frozen dataclasses): they are static arguments of jitted functions.
    A model may also accept an optional static keyword `kv_len`: attend to cache positions
    [0, kv_len) only (the decoder passes it when every row is shorter; models without it work).

    Hook points (optional, jaxdecode/device/hooks.py): a model that accepts the keyword `hook` calls
    `x = hook(name, x)` at each point of `hook_points(config.num_layers)`, in that order, with
    `x` the activation [B, T, hidden] of this call's tokens, and continues with the returned
    value (same shape and dtype). `hook=None` (the default) must leave the computation exactly
    as without the keyword. The decoder reads captured values and applies interventions
    through this one function.

    Batch invariance (docs/batch_invariance.md): a model whose `batch_invariant` attribute is
    True promises that a row's logits are bitwise the same whatever the other rows are, however
    many there are, and whatever `kv_len` or cache length the call uses (for a fixed number T of
    tokens per row). `models/` does it with fixed-shape row tiles, key blocks and `fixed_sum`.
    """

    config: ModelConfig

    def init_cache(self, batch: int, max_len: int, dtype: Any) -> KVCache: ...

    def forward(self, params: Any, tokens: Array, positions: Array, cache: KVCache, *,
                lengths: Array) -> tuple[Array, KVCache]: ...


def hook_points(num_layers: int) -> tuple[str, ...]:
    """The named hook points every family in models/ provides, in call order:

    "embed"          the input of layer 0 (token embedding; GPT-2: plus position embedding)
    "resid.{i}"      the residual stream after layer i, i = 0 .. num_layers - 1
    "final_norm"     the output of the final norm (the LM head's input)

    Hugging Face's `output_hidden_states` tuple is ("embed", "resid.0", ..., "resid.{L-2}",
    "final_norm"): its entry l is `hidden_state_point(l, L)`."""
    return ("embed",) + tuple(f"resid.{i}" for i in range(num_layers)) + ("final_norm",)


def hidden_state_point(layer: int, num_layers: int) -> str:
    """The hook point of entry `layer` of HF's `output_hidden_states` (0 .. num_layers)."""
    if not 0 <= layer <= num_layers:
        raise ValueError(f"return_hidden_states: layer {layer} is outside [0, {num_layers}] "
                         "(HF output_hidden_states indexing: 0 = embeddings, L = final norm)")
    return "embed" if layer == 0 else "final_norm" if layer == num_layers else f"resid.{layer - 1}"


def fixed_sum(x: Array, axis: int = -1, keepdims: bool = False) -> Array:
    """Sum along `axis` in a fixed layout: a halving tree of elementwise adds over the axis
    zero-padded to a power of two (element i pairs with i + n/2, then recursively).

    XLA picks the order of its own reductions from the whole shape (on XLA:CPU a row's sum
    changes with the number of rows), while elementwise adds are never reordered, so this sum
    of a row depends on that row alone. Trailing zeros change nothing (x + 0 == x), so a row
    padded to a longer axis sums to the same bits -- attention over a longer cache included."""
    axis = axis % x.ndim
    n = x.shape[axis]
    size = 1 << max(0, n - 1).bit_length()
    if size != n:
        pad = [(0, 0)] * x.ndim
        pad[axis] = (0, size - n)
        x = jnp.pad(x, pad)
    while size > 1:
        size //= 2
        x = (jax.lax.slice_in_dim(x, 0, size, axis=axis)
             + jax.lax.slice_in_dim(x, size, 2 * size, axis=axis))
    return x if keepdims else jnp.squeeze(x, axis)


# -- sharding -----------------------------------------------------------------------------------
# The KV-cache part of the one sharding rules table (the parameter rules are in
# models/sharding.py, which imports these): (regex on the field path, spec per dimension).
# A spec entry is a mesh axis name, a tuple of names, or None (replicated along that dimension).
# Batch rows on "data", kv heads on "model" (each device holds whole heads: attention needs no
# collective beyond the output projection's all-reduce).
CACHE_RULES: tuple = (
    (r"cache/(k|v)", (None, "data", "model", None, None)),  # [layers, batch, kv_heads, len, hd]
    (r"cache/lengths", ("data",)),                           # [batch]
)


def fit_spec(spec: Sequence[Any], shape: Sequence[int], mesh: Any) -> Any:
    """A `PartitionSpec` for an array of `shape`: `spec` with every entry that does not apply
    dropped to None (replicated) -- an axis the mesh lacks, or a dimension not divisible by the
    axis size. Never an error: a rule that does not fit replicates."""
    entries = []
    for d in range(len(shape)):
        axes = spec[d] if d < len(spec) else None
        names = (axes,) if isinstance(axes, str) else tuple(axes or ())
        size = 1
        for name in names:
            size *= mesh.shape.get(name, 0) if name in mesh.axis_names else 0
        ok = bool(names) and size > 0 and shape[d] % size == 0
        entries.append(axes if ok else None)
    while entries and entries[-1] is None:
        entries.pop()
    return jax.sharding.PartitionSpec(*entries)


def match_rules(rules: Sequence[tuple], path: str) -> Optional[tuple]:
    """The spec of the first rule whose regex matches all of `path`, or None."""
    for pattern, spec in rules:
        if re.fullmatch(pattern, path):
            return spec
    return None


def cache_sharding(mesh: Any, cache: KVCache) -> KVCache:
    """`NamedSharding`s for `cache` (arrays or shape structs) under `CACHE_RULES`."""
    def one(name, leaf):
        spec = match_rules(CACHE_RULES, f"cache/{name}")
        return jax.sharding.NamedSharding(mesh, fit_spec(spec or (), leaf.shape, mesh))
    return KVCache(k=one("k", cache.k), v=one("v", cache.v),
                   lengths=one("lengths", cache.lengths))


def params_dtype(params: Any):
    """The floating dtype of a model's weights (the KV cache is kept in it)."""
    floats = [x.dtype for x in jax.tree.leaves(params) if jnp.issubdtype(x.dtype, jnp.floating)]
    return floats[0] if floats else jnp.float32
