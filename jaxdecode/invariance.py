"""Batch invariance (docs/batch_invariance.md, docs/contract.md X1): the one home of its
construction -- row tiles, fixed sums, block attention, the product probes and the row-tile check.

A leaf module (jax and numpy only) that `models/` and the decoder both import. A model's
construction is one static setting, `mode`:

- "row_tiles" (XLA:CPU's default): weight products on `row_tile`-row tiles; the tiles of a batch
  run as one stacked product where a probe found that this keeps every row's bits, else as a
  loop; attention on fixed key blocks; every sum in `fixed_sum`'s layout.
- "fixed_shape" (GPU and TPU's default; forced anywhere with `JAXDECODE_INVARIANCE` or
  `with_invariance`): the program's products have one fixed row count, the tile (the engine's
  slot count, or a width declared for `jd.generate`), so a decode step holds one product per
  weight; a call of several tiles unrolls them statically, chained so that no compiler merges
  them -- no loop, no host read-back, no probe. Attention and sums as in "row_tiles".
- "none" (`batch_invariant=False`): XLA's plain products, reductions and softmax attention.

Probes run when a program is built (`ProbesNeeded`, caught by `device.numerics.jit`), never
eagerly inside a trace.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os
import threading
from typing import Any, Iterator, Optional

import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array

MODES = ("row_tiles", "fixed_shape", "none")
# Environment switch for the construction of "auto" models: "auto", "row_tiles" or "fixed_shape".
CONSTRUCTION_ENV = "JAXDECODE_INVARIANCE"
# Token rows per weight-product tile of a "row_tiles" model by default.
ROW_TILE = 4
# The widest row tile a model accepts.
MAX_ROW_TILE = 256
# Keys per attention block: every (row, kv head, block) is one product of fixed shape.
ATTN_BLOCK = 128
# Query rows per kv head (T x G, static) up to which attention is elementwise products and
# fixed sums (`_attention_elementwise`): decode steps and speculative verification.
ELEMENTWISE_QUERY_ROWS = 8


def construction(mode: str = "auto", backend: Optional[str] = None) -> str:
    """The construction a model of `mode` runs on `backend` (default: jax's): "auto" is
    `JAXDECODE_INVARIANCE` when set, else "row_tiles" on XLA:CPU and "fixed_shape" elsewhere."""
    if mode != "auto":
        return mode
    forced = os.environ.get(CONSTRUCTION_ENV, "auto")
    if forced not in ("auto", "row_tiles", "fixed_shape"):
        raise ValueError(f"{CONSTRUCTION_ENV}={forced!r}: expected 'auto', 'row_tiles' or "
                         "'fixed_shape'")
    if forced != "auto":
        return forced
    return "row_tiles" if (backend or jax.default_backend()) == "cpu" else "fixed_shape"


def check_mode(mode: Any) -> str:
    if mode not in MODES + ("auto",):
        raise ValueError(f"batch_invariance: expected one of {('auto',) + MODES}, got {mode!r}")
    return mode


def check_tile(row_tile: Any) -> int:
    if (not isinstance(row_tile, (int, np.integer)) or isinstance(row_tile, bool)
            or not 1 <= row_tile <= MAX_ROW_TILE):
        raise ValueError(f"row_tile: expected an integer in [1, {MAX_ROW_TILE}], got "
                         f"{row_tile!r}")
    return int(row_tile)


def configure(model: Any, batch_invariant: Optional[bool] = None,
              row_tile: Optional[int] = None) -> Any:
    """`model` with invariance off (`batch_invariant=False`) and on `row_tile`-row tiles (None:
    its own); ValueError naming the field a model cannot take. A tile is checked against this
    process's products (`check_row_tile`)."""
    if batch_invariant is not None and not isinstance(batch_invariant, bool):
        raise ValueError(f"batch_invariant: expected True or False, got {batch_invariant!r}")
    if batch_invariant is False and getattr(model, "batch_invariant", False):
        if not hasattr(model, "with_invariance"):
            raise ValueError(f"batch_invariant: {type(model).__name__} cannot turn its "
                             "invariance off (no `with_invariance`)")
        model = model.with_invariance("none")
    if row_tile is not None:
        if not hasattr(model, "with_row_tile"):
            raise ValueError(f"row_tile: {type(model).__name__} has no row tiles "
                             "(no `with_row_tile`, jaxdecode.model_api.DecoderModel)")
        model = model.with_row_tile(row_tile)
    if getattr(model, "batch_invariant", False) and hasattr(model, "row_tile"):
        check_row_tile(model.row_tile)
    return model


def mode_of(model: Any) -> str:
    """The construction `model` runs here: its resolved `mode`, or "none" without invariance."""
    if not getattr(model, "batch_invariant", False):
        return "none"
    return construction(getattr(model, "invariance", "auto"))


# -- sums -----------------------------------------------------------------------------------------

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


def mean(x: Array, invariant: bool = True) -> Array:
    """Mean over the last axis (kept): `fixed_sum`'s layout, or XLA's own reduction."""
    if not invariant:
        return jnp.mean(x, axis=-1, keepdims=True)
    return fixed_sum(x, -1, keepdims=True) / x.shape[-1]


def block_sum(x: Array, axis: int) -> Array:
    """Sum over a key axis of whole ATTN_BLOCKs: `fixed_sum`'s tree inside each block, then the
    blocks added left to right. Whole zero blocks at either end (masked keys) add exact zeros
    and change no bit, so attention over a block-aligned window of the cache equals attention
    over the whole cache."""
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


# -- weight products ------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Tiles:
    """`dense`'s row tiling in the cached forward: products of max(size, T) token rows, up to
    the tile holding the last of the first `rows` batch rows (int32, traced) where the tiles
    loop; `unrolled` ("fixed_shape"): every tile, statically, one product each. Batch rows past
    `rows` (padding rows of a chunk call, finished or empty slots) are dropped by the callers."""

    size: int
    rows: Array
    unrolled: bool = False

    @classmethod
    def upto_last_live(cls, lengths: Array, size: int = ROW_TILE,
                       unrolled: bool = False) -> "Tiles":
        """Tiles of `size` rows covering every row with tokens (lengths > 0) and the rows
        before it."""
        live = jnp.where(lengths > 0, jnp.arange(lengths.shape[0], dtype=jnp.int32) + 1, 0)
        return cls(size, jnp.max(live, initial=0), unrolled)


def dense(x: Array, w: Array, tile: Optional[Tiles] = None, *, transpose: bool = False,
          out_dtype: Any = None, dot: Any = None) -> Array:
    """x [B, T, K] @ w [K, N] (w [N, K] with `transpose`) -> [B, T, N]; `tile` None: XLA's
    product. `dot`: a drop-in for `jax.lax.dot_general` that takes `w` (a quantized weight's
    product, models/quantization.py); its tiles never stack (no probe knows its product).

    With `tile`, each token row's arithmetic is that of one fixed-shape product of exactly
    max(tile.size, T) rows (the last tile zero-padded), whatever B is. One tile: one product.
    Several, unrolled: one product each, each tile's input chained after the previous tile's
    output (an optimization barrier), so no compiler pass merges them into a larger product.
    Several, looped: where the CPU's GEMM gives every row of the stacked tiles the bits of its
    own tile (`stacked_tiles_agree`, probed per shape when the program is built) one product,
    else a loop of tile products that stops after the tile holding batch row `tile.rows - 1`
    (later rows are zeros), its trip count hidden from XLA so that it is never unrolled."""
    contract = lambda a: (((a.ndim - 1,), (1 if transpose else 0,)), ((), ()))  # noqa: E731
    product = lambda a: (dot or jax.lax.dot_general)(a, w, contract(a),  # noqa: E731
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
    shape = (count * rows, rows, k, n, jnp.dtype(x.dtype).name, jnp.dtype(w.dtype).name,
             None if out_dtype is None else jnp.dtype(out_dtype).name, transpose)
    if count == 1 or (not tile.unrolled and dot is None and stacked_tiles_agree(*shape)):
        return product(flat)[:m].reshape(*lead, t, n)
    if tile.unrolled:
        return _unrolled(flat, product, rows, count)[:m].reshape(*lead, t, n)
    out = jnp.zeros((count * rows, n), jax.eval_shape(product, flat[:rows]).dtype)

    def body(i, out):
        part = jax.lax.dynamic_slice_in_dim(flat, i * rows, rows)
        return jax.lax.dynamic_update_slice_in_dim(out, product(part), i * rows, 0)

    trips = jnp.minimum((tile.rows * t + rows - 1) // rows, count)
    out = jax.lax.fori_loop(0, jax.lax.optimization_barrier(trips), body, out)
    return out[:m].reshape(*lead, t, n)


def _unrolled(flat: Array, product, rows: int, count: int) -> Array:
    """The `count` tiles of `flat` as `count` products of `rows` rows, each tile's input passed
    through an optimization barrier together with the previous tile's output."""
    outs = [product(flat[:rows])]
    for i in range(1, count):
        part, _ = jax.lax.optimization_barrier((flat[i * rows:(i + 1) * rows], outs[-1]))
        outs.append(product(part))
    return jnp.concatenate(outs)


# -- attention ------------------------------------------------------------------------------------

def soft_cap(x: Array, cap: Optional[float]) -> Array:
    """cap * tanh(x / cap) (Gemma 2's attention-logit and final-logit soft-capping, HF order of
    operations), elementwise, so it keeps X1; `cap` None: x unchanged."""
    return x if cap is None else jnp.tanh(x / cap) * cap


def attention(q: Array, k: Array, v: Array, q_pos: Array, k_pos: Array,
              sliding_window: Optional[int] = None, scale: Optional[float] = None,
              invariant: bool = True, softcap: Optional[float] = None) -> Array:
    """Causal grouped-query attention by absolute position.

    q: [B, T, H, D]; k, v: [B, KVH, S, D] (heads-major, as in the cache); q_pos: int32[B, T];
    k_pos: int32[S] or [B, S]. A query at position p sees keys at positions 0..p (and
    > p - window with a sliding window). Returns [B, T, H, D]. `invariant=False`: XLA's
    products and softmax over the whole key axis. `softcap`: the scaled scores pass through
    `soft_cap` before the mask and softmax (Gemma 2).

    Batch invariant by construction: the keys are cut into blocks of ATTN_BLOCK (the last one
    zero-padded and masked) and the block is a batch axis of both products, so every (row, kv
    head, block) is one product of fixed shape whatever B and S are; the maximum is exact and
    the softmax denominator and the sum over blocks are `block_sum`s, to which masked keys and
    whole masked blocks at either end add exact zeros. With at most ELEMENTWISE_QUERY_ROWS
    query rows per kv head (decode, speculative verification) the same holds without products
    (`_attention_elementwise`); which path runs depends only on the static T and G."""
    b, t, h, d = q.shape
    kvh, s = k.shape[1], k.shape[2]
    g = h // kvh
    scale = (1.0 / math.sqrt(d)) if scale is None else scale
    k_pos = jnp.broadcast_to(k_pos, (b, s))
    if not invariant:
        return _attention_plain(q, k, v, q_pos, k_pos, sliding_window, scale, softcap)
    nb = -(-s // ATTN_BLOCK)
    if nb * ATTN_BLOCK != s:  # padded keys sit past every query: never visible
        pad = ((0, 0), (0, 0), (0, nb * ATTN_BLOCK - s), (0, 0))
        k, v = jnp.pad(k, pad), jnp.pad(v, pad)
        k_pos = jnp.pad(k_pos, ((0, 0), (0, nb * ATTN_BLOCK - s)),
                        constant_values=jnp.iinfo(jnp.int32).max)
    if t * g <= ELEMENTWISE_QUERY_ROWS:
        return _attention_elementwise(q, k, v, q_pos, k_pos, sliding_window, scale, softcap)
    blocks = lambda x: x.reshape(b, kvh, nb, ATTN_BLOCK, d)  # noqa: E731
    # at least 2 query rows: XLA rewrites a product with one row as multiply + reduce, whose
    # order depends on the batch axes (the padding row is dropped below)
    rows = max(2, t * g)
    qg = q.reshape(b, t, kvh, g, d).transpose(0, 2, 1, 3, 4).reshape(b, kvh, 1, t * g, d)
    qg = jnp.pad(qg, ((0, 0), (0, 0), (0, 0), (0, rows - t * g), (0, 0)))
    qg = jnp.broadcast_to(qg, (b, kvh, nb, rows, d))
    scores = jnp.einsum("bknqd,bknsd->bknqs", qg, blocks(k),
                        preferred_element_type=jnp.float32)[:, :, :, :t * g] * scale
    scores = soft_cap(scores, softcap)
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


def _visible(kp: Array, qp: Array, sliding_window: Optional[int]) -> Array:
    visible = kp <= qp
    if sliding_window is not None:
        visible &= kp > qp - sliding_window
    return visible


def _softmax_numerator(scores: Array, kp: Array, qp: Array, sliding_window: Optional[int],
                       axes: tuple) -> Array:
    """exp(score - max over the key `axes`) where the key at position kp is visible from the
    query at qp (causal, within the window), exactly 0 elsewhere; the maximum is exact."""
    scores = jnp.where(_visible(kp, qp, sliding_window), scores, -jnp.inf)
    top = jnp.max(scores, axis=axes, keepdims=True)
    return jnp.exp(scores - jnp.where(jnp.isfinite(top), top, 0.0))


def _attention_plain(q: Array, k: Array, v: Array, q_pos: Array, k_pos: Array,
                     sliding_window: Optional[int], scale: float,
                     softcap: Optional[float] = None) -> Array:
    """`attention` as XLA's products and softmax over the whole key axis (not invariant)."""
    b, t, h, d = q.shape
    kvh = k.shape[1]
    g = h // kvh
    qg = q.reshape(b, t, kvh, g, d)
    scores = jnp.einsum("btkgd,bksd->bkgts", qg, k, preferred_element_type=jnp.float32) * scale
    scores = soft_cap(scores, softcap)
    visible = _visible(k_pos[:, None, None, None, :], q_pos[:, None, None, :, None],
                       sliding_window)
    scores = jnp.where(visible, scores, -jnp.inf)
    top = jnp.max(scores, axis=-1, keepdims=True)
    probs = jnp.exp(scores - jnp.where(jnp.isfinite(top), top, 0.0))
    total = jnp.sum(probs, axis=-1, keepdims=True)
    probs = (probs / jnp.where(total > 0, total, 1.0)).astype(v.dtype)
    out = jnp.einsum("bkgts,bksd->btkgd", probs, v)
    return out.astype(q.dtype).reshape(b, t, h, d)


def _attention_elementwise(q: Array, k: Array, v: Array, q_pos: Array, k_pos: Array,
                           sliding_window: Optional[int], scale: float,
                           softcap: Optional[float] = None) -> Array:
    """`attention` for a few query rows per kv head, without products: each score is a
    `fixed_sum` over head_dim of elementwise products, each output a `fixed_sum` over the keys,
    so a row's bits depend on that row alone and invisible keys add exact zeros. The keys are
    already padded to whole ATTN_BLOCKs: XLA:CPU evaluates `exp` on the ragged tail of a
    vectorized axis with other code, whose last bit differs. The products and the scaled scores
    are materialized (optimization barriers), so no add is contracted with a multiply into a
    fused multiply-add whose presence would depend on how XLA fuses a given batch."""
    b, t, h, d = q.shape
    kvh, s = k.shape[1], k.shape[2]
    g = h // kvh
    f32 = jnp.float32
    qg = q.reshape(b, t, kvh, g, d).transpose(0, 2, 1, 3, 4).astype(f32)  # [B, KVH, T, G, D]
    products = jax.lax.optimization_barrier(
        qg[:, :, :, :, None, :] * k.astype(f32)[:, :, None, None])        # [B, KVH, T, G, S, D]
    scores = jax.lax.optimization_barrier(fixed_sum(products, -1) * scale)  # [B, KVH, T, G, S]
    scores = soft_cap(scores, softcap)
    probs = _softmax_numerator(scores, k_pos.reshape(b, 1, 1, 1, s),
                               q_pos.reshape(b, 1, t, 1, 1), sliding_window, (4,))
    total = block_sum(probs, -1)                                          # [B, KVH, T, G]
    weighted = jax.lax.optimization_barrier(
        probs[..., None] * v.astype(f32)[:, :, None, None])              # [B, KVH, T, G, S, D]
    out = block_sum(weighted, 4) / jnp.where(total > 0, total, 1.0)[..., None]
    return out.astype(q.dtype).transpose(0, 2, 1, 3, 4).reshape(b, t, h, d)


# -- XLA:CPU's product library and the probes ----------------------------------------------------

# XLA:CPU's Eigen products instead of jaxlib 0.10's default YNNPACK fusions: about twice as fast
# for small row tiles, but under Eigen a row's bits may depend on its place in the tile (on an
# AVX2 CPU: the last two places of 8 rows, none of 4), so `compiler_options` asks for them only
# where `place_invariant` holds. Single-threaded: Eigen's thread-pool products gave a row of a
# Gemma 3 chunk call other bits in a call of 3 or 8 rows than alone (K/V one ulp apart, AMD
# EPYC), though each product alone passed its probe; one thread per product costs nothing
# measurable here (llama-512 decode at batch 1 and 16: docs/performance/journal.md).
EIGEN_PRODUCTS = {"xla_cpu_experimental_ynn_fusion_type": "", "xla_cpu_multi_thread_eigen": False}
# Environment switch: "auto" (the default: Eigen where the probe passes) or "ynnpack".
PRODUCTS_ENV = "JAXDECODE_CPU_PRODUCTS"


def place_invariant(options: dict, rows: int = ROW_TILE) -> bool:
    """Whether products of `rows` x K rows compiled with `options` give every row the same bits
    at every place in the tile, whatever the other rows hold (zeros or data), for float32 and
    bfloat16, plain and transposed weights. False when the backend rejects `options`."""
    rng = np.random.default_rng(0)
    for dtype in (jnp.float32, jnp.bfloat16):
        for transpose in (False, True):
            try:
                x, product = _probe_product(rng, rows, 96, 160, dtype, dtype, None, transpose,
                                            options)
                full = product(x)
                for place in range(rows):
                    alone = jnp.zeros_like(x).at[place].set(x[0])
                    moved = jnp.roll(x, place, axis=0)
                    if not (np.array_equal(product(alone)[place], full[0])
                            and np.array_equal(product(moved)[place], full[0])):
                        return False
            except Exception:  # noqa: BLE001 -- an option this XLA does not know
                return False
    return True


def _probe_product(rng: np.random.Generator, rows: int, k: int, n: int, dtype: Any,
                   weight_dtype: Any, out_dtype: Any, transpose: bool, options: dict):
    """The probes' setup: random rows x [rows, K] and `product(a) -> numpy`, a jitted product
    of any rows against one random weight ([K, N], [N, K] with `transpose`) under `options`."""
    w = jnp.asarray(rng.standard_normal((n, k) if transpose else (k, n)), weight_dtype)
    x = jnp.asarray(rng.standard_normal((rows, k)), dtype)
    dims = (((1,), (1 if transpose else 0,)), ((), ()))
    jitted = jax.jit(lambda a, b: jax.lax.dot_general(a, b, dims,
                                                      preferred_element_type=out_dtype),
                     compiler_options=options)
    return x, lambda a: np.asarray(jitted(a, w))


# XLA:GPU's determinism option: no atomics-based (run-to-run nondeterministic) split-K
# reductions or scatters. A fixed-shape product then runs one algorithm per shape in a process.
GPU_DETERMINISM = {"xla_gpu_deterministic_ops": True}


@functools.cache
def compiler_options() -> dict:
    """Options of every program the decoder compiles, decided once per process at its first
    compile: on XLA:CPU Eigen's products where they are place invariant at `ROW_TILE` rows (and
    `JAXDECODE_CPU_PRODUCTS` is not "ynnpack"), else XLA's defaults; on a GPU
    `GPU_DETERMINISM` where this XLA accepts it."""
    choice = os.environ.get(PRODUCTS_ENV, "auto")
    if choice not in ("auto", "ynnpack"):
        raise ValueError(f"{PRODUCTS_ENV}={choice!r}: expected 'auto' or 'ynnpack'")
    backend = jax.default_backend()
    if backend == "gpu":
        return GPU_DETERMINISM if _accepted(GPU_DETERMINISM) else {}
    if choice == "auto" and backend == "cpu" and place_invariant(EIGEN_PRODUCTS):
        return EIGEN_PRODUCTS
    return {}


def _accepted(options: dict) -> bool:
    """Whether this backend compiles a small program with `options`."""
    try:
        jax.jit(lambda a: a @ a, compiler_options=options)(jnp.ones((8, 8))).block_until_ready()
        return True
    except Exception:  # noqa: BLE001 -- an option this XLA does not know
        return False


@functools.cache
def check_row_tile(rows: int) -> None:
    """A model's `row_tile` must keep every row's bits the same at every place of its tile under
    the products this process compiles with (`compiler_options`, chosen for `ROW_TILE` rows);
    ValueError naming `row_tile` where they do not. Checked on XLA:CPU."""
    if rows == ROW_TILE or jax.default_backend() != "cpu":
        return
    options = compiler_options()
    if not place_invariant(options, rows):
        library = "Eigen's" if options else "YNNPACK's"
        raise ValueError(
            f"row_tile: {library} products on this CPU give a row different bits at different "
            f"places of a {rows}-row tile, so a request's tokens would depend on its neighbours;"
            f" use row_tile {ROW_TILE} (the default) or another width that passes "
            "`jaxdecode.invariance.place_invariant`")


class ProbesNeeded(Exception):
    """Raised out of a trace that met product shapes no probe has answered yet (`shapes`); the
    program builder (`device.numerics.jit`) runs `run_probes(shapes)` and traces again."""

    def __init__(self, shapes: frozenset):
        super().__init__(f"{len(shapes)} product shapes to probe")
        self.shapes = shapes


_answers: dict = {}
_recording = threading.local()


@contextlib.contextmanager
def recording() -> Iterator[set]:
    """Within a trace: the set of product shapes `stacked_tiles_agree` found unanswered."""
    outer = getattr(_recording, "missing", None)
    _recording.missing = missing = set()
    try:
        yield missing
    finally:
        _recording.missing = outer


def stacked_tiles_agree(m: int, rows: int, k: int, n: int, dtype: str, weight_dtype: str,
                        out_dtype: Optional[str], transpose: bool) -> bool:
    """Whether one product of m = c x `rows` rows against a [K, N] weight ([N, K] with
    `transpose`) gives every row the bits that the product of its own `rows`-row tile gives it,
    under `compiler_options()`: then `dense` runs the c tiles as that one product. Answered by
    a probe that ran before the trace (`run_probes`); a shape without an answer is recorded for
    the builder (`recording`) and runs the tile loop. XLA:CPU in a process of one device only (a
    partitioned weight runs other products); elsewhere False."""
    if m == rows:
        return True
    if jax.default_backend() != "cpu" or jax.device_count() != 1:
        return False
    shape = (m, rows, k, n, dtype, weight_dtype, out_dtype, transpose,
             tuple(sorted(compiler_options().items())))
    if shape in _answers:
        return _answers[shape]
    missing = getattr(_recording, "missing", None)
    if missing is not None:
        missing.add(shape)
    return False


def run_probes(shapes) -> None:
    """Probe every shape of `stacked_tiles_agree` (eagerly: call it outside any trace): compile
    the m-row product and the `rows`-row product, run both on random data, compare every row."""
    for shape in shapes:
        if shape not in _answers:
            _answers[shape] = _stacked_probe(*shape)


def _stacked_probe(m: int, rows: int, k: int, n: int, dtype: str, weight_dtype: str,
                   out_dtype: Optional[str], transpose: bool, options: tuple) -> bool:
    x, product = _probe_product(np.random.default_rng(0), m, k, n, dtype, weight_dtype, out_dtype,
                                transpose, dict(options))
    tiles = [product(x[i:i + rows]) for i in range(0, m, rows)]
    return bool(np.array_equal(product(x), np.concatenate(tiles)))
