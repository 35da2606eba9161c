"""Decode attention over a `PagedKVCache` with the Pallas kernels that ship with jax.

On CPU (and wherever no kernel applies) the cached forward reads a row's pages with a gather
(`PagedKVCache.read`) and runs the batch-invariant XLA attention of layers.py. For a decode
step (one query per row, no sliding window) on an accelerator, `kernel_for` picks:

- GPU: `jax.experimental.pallas.ops.gpu.paged_attention` -- its page layout
  `[kv_heads, pages, page_size, head_dim]` is one layer of our pool, so the pool and the page
  table go in as they are (queries pre-scaled: the kernel does not scale);
- TPU: `jax.experimental.pallas.ops.tpu.ragged_paged_attention` -- its pages interleave keys
  and values by head (`[pages, page_size, 2 * kv_heads, head_dim]`), so the rows' pages are
  gathered into that layout first (the same gather the XLA path does) and the kernel reads the
  compact copy.

Neither kernel promises batch invariance (docs/batch_invariance.md: accelerators). Each is
also callable in Pallas interpret mode (`interpret=True`), which tests use on CPU to compare
it with the XLA path; `JAXDECODE_PAGED_KERNEL=xla` turns the dispatch off.
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
    """The largest power of two <= most dividing `pages` (the GPU kernel's k_splits)."""
    s = 1
    while s * 2 <= most and pages % (s * 2) == 0:
        s *= 2
    return s


def gpu_decode(q: Array, cache: PagedKVCache, layer: int, lengths: Array, kv_len: int,
               scale: Optional[float] = None, interpret: bool = False) -> Array:
    """q [B, 1, H, D] -> [B, 1, H, D] over the first `lengths[b]` keys of each row."""
    from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention

    d = q.shape[-1]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    pages = -(-kv_len // cache.page_size)
    splits = _splits(pages)
    out = paged_attention((q[:, 0] * scale).astype(q.dtype), cache.k[layer], cache.v[layer],
                          cache.page_table[:, :pages], lengths.astype(jnp.int32),
                          k_splits=splits, pages_per_compute_block=min(8, pages // splits),
                          interpret=interpret)
    return out[:, None]


def tpu_decode(q: Array, cache: PagedKVCache, layer: int, lengths: Array, kv_len: int,
               scale: Optional[float] = None, interpret: bool = False) -> Array:
    """q [B, 1, H, D] -> [B, 1, H, D]: the rows' pages in the ragged kernel's combined layout,
    one query per sequence."""
    from jax.experimental.pallas import tpu as pltpu
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ragged_paged_attention

    b, _, h, d = q.shape
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    pages = -(-kv_len // cache.page_size)
    table = cache.page_table[:, :pages]

    def layout(pool):  # [kvh, N, ps, D] -> the rows' pages [B * pages, ps, kvh, D]
        x = jnp.take(pool[layer], table.reshape(-1), axis=1)
        return x.transpose(1, 2, 0, 3)

    k, v = layout(cache.k), layout(cache.v)
    kv = jnp.stack([k, v], axis=3).reshape(k.shape[:2] + (-1, d))  # k at even, v at odd heads
    args = (q[:, 0], kv, lengths.astype(jnp.int32),
            jnp.arange(b * pages, dtype=jnp.int32).reshape(b, pages),
            jnp.arange(b + 1, dtype=jnp.int32), jnp.array([b], jnp.int32))
    # interpret: the TPU kernel itself under Pallas' TPU interpreter (runs on CPU)
    with pltpu.force_tpu_interpret_mode() if interpret else contextlib.nullcontext():
        return ragged_paged_attention(*args, sm_scale=scale, num_kv_pages_per_block=pages,
                                      num_queries_per_block=8)[:, None]


KERNELS = {"gpu": gpu_decode, "tpu": tpu_decode}


def kernel_for(cache: Any, tokens_per_row: int) -> Optional[Callable[..., Array]]:
    """The Pallas decode kernel for this call, or None for the XLA path (module docstring)."""
    if not isinstance(cache, PagedKVCache) or tokens_per_row != 1:
        return None
    if os.environ.get("JAXDECODE_PAGED_KERNEL", "auto") == "xla":
        return None
    return KERNELS.get(jax.default_backend())


__all__ = ["KERNELS", "gpu_decode", "kernel_for", "tpu_decode"]
