"""Decode attention over a `PagedKVCache` with the Pallas kernels that ship with jax.

On CPU (and wherever no kernel applies) the cached forward reads a row's pages with a gather
(`PagedKVCache.read`) and runs the batch-invariant XLA attention of layers.py. For a decode
step (one query per row, no sliding window) on an accelerator, `kernel_for` picks a Pallas
kernel that ships with jax and reads the pool as it is -- `[kv_heads, pages, page_size,
head_dim]` per kv head, every layer's pages in one array (`PagedKVCache.kernel_pool`, a bitcast
of the pool and the page table offset to the layer), so a step reads each page once and
nothing is gathered or copied first; queries go in pre-scaled (neither kernel scales):

- GPU: `jax.experimental.pallas.ops.gpu.paged_attention` (Triton);
- TPU: `jax.experimental.pallas.ops.tpu.paged_attention` (Mosaic), one query per sequence.
  jax's newer `ragged_paged_attention` wants keys and values interleaved by head in one pool;
  it is not used because Pallas' TPU interpreter (jax 0.10.2) cannot run it, so it could not be
  tested anywhere but on a TPU, and the paged kernel needs no second pool layout.

An int8 pool (`LLM(kv_cache_dtype="int8")`, jaxdecode/kv_int8.py) goes in as it is too, with
its scales (`PagedKVCache.kernel_scales`): the GPU kernel takes them as `k_scales_pages` /
`v_scales_pages` (scale times code, as the pool means them); the TPU kernel as jax's
`QuantizedTensor`, whose scales mean `max / 127.5`, so ours go in times 127.5 (an elementwise
product over the scale pool, head_dim times smaller than the pool).

Neither kernel promises batch invariance (docs/batch_invariance.md: accelerators). Both run in
Pallas interpret mode on the CPU (`interpret=True`: the GPU kernel's interpreter, the TPU
kernel under `pltpu.force_tpu_interpret_mode`), which tests use to compare them with the XLA
path; `JAXDECODE_PAGED_KERNEL=xla` turns the dispatch off.
"""

from __future__ import annotations

import contextlib
import math
import os
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp

from jaxdecode.model_api import PagedKVCache

Array = jax.Array


def _splits(pages: int, most: int = 16) -> int:
    """The largest power of two <= most dividing `pages` (the GPU kernel's k_splits,
    the TPU kernel's pages per block)."""
    s = 1
    while s * 2 <= most and pages % (s * 2) == 0:
        s *= 2
    return s


def _inputs(q: Array, cache: PagedKVCache, layer: int, kv_len: int,
            scale: Optional[float]) -> tuple[Array, Array, Array, Array, int]:
    """(scaled queries [B, H, D], key pool, value pool, page table, pages per row)."""
    d = q.shape[-1]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    pages = -(-kv_len // cache.page_size)
    k, v, table = cache.kernel_pool(layer, pages)
    return (q[:, 0] * scale).astype(q.dtype), k, v, table, pages


def gpu_decode(q: Array, cache: PagedKVCache, layer: int, lengths: Array, kv_len: int,
               scale: Optional[float] = None, interpret: bool = False) -> Array:
    """q [B, 1, H, D] -> [B, 1, H, D] over the first `lengths[b]` keys of each row."""
    from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention

    q, k, v, table, pages = _inputs(q, cache, layer, kv_len, scale)
    splits = _splits(pages)
    ks, vs = cache.kernel_scales()
    out = paged_attention(q, k, v, table, lengths.astype(jnp.int32), ks, vs, k_splits=splits,
                          pages_per_compute_block=min(8, pages // splits), interpret=interpret)
    return out[:, None]


def tpu_decode(q: Array, cache: PagedKVCache, layer: int, lengths: Array, kv_len: int,
               scale: Optional[float] = None, interpret: bool = False) -> Array:
    """q [B, 1, H, D] -> [B, 1, H, D] over the first `lengths[b]` keys of each row."""
    from jax.experimental.pallas import tpu as pltpu
    from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention
    from jax.experimental.pallas.ops.tpu.paged_attention.quantization_utils import (
        MAX_INT8, QuantizedTensor)

    q, k, v, table, pages = _inputs(q, cache, layer, kv_len, scale)
    ks, vs = cache.kernel_scales()
    if ks is not None:  # jax's QuantizedTensor: value = code * scales / 127.5
        k, v = (QuantizedTensor(x, s.astype(jnp.float32)[..., None] * MAX_INT8)
                for x, s in ((k, ks), (v, vs)))
    # interpret: the TPU kernel itself under Pallas' TPU interpreter (runs on CPU)
    with pltpu.force_tpu_interpret_mode() if interpret else contextlib.nullcontext():
        out = paged_attention(q, k, v, lengths.astype(jnp.int32), table,
                              pages_per_compute_block=_splits(pages, 8))
    return out[:, None].astype(q.dtype)


KERNELS = {"gpu": gpu_decode, "tpu": tpu_decode}


def kernel_for(cache: Any, tokens_per_row: int) -> Optional[Callable[..., Array]]:
    """The Pallas decode kernel for this call, or None for the XLA path (module docstring)."""
    if not isinstance(cache, PagedKVCache) or tokens_per_row != 1:
        return None
    if os.environ.get("JAXDECODE_PAGED_KERNEL", "auto") == "xla":
        return None
    return KERNELS.get(jax.default_backend())


__all__ = ["KERNELS", "gpu_decode", "kernel_for", "tpu_decode"]
