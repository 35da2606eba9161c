"""`jaxdecode bench --device-check --out DIR [--quick]` (issue #38): every section runs in the
CPU smoke run and writes its figures; a section that fails or hangs costs only itself; the
goals are read off the figures; wrong flags are named."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from jaxdecode.cli.bench import device_sections, devicecheck


def test_quick_device_check_runs_every_section_on_the_cpu(tmp_path):
    out = tmp_path / "check"
    proc = subprocess.run([sys.executable, "-m", "jaxdecode.cli", "bench", "--device-check",
                           "--quick", "--out", str(out)], capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert {n: s["status"] for n, s in report["sections"].items()} == dict.fromkeys(
        device_sections.SECTIONS, "ok")
    figures = {n: s["figures"] for n, s in report["sections"].items()}
    assert figures["environment"]["backend"] == "cpu" and (out / "lscpu.txt").exists()
    rows = figures["decode"]["rows"]
    assert [r["batch"] for r in rows] == [1, 4]
    assert all({"jaxdecode", "fast", "hf", "tax", "fast_ratio"} <= set(r) for r in rows)
    low = figures["decode"]["lowered"]
    for mode in ("invariant", "fast"):  # one product per weight matrix, no loop at 4 rows
        assert low[mode]["weight_products"] == low[mode]["weight_matrices"]
        assert low[mode]["while_loops"] == 0
    assert low["fast"]["optimization_barriers"] == 0 < low["invariant"]["optimization_barriers"]
    assert set(figures["kernels"]["kernels"]) == {"gpu", "tpu"}
    inv = figures["invariance"]["modes"]["invariant"]
    assert inv["bitwise_batches"] == inv["batches"] and inv["max_abs_diff"] == 0
    assert figures["serving"]["levels"][0]["completed"] == 4
    goals = {g["goal"]: g["met"] for g in report["goals"]}
    assert goals["X1: probe logits bitwise in every batch (invariant mode)"]
    assert goals["gpu kernel matches the XLA path"] and goals["tpu kernel matches the XLA path"]
    text = (out / "report.md").read_text()
    for name in device_sections.SECTIONS:
        assert f"## {name}" in text


def test_a_failing_or_hanging_section_costs_only_itself(tmp_path):
    planted = {name: f"tests.device_check_planted:{name}" for name in ("fine", "broken", "hangs")}
    report = devicecheck.run(str(tmp_path), True, planted, budgets={"hangs": 5})
    sections = report["sections"]
    assert sections["fine"]["status"] == "ok"
    assert sections["fine"]["figures"] == {"quick": True, "out": str(tmp_path)}
    assert sections["broken"]["status"] == "failed"
    assert "RuntimeError: planted failure" in sections["broken"]["error"]
    assert "planted failure" in (tmp_path / "broken.log").read_text()  # the traceback is kept
    assert sections["hangs"]["status"] == "timed out" and sections["hangs"]["seconds"] < 60
    text = (tmp_path / "report.md").read_text()
    assert "| broken | failed: RuntimeError: planted failure |" in text
    assert "| hangs | timed out" in text and "## fine" in text


def _decode(backend, rows):
    return {"status": "ok", "figures": {"machine": {"backend": backend}, "rows": rows}}


def _row(batch, step_ms, ratio, tax, fast_ratio):
    return {"batch": batch, "jaxdecode": {"step_ms": step_ms}, "ratio": ratio, "tax": tax,
            "fast_ratio": fast_ratio}


def test_goals_are_the_issues_per_backend():
    gpu = device_sections.goals({"decode": _decode("gpu", [
        _row(1, 1.8, 3.0, 0.30, 4.0), _row(16, 5.0, 1.9, 0.08, 2.1)])})
    assert [(g["goal"], g["met"]) for g in gpu] == [
        ("batch 1 step <= 2 ms", True), ("batch 16 >= 2x HF", False),
        ("invariance tax batch 16 <= 10%", True)]
    cpu = device_sections.goals({"decode": _decode("cpu", [
        _row(1, 4.0, 1.9, 0.05, 2.1), _row(16, 9.0, 1.2, 0.20, 1.4)])})
    assert [(g["goal"], g["met"]) for g in cpu] == [
        ("fast path batch 1 >= 2.0x HF", True), ("invariance tax batch 1 <= 15%", True),
        ("fast path batch 16 >= 1.5x HF", False), ("invariance tax batch 16 <= 15%", False)]
    failed = device_sections.goals({"decode": {"status": "failed", "error": "x"}})
    assert failed == []


@pytest.mark.parametrize("argv,message", [
    (["--device-check"], "--device-check and --out DIR go together"),
    (["--device-check", "--out", "d", "--batch", "4"], "--batch: not used by --device-check"),
])
def test_device_check_flags_are_named(argv, message):
    from jaxdecode.cli import main

    with pytest.raises(SystemExit, match=message):
        main(["bench", *argv])
