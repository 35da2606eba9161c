"""The requests of one level (`make_workload`: snippets, random, prefix-repetition,
sharegpt; deterministic given the seed) and their arrival times (`arrival_offsets`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional, Union

from jaxdecode.cli.bench.loadtest.config import (PROMPTS, SHAREGPT_INPUT, SHAREGPT_MAX_TOTAL,
                                                 SHAREGPT_MIN_LEN, SHAREGPT_OUTPUT, LoadConfig)

@dataclasses.dataclass(frozen=True)
class WorkItem:
    """One request's prompt (text, or token ids) and output length."""
    prompt: Union[str, list[int]]
    max_tokens: int

    @property
    def prompt_len(self) -> Optional[int]:
        return len(self.prompt) if isinstance(self.prompt, list) else None


def _rng(seed: int, stream: int, purpose: int):
    """A numpy Generator for (seed, stream, purpose): stream 0, 1, ... are the levels and -1 the
    warm-up; purpose 0 is the prompts, 1 the arrivals."""
    import numpy as np

    return np.random.default_rng([seed, stream + 1, purpose])


def _tokens(rng, cfg: LoadConfig, shape) -> Any:
    return rng.integers(cfg.token_min, cfg.token_max, size=shape)


def _distinct_rows(rng, cfg: LoadConfig, n: int, length: int) -> list[list[int]]:
    """n rows of random token ids, redrawn until no two are equal (when that is possible)."""
    rows = _tokens(rng, cfg, (n, length)).tolist()
    if (cfg.token_max - cfg.token_min) ** length < n:
        return rows
    seen: dict[tuple, int] = {}
    for i in range(n):
        while tuple(rows[i]) in seen:
            rows[i] = _tokens(rng, cfg, length).tolist()
        seen[tuple(rows[i])] = i
    return rows


def sharegpt_lengths(n: int, rng, max_input_len: int = 1024, max_total_len: int = 2048,
                     output_len: Optional[int] = None) -> list[tuple[int, int]]:
    """n (input, output) lengths: lognormal `SHAREGPT_INPUT` / `SHAREGPT_OUTPUT` rounded; input
    clipped to [4, min(max_input_len, max_total_len - 4)]; output at least 4 (or the fixed
    `output_len`) and at most max_total_len - input."""
    import numpy as np

    lo = SHAREGPT_MIN_LEN
    (mi, si), (mo, so) = SHAREGPT_INPUT, SHAREGPT_OUTPUT
    ins = np.rint(rng.lognormal(np.log(mi), si, n))
    outs = np.rint(rng.lognormal(np.log(mo), so, n))
    ins = np.clip(ins, lo, max(lo, min(max_input_len, max_total_len - lo))).astype(int)
    outs = np.full(n, output_len) if output_len is not None else np.maximum(outs, lo)
    outs = np.maximum(np.minimum(outs, max_total_len - ins), 1).astype(int)
    return [(int(a), int(b)) for a, b in zip(ins, outs)]


def make_workload(cfg: LoadConfig, n: int, stream: int = 0) -> list[WorkItem]:
    """The n requests of one level (`stream` 0, 1, ...; -1: the warm-up), deterministic given
    cfg.seed: each level draws its own token ids, so a level does not hit the prefix cache with
    an earlier level's prompts (the prefix-repetition prefixes are per level too)."""
    w = cfg.workload
    if w == "snippets":
        return [WorkItem(PROMPTS[i % len(PROMPTS)], cfg.max_tokens) for i in range(n)]
    rng = _rng(cfg.seed, stream, 0)
    if w == "random":
        rows = _tokens(rng, cfg, (n, cfg.input_len)).tolist()
        return [WorkItem(p, cfg.max_tokens) for p in rows]
    if w == "prefix-repetition":
        prefixes = _distinct_rows(rng, cfg, cfg.num_prefixes, cfg.prefix_len)
        suffixes = _distinct_rows(rng, cfg, n, cfg.suffix_len)
        which = rng.permutation(n) % cfg.num_prefixes  # each prefix n / N times, shuffled
        return [WorkItem(prefixes[k] + suffixes[i], cfg.max_tokens)
                for i, k in enumerate(which.tolist())]
    assert w == "sharegpt", w
    lengths = sharegpt_lengths(n, rng, cfg.max_input_len,
                               cfg.max_total_len or SHAREGPT_MAX_TOTAL, cfg.sharegpt_output_len)
    return [WorkItem(_tokens(rng, cfg, a).tolist(), b) for a, b in lengths]


def arrival_offsets(n: int, rate: float, burstiness: float = 1.0, seed: int = 0,
                    stream: int = 0) -> list[float]:
    """When each of n requests arrives, in seconds from the level's start: the first at 0, then
    gaps from a gamma distribution of shape `burstiness` and mean 1 / rate (shape 1: a Poisson
    process, exponential gaps; vLLM's `--burstiness`); every request at 0 when rate is inf."""
    import numpy as np

    if math.isinf(rate) or n <= 1:
        return [0.0] * n
    gaps = _rng(seed, stream, 1).gamma(burstiness, 1.0 / (rate * burstiness), n - 1)
    return [0.0] + np.cumsum(gaps).tolist()
