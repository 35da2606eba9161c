"""The model protocol (docs/architecture.md "The model protocol"): the only way `jaxdecode` reaches a model.

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

from jaxdecode import kv_int8

Array = jax.Array


@struct.dataclass
class KVCache:
    """Per-layer keys and values for a batch of rows.

    k, v:    [layers, batch, kv_heads, max_len, head_dim]
    lengths: int32[batch] -- one past the last written position of each row.
    k_scale, v_scale: where k and v are int8 (`kv_cache_dtype="int8"`, jaxdecode/kv_int8.py),
             the scales [layers, batch, kv_heads, max_len] of their codes, one per (token, kv
             head), as in the page pool: `write` quantizes, the reads dequantize; None for a
             float cache.

    Heads-major (docs/architecture.md first had max_len before kv_heads): each (row, kv head) is then one
    contiguous [max_len, head_dim] matrix, and decode attention on XLA:CPU runs 4-40x faster
    (measured 0.6 ms vs 26 ms per layer at batch 16, cache 512).

    Positions at or past `lengths` are garbage and must be masked by the reader. Rolling back a
    speculative or beam branch is lowering `lengths`; later writes overwrite.
    """

    k: Array
    v: Array
    lengths: Array
    k_scale: Optional[Array] = None
    v_scale: Optional[Array] = None

    @classmethod
    def zeros(cls, num_layers: int, batch: int, max_len: int, num_kv_heads: int,
              head_dim: int, dtype: Any = jnp.float32) -> "KVCache":
        """An empty cache of `dtype` (jnp.int8: int8 codes with their scales)."""
        shape = (num_layers, batch, num_kv_heads, max_len, head_dim)
        return cls(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype),
                   lengths=jnp.zeros((batch,), jnp.int32),
                   k_scale=kv_int8.scales_for(shape, dtype),
                   v_scale=kv_int8.scales_for(shape, dtype))

    @property
    def row_fields(self) -> dict:
        """The per-row arrays with rows on axis 1: k, v and, where int8, their scales -- what
        a row gather, scatter or concatenation moves."""
        return _kv_arrays(self)

    @property
    def max_len(self) -> int:
        return self.k.shape[3]

    @property
    def batch(self) -> int:
        return self.k.shape[1]

    def write(self, layer: int, k: Array, v: Array, positions: Array) -> "KVCache":
        """Layer `layer` with this call's K/V ([B, T, kv_heads, head_dim]) written at
        `positions` int32[B, T]; a position >= max_len (padding) is dropped."""
        b, t, kvh, _ = k.shape
        at = (layer, jnp.arange(b)[:, None, None], jnp.arange(kvh)[None, None, :],
              positions[:, :, None])
        return _written(self, at, k, v)

    def read(self, layer: int, kv_len: int) -> tuple[Array, Array]:
        """Keys and values [B, kv_heads, kv_len, head_dim] of positions [0, kv_len),
        dequantized where the cache is int8."""
        part = lambda x: None if x is None else x[layer, :, :, :kv_len]  # noqa: E731
        return (kv_int8.dequantize(part(self.k), part(self.k_scale)),
                kv_int8.dequantize(part(self.v), part(self.v_scale)))

    def read_positions(self, layer: int, index: Array) -> tuple[Array, Array]:
        """Keys and values [B, kv_heads, S, head_dim] at positions index int32[B, S] of each row
        (a position past max_len reads the last one: the caller masks it), dequantized where
        the cache is int8."""
        at = jnp.minimum(index, self.max_len - 1)[:, None, :]

        def take(x):
            if x is None:
                return None
            return jnp.take_along_axis(x[layer], at[..., None] if x.ndim == 5 else at, axis=2)

        return (kv_int8.dequantize(take(self.k), take(self.k_scale)),
                kv_int8.dequantize(take(self.v), take(self.v_scale)))


@struct.dataclass
class PagedKVCache:
    """Keys and values in fixed-size pages of one shared pool, with a page table per row.

    k, v:       [kv_heads, layers, num_pages, page_size, head_dim] -- kv heads first, then
                layers: `kernel_pool` views the whole pool as the
                [kv_heads, pages, page_size, head_dim] layout of the Pallas paged-attention
                kernels (GPU and TPU) without a copy (layer l's page p is page l * num_pages + p),
                and the pool shards by kv head on a "model" axis
    page_table: int32[batch, pages_per_row] -- position p of row b lives in page
                page_table[b, p // page_size] at offset p % page_size; entries past a row's
                pages point at any valid page (page 0, never allocated): they are read only
                past the row's length, where attention masks them
    lengths:    int32[batch] -- one past the last written position of each row
    k_scale, v_scale: where the pool is int8 (`LLM(kv_cache_dtype="int8")`, jaxdecode/kv_int8.py),
                the scales [kv_heads, layers, num_pages, page_size] of its codes, one per
                (token, kv head): `write` quantizes, the reads dequantize; None for a float pool
    max_len:    positions per row (static; at most pages_per_row * page_size)

    Pages hold no row identity: several rows may map the same page (samples sharing a prompt,
    a cached prompt prefix), and the host (the engine's scheduler) owns allocation. Reading
    gathers a row's pages into a contiguous [kv_heads, kv_len, head_dim] view, so attention is
    the same computation as over a `KVCache` of the same length.
    """

    k: Array
    v: Array
    page_table: Array
    lengths: Array
    k_scale: Optional[Array] = None
    v_scale: Optional[Array] = None
    max_len: int = struct.field(pytree_node=False, default=0)

    @classmethod
    def zeros(cls, num_layers: int, num_kv_heads: int, num_pages: int, page_size: int,
              head_dim: int, batch: int, max_len: int,
              dtype: Any = jnp.float32) -> "PagedKVCache":
        """An empty pool of `dtype` (jnp.int8: int8 codes with their scales)."""
        shape = (num_kv_heads, num_layers, num_pages, page_size, head_dim)
        return cls(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype),
                   page_table=jnp.zeros((batch, -(-max_len // page_size)), jnp.int32),
                   lengths=jnp.zeros((batch,), jnp.int32),
                   k_scale=kv_int8.scales_for(shape, dtype),
                   v_scale=kv_int8.scales_for(shape, dtype), max_len=max_len)

    @property
    def pools(self) -> dict:
        """The page-pool fields (pages on axis 2): k, v and, where int8, their scales -- what
        a page copy, a branch pick or a saved row moves."""
        return _kv_arrays(self)

    @property
    def page_size(self) -> int:
        return self.k.shape[3]

    @property
    def num_pages(self) -> int:
        return self.k.shape[2]

    @property
    def batch(self) -> int:
        return self.page_table.shape[0]

    def write(self, layer: int, k: Array, v: Array, positions: Array) -> "PagedKVCache":
        """Layer `layer` with this call's K/V ([B, T, kv_heads, head_dim]) written at
        `positions` int32[B, T], through each row's page table; a position >= max_len
        (padding) is dropped."""
        ps, kvh = self.page_size, k.shape[2]
        slot = jnp.take_along_axis(self.page_table,
                                   jnp.minimum(positions // ps, self.page_table.shape[1] - 1),
                                   axis=1)
        page = jnp.where(positions < self.max_len, slot, self.num_pages)[:, :, None]
        offset = (positions % ps)[:, :, None]
        at = (jnp.arange(kvh)[None, None, :], layer, page, offset)
        return _written(self, at, k, v)

    def kernel_pool(self, layer: int, pages: int) -> tuple[Array, Array, Array]:
        """(keys, values, page table) as a paged-attention kernel reads layer `layer`: the
        pools reshaped to [kv_heads, layers * num_pages, page_size, head_dim] (a bitcast, no
        copy) and the rows' first `pages` table entries offset to that layer's pages. An int8
        pool's scales in the same layout: `kernel_scales`."""
        return (_flat(self.k), _flat(self.v),
                self.page_table[:, :pages] + layer * self.num_pages)

    def kernel_scales(self) -> tuple[Optional[Array], Optional[Array]]:
        """An int8 pool's scales as [kv_heads, layers * num_pages, page_size] (None, None for
        a float pool)."""
        if self.k_scale is None:
            return None, None
        return _flat(self.k_scale), _flat(self.v_scale)

    def read(self, layer: int, kv_len: int) -> tuple[Array, Array]:
        """Keys and values [B, kv_heads, kv_len, head_dim] of positions [0, kv_len): each
        row's first pages gathered (kv_len a multiple of the page size), dequantized where
        the pool is int8."""
        k, v, pages = self.kernel_pool(layer, -(-kv_len // self.page_size))
        ks, vs = self.kernel_scales()

        def gather(pool):
            if pool is None:
                return None
            x = jnp.moveaxis(jnp.take(pool, pages, axis=1), 1, 0)   # [B, kvh, n, ps, ...]
            return x.reshape(x.shape[:2] + (-1,) + x.shape[4:])[:, :, :kv_len]

        return (kv_int8.dequantize(gather(k), gather(ks)),
                kv_int8.dequantize(gather(v), gather(vs)))

    def read_positions(self, layer: int, index: Array) -> tuple[Array, Array]:
        """Keys and values [B, kv_heads, S, head_dim] at positions index int32[B, S] of each row,
        through its page table (a position past max_len reads a valid page: the caller masks
        it)."""
        index = jnp.minimum(index, self.max_len - 1)
        page = jnp.take_along_axis(self.page_table, index // self.page_size, axis=1)
        offset = index % self.page_size

        def gather(pool):
            return None if pool is None else jnp.moveaxis(pool[:, layer, page, offset], 1, 0)

        return (kv_int8.dequantize(gather(self.k), gather(self.k_scale)),    # [B, kvh, S, hd]
                kv_int8.dequantize(gather(self.v), gather(self.v_scale)))


def _kv_arrays(cache: Any) -> dict:
    """k, v and, where the cache is int8, their scales (a KVCache's or a PagedKVCache's)."""
    names = ("k", "v") if cache.k_scale is None else ("k", "v", "k_scale", "v_scale")
    return {name: getattr(cache, name) for name in names}


def _written(cache: Any, at: tuple, k: Array, v: Array) -> Any:
    """`cache` (a KVCache or PagedKVCache) with k and v set at index `at` of its k and v
    arrays (out-of-range entries dropped), quantized with their scales where it is int8."""
    if cache.k_scale is None:
        return cache.replace(k=cache.k.at[at].set(k.astype(cache.k.dtype), mode="drop"),
                             v=cache.v.at[at].set(v.astype(cache.v.dtype), mode="drop"))
    (qk, sk), (qv, sv) = kv_int8.quantize(k), kv_int8.quantize(v)
    return cache.replace(k=cache.k.at[at].set(qk, mode="drop"),
                         v=cache.v.at[at].set(qv, mode="drop"),
                         k_scale=cache.k_scale.at[at].set(sk, mode="drop"),
                         v_scale=cache.v_scale.at[at].set(sv, mode="drop"))


def _flat(pool: Array) -> Array:
    """[kv_heads, layers, pages, ...] -> [kv_heads, layers * pages, ...] (a bitcast)."""
    return pool.reshape((pool.shape[0], -1) + pool.shape[3:])


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
      tokens, positions: int32[B, T], right-padded; lengths: int32[B] real tokens per row,
      which sit at consecutive positions.
      Writes K/V of each real token at its absolute position (padding is never written), lets a
      query at position p attend to cache entries 0..p of its row, and returns
      (logits f32[B, T, vocab_size], cache with lengths = one past the last written position).
    Models must be hashable (frozen dataclasses): they are static arguments of jitted functions.
    A model may also accept an optional static keyword `kv_len`: attend to cache positions
    [0, kv_len) only (the decoder passes it when every row is shorter; models without it work),
    and an optional static keyword `last_only`: return only the logits after each row's last
    real token, [B, 1, vocab_size] (the decoder's prompt passes ask for it; without it they
    take that row of the full logits).

    Adapters (optional, contract R6): a model whose forward accepts the keyword `adapters`
    (int32[B], each row's LoRA adapter index, 0 the base) applies the stack its params carry as
    `params["lora"]` (ignored without one); `load_adapter(name, path, params)` reads one
    adapter for the base params and `stack_adapters(adapters, params, max_loras)` builds that
    stack (jaxdecode/engine/adapters.py calls them; models/lora.py for the Llama family).

    Hook points (optional, jaxdecode/device/hooks.py): a model that accepts the keyword `hook` calls
    `x = hook(name, x)` at each point of `hook_points(config.num_layers)`, in that order, with
    `x` the activation [B, T, hidden] of this call's tokens, and continues with the returned
    value (same shape and dtype). `hook=None` (the default) must leave the computation exactly
    as without the keyword. The decoder reads captured values and applies interventions
    through this one function.

    Batch invariance (docs/batch_invariance.md, X1): a model whose `batch_invariant` attribute is
    True promises that a row's logits are bitwise the same whatever the other rows are, however
    many there are, and whatever `kv_len` or cache length the call uses (for a fixed number T of
    tokens per row). `models/` builds it from `jaxdecode.invariance`. Such a model may carry its
    tile as `row_tile` (rows per weight product) with `with_row_tile(n)` (`LLM(row_tile=n)`
    calls it; the promise holds for one tile), and its construction as `invariance` with
    `with_invariance(mode)` (`batch_invariant=False` calls it with "none").
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


# -- sharding -----------------------------------------------------------------------------------
# The KV-cache part of the one sharding rules table (the parameter rules are in
# models/sharding.py, which imports these): (regex on the field path, spec per dimension).
# A spec entry is a mesh axis name, a tuple of names, or None (replicated along that dimension).
# Batch rows on "data", kv heads on "model" (each device holds whole heads: attention needs no
# collective beyond the output projection's all-reduce).
CACHE_RULES: tuple = (
    (r"cache/(k|v)", (None, "data", "model", None, None)),  # [layers, batch, kv_heads, len, hd]
    (r"cache/lengths", ("data",)),                           # [batch]
    # PagedKVCache: pages hold no row, so the pool shards by kv head only
    (r"paged/(k|v)", ("model", None, None, None, None)),    # [kv_heads, layers, pages, ps, hd]
    (r"paged/(k|v)_scale", ("model", None, None, None)),    # [kv_heads, layers, pages, ps]
    (r"paged/(page_table|lengths)", ("data",)),             # [batch, ...]
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


def cache_sharding(mesh: Any, cache: Any) -> Any:
    """`NamedSharding`s for a KVCache or PagedKVCache (arrays or shape structs) under
    `CACHE_RULES`."""
    prefix = "paged" if isinstance(cache, PagedKVCache) else "cache"

    def one(name, leaf):
        spec = match_rules(CACHE_RULES, f"{prefix}/{name}")
        return jax.sharding.NamedSharding(mesh, fit_spec(spec or (), leaf.shape, mesh))

    fields = ((*cache.pools, "page_table", "lengths") if prefix == "paged"
              else ("k", "v", "lengths"))
    return cache.replace(**{name: one(name, getattr(cache, name)) for name in fields})


def params_quantization(params: Any) -> Optional[str]:
    """"int8" where the weights hold int8 arrays (models.load's `quantization="int8"`: values
    beside their float scales), else None (float weights); records pin it."""
    if any(x.dtype == jnp.int8 for x in jax.tree.leaves(params)):
        return "int8"
    return None


def params_dtype(params: Any):
    """The floating dtype of a model's weights (the KV cache is kept in it)."""
    floats = [x.dtype for x in jax.tree.leaves(params) if jnp.issubdtype(x.dtype, jnp.floating)]
    return floats[0] if floats else jnp.float32
