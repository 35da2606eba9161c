"""Static sizes for dynamic lengths (pure Python, shared by the device code and the engine's
scheduler): every jitted program is compiled for a few bucketed shapes, never per length."""

from __future__ import annotations

from typing import Optional

MIN_BUCKET = 16
KV_BUCKET_MIN = 128  # one attention key block (models.layers.ATTN_BLOCK)


def power_of_two(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(0, int(n) - 1).bit_length()


def bucket(n: int, cap: Optional[int] = None) -> int:
    """The static size used for a dynamic length n: the next power of two >= 16, capped."""
    size = max(MIN_BUCKET, power_of_two(n))
    return min(size, cap) if cap is not None else size


def row_bucket(n: int) -> int:
    """The row count a device call of n rows runs (a prefill chunk call): the smallest of
    1, 2, 3, 4, 6, 8, 12, 16, 24, ... (powers of two and three quarters of them) >= n, the
    rows past n padding. Every padding row costs its weight products (stacked tiles), so the
    three-quarter steps bound the padding at a third of the call, where powers of two alone
    let it reach a half, for a few more programs (a call's row count moves no row's bits)."""
    power = power_of_two(n)
    three_quarters = 3 * power // 4
    return three_quarters if power >= 4 and n <= three_quarters else power


def row_buckets(most: int) -> list[int]:
    """Every `row_bucket` value up to row_bucket(most), ascending (the row counts warm-up
    compiles)."""
    return sorted({row_bucket(n) for n in range(1, row_bucket(most) + 1)})


def kv_bucket(longest: int, max_len: int) -> int:
    """The attention bucket covering `longest` positions: a power of two >= KV_BUCKET_MIN,
    capped at max_len -- few compiled variants, and short requests never pay for a long
    max_len."""
    size = max(KV_BUCKET_MIN, power_of_two(longest))
    return min(size, max_len)


def chunk_plan(n: int, start: int, chunk: int, max_len: int) -> list[tuple[int, int, int, int]]:
    """The prefill chunks of positions [start, n) (start a multiple of `chunk`): (start, T,
    real tokens, attention bucket) each. Chunks start at multiples of `chunk` from position 0;
    every one runs at T = chunk but the last, which runs at its own bucket (<= chunk)."""
    out = []
    while start < n:
        length = min(chunk, n - start)
        t = chunk if length == chunk else bucket(length, chunk)
        out.append((start, t, length, kv_bucket(start + t, max_len)))
        start += length
    return out


def chunk_length(n: int, chunk: int):
    """chunk index -> the program length T of that chunk for an input of n tokens."""
    last = (n - 1) // chunk
    return lambda c: chunk if c < last else chunk_plan(n, last * chunk, chunk, 1 << 62)[0][1]
