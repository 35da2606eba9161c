"""`bench --paged`: the decode step over KV pages against the same step over a contiguous
cache (issue #15: within 10%), measured round-robin in one process at each batch size; with
`--kv-cache-dtype int8` also over int8 pages (contract §12), with the tokens each pool holds
per GiB."""

from __future__ import annotations

import functools
import time
from typing import Sequence

import jax.numpy as jnp
import numpy as np

from jaxdecode.cli.bench.timing import machine, prompts, step_times
from jaxdecode.config import SamplingParams


def paged_state(state, page_size: int, kv_cache_dtype: str = "auto"):
    """`state` (a StepState over a contiguous KVCache, as `decode.prepare` builds it) with its
    cache copied into a page pool: row b's positions in pages 1 + b * P, ... (page 0 null);
    `kv_cache_dtype` "int8" quantizes the pool (a scale per token and kv head)."""
    from jaxdecode import kv_int8
    from jaxdecode.model_api import PagedKVCache

    cache = state.cache
    layers, b, kvh, max_len, hd = cache.k.shape
    per_row = -(-max_len // page_size)

    def pool(x):  # [L, B, kvh, S, hd] -> [kvh, L, 1 + B * P, ps, hd]
        x = jnp.pad(x, ((0, 0), (0, 0), (0, 0), (0, per_row * page_size - max_len), (0, 0)))
        x = x.reshape(layers, b, kvh, per_row, page_size, hd).transpose(2, 0, 1, 3, 4, 5)
        x = x.reshape(kvh, layers, b * per_row, page_size, hd)
        return jnp.pad(x, ((0, 0), (0, 0), (1, 0), (0, 0), (0, 0)))

    table = 1 + np.arange(b * per_row, dtype=np.int32).reshape(b, per_row)
    (k, k_scale), (v, v_scale) = ((kv_int8.quantize(pool(x)) if kv_cache_dtype == "int8"
                                   else (pool(x), None)) for x in (cache.k, cache.v))
    return state.replace(cache=PagedKVCache(k=k, v=v, page_table=jnp.asarray(table),
                                            lengths=cache.lengths, k_scale=k_scale,
                                            v_scale=v_scale, max_len=max_len))


def tokens_per_gib(model, params, kv_cache_dtype: str) -> int:
    """Positions a page pool of 1 GiB holds for `model` (keys, values and int8 scales)."""
    import jax

    from serving.server import kv_page_bytes

    return (1 << 30) // kv_page_bytes(model, jax.tree.leaves(params)[0].dtype, 1, kv_cache_dtype)


def time_paged(model, params, batches: Sequence[int] = (1, 16), steps: int = 32,
               repeats: int = 5, page_size: int = 16, prompt_len: int = 16,
               kv_cache_dtype: str = "auto") -> dict:
    """Chained decode-step time, contiguous cache vs pages (and int8 pages with
    `kv_cache_dtype` "int8"), per batch size (sampled rows, the attention bucket of the
    engine's first steps)."""
    from jaxdecode.device.decode import StepConfig, decode_step_jit, prepare
    from jaxdecode.shapes import kv_bucket

    report: dict = {"machine": machine(), "steps": steps, "repeats": repeats,
                    "page_size": page_size, "kv_cache_dtype": kv_cache_dtype, "rows": [],
                    "tokens_per_gib": {d: tokens_per_gib(model, params, d)
                                       for d in ("auto", kv_cache_dtype)}}
    ids = prompts(max(batches), prompt_len, model.config.vocab_size, 0)
    for batch in batches:
        sp = [SamplingParams(seed=r, max_tokens=steps + 1, ignore_eos=True)
              for r in range(batch)]
        state = prepare(model, params, ids[:batch], sp, steps + 1, None)[0]
        kv = kv_bucket(prompt_len + steps + 1, state.cache.max_len)
        step = functools.partial(decode_step_jit, params=params,
                                 config=StepConfig(model, kv_len=kv))
        runs = {"contiguous": (step, state), "paged": (step, paged_state(state, page_size))}
        if kv_cache_dtype == "int8":
            runs["paged_int8"] = (step, paged_state(state, page_size, "int8"))
        report["rows"].append({"batch": batch, "kv_len": kv, **step_times(runs, steps, repeats)})
    return report


def format_paged_table(report: dict) -> str:
    int8 = report.get("kv_cache_dtype") == "int8"
    lines = [f"decode step ms, contiguous cache vs pages of {report['page_size']} (median of "
             f"{report['repeats']} x {report['steps']} chained steps):",
             "| batch | kv_len | contiguous | paged |" + (" int8 pages |" if int8 else ""),
             "|---:|---:|---:|---:|" + ("---:|" if int8 else "")]
    for row in report["rows"]:
        line = (f"| {row['batch']} | {row['kv_len']} | {row['contiguous_step_ms']:.3f} | "
                f"{row['paged_step_ms']:.3f} ({row['paged_overhead'] * 100:+.1f}%) |")
        if int8:
            line += (f" {row['paged_int8_step_ms']:.3f} "
                     f"({row['paged_int8_overhead'] * 100:+.1f}%) |")
        lines.append(line)
    per_gib = report["tokens_per_gib"]
    lines.append("KV positions per GiB of pool: " + ", ".join(
        f"{'int8' if d == 'int8' else 'weights dtype'} {n:,}" for d, n in per_gib.items()))
    return "\n".join(lines)


def chunked_prefill_itl(model, params, tokenizer, streams: int = 8, arrivals: int = 4,
                        long_len: int = 2048, new_tokens: int = 256, chunk: int = 256) -> dict:
    """Inter-token latency of `streams` running greedy streams while `arrivals` prompts of
    `long_len` tokens arrive one after another (issue #15): prefill in chunks of `chunk`
    against the whole prompt at once. ITLs are the gaps between a stream's selected tokens
    from the first arrival to the last one's first token."""
    from jaxdecode.engine import LLM

    rng = np.random.default_rng(0)
    vocab = model.config.vocab_size
    short = prompts(streams, 16, vocab, 1)
    long = [list(rng.integers(3, vocab, long_len)) for _ in range(arrivals + 1)]
    sp = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True,
                        utf8_errors="replace")
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, utf8_errors="replace")
    report: dict = {"machine": machine(), "streams": streams, "arrivals": arrivals,
                    "long_prompt_len": long_len, "rows": []}
    for prefill_chunk in (chunk, None):
        with LLM(model, params, tokenizer, max_slots=streams + 1, max_len=long_len + 64,
                 prefill_chunk=prefill_chunk, prefix_cache=False) as llm:
            llm.warmup(16)
            llm.generate([long[-1]], one)  # compiles the long prompt's programs
            handles = [llm.submit(p, sp) for p in short]
            while min(h.selected for h in handles) < 4:
                time.sleep(0.005)
            start = _clock(handles)
            for p in long[:arrivals]:
                llm.submit(p, one).result(timeout=600)
            end = _clock(handles)
            gaps = []
            for h in handles:
                times = [e.time for e in h.trace() if e.kind == "token.selected"
                         and start <= e.time <= end]
                gaps += list(np.diff(times) * 1e3)
            for h in handles:
                h.cancel()
        assert gaps and max(h.selected for h in handles) < new_tokens, "streams ended early"
        report["rows"].append({"prefill_chunk": prefill_chunk, "itl_ms_p50": np.median(gaps),
                               "itl_ms_p99": float(np.percentile(gaps, 99)),
                               "itl_ms_max": float(np.max(gaps)), "gaps": len(gaps)})
    return report


def _clock(handles) -> float:
    """The time of the newest event of any of `handles` (the engine's clock)."""
    return max(h.trace()[-1].time for h in handles)


def format_itl_table(report: dict) -> str:
    lines = [f"ITL of {report['streams']} running streams while {report['arrivals']} prompts of "
             f"{report['long_prompt_len']} tokens arrive:",
             "| prefill | ITL p50 ms | ITL p99 ms | max ms |", "|---|---:|---:|---:|"]
    for row in report["rows"]:
        how = f"chunks of {row['prefill_chunk']}" if row["prefill_chunk"] else "whole prompt"
        lines.append(f"| {how} | {row['itl_ms_p50']:.1f} | {row['itl_ms_p99']:.1f} | "
                     f"{row['itl_ms_max']:.1f} |")
    return "\n".join(lines)
