"""`bench --lora`: the decode step with two LoRA adapters in the batch against none (issue
#42: at most 15% slower), measured round-robin in one process at each batch size, for adapters
on every projection and on q_proj / v_proj only (PEFT's default targets for Llama)."""

from __future__ import annotations

import functools
from typing import Sequence

import numpy as np

from jaxdecode.cli.bench.timing import machine, prompts, step_times
from jaxdecode.config import SamplingParams

TARGETS = ("q", "k", "v", "o", "gate", "up", "down")
# the adapters' target sets timed: mode -> targets
TARGET_SETS = {"lora": TARGETS, "lora_qv": ("q", "v")}


def random_adapter(params: dict, rank: int, seed: int, targets: Sequence[str] = TARGETS) -> dict:
    """A random adapter of `rank` on `targets` (every projection by default), in the model's
    adapter layout (`load_adapter`'s: per layer, target -> (a [in, r], b [r, out]))."""
    rng = np.random.default_rng(seed)
    layers = [{t: (0.02 * rng.standard_normal((np.shape(p[t])[0], rank), np.float32),
                   0.02 * rng.standard_normal((rank, np.shape(p[t])[1]), np.float32))
               for t in targets} for p in params["layers"]]
    return {"rank": rank, "layers": layers}


def time_lora(model, params, batches: Sequence[int] = (1, 16), steps: int = 32,
              repeats: int = 5, ranks: Sequence[int] = (8, 16)) -> dict:
    """Chained `decode_step_jit` time: "none" (the base weights), "lora" and "lora_qv" (a stack
    of one adapter per rank in `ranks` on each of `TARGET_SETS`, rows alternating between them),
    sampled rows."""
    from jaxdecode.device.decode import StepConfig, decode_step_jit, prepare

    if not hasattr(model, "stack_adapters"):
        raise SystemExit(f"--lora: the {type(model).__name__} family has no LoRA support")
    stacks = {}
    for mode, targets in TARGET_SETS.items():
        adapters = [random_adapter(params, r, seed, targets) for seed, r in enumerate(ranks)]
        stacks[mode] = {**params, "lora": model.stack_adapters(adapters, params, len(ranks))}
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
        runs = {"none": (step(params), state),
                **{mode: (step(p), mixed) for mode, p in stacks.items()}}
        report["rows"].append({"batch": batch, **step_times(runs, steps, repeats)})
    return report


def format_lora_table(report: dict) -> str:
    ranks = " and ".join(map(str, report["ranks"]))
    lines = [f"decode step ms, no adapter vs {len(report['ranks'])} LoRA adapters (ranks "
             f"{ranks}) in the batch (median of {report['repeats']} x {report['steps']} "
             "chained steps):",
             "| batch | none | 2 adapters, every projection | 2 adapters, q_proj + v_proj |",
             "|---:|---:|---:|---:|"]
    for row in report["rows"]:
        cells = [f"{row[m + '_step_ms']:.3f} ({row[m + '_overhead'] * 100:+.1f}%)"
                 for m in TARGET_SETS]
        lines.append(f"| {row['batch']} | {row['none_step_ms']:.3f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
