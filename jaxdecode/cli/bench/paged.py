"""`bench --paged`: the decode step over KV pages against the same step over a contiguous
cache (issue #15: within 10%), measured round-robin in one process at each batch size."""

from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxdecode.cli.bench.timing import machine, prompts, step_times
from jaxdecode.config import SamplingParams


def paged_state(state, page_size: int):
    """`state` (a StepState over a contiguous KVCache, as `decode.prepare` builds it) with its
    cache copied into a page pool: row b's positions in pages 1 + b * P, ... (page 0 null)."""
    from jaxdecode.model_api import PagedKVCache

    cache = state.cache
    layers, b, kvh, max_len, hd = cache.k.shape
    per_row = -(-max_len // page_size)

    def pool(x):  # [L, B, kvh, S, hd] -> [L, kvh, 1 + B * P, ps, hd]
        x = jnp.pad(x, ((0, 0), (0, 0), (0, 0), (0, per_row * page_size - max_len), (0, 0)))
        x = x.reshape(layers, b, kvh, per_row, page_size, hd).transpose(0, 2, 1, 3, 4, 5)
        x = x.reshape(layers, kvh, b * per_row, page_size, hd)
        return jnp.pad(x, ((0, 0), (0, 0), (1, 0), (0, 0), (0, 0)))

    table = 1 + np.arange(b * per_row, dtype=np.int32).reshape(b, per_row)
    return state.replace(cache=PagedKVCache(k=pool(cache.k), v=pool(cache.v),
                                            page_table=jnp.asarray(table),
                                            lengths=cache.lengths, max_len=max_len))


def time_paged(model, params, batches: Sequence[int] = (1, 16), steps: int = 32,
               repeats: int = 5, page_size: int = 16, prompt_len: int = 16) -> dict:
    """Chained decode-step time, contiguous cache vs pages, per batch size (sampled rows, the
    attention bucket of the engine's first steps)."""
    from jaxdecode.device.decode import StepConfig, decode_step_jit, prepare
    from jaxdecode.shapes import kv_bucket

    report: dict = {"machine": machine(), "steps": steps, "repeats": repeats,
                    "page_size": page_size, "rows": []}
    ids = prompts(max(batches), prompt_len, model.config.vocab_size, 0)
    for batch in batches:
        sp = [SamplingParams(seed=r, max_tokens=steps + 1, ignore_eos=True)
              for r in range(batch)]
        state = prepare(model, params, ids[:batch], sp, steps + 1, None)[0]
        kv = kv_bucket(prompt_len + steps + 1, state.cache.max_len)
        step = functools.partial(decode_step_jit, params=params,
                                 config=StepConfig(model, kv_len=kv))
        runs = {"contiguous": (step, state), "paged": (step, paged_state(state, page_size))}
        report["rows"].append({"batch": batch, "kv_len": kv, **step_times(runs, steps, repeats)})
    return report


def format_paged_table(report: dict) -> str:
    lines = [f"decode step ms, contiguous cache vs pages of {report['page_size']} (median of "
             f"{report['repeats']} x {report['steps']} chained steps):",
             "| batch | kv_len | contiguous | paged |", "|---:|---:|---:|---:|"]
    for row in report["rows"]:
        lines.append(f"| {row['batch']} | {row['kv_len']} | {row['contiguous_step_ms']:.3f} | "
                     f"{row['paged_step_ms']:.3f} ({row['paged_overhead'] * 100:+.1f}%) |")
    return "\n".join(lines)
