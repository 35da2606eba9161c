"""The bench report: text tables for the terminal, and `write_report` (report.json, report.md
and the plots of `jaxdecode.cli.bench.plots`) for `jaxdecode bench --report DIR`."""

from __future__ import annotations

import json
import os
from typing import Optional

from jaxdecode.cli.bench import plots


def format_table(report: dict) -> str:
    fast = FAST_HEADER if any("fast" in row for row in report["rows"]) else ("", "")
    lines = [f"machine: {report['machine']['cpu']} ({report['machine']['cores']} cores), "
             f"{report['machine']['backend']}, jax {report['machine']['jax']}",
             f"params: {report['param_bytes'] / 1e6:.1f} MB; bytes read per step "
             f"{report['step_bytes'] / 1e6:.1f} MB; GEMV bandwidth "
             f"{report['gemv_bandwidth_gb_s']:.2f} GB/s -> roofline step "
             f"{report['roofline_step_ms']:.2f} ms",
             *([f"weights: jaxdecode {report['dtype']}; HF torch {report['hf']['torch']} on "
                f"{report['hf']['device']}, {report['hf']['dtype']}"] if "hf" in report else []),
             f"batch invariance: {report.get('batch_invariance', '?')}; weights: "
             f"{report.get('quantization') or 'float'}",
             "| batch | jaxdecode tok/s | step ms | HF tok/s | ratio |" + fast[0],
             "|---:|---:|---:|---:|---:|" + fast[1]]
    for row in report["rows"]:
        hf = row.get("hf", {}).get("tokens_per_s")
        hf_cell = "-" if hf is None else f"{hf:.1f}"
        ratio_cell = "-" if hf is None else f"{row['ratio']:.2f}x"
        lines.append(f"| {row['batch']} | {row['jaxdecode']['tokens_per_s']:.1f} | "
                     f"{row['jaxdecode']['step_ms']:.2f} | {hf_cell} | {ratio_cell} |"
                     + _fast_cells(row))
    if "roofline_fraction_batch1" in report:
        lines.append(f"batch-1 step time vs roofline: {report['roofline_fraction_batch1'] * 100:.0f}% "
                     f"of the bandwidth limit")
    return "\n".join(lines)




# The fast path's columns (bench --invariance-tax)
FAST_HEADER = (" fast-path step ms | fast-path ratio | invariance tax |", "---:|---:|---:|")


def _fast_cells(row: dict) -> str:
    if "fast" not in row:
        return ""
    ratio = f"{row['fast_ratio']:.2f}x" if "fast_ratio" in row else "-"
    return f" {row['fast']['step_ms']:.2f} | {ratio} | {row['tax'] * 100:.1f}% |"


def format_search(beam: Optional[dict] = None, spec: Optional[dict] = None) -> str:
    lines = []
    if beam:
        lines.append(f"beam search (batch {beam['batch']}, {beam['num_beams']} beams, "
                     f"{beam['new_tokens']} tokens): {beam['beam_tokens_per_s']:.1f} tok/s vs "
                     f"greedy {beam['greedy_tokens_per_s']:.1f} tok/s "
                     f"({beam['beam_vs_greedy']:.2f}x); all beams "
                     f"{beam['beam_row_tokens_per_s']:.1f} tok/s")
    if spec:
        lines.append(f"speculative (batch {spec['batch']}, T={spec['temperature']}, "
                     f"{spec['new_tokens']} tokens): plain {spec['plain_tokens_per_s']:.1f} tok/s "
                     f"(drift between its two timings {spec['plain_drift'] * 100:.0f}%)")
        lines.append("| draft | k | tok/s | speed-up | mean accepted length | acceptance | "
                     "same tokens |")
        lines.append("|---|---:|---:|---:|---:|---:|---|")
        for r in spec["rows"]:
            lines.append(f"| {r['draft']} | {r['k']} | {r['tokens_per_s']:.1f} | "
                         f"{r['speedup']:.2f}x | {r['mean_accepted_length']:.2f} | "
                         f"{r['acceptance_rate']:.2f} | {r['same_tokens_as_plain']} |")
    return "\n".join(lines)




def format_constraints_table(report: dict) -> str:
    lines = ["| schema | states | edges | lookup | index compile s | table build ms |",
             "|---|---:|---:|---|---:|---:|"]
    for name, c in report["compile"].items():
        lines.append(f"| {name} | {c['states']} | {c['edges']} | {c['lookup']} | "
                     f"{c['index_compile_s']:.3f} | {c['table_build_ms']:.1f} |")
    modes = [k[:-len("_step_ms")] for k in report["rows"][0] if k.endswith("_step_ms")]
    lines += ["", "| batch | " + " | ".join(f"{m} step ms (median / min)" for m in modes) + " |",
              "|---:|" + "---:|" * len(modes)]
    for row in report["rows"]:
        cells = []
        for m in modes:
            cell = f"{row[m + '_step_ms']:.2f}"
            if m != "none":
                cell += f" ({row[m + '_overhead'] * 100:+.0f}%)"
            cell += f" / min {row[m + '_step_ms_min']:.2f}"
            cells.append(cell)
        lines.append(f"| {row['batch']} | " + " | ".join(cells) + " |")
    lines.append("")
    for row in report["rows"]:
        ops = ", ".join(f"{k[:-len('_grammar_ops_ms')]} {v:.3f} ms" for k, v in row.items()
                        if k.endswith("_grammar_ops_ms"))
        lines.append(f"batch {row['batch']}: grammar mask + next state alone: {ops}")
    return "\n".join(lines)




def markdown(report: dict) -> str:
    """report.md: the throughput table, time to first token, every other section as JSON."""
    md = ["# jaxdecode performance report", "",
          f"Produced by `jaxdecode bench --report` on {report['machine']['cpu']} "
          f"({report['machine']['cores']} cores), backend `{report['machine']['backend']}` "
          f"({report['machine']['device']}), jax {report['machine']['jax']}. Every figure "
          "comes from this one run; ratios compare measurements taken side by side.", "",
          "## Decode throughput", "", format_table(report), ""]
    if report.get("ttft"):
        md += ["## Time to first token (batch 1)", "", "| prompt | jaxdecode ms | HF ms |",
               "|---:|---:|---:|"]
        md += [f"| {r['prompt_len']} | {r['jaxdecode_s'] * 1e3:.1f} | "
               f"{r['hf_s'] * 1e3:.1f} |" if "hf_s" in r else
               f"| {r['prompt_len']} | {r['jaxdecode_s'] * 1e3:.1f} | - |" for r in report["ttft"]]
        md.append("")
    for key, title in (("host_cost", "Host pipeline cost per token"),
                       ("engine", "Engine with streaming vs the raw jitted loop"),
                       ("recompiles", "Recompilations after warm-up (mixed engine requests)"),
                       ("beam", "Beam search vs greedy"),
                       ("speculative", "Speculative decoding vs plain (demo model and draft)"),
                       ("constraints", "Structured output: step time and index compile time"),
                       ("compiles", "Compilations")):
        if report.get(key) is not None:
            md += [f"## {title}", "", "```", json.dumps(report[key], indent=2, default=str), "```",
                   ""]
    md += ["![throughput](throughput.png)"] + (["![ttft](ttft.png)"] if report.get("ttft") else [])
    return "\n".join(md) + "\n"


def write_report(report: dict, out_dir: str) -> list[str]:
    """Write report.json, the PNG plots and report.md into `out_dir`; returns the paths."""
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "report.json")
    with open(path, "w") as f:
        json.dump(report, f, indent=2, default=str)
    written = [path, *plots.write_plots(report, out_dir)]
    path = os.path.join(out_dir, "report.md")
    with open(path, "w") as f:
        f.write(markdown(report))
    written.append(path)
    return written
