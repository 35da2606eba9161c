"""The metrics of one concurrency level, as `vllm bench serve` computes them: percentiles,
mean / median / std / p99 in ms, throughput (`summarize`).
"""

from __future__ import annotations

import math
from typing import Sequence

from jaxdecode.cli.bench.loadtest.results import RequestResult

def percentiles(values: Sequence[float], qs: Sequence[int] = (50, 99)) -> dict:
    """{"p50": ..., "p99": ...} (numpy's linear interpolation); None values when empty."""
    import numpy as np

    if len(values) == 0:
        return {f"p{q}": None for q in qs}
    got = np.percentile(np.asarray(values, dtype=np.float64), qs)
    return {f"p{q}": float(v) for q, v in zip(qs, got)}


def stats_ms(values_s: Sequence[float]) -> dict:
    """vLLM's statistics of a latency in milliseconds: {"mean", "median", "std", "p99"}
    (numpy's mean, median, population std and linear-interpolation p99); None when empty."""
    import numpy as np

    if len(values_s) == 0:
        return {"mean": None, "median": None, "std": None, "p99": None}
    ms = np.asarray(values_s, dtype=np.float64) * 1e3
    return {"mean": float(ms.mean()), "median": float(np.median(ms)), "std": float(ms.std()),
            "p99": float(np.percentile(ms, 99))}


def summarize(results: Sequence[RequestResult], concurrency: int, wall_s: float,
              request_rate: float = math.inf) -> dict:
    """One level's row: counts, token totals, throughput, and latency statistics -- vLLM's
    (`ttft_ms`, `tpot_ms`, `itl_ms`, `e2el_ms`: mean / median / std / p99 in ms) and the
    earlier percentiles in seconds (`ttft_s`, `inter_chunk_s`: p50 / p99)."""
    ok = [r for r in results if r.ok]
    errors: dict[str, int] = {}
    for r in results:
        if not r.ok:
            errors[r.failure()] = errors.get(r.failure(), 0) + 1
    tokens = sum(r.completion_tokens for r in ok)
    inputs = sum(r.prompt_tokens or 0 for r in ok)
    cached = [r.cached_tokens for r in ok if r.cached_tokens is not None]
    chunks = sum(len(r.chunk_times) for r in ok)
    gaps = [g for r in ok for g in r.gaps_s]
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    per_s = (lambda v: v / wall_s) if wall_s > 0 else (lambda v: None)
    return {"concurrency": concurrency,
            "request_rate": None if math.isinf(request_rate) else request_rate,
            "requests": len(results), "completed": len(ok), "errors": len(results) - len(ok),
            "error_kinds": errors, "wall_s": wall_s, "input_tokens": inputs,
            "output_tokens": tokens, "cached_tokens": sum(cached) if cached else None,
            "requests_per_s": per_s(len(ok)), "output_tokens_per_s": per_s(tokens),
            "total_tokens_per_s": per_s(inputs + tokens),
            "ttft_ms": stats_ms(ttfts),
            "tpot_ms": stats_ms([r.tpot_s for r in ok if r.tpot_s is not None]),
            "itl_ms": stats_ms(gaps),
            "e2el_ms": stats_ms([r.e2el_s for r in ok if r.e2el_s is not None]),
            "ttft_s": percentiles(ttfts), "inter_chunk_s": percentiles(gaps),
            "tokens_per_chunk": tokens / chunks if chunks else None}
