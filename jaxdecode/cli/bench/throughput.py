"""Decode throughput and time to first token: jaxdecode's on-device loop against Hugging Face
PyTorch `generate` on the same weights, in one process (ratios, never timed unit tests)."""

from __future__ import annotations

import dataclasses
import os
import sys
from typing import Optional, Sequence

import jax

from jaxdecode import invariance
from jaxdecode.cli.bench.timing import (BenchConfig, gemv_bandwidth, machine, median_time, prompts,
                                        step_bytes)
from jaxdecode.config import SamplingParams
from jaxdecode.device.decode import compilation_count, generate
from jaxdecode.model_api import params_quantization


def time_jaxdecode(model, params, batch: int, cfg: BenchConfig) -> dict:
    ids = prompts(batch, cfg.prompt_len, model.config.vocab_size, cfg.seed)
    sp = SamplingParams(temperature=0.0, max_tokens=cfg.new_tokens, ignore_eos=True)
    short = SamplingParams(temperature=0.0, max_tokens=cfg.new_tokens // 8, ignore_eos=True)
    run = lambda s: generate(model, params, ids, s).token_ids  # noqa: E731
    c0 = compilation_count()
    run(sp), run(short)  # warm-up (compiles)
    warm_compiles = compilation_count() - c0
    c1 = compilation_count()
    total = median_time(lambda: run(sp), cfg.repeats)
    part = median_time(lambda: run(short), cfg.repeats)
    step = (total - part) / (cfg.new_tokens - cfg.new_tokens // 8)
    if step <= 0:  # too few tokens to separate the prefill: fall back to the plain average
        step = total / cfg.new_tokens
    return {"seconds": total, "tokens_per_s": batch * cfg.new_tokens / total,
            "step_ms": step * 1e3, "compiles_warmup": warm_compiles,
            "compiles_after_warmup": compilation_count() - c1}


def time_hf(hf_model, batch: int, cfg: BenchConfig, vocab: int, threads: int) -> dict:
    import torch

    torch.set_num_threads(threads)
    ids = torch.tensor(prompts(batch, cfg.prompt_len, vocab, cfg.seed), device=hf_model.device)
    kwargs = dict(max_new_tokens=cfg.new_tokens, min_new_tokens=cfg.new_tokens, do_sample=False,
                  attention_mask=torch.ones_like(ids), pad_token_id=0)

    def run():
        with torch.inference_mode():
            hf_model.generate(ids, **kwargs)
        _hf_sync(hf_model)

    run()
    total = median_time(run, cfg.repeats)
    return {"seconds": total, "tokens_per_s": batch * cfg.new_tokens / total}


def _hf_sync(hf_model) -> None:
    """Wait for HF's queued GPU work, so that its time is measured whole."""
    import torch

    if hf_model.device.type == "cuda":
        torch.cuda.synchronize(hf_model.device)


def hf_setup(hf_model) -> dict:
    """What the HF column ran on: torch version, device and weight dtype."""
    import torch

    return {"torch": torch.__version__, "device": str(hf_model.device),
            "dtype": str(hf_model.dtype).removeprefix("torch.")}


def run(model, params, cfg: BenchConfig, hf_model=None, hf_threads: Optional[int] = None,
        progress=None, fast_model=None) -> dict:
    """Measure every batch size; `hf_model` (same weights) adds the HF column and ratios;
    `fast_model` (the model without batch invariance) the fast path beside it and the
    invariance tax, 1 - invariant tokens/s over the fast path's (docs/batch_invariance.md)."""
    report: dict = {"machine": machine(), "config": dataclasses.asdict(cfg),
                    "model": {k: v for k, v in dataclasses.asdict(model.config).items()
                              if not isinstance(v, (tuple, list)) or len(v) < 16},
                    "param_bytes": int(sum(x.nbytes for x in jax.tree.leaves(params))),
                    "step_bytes": int(step_bytes(params))}
    bw = gemv_bandwidth()
    report["gemv_bandwidth_gb_s"] = bw / 1e9
    report["roofline_step_ms"] = report["step_bytes"] / bw * 1e3
    report["dtype"] = str(jax.tree.leaves(params)[0].dtype)
    report["quantization"] = params_quantization(params)
    report["batch_invariance"] = invariance.mode_of(model)
    if hf_model is not None:
        report["hf"] = hf_setup(hf_model)
    rows = []
    from tqdm.auto import tqdm

    for batch in tqdm(cfg.batches, desc="bench", unit="batch", file=sys.stderr):
        row = {"batch": batch, "jaxdecode": time_jaxdecode(model, params, batch, cfg)}
        if fast_model is not None:
            row["fast"] = time_jaxdecode(fast_model, params, batch, cfg)
            row["tax"] = 1 - row["jaxdecode"]["tokens_per_s"] / row["fast"]["tokens_per_s"]
        if hf_model is not None:
            row["hf"] = time_hf(hf_model, batch, cfg, model.config.vocab_size,
                                hf_threads or os.cpu_count())
            row["ratio"] = row["jaxdecode"]["tokens_per_s"] / row["hf"]["tokens_per_s"]
            if fast_model is not None:
                row["fast_ratio"] = row["fast"]["tokens_per_s"] / row["hf"]["tokens_per_s"]
        if batch == 1:
            report["roofline_fraction_batch1"] = report["roofline_step_ms"] / row["jaxdecode"]["step_ms"]
        rows.append(row)
        if progress:
            progress(row)
    report["rows"] = rows
    return report


def ttft(model, params, lengths: Sequence[int], hf_model=None, hf_threads: Optional[int] = None,
         repeats: int = 3) -> list[dict]:
    """Seconds from a prompt of each length to its first token: prefill + one selection (batch 1,
    greedy), jaxdecode's on-device loop and, when given, HF `generate(max_new_tokens=1)`."""
    rows = []
    sp = SamplingParams(temperature=0.0, max_tokens=1)
    for n in lengths:
        if n >= model.config.max_len:
            continue
        ids = prompts(1, n, model.config.vocab_size, n)
        first = lambda: generate(model, params, ids, sp).token_ids  # noqa: E731
        first()
        row = {"prompt_len": n, "jaxdecode_s": median_time(first, repeats)}
        if hf_model is not None:
            import torch

            torch.set_num_threads(hf_threads or os.cpu_count())
            tokens = torch.tensor(ids, device=hf_model.device)

            def hf_first():
                with torch.inference_mode():
                    hf_model.generate(tokens, attention_mask=torch.ones_like(tokens),
                                      max_new_tokens=1, do_sample=False, pad_token_id=0)
                _hf_sync(hf_model)

            hf_first()
            row["hf_s"] = median_time(hf_first, repeats)
        rows.append(row)
    return rows


