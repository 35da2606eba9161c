"""Shared pieces of the bench runners: the configuration, the machine description, the
memory-bandwidth roofline, timing helpers and random prompts."""

from __future__ import annotations

import dataclasses
import os
import platform
import statistics
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

@dataclasses.dataclass
class BenchConfig:
    batches: Sequence[int] = (1, 16)
    prompt_len: int = 16
    new_tokens: int = 64
    repeats: int = 3
    seed: int = 0


def machine() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "backend": jax.default_backend(),
            "device": jax.devices()[0].device_kind, "jax": jax.__version__,
            "jaxlib": jax.lib.__version__ if hasattr(jax.lib, "__version__") else jax.__version__}


def gemv_bandwidth(mbytes: int = 128, repeats: int = 20) -> float:
    """Bytes/s streamed by an f32 matrix-vector product over a matrix of `mbytes` MB."""
    cols = 4096
    rows = mbytes * 2**20 // (4 * cols)
    mat = jax.random.normal(jax.random.key(0), (rows, cols), jnp.float32)
    vec = jnp.ones((cols,), jnp.float32)
    f = jax.jit(lambda m, v: m @ v)
    f(mat, vec).block_until_ready()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        f(mat, vec).block_until_ready()
        times.append(time.perf_counter() - t0)
    return mat.nbytes / min(times)


def step_bytes(params: Any) -> int:
    """Bytes a decode step must read: every parameter except the embedding table's unused rows."""
    total = sum(x.nbytes for x in jax.tree.leaves(params))
    if isinstance(params, dict) and "embed" in params and "lm_head" in params:
        total -= params["embed"].nbytes
    return total


def median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def timed(fn, repeats: int) -> tuple[float, Any]:
    result = fn()  # warm-up (compiles)
    return median_time(fn, repeats), result


def prompts(batch: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return rng.integers(3, vocab, size=(batch, length)).tolist()



def step_times(runs: dict, steps: int, repeats: int) -> dict:
    """Decode-step time per mode: `runs[mode] = (step, state)`, `step(state) -> (state, out)`
    jitted; `steps` chained steps timed (the state copy is not), modes measured round-robin
    in the same process so that machine load hits every mode alike, after one warm-up round.
    Keys: <mode>_step_ms (median), <mode>_step_ms_min (least disturbed by load),
    <mode>_overhead vs the first mode, compiles_warmup, compiles_after_warmup."""
    from jaxdecode.device.decode import compilation_count

    def chain(step, state) -> float:  # seconds per step
        state = jax.block_until_ready(jax.tree.map(jnp.copy, state))
        t0 = time.perf_counter()
        for _ in range(steps):
            state, out = step(state)
        jax.block_until_ready(out.token)
        return (time.perf_counter() - t0) / steps

    c0 = compilation_count()
    for step, state in runs.values():  # warm-up (compiles)
        chain(step, state)
    c1 = compilation_count()
    times: dict = {m: [] for m in runs}
    for _ in range(repeats):
        for mode, (step, state) in runs.items():
            times[mode].append(chain(step, state))
    row = {"compiles_warmup": c1 - c0, "compiles_after_warmup": compilation_count() - c1}
    for mode in runs:
        row[f"{mode}_step_ms"] = statistics.median(times[mode]) * 1e3
        row[f"{mode}_step_ms_min"] = min(times[mode]) * 1e3
    base = next(iter(runs))
    for mode in list(runs)[1:]:
        row[f"{mode}_overhead"] = row[f"{mode}_step_ms"] / row[f"{base}_step_ms"] - 1
    return row
