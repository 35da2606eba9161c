"""Small pure building blocks shared by the model families: norms, RoPE, KV writes, attention."""

from __future__ import annotations

import math
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxdecode.model_api import KVCache

Array = jax.Array


def rms_norm(x: Array, weight: Array, eps: float) -> Array:
    """Llama RMSNorm: statistics in f32, result in the input dtype (HF order of casts)."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight * xf.astype(x.dtype)


def layer_norm(x: Array, weight: Array, bias: Array, eps: float) -> Array:
    xf = x.astype(jnp.float32)
    mean = jnp.mean(xf, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
    y = (xf - mean) * jax.lax.rsqrt(var + eps)
    return (y * weight.astype(jnp.float32) + bias.astype(jnp.float32)).astype(x.dtype)


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


def write_kv(cache: KVCache, layer: int, k: Array, v: Array, write_pos: Array) -> KVCache:
    """Scatter this call's K/V ([B, T, kv_heads, head_dim]) into layer `layer` of the cache."""
    b, t, kvh, _ = k.shape
    rows = jnp.arange(b)[:, None, None]
    heads = jnp.arange(kvh)[None, None, :]
    pos = write_pos[:, :, None]
    new_k = cache.k.at[layer, rows, heads, pos].set(k.astype(cache.k.dtype), mode="drop")
    new_v = cache.v.at[layer, rows, heads, pos].set(v.astype(cache.v.dtype), mode="drop")
    return cache.replace(k=new_k, v=new_v)


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
    the query axis so each (row, kv head) is one contiguous matrix product. Returns [B, T, H, D].
    """
    b, t, h, d = q.shape
    kvh = k.shape[1]
    g = h // kvh
    scale = (1.0 / math.sqrt(d)) if scale is None else scale
    qg = q.reshape(b, t, kvh, g, d).transpose(0, 2, 1, 3, 4).reshape(b, kvh, t * g, d)
    scores = jnp.einsum("bkqd,bksd->bkqs", qg, k, preferred_element_type=jnp.float32) * scale
    k_pos = jnp.broadcast_to(k_pos, (b, k.shape[2]))
    visible = k_pos[:, None, :] <= q_pos[:, :, None]  # [B, T, S]
    if sliding_window is not None:
        visible &= k_pos[:, None, :] > q_pos[:, :, None] - sliding_window
    scores = jnp.where(visible[:, None, :, None, :], scores.reshape(b, kvh, t, g, -1), -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    # A padded query may see nothing; give it zeros rather than NaN.
    probs = jnp.where(jnp.any(visible, -1)[:, None, :, None, None], probs, 0.0)
    out = jnp.einsum("bkqs,bksd->bkqd", probs.reshape(b, kvh, t * g, -1).astype(v.dtype), v)
    return out.reshape(b, kvh, t, g, d).transpose(0, 2, 1, 3, 4).reshape(b, t, h, d)


class CachedDecoder:
    """The `DecoderModel` protocol methods every family shares. A family is a frozen dataclass
    with a `config` and `_run(params, tokens, positions, kv_source, hook) -> logits`, where
    `kv_source(layer, k, v)` returns the keys, values and key positions that layer attends to
    and `hook` is None or called as `x = hook(name, x)` at each of `model_api.hook_points`."""

    def init_cache(self, batch: int, max_len: int, dtype: Any = jnp.float32) -> KVCache:
        c = self.config
        return KVCache.zeros(c.num_layers, batch, max_len, c.num_kv_heads, c.head_dim, dtype)

    def forward(self, params: dict, tokens: Array, positions: Array, cache: KVCache, *,
                lengths: Array, kv_len: Optional[int] = None,
                hook: Optional[Any] = None) -> tuple[Array, KVCache]:
        """The protocol's forward: each layer's K/V is written at its absolute positions
        (padding dropped); `kv_len` (static, optional) limits attention to the first kv_len
        cache positions when the caller knows every row is shorter; `hook(name, x) -> x` is
        called at each of `model_api.hook_points` (jaxdecode/hooks.py)."""
        write_pos = write_positions(positions, lengths, cache.max_len)
        kv_len = cache.max_len if kv_len is None else min(kv_len, cache.max_len)
        k_pos = jnp.arange(kv_len, dtype=jnp.int32)
        new_lengths = updated_lengths(cache, positions, lengths)

        def kv_source(i, k, v):
            nonlocal cache
            cache = write_kv(cache, i, k, v, write_pos)
            return cache.k[i, :, :, :kv_len], cache.v[i, :, :, :kv_len], k_pos

        logits = self._run(params, tokens, positions, kv_source, hook)
        return logits, cache.replace(lengths=new_lengths)

    def logits(self, params: dict, tokens: Array, positions: Optional[Array] = None,
               hook: Optional[Any] = None) -> Array:
        """Full causal forward without a cache (training and full recompute)."""
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32),
                                         tokens.shape)
        return self._run(params, tokens, positions,
                         lambda i, k, v: (heads_major(k), heads_major(v), positions), hook)
