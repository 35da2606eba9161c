"""The int8 KV cache (contract §12, "KV cache quantization"): `LLM(kv_cache_dtype="int8")`.

Keys and values are stored as int8 with one bfloat16 scale per (token, kv head): symmetric
absmax over head_dim, `scale = max|x| / 127`, `q = clip(round(x / scale), -127, 127)`. They are
quantized where `PagedKVCache.write` puts them into the page pool and dequantized
(`q * scale`, in float32, then the query's dtype) where attention reads them, so every product
of attention keeps its construction (X1 holds: each element's code and scale depend on that
(token, kv head) alone; a max is exact in any order). A position costs `head_dim` bytes plus
2 for its scale per kv head, against `2 * head_dim` in bfloat16 and `4 * head_dim` in float32.
"""

from __future__ import annotations

from typing import Any, Optional

import jax
import jax.numpy as jnp

Array = jax.Array

KV_CACHE_DTYPES = ("auto", "int8")
SCALE_DTYPE = jnp.bfloat16


def check(kv_cache_dtype: Any) -> str:
    """`kv_cache_dtype` if it is one of KV_CACHE_DTYPES (ValueError naming the field)."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype: must be one of {', '.join(KV_CACHE_DTYPES)} "
                         f"(\"auto\": the weights' dtype), got {kv_cache_dtype!r}")
    return kv_cache_dtype


def pool_dtype(kv_cache_dtype: str, float_dtype: Any) -> Any:
    """The page pool's element dtype: int8, or the weights' float dtype for "auto"."""
    return jnp.int8 if check(kv_cache_dtype) == "int8" else float_dtype


def is_int8(dtype: Any) -> bool:
    return jnp.dtype(dtype) == jnp.int8


def scales_for(pool_shape: tuple, dtype: Any) -> Optional[Array]:
    """Zero scales for a pool of `pool_shape` (head_dim last) where it is int8, else None."""
    return jnp.zeros(pool_shape[:-1], SCALE_DTYPE) if is_int8(dtype) else None


def quantize(x: Array) -> tuple[Array, Array]:
    """x [..., head_dim] -> (int8 codes [..., head_dim], scales [...]) (module docstring)."""
    xf = x.astype(jnp.float32)
    scale = (jnp.max(jnp.abs(xf), axis=-1) / 127.0).astype(SCALE_DTYPE)
    s = scale.astype(jnp.float32)[..., None]
    q = jnp.clip(jnp.round(xf / jnp.where(s > 0, s, 1.0)), -127, 127)
    return q.astype(jnp.int8), scale


def dequantize(q: Array, scale: Optional[Array]) -> Array:
    """int8 codes and their scales -> float32 values (a float pool, scale None, as it is)."""
    if scale is None:
        return q
    return q.astype(jnp.float32) * scale.astype(jnp.float32)[..., None]


def position_bytes(num_layers: int, num_kv_heads: int, head_dim: int, dtype: Any) -> int:
    """Bytes of keys and values (and their scales) one position holds in every layer."""
    per_head = head_dim * jnp.dtype(dtype).itemsize
    if is_int8(dtype):
        per_head += jnp.dtype(SCALE_DTYPE).itemsize
    return 2 * num_layers * num_kv_heads * per_head
