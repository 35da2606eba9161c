"""The research API (jaxdecode/device/research.py, issue #16): decode-step time with one trivial custom
processor, with the capture of one layer's hidden state, and with both, against none."""

from __future__ import annotations

import functools
from typing import Sequence

from jaxdecode.cli.bench.timing import machine, prompts, step_times
from jaxdecode.config import SamplingParams


def _trivial_processor(logits, ctx):
    """The benchmark's custom processor: one elementwise op on the logits."""
    return logits * 1.0001


def time_research(model, params, batches: Sequence[int] = (1, 16), steps: int = 32,
                  repeats: int = 5, capture_layer: int = 1) -> dict:
    """Chained `decode_step_jit` time per mode (rows sampled, T = 1): "none", "processor",
    "capture" (one layer's hidden state) and "both", measured round-robin in one process."""
    from jaxdecode.device import research
    from jaxdecode.device.decode import StepConfig, decode_step_jit, prepare

    options = {"none": {},
               "processor": dict(processors=[research.LogitProcessor(_trivial_processor)]),
               "capture": dict(return_hidden_states=(capture_layer,)),
               "both": dict(processors=[research.LogitProcessor(_trivial_processor)],
                            return_hidden_states=(capture_layer,))}
    report: dict = {"machine": machine(), "steps": steps, "repeats": repeats,
                    "capture_layer": capture_layer, "rows": []}
    ids = prompts(max(batches), 16, model.config.vocab_size, 0)
    for batch in batches:
        runs = {}
        sp = [SamplingParams(seed=r, max_tokens=steps + 1, ignore_eos=True)
              for r in range(batch)]
        for mode, kwargs in options.items():
            setup = research.configure(model, **kwargs)
            state = prepare(model, params, ids[:batch], sp, steps + 1, None, research=setup)[0]
            config, args = (None, None) if setup is None else (setup.config, setup.args)
            runs[mode] = (functools.partial(decode_step_jit, params=params, research_args=args,
                                            config=StepConfig(model, research=config)), state)
        report["rows"].append({"batch": batch, **step_times(runs, steps, repeats)})
    return report


def format_research_table(report: dict) -> str:
    modes = [k[:-len("_step_ms")] for k in report["rows"][0] if k.endswith("_step_ms")]
    lines = [f"decode step ms with the research API (median of {report['repeats']} x "
             f"{report['steps']} chained steps; capture = layer {report['capture_layer']}):",
             "| batch | " + " | ".join(modes) + " |", "|---:|" + "---:|" * len(modes)]
    for row in report["rows"]:
        cells = [f"{row['none_step_ms']:.3f}"] + [
            f"{row[m + '_step_ms']:.3f} ({row[m + '_overhead'] * 100:+.1f}%)" for m in modes[1:]]
        lines.append(f"| {row['batch']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
