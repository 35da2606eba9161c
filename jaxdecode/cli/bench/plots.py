"""The PNG plots of the bench report: decode throughput per batch and time to first token per
prompt length, jaxdecode beside HF PyTorch when the report has that column."""

from __future__ import annotations

import os
from typing import Optional, Sequence


def _line_plot(path: str, x: Sequence, ours: Sequence, hf: Optional[Sequence], xlabel: str,
               ylabel: str, title: Optional[str] = None) -> str:
    import matplotlib  # the dev extra; `jaxdecode bench --report` checks for it first
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(x, ours, "o-", label="jaxdecode")
    if hf is not None:
        ax.plot(x, hf, "s--", label="HF PyTorch")
    ax.set_xscale("log", base=2)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_plots(report: dict, out_dir: str) -> list[str]:
    """throughput.png, and ttft.png when the report has a time-to-first-token section."""
    rows = report["rows"]
    written = [_line_plot(
        os.path.join(out_dir, "throughput.png"), [r["batch"] for r in rows],
        [r["jaxdecode"]["tokens_per_s"] for r in rows],
        [r["hf"]["tokens_per_s"] for r in rows] if all("hf" in r for r in rows) else None,
        "batch", "decode tokens/s", f"decode throughput ({report['machine']['backend']})")]
    t = report.get("ttft")
    if t:
        written.append(_line_plot(
            os.path.join(out_dir, "ttft.png"), [r["prompt_len"] for r in t],
            [r["jaxdecode_s"] * 1e3 for r in t],
            [r["hf_s"] * 1e3 for r in t] if all("hf_s" in r for r in t) else None,
            "prompt tokens", "time to first token (ms)"))
    return written
