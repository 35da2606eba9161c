"""Small pure building blocks shared by the model families: norms, RoPE, KV writes, attention.

Batch invariance (docs/batch_invariance.md): on XLA:CPU a matrix product's arithmetic depends
on its whole shape (a batch of one takes a matrix-vector path; the K-blocking of a GEMM moves
with its row count) and so does a reduction's. In the cached forward every weight product
therefore has the arithmetic of fixed row tiles (`dense`, `CachedDecoder.row_tile` rows; the
tiles of a batch run as one product where a probe finds that this keeps every row's bits),
attention on fixed key blocks (`ATTN_BLOCK`) with per-(row, head, block) batched products
(elementwise products for a few query rows), and every sum is `fixed_sum`: a row's logits are
the same bits whatever batch, cache length or attention bucket it is in.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxdecode.model_api import ROW_TILE, KVCache, fixed_sum, stacked_tiles_agree
from models import paged_attention

Array = jax.Array

# `CachedDecoder.row_tile` (default `model_api.ROW_TILE`): token rows per weight-product tile in
# the cached forward. A call of B rows of T tokens runs products of exactly max(row_tile, T) rows
# (the last one zero-padded), one per tile up to the last row with tokens to process (`Tiles`).

# The widest row tile a model accepts (a tile wider than the batch computes padding rows).
MAX_ROW_TILE = 64

# Keys per attention block: every (row, kv head, block) is one product of fixed shape.
ATTN_BLOCK = 128
# Query rows per kv head (T x G, static) up to which attention is elementwise products and
# fixed sums (`_attention_elementwise`): decode steps and speculative verification, where the
# per-block products would be thousands of tiny dots.
ELEMENTWISE_QUERY_ROWS = 8


def rms_norm(x: Array, weight: Array, eps: float) -> Array:
    """Llama RMSNorm: statistics in f32, result in the input dtype (HF order of casts)."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(_mean(xf * xf) + eps)
    return weight * xf.astype(x.dtype)


def layer_norm(x: Array, weight: Array, bias: Array, eps: float) -> Array:
    xf = x.astype(jnp.float32)
    mean = _mean(xf)
    var = _mean(jnp.square(xf - mean))
    y = (xf - mean) * jax.lax.rsqrt(var + eps)
    return (y * weight.astype(jnp.float32) + bias.astype(jnp.float32)).astype(x.dtype)


def _mean(x: Array) -> Array:
    """Mean over the last axis (kept), summed in `fixed_sum`'s layout."""
    return fixed_sum(x, -1, keepdims=True) / x.shape[-1]


@dataclasses.dataclass(frozen=True)
class Tiles:
    """`dense`'s row tiling in the cached forward: products of max(size, T) token rows, run up
    to the tile holding the last of the first `rows` batch rows (int32, traced). Batch rows past
    `rows` (padding rows of a chunk call, finished or empty slots at the end of a step) are
    dropped by the callers: the tile loop does not compute them (zeros), a stacked product
    does."""

    size: int
    rows: Array

    @classmethod
    def upto_last_live(cls, lengths: Array, size: int = ROW_TILE) -> "Tiles":
        """Tiles of `size` rows covering every row with tokens (lengths > 0) and the rows
        before it."""
        live = jnp.where(lengths > 0, jnp.arange(lengths.shape[0], dtype=jnp.int32) + 1, 0)
        return cls(size, jnp.max(live, initial=0))


def dense(x: Array, w: Array, tile: Optional[Tiles] = None, *, transpose: bool = False,
          out_dtype: Any = None) -> Array:
    """x [B, T, K] @ w [K, N] (w [N, K] with `transpose`) -> [B, T, N].

    With `tile`, each token row's arithmetic is that of one fixed-shape product of exactly
    max(tile.size, T) rows (the last tile zero-padded), whatever B is. Where the CPU's GEMM
    gives every row of the c tiles stacked into one product the bits of its own tile
    (`model_api.stacked_tiles_agree`, probed per shape), that one product runs; else a loop of
    tile products that stops after the tile holding batch row `tile.rows - 1` (later rows are
    zeros). The loop's trip count is hidden from XLA (an optimization barrier), so it is never
    unrolled or inlined: every batch size and trip count runs the same loop body."""
    contract = lambda a: (((a.ndim - 1,), (1 if transpose else 0,)), ((), ()))  # noqa: E731
    product = lambda a: jax.lax.dot_general(a, w, contract(a),  # noqa: E731
                                            preferred_element_type=out_dtype)
    if tile is None:
        return product(x)
    *lead, t, k = x.shape
    rows = max(tile.size, t)
    flat = x.reshape(-1, k)
    m = flat.shape[0]
    count = -(-m // rows)
    flat = jnp.pad(flat, ((0, count * rows - m), (0, 0)))
    n = w.shape[0] if transpose else w.shape[1]
    if stacked_tiles_agree(count * rows, rows, k, n, jnp.dtype(x.dtype).name,
                           jnp.dtype(w.dtype).name,
                           None if out_dtype is None else jnp.dtype(out_dtype).name, transpose):
        return product(flat)[:m].reshape(*lead, t, n)
    out = jnp.zeros((count * rows, n), jax.eval_shape(product, flat[:rows]).dtype)

    def body(i, out):
        part = jax.lax.dynamic_slice_in_dim(flat, i * rows, rows)
        return jax.lax.dynamic_update_slice_in_dim(out, product(part), i * rows, 0)

    trips = jnp.minimum((tile.rows * t + rows - 1) // rows, count)
    out = jax.lax.fori_loop(0, jax.lax.optimization_barrier(trips), body, out)
    return out[:m].reshape(*lead, t, n)


def rope_inv_freq(head_dim: int, theta: float, scaling: Optional[dict]) -> np.ndarray:
    """Inverse frequencies, with HF's `default`, `linear` and `llama3` rope types.

    Computed in numpy at trace time from the static config, so they are constants in XLA.
    """
    inv = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind in (None, "default"):
        pass
    elif kind == "linear":
        inv = inv / float(scaling["factor"])
    elif kind == "llama3":
        factor = float(scaling["factor"])
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_len = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv = np.where(medium, smoothed, scaled)
    else:
        raise ValueError(f"rope_scaling: unsupported rope_type {kind!r} "
                         "(supported: default, linear, llama3)")
    return inv.astype(np.float32)


def apply_rope(x: Array, positions: Array, inv_freq: np.ndarray) -> Array:
    """Rotate-half RoPE (HF layout). x: [B, T, heads, head_dim]; positions: int32[B, T]."""
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)  # [B, T, hd/2]
    cos = jnp.cos(angles)[:, :, None, :]
    sin = jnp.sin(angles)[:, :, None, :]
    cos = jnp.concatenate([cos, cos], -1).astype(x.dtype)
    sin = jnp.concatenate([sin, sin], -1).astype(x.dtype)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], -1)
    return x * cos + rotated * sin


def write_positions(positions: Array, lengths: Array, max_len: int) -> Array:
    """Absolute write index per token; padding gets `max_len`, which a `drop` scatter ignores."""
    real = jnp.arange(positions.shape[1])[None, :] < lengths[:, None]
    return jnp.where(real, positions, max_len)


def heads_major(x: Array) -> Array:
    """[B, T, heads, head_dim] -> [B, heads, T, head_dim], the cache layout."""
    return x.transpose(0, 2, 1, 3)


def updated_lengths(cache: KVCache, positions: Array, lengths: Array) -> Array:
    """One past the last written position of each row; rows with nothing written keep theirs."""
    last = jnp.take_along_axis(positions, jnp.maximum(lengths - 1, 0)[:, None], axis=1)[:, 0]
    return jnp.where(lengths > 0, last + 1, cache.lengths).astype(jnp.int32)


def attention(q: Array, k: Array, v: Array, q_pos: Array, k_pos: Array,
              sliding_window: Optional[int] = None, scale: Optional[float] = None) -> Array:
    """Causal grouped-query attention by absolute position.

    q: [B, T, H, D]; k, v: [B, KVH, S, D] (heads-major, as in the cache); q_pos: int32[B, T];
    k_pos: int32[S] or [B, S]. A query at position p sees keys at positions 0..p (and
    > p - window with a sliding window). The G = H / KVH query heads of a group are folded into
    the query axis. Returns [B, T, H, D].

    Batch invariant by construction: the keys are cut into blocks of ATTN_BLOCK (the last one
    zero-padded and masked) and the block is a batch axis of both products, so every (row, kv
    head, block) is one product of fixed shape whatever B and S are; the maximum is exact and
    the softmax denominator and the sum over blocks are `block_sum`s (a fixed tree inside a
    block, blocks left to right), to which masked keys and whole masked blocks at either end add
    exact zeros. A longer cache, another attention bucket or a block-aligned window of the
    cache (`window_span`) changes no bit of a row. With at
    most ELEMENTWISE_QUERY_ROWS query rows per kv head (decode, speculative verification) the
    same holds without products (`_attention_elementwise`); which path runs depends only on the
    static T and G, never on the batch.
    """
    b, t, h, d = q.shape
    kvh, s = k.shape[1], k.shape[2]
    g = h // kvh
    scale = (1.0 / math.sqrt(d)) if scale is None else scale
    nb = -(-s // ATTN_BLOCK)
    k_pos = jnp.broadcast_to(k_pos, (b, s))
    if nb * ATTN_BLOCK != s:  # padded keys sit past every query: never visible
        pad = ((0, 0), (0, 0), (0, nb * ATTN_BLOCK - s), (0, 0))
        k, v = jnp.pad(k, pad), jnp.pad(v, pad)
        k_pos = jnp.pad(k_pos, ((0, 0), (0, nb * ATTN_BLOCK - s)),
                        constant_values=jnp.iinfo(jnp.int32).max)
    if t * g <= ELEMENTWISE_QUERY_ROWS:
        return _attention_elementwise(q, k, v, q_pos, k_pos, sliding_window, scale)
    blocks = lambda x: x.reshape(b, kvh, nb, ATTN_BLOCK, d)  # noqa: E731
    # at least 2 query rows: XLA rewrites a product with one row as multiply + reduce, whose
    # order depends on the batch axes (the padding row is dropped below)
    rows = max(2, t * g)
    qg = q.reshape(b, t, kvh, g, d).transpose(0, 2, 1, 3, 4).reshape(b, kvh, 1, t * g, d)
    qg = jnp.pad(qg, ((0, 0), (0, 0), (0, 0), (0, rows - t * g), (0, 0)))
    qg = jnp.broadcast_to(qg, (b, kvh, nb, rows, d))
    scores = jnp.einsum("bknqd,bknsd->bknqs", qg, blocks(k),
                        preferred_element_type=jnp.float32)[:, :, :, :t * g] * scale
    probs = _softmax_numerator(scores.reshape(b, kvh, nb, t, g, ATTN_BLOCK),
                               k_pos.reshape(b, 1, nb, 1, 1, ATTN_BLOCK),
                               q_pos.reshape(b, 1, 1, t, 1, 1), sliding_window, (2, 5))
    total = fold_blocks(fixed_sum(probs, -1), 2)                        # [B, KVH, T, G]
    probs = probs.reshape(b, kvh, nb, t * g, ATTN_BLOCK).astype(v.dtype)
    probs = jnp.pad(probs, ((0, 0), (0, 0), (0, 0), (0, rows - t * g), (0, 0)))
    out = fold_blocks(jnp.einsum("bknqs,bknsd->bknqd", probs, blocks(v)), 2)[:, :, :t * g]
    # a padded query may see nothing: zeros rather than NaN
    out = out.reshape(b, kvh, t, g, d) / jnp.where(total > 0, total, 1.0)[..., None]
    return out.astype(q.dtype).transpose(0, 2, 1, 3, 4).reshape(b, t, h, d)


def block_sum(x: Array, axis: int) -> Array:
    """Sum over a key axis of whole ATTN_BLOCKs: `fixed_sum`'s tree inside each block, then the
    blocks added left to right. Whole zero blocks at either end (masked keys) add exact zeros
    and change no bit, so attention over a block-aligned window of the cache equals attention
    over the whole cache (`window_span`)."""
    axis = axis % x.ndim
    nb = x.shape[axis] // ATTN_BLOCK
    x = fixed_sum(x.reshape(x.shape[:axis] + (nb, ATTN_BLOCK) + x.shape[axis + 1:]), axis + 1)
    return fold_blocks(x, axis)


def fold_blocks(x: Array, axis: int) -> Array:
    """Sum over the block axis `axis`, left to right (see `block_sum`)."""
    total = jax.lax.index_in_dim(x, 0, axis, keepdims=False)
    for j in range(1, x.shape[axis]):
        total = total + jax.lax.index_in_dim(x, j, axis, keepdims=False)
    return total


def window_span(t: int, window: int) -> int:
    """Keys (static, whole ATTN_BLOCKs) that cover every key a call of `t` consecutive query
    positions can see under a sliding `window`, from a block-aligned start (`window_start`)."""
    return ATTN_BLOCK * (-(-(t + window - 1) // ATTN_BLOCK) + 1)


def window_start(positions: Array, lengths: Array, window: int) -> Array:
    """int32[B]: the block-aligned first key position of each row's window read -- the block of
    its first query's earliest visible key. A row's real tokens sit at consecutive positions
    (the DecoderModel protocol), so [start, start + window_span) holds every key they see."""
    first = jnp.where(lengths > 0, positions[:, 0], 0)
    return jnp.maximum(first - window + 1, 0) // ATTN_BLOCK * ATTN_BLOCK


def _softmax_numerator(scores: Array, kp: Array, qp: Array, sliding_window: Optional[int],
                       axes: tuple) -> Array:
    """exp(score - max over the key `axes`) where the key at position kp is visible from the
    query at qp (causal, within the window), exactly 0 elsewhere; the maximum is exact."""
    visible = kp <= qp
    if sliding_window is not None:
        visible &= kp > qp - sliding_window
    scores = jnp.where(visible, scores, -jnp.inf)
    top = jnp.max(scores, axis=axes, keepdims=True)
    return jnp.exp(scores - jnp.where(jnp.isfinite(top), top, 0.0))


def _attention_elementwise(q: Array, k: Array, v: Array, q_pos: Array, k_pos: Array,
                           sliding_window: Optional[int], scale: float) -> Array:
    """`attention` for a few query rows per kv head, without products: each score is a
    `fixed_sum` over head_dim of elementwise products, each output a `fixed_sum` over the keys,
    so a row's bits depend on that row alone and invisible keys add exact zeros. Shapes as in
    `attention`; the keys are already padded to whole ATTN_BLOCKs: XLA:CPU evaluates `exp` on
    the ragged tail of a vectorized axis with other code, whose last bit differs, so the key
    axis is always a multiple of the vector width. The products and the scaled scores are
    materialized (optimization barriers), so no add is contracted with a multiply into a fused
    multiply-add whose presence would depend on how XLA fuses a given batch."""
    b, t, h, d = q.shape
    kvh, s = k.shape[1], k.shape[2]
    g = h // kvh
    f32 = jnp.float32
    qg = q.reshape(b, t, kvh, g, d).transpose(0, 2, 1, 3, 4).astype(f32)  # [B, KVH, T, G, D]
    products = jax.lax.optimization_barrier(
        qg[:, :, :, :, None, :] * k.astype(f32)[:, :, None, None])        # [B, KVH, T, G, S, D]
    scores = jax.lax.optimization_barrier(fixed_sum(products, -1) * scale)  # [B, KVH, T, G, S]
    probs = _softmax_numerator(scores, k_pos.reshape(b, 1, 1, 1, s),
                               q_pos.reshape(b, 1, t, 1, 1), sliding_window, (4,))
    total = block_sum(probs, -1)                                          # [B, KVH, T, G]
    weighted = jax.lax.optimization_barrier(
        probs[..., None] * v.astype(f32)[:, :, None, None])              # [B, KVH, T, G, S, D]
    out = block_sum(weighted, 4) / jnp.where(total > 0, total, 1.0)[..., None]
    return out.astype(q.dtype).transpose(0, 2, 1, 3, 4).reshape(b, t, h, d)


@dataclasses.dataclass(frozen=True)
class CachedDecoder:
    """The `DecoderModel` protocol methods every family shares. A family is a frozen dataclass
    with a `config` (and the keyword `row_tile`: `dense`'s rows per product tile in the cached
    forward, a static setting that trades batch-1 against full-batch step time; a row's bits
    are invariant for one `row_tile`, not across two) and `_run(params, tokens, positions, attend, tile, hook) -> hidden states`
    after the final norm (`_head` maps them to logits: the tied embedding or `lm_head`), where
    `attend(layer, q, k, v, window=None, scale=None)` takes this call's queries [B, T, H, D]
    and keys / values [B, T, KVH, D] (RoPE applied) and returns the attention output
    [B, T, H, D] -- in the cached forward after writing k, v into the cache (a `KVCache` or a
    `PagedKVCache`: `model_api`'s `write` / `read`), over the cached keys; `tile` is `dense`'s
    row tiling (`Tiles` in the cached forward, None in `logits`) and `hook` is None or called as
    `x = hook(name, x)` at each of `model_api.hook_points`."""

    row_tile: int = dataclasses.field(default=ROW_TILE, kw_only=True)
    batch_invariant = True  # the cached forward: docs/batch_invariance.md

    def __post_init__(self):
        if (not isinstance(self.row_tile, (int, np.integer)) or isinstance(self.row_tile, bool)
                or not 1 <= self.row_tile <= MAX_ROW_TILE):
            raise ValueError(f"row_tile: expected an integer in [1, {MAX_ROW_TILE}], got "
                             f"{self.row_tile!r}")

    def with_row_tile(self, row_tile: int) -> "CachedDecoder":
        """This model with products on tiles of `row_tile` rows (`model_api.DecoderModel`)."""
        return dataclasses.replace(self, row_tile=row_tile)

    def init_cache(self, batch: int, max_len: int, dtype: Any = jnp.float32) -> KVCache:
        c = self.config
        return KVCache.zeros(c.num_layers, batch, max_len, c.num_kv_heads, c.head_dim, dtype)

    def forward(self, params: dict, tokens: Array, positions: Array, cache: Any, *,
                lengths: Array, kv_len: Optional[int] = None, hook: Optional[Any] = None,
                last_only: bool = False) -> tuple[Array, Any]:
        """The protocol's forward: each layer's K/V is written at its absolute positions
        (padding dropped); `kv_len` (static, optional) limits attention to the first kv_len
        cache positions when the caller knows every row is shorter; `last_only` (static)
        returns only the logits after each row's last token, [B, 1, V] (a prompt pass: the
        output head reads its weights once per tile of rows, as in a decode step, not once per row
        of T tokens -- the head is 14% of llama-512's weights); `hook(name, x) -> x` is
        called at each of `model_api.hook_points` (jaxdecode/device/hooks.py). On a GPU or
        TPU a decode step over a `PagedKVCache` runs the Pallas paged-attention kernel
        (models/paged_attention.py); everywhere else attention reads the gathered pages."""
        write_pos = write_positions(positions, lengths, cache.max_len)
        kv_len = cache.max_len if kv_len is None else min(kv_len, cache.max_len)
        k_pos = jnp.arange(kv_len, dtype=jnp.int32)
        new_lengths = updated_lengths(cache, positions, lengths)
        kernel = paged_attention.kernel_for(cache, tokens.shape[1])

        def attend(i, q, k, v, window=None, scale=None):
            nonlocal cache
            cache = cache.write(i, k, v, write_pos)
            if kernel is not None and window is None:
                return kernel(q, cache, i, positions[:, 0] + 1, kv_len, scale)
            if window is not None and window_span(tokens.shape[1], window) < kv_len:
                # a sliding window reads its own blocks only: same bits, less work
                index = (window_start(positions, lengths, window)[:, None]
                         + jnp.arange(window_span(tokens.shape[1], window), dtype=jnp.int32))
                keys, values = cache.read_positions(i, index)
                key_pos = index  # keys past max_len (clipped reads) sit past every query
            else:
                keys, values = cache.read(i, kv_len)
                key_pos = k_pos
            return attention(q, keys.astype(q.dtype), values.astype(q.dtype), positions, key_pos,
                             window, scale)

        tiles = Tiles.upto_last_live(lengths, self.row_tile)
        x = self._run(params, tokens, positions, attend, tiles, hook)
        if last_only:
            x = jnp.take_along_axis(x, jnp.maximum(lengths - 1, 0)[:, None, None], axis=1)
        return self._head(params, x, tiles), cache.replace(lengths=new_lengths)

    def logits(self, params: dict, tokens: Array, positions: Optional[Array] = None,
               hook: Optional[Any] = None) -> Array:
        """Full causal forward without a cache (training and full recompute: plain products,
        differentiable, not batch invariant)."""
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32),
                                         tokens.shape)

        def attend(i, q, k, v, window=None, scale=None):
            return attention(q, heads_major(k), heads_major(v), positions, positions, window,
                             scale)

        return self._head(params, self._run(params, tokens, positions, attend, None, hook), None)

    def _head(self, params: dict, x: Array, tile: Optional[Tiles]) -> Array:
        """Hidden states [B, T, D] -> f32 logits [B, T, V] (the tied embedding or lm_head)."""
        tied = self.config.tie_word_embeddings
        return dense(x, params["embed"] if tied else params["lm_head"], tile, transpose=tied,
                     out_dtype=jnp.float32)
