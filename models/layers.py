"""Small pure building blocks shared by the model families: norms, RoPE, KV writes, the
shared `CachedDecoder`.

Batch invariance (docs/batch_invariance.md, X1) is built in `jaxdecode.invariance`: the weight
products (`dense` on the call's `Tiles`, float or int8 weights: models/quantization.py),
attention on fixed key blocks and `fixed_sum`s, and XLA's plain ones for a model without
invariance (`with_invariance("none")`); this module re-exports the pieces the families call. A
family passes its call's `tile` (a `Tiles`, or None for plain numerics: `logits()` and the fast
path) to every product and norm.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxdecode import invariance
from jaxdecode.invariance import (  # noqa: F401 -- the families' attention
    ATTN_BLOCK, ROW_TILE, Tiles, attention, soft_cap)
from jaxdecode.model_api import KVCache
from models import paged_attention, quantization
from models.quantization import embed_rows  # noqa: F401 -- the families' embedding lookup

Array = jax.Array


def dense(x: Array, w: Any, tile: Optional[Tiles] = None, *, transpose: bool = False,
          out_dtype: Any = None) -> Array:
    """`invariance.dense` for a float weight or an int8 `qwix.QArray` (models/quantization.py,
    contract §12): the same row tiles around the quantized weight's product."""
    return invariance.dense(x, w, tile, transpose=transpose, out_dtype=out_dtype,
                            dot=quantization.weight_product(w))


def rms_norm(x: Array, weight: Array, eps: float, tile: Optional[Tiles] = None) -> Array:
    """Llama RMSNorm: statistics in f32, result in the input dtype (HF order of casts); the
    mean in `fixed_sum`'s layout with a `tile`, XLA's without."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(invariance.mean(xf * xf, tile is not None) + eps)
    return weight * xf.astype(x.dtype)


def rms_norm_plus_one(x: Array, weight: Array, eps: float,
                     tile: Optional[Tiles] = None) -> Array:
    """Gemma RMSNorm: x * rsqrt(mean(x^2) + eps) * (1 + weight), all in f32, then the input
    dtype (HF's Gemma order of casts, unlike `rms_norm`'s)."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(invariance.mean(xf * xf, tile is not None) + eps)
    return (xf * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)


def qk_norm(x: Array, weight: Array, eps: float, tile: Optional[Tiles] = None,
            plus_one: bool = False) -> Array:
    """Per-head RMSNorm of queries or keys (Qwen3; Gemma 3 with `plus_one`): x [B, T, heads,
    head_dim], one weight [head_dim] shared by the heads, applied before RoPE (HF order). Each
    (token, head) is normalised on its own, so it keeps X1 like `rms_norm`."""
    return (rms_norm_plus_one if plus_one else rms_norm)(x, weight, eps, tile)


def layer_windows(layer_types: tuple, window: Optional[int]) -> tuple:
    """Per-layer sliding windows from HF's `layer_types` ("sliding_attention" /
    "full_attention"): the window on sliding layers, None on full ones. `attend` takes a
    layer's window, so every attention path (dense and paged cache, no-cache `logits`) applies
    its own per layer."""
    return tuple(window if t == "sliding_attention" else None for t in layer_types)


def random_decoder_params(c: Any, key: Array, dtype: Any, scale: float, norms: tuple,
                          norm_fill: float, biases: bool = False) -> dict:
    """Random Llama-layout parameters of config `c` (Llama, Gemma): projections and embeddings
    normal * scale; every name in `norms`, the q/k norms where `c.qk_norm` and the final norm
    filled with `norm_fill` (1 for RMSNorm, 0 for Gemma's (1 + weight)); q/k/v biases zero
    where `biases`; an output head unless `c.tie_word_embeddings`."""
    d, hd, f = c.hidden_size, c.head_dim, c.intermediate_size
    qd, kvd = c.num_heads * hd, c.num_kv_heads * hd
    shapes = {"q": (d, qd), "k": (d, kvd), "v": (d, kvd), "o": (qd, d),
              "gate": (d, f), "up": (d, f), "down": (f, d)}
    keys = iter(jax.random.split(key, 2 + c.num_layers * len(shapes)))

    def normal(shape):
        return (scale * jax.random.normal(next(keys), shape, jnp.float32)).astype(dtype)

    fill = lambda n: jnp.full((n,), norm_fill, dtype)  # noqa: E731
    layers = []
    for _ in range(c.num_layers):
        layer = {name: normal(shape) for name, shape in shapes.items()}
        layer.update({name: fill(d) for name in norms})
        if biases:
            layer.update(q_bias=jnp.zeros((qd,), dtype), k_bias=jnp.zeros((kvd,), dtype),
                         v_bias=jnp.zeros((kvd,), dtype))
        if c.qk_norm:
            layer.update(q_norm=fill(hd), k_norm=fill(hd))
        layers.append(layer)
    params = {"embed": normal((c.vocab_size, d)), "layers": layers, "final_norm": fill(d)}
    if not c.tie_word_embeddings:
        params["lm_head"] = normal((d, c.vocab_size))
    return params


def layer_norm(x: Array, weight: Array, bias: Array, eps: float,
               tile: Optional[Tiles] = None) -> Array:
    invariant = tile is not None
    xf = x.astype(jnp.float32)
    mean = invariance.mean(xf, invariant)
    var = invariance.mean(jnp.square(xf - mean), invariant)
    y = (xf - mean) * jax.lax.rsqrt(var + eps)
    return (y * weight.astype(jnp.float32) + bias.astype(jnp.float32)).astype(x.dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: Optional[dict]) -> np.ndarray:
    """Inverse frequencies, with HF's `default`, `linear`, `llama3` and `longrope` (`su`, Phi-3)
    rope types; `longrope` with its `short_factor`, which HF uses up to
    `original_max_position_embeddings` (models.load caps the model's max_len there, so the
    long factors are never needed; `rope_attention_factor` gives its cos/sin scale).

    Computed in numpy at trace time from the static config, so they are constants in XLA.
    """
    inv = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind in (None, "default"):
        pass
    elif kind == "linear":
        inv = inv / float(scaling["factor"])
    elif kind in ("longrope", "su"):
        short = np.asarray(scaling["short_factor"], np.float64)
        if short.shape != inv.shape:
            raise ValueError(f"short_factor has {short.size} entries, expected {inv.size}")
        inv = inv / short
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
                         "(supported: default, linear, llama3, longrope)")
    return inv.astype(np.float32)


def rope_attention_factor(scaling: Optional[dict]) -> float:
    """The scale HF puts on RoPE's cos and sin: longrope's `attention_factor`, by default
    sqrt(1 + ln(factor) / ln(original_max_position_embeddings)) for a factor above 1 (`factor`
    defaults to max_position_embeddings / original, set by models.load); 1 for other types."""
    scaling = scaling or {}
    if scaling.get("rope_type", scaling.get("type")) not in ("longrope", "su"):
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = float(scaling.get("factor") or 1.0)
    if factor <= 1.0:
        return 1.0
    original = float(scaling["original_max_position_embeddings"])
    return math.sqrt(1 + math.log(factor) / math.log(original))


def apply_rope(x: Array, positions: Array, inv_freq: np.ndarray,
               attention_factor: float = 1.0) -> Array:
    """Rotate-half RoPE (HF layout). x: [B, T, heads, head_dim]; positions: int32[B, T];
    cos and sin scaled by `attention_factor` in f32 (longrope)."""
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)  # [B, T, hd/2]
    cos = jnp.cos(angles)[:, :, None, :]
    sin = jnp.sin(angles)[:, :, None, :]
    if attention_factor != 1.0:
        cos, sin = cos * attention_factor, sin * attention_factor
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


@dataclasses.dataclass(frozen=True)
class CachedDecoder:
    """The `DecoderModel` protocol methods every family shares. A family is a frozen dataclass
    with a `config` and `_run(params, tokens, positions, attend, tile, hook) -> hidden states`
    after the final norm (`_head` maps them to logits: the tied embedding or `lm_head`, then
    the config's `final_logit_softcapping` where it has one), where
    `attend(layer, q, k, v, window=None, scale=None, softcap=None)` takes this call's queries
    [B, T, H, D] and keys / values [B, T, KVH, D] (RoPE applied) and returns the attention output
    [B, T, H, D] -- in the cached forward after writing k, v into the cache (a `KVCache` or a
    `PagedKVCache`: `model_api`'s `write` / `read`), over the cached keys; `tile` is the call's
    `invariance.Tiles` (None: plain numerics, in `logits` and without invariance), passed to
    every product and norm, and `hook` is None or called as `x = hook(name, x)` at each of
    `model_api.hook_points`.

    Two static keywords set the numerics of the cached forward (docs/batch_invariance.md):
    `invariance` -- "auto" (the backend's construction: `invariance.construction`),
    "row_tiles", "fixed_shape" or "none" (XLA's plain numerics, `batch_invariant` False) -- and
    `row_tile`, the rows of one weight product; a row's bits are invariant for one tile, not
    across two."""

    row_tile: int = dataclasses.field(default=ROW_TILE, kw_only=True)
    invariance: str = dataclasses.field(default="auto", kw_only=True)

    def __post_init__(self):
        invariance.check_tile(self.row_tile)
        invariance.check_mode(self.invariance)

    @property
    def batch_invariant(self) -> bool:
        """Whether the cached forward keeps X1 (`model_api.DecoderModel`)."""
        return self.invariance != "none"

    def with_row_tile(self, row_tile: int) -> "CachedDecoder":
        """This model with products on tiles of `row_tile` rows (`model_api.DecoderModel`)."""
        return dataclasses.replace(self, row_tile=row_tile)

    def with_invariance(self, mode: str) -> "CachedDecoder":
        """This model with the construction `mode` ("auto", "row_tiles", "fixed_shape" or
        "none")."""
        return dataclasses.replace(self, invariance=mode)

    def init_cache(self, batch: int, max_len: int, dtype: Any = jnp.float32) -> KVCache:
        c = self.config
        return KVCache.zeros(c.num_layers, batch, max_len, c.num_kv_heads, c.head_dim, dtype)

    def forward(self, params: dict, tokens: Array, positions: Array, cache: Any, *,
                lengths: Array, kv_len: Optional[int] = None, hook: Optional[Any] = None,
                last_only: bool = False, adapters: Optional[Array] = None
                ) -> tuple[Array, Any]:
        """The protocol's forward: each layer's K/V is written at its absolute positions
        (padding dropped); `kv_len` (static, optional) limits attention to the first kv_len
        cache positions when the caller knows every row is shorter; `last_only` (static)
        returns only the logits after each row's last token, [B, 1, V] (a prompt pass: the
        output head reads its weights once per tile of rows, as in a decode step, not once per row
        of T tokens -- the head is 14% of llama-512's weights); `hook(name, x) -> x` is
        called at each of `model_api.hook_points` (jaxdecode/device/hooks.py); `adapters`
        int32[B]: each row's LoRA adapter index (0: none) into the stack `params["lora"]`
        (models/lora.py: a family with LoRA support overrides `_adapters`; ignored without
        a stack). On a GPU or
        TPU a decode step over a `PagedKVCache` runs the Pallas paged-attention kernel
        (models/paged_attention.py); everywhere else attention reads the gathered pages."""
        write_pos = write_positions(positions, lengths, cache.max_len)
        kv_len = cache.max_len if kv_len is None else min(kv_len, cache.max_len)
        k_pos = jnp.arange(kv_len, dtype=jnp.int32)
        new_lengths = updated_lengths(cache, positions, lengths)
        kernel = paged_attention.kernel_for(cache, tokens.shape[1])

        def attend(i, q, k, v, window=None, scale=None, softcap=None):
            nonlocal cache
            cache = cache.write(i, k, v, write_pos)
            # the Pallas kernel has no window or soft-cap: those layers read the gathered pages
            if kernel is not None and window is None and softcap is None:
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
                             window, scale, invariant=tiles is not None, softcap=softcap)

        mode = invariance.construction(self.invariance)
        tiles = None if mode == "none" else Tiles.upto_last_live(lengths, self.row_tile,
                                                                 unrolled=mode == "fixed_shape")
        x = self._run(params, tokens, positions, attend, tiles, hook,
                      **self._adapters(params, adapters, tiles))
        if last_only:
            x = jnp.take_along_axis(x, jnp.maximum(lengths - 1, 0)[:, None, None], axis=1)
        return self._head(params, x, tiles), cache.replace(lengths=new_lengths)

    def _adapters(self, params: dict, adapters: Optional[Array], tiles: Optional[Tiles]) -> dict:
        """The `_run` keywords that apply the rows' LoRA adapters: none in a family without
        LoRA support."""
        return {}

    def logits(self, params: dict, tokens: Array, positions: Optional[Array] = None,
               hook: Optional[Any] = None) -> Array:
        """Full causal forward without a cache (training and full recompute: XLA's plain
        numerics, differentiable, not batch invariant)."""
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32),
                                         tokens.shape)

        def attend(i, q, k, v, window=None, scale=None, softcap=None):
            return attention(q, heads_major(k), heads_major(v), positions, positions, window,
                             scale, invariant=False, softcap=softcap)

        return self._head(params, self._run(params, tokens, positions, attend, None, hook), None)

    def _head(self, params: dict, x: Array, tile: Optional[Tiles]) -> Array:
        """Hidden states [B, T, D] -> f32 logits [B, T, V] (the tied embedding or lm_head)."""
        tied = self.config.tie_word_embeddings
        logits = dense(x, params["embed"] if tied else params["lm_head"], tile, transpose=tied,
                       out_dtype=jnp.float32)
        return soft_cap(logits, getattr(self.config, "final_logit_softcapping", None))
