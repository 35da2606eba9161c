"""`bench --lora`: the decode step with two LoRA adapters in the batch against none (issue
#42: at most 15% slower), measured round-robin in one process at each batch size."""

from __future__ import annotations

import functools
from typing import Sequence

import numpy as np

from jaxdecode.cli.bench.timing import machine, prompts, step_times
from jaxdecode.config import SamplingParams

TARGETS = ("q", "k", "v", "o", "gate", "up", "down")


def random_adapter(params: dict, rank: int, seed: int) -> dict:
    """A random adapter of `rank` on every projection, in the model's adapter layout
    (`load_adapter`'s: per layer, target -> (a [in, r], b [r, out]))."""
    rng = np.random.default_rng(seed)
    layers = [{t: (0.02 * rng.standard_normal((np.shape(p[t])[0], rank), np.float32),
                   0.02 * rng.standard_normal((rank, np.shape(p[t])[1]), np.float32))
               for t in TARGETS} for p in params["layers"]]
    return {"rank": rank, "layers": layers}


def time_lora(model, params, batches: Sequence[int] = (1, 16), steps: int = 32,
              repeats: int = 5, ranks: Sequence[int] = (8, 16)) -> dict:
    """Chained `decode_step_jit` time: "none" (the base weights) and "lora" (a stack of one
    adapter per rank in `ranks`, rows alternating between them), sampled rows."""
    from jaxdecode.device.decode import StepConfig, decode_step_jit, prepare

    if not hasattr(model, "stack_adapters"):
        raise SystemExit(f"--lora: the {type(model).__name__} family has no LoRA support")
    adapters = [random_adapter(params, r, seed) for seed, r in enumerate(ranks)]
    lora_params = {**params, "lora": model.stack_adapters(adapters, params, len(adapters))}
    report: dict = {"machine": machine(), "steps": steps, "repeats": repeats,
                    "ranks": list(ranks), "rows": []}
    ids = prompts(max(batches), 16, model.config.vocab_size, 0)
    for batch in batches:
        sp = [SamplingParams(seed=r, max_tokens=steps + 1, ignore_eos=True)
              for r in range(batch)]
        state = prepare(model, params, ids[:batch], sp, steps + 1, None)[0]
        index = 1 + np.arange(state.rows.adapter.shape[0], dtype=np.int32) % len(ranks)
        mixed = state.replace(rows=state.rows.replace(adapter=index))
        step = lambda p: functools.partial(decode_step_jit, params=p,  # noqa: E731
                                           config=StepConfig(model))
        runs = {"none": (step(params), state), "lora": (step(lora_params), mixed)}
        report["rows"].append({"batch": batch, **step_times(runs, steps, repeats)})
    return report


def format_lora_table(report: dict) -> str:
    ranks = " and ".join(map(str, report["ranks"]))
    lines = [f"decode step ms, no adapter vs {len(report['ranks'])} LoRA adapters (ranks "
             f"{ranks}, every projection) in the batch (median of {report['repeats']} x "
             f"{report['steps']} chained steps):",
             "| batch | none | 2 adapters |", "|---:|---:|---:|"]
    for row in report["rows"]:
        lines.append(f"| {row['batch']} | {row['none_step_ms']:.3f} | {row['lora_step_ms']:.3f} "
                     f"({row['lora_overhead'] * 100:+.1f}%) |")
    return "\n".join(lines)
