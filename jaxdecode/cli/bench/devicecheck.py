"""`jaxdecode bench --device-check --out DIR [--quick]`: the accelerator check as one command
(docs/performance.md "The device check").

Each section (`device_sections.SECTIONS`: environment, decode, kernels, invariance, serving)
runs in a process of its own under a time budget, so a section that crashes, hangs or runs out
of memory costs only its own figures: the others still run and the report says what became of
each (ok, failed with its error, or timed out). DIR receives `report.md`, `report.json` and one
`SECTION.log` per section (its output). The full budgets sum to under 8 minutes (an H200 lease
is 15 minutes all told); `--quick` is the CPU smoke run the suite keeps from rotting.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Mapping, Optional

from jaxdecode.cli.bench import device_sections

# Seconds per section on the device, and in the --quick run on a CPU.
BUDGETS = {"environment": 60, "decode": 240, "kernels": 45, "invariance": 75, "serving": 90}
QUICK_BUDGETS = {"environment": 60, "decode": 240, "kernels": 120, "invariance": 180,
                 "serving": 240}


def run(out: str, quick: bool, sections: Optional[Mapping[str, str]] = None,
        budgets: Optional[Mapping[str, float]] = None) -> dict:
    """Run `sections` (name -> "module:function", default `device_sections.SECTIONS`) one
    process each under `budgets` seconds; write DIR/report.json and DIR/report.md; return the
    report."""
    sections = dict(sections or device_sections.SECTIONS)
    budgets = dict(QUICK_BUDGETS if quick else BUDGETS, **(budgets or {}))
    os.makedirs(out, exist_ok=True)
    env = dict(os.environ)
    # HF PyTorch shares the GPU with jax in the decode section: jax must not take 75% of it.
    env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.5")
    env.setdefault("PYTHONUNBUFFERED", "1")
    report = {"quick": quick, "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
              "sections": {}}
    for name, target in sections.items():
        report["sections"][name] = _run_section(name, target, out, quick, budgets.get(name, 120),
                                                env)
        print(f"device check: {name}: {report['sections'][name]['status']} "
              f"({report['sections'][name]['seconds']:.0f} s)", file=sys.stderr)
    report["goals"] = device_sections.goals(report["sections"])
    with open(os.path.join(out, "report.json"), "w") as f:
        json.dump(report, f, indent=2, default=str)
    with open(os.path.join(out, "report.md"), "w") as f:
        f.write(format_report(report))
    return report


def _run_section(name: str, target: str, out: str, quick: bool, budget: float,
                 env: dict) -> dict:
    result = os.path.join(out, f"{name}.json")
    if os.path.exists(result):
        os.remove(result)
    cmd = [sys.executable, "-m", __name__, "--section", target, "--result", result]
    cmd += ["--quick"] if quick else []
    t0 = time.perf_counter()
    with open(os.path.join(out, f"{name}.log"), "w") as log:
        try:
            proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                  timeout=budget, start_new_session=True)
            rc: Optional[int] = proc.returncode
        except subprocess.TimeoutExpired:
            rc = None
    seconds = time.perf_counter() - t0
    if rc is None:
        return {"status": "timed out", "seconds": seconds,
                "error": f"still running after its budget of {budget:.0f} s (killed)"}
    try:
        with open(result) as f:
            done = json.load(f)
    except (OSError, ValueError):
        done = {"status": "failed", "error": f"exited {rc} without a result (see {name}.log)"}
    return dict(done, seconds=seconds)


def _section_main(target: str, result: str, quick: bool) -> int:
    """One section in this process: its figures, or its error, to `result` as JSON."""
    import importlib
    import traceback

    module, func = target.split(":")
    try:
        figures = getattr(importlib.import_module(module), func)(quick, os.path.dirname(result))
        done = {"status": "ok", "figures": figures}
    except Exception as e:  # noqa: BLE001 -- a section's failure is a figure of the report
        traceback.print_exc()
        done = {"status": "failed", "error": f"{type(e).__name__}: {e}"}
    with open(result, "w") as f:
        json.dump(done, f, indent=2, default=str)
    return 0 if done["status"] == "ok" else 1


def format_report(report: dict) -> str:
    lines = ["# Device check" + (" (--quick)" if report["quick"] else ""), "",
             f"Started {report['started']}.", "", "| section | status | seconds |",
             "|---|---|---:|"]
    for name, s in report["sections"].items():
        status = s["status"] + (f": {s['error']}" if "error" in s else "")
        lines.append(f"| {name} | {status} | {s['seconds']:.0f} |")
    if report["goals"]:
        lines += ["", "## Goals", "", "| goal | figure | met |", "|---|---|---|"]
        lines += [f"| {g['goal']} | {g['figure']} | {'yes' if g['met'] else 'NO'} |"
                  for g in report["goals"]]
    for name, s in report["sections"].items():
        if s["status"] == "ok":
            lines += ["", f"## {name}", ""] + device_sections.format_section(name, s["figures"])
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    import argparse

    p = argparse.ArgumentParser(description="one section of the device check (internal)")
    p.add_argument("--section", required=True, help="module:function")
    p.add_argument("--result", required=True)
    p.add_argument("--quick", action="store_true")
    args = p.parse_args(argv)
    return _section_main(args.section, args.result, args.quick)


if __name__ == "__main__":
    sys.exit(main())
