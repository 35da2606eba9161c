"""The notebooks (notebooks/*.ipynb) run top to bottom, and git holds them without outputs.

Each notebook is executed with nbclient on the `python3` kernel of this interpreter (jupyter
replaces a kernelspec's `python` with sys.executable), cwd notebooks/, the project root first
on PYTHONPATH and matplotlib on Agg. Any cell error fails the test and names the cell.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK_DIR = ROOT / "notebooks"
EXPECTED = [
    "01_quickstart", "02_logit_processors", "03_beam_vs_sampling", "04_speculative",
    "05_structured_output", "06_replay", "07_consistency", "08_watermark",
    "09_guidance_and_steering", "10_grpo",
]
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
TIMEOUT_S = 300  # per cell; each notebook takes well under a minute on a CPU


def test_every_notebook_is_there():
    assert [p.stem for p in NOTEBOOKS] == EXPECTED


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs(path):
    nb = nbformat.read(path, as_version=4)
    env = dict(os.environ, MPLBACKEND="Agg",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    client = nbclient.NotebookClient(nb, timeout=TIMEOUT_S, kernel_name="python3",
                                     resources={"metadata": {"path": str(NOTEBOOK_DIR)}})
    client.execute(env=env)  # CellExecutionError (the cell and its traceback) on any error


def _outputs(nb: dict) -> list[str]:
    bad = []
    for i, cell in enumerate(nb.get("cells", [])):
        if cell.get("cell_type") != "code":
            continue
        if cell.get("outputs"):
            bad.append(f"cell {i}: outputs")
        if cell.get("execution_count") is not None:
            bad.append(f"cell {i}: execution_count")
    return bad


def _git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_outputs_are_stripped(path):
    """The working copy and the version staged in git carry no outputs or execution counts
    (strip them with `python notebooks/strip_outputs.py`)."""
    versions = {"working tree": path.read_text(encoding="utf-8")}
    rel = path.relative_to(ROOT).as_posix()
    staged = _git("show", f":{rel}")
    if staged.returncode == 0:  # tracked (git available and the file is staged or committed)
        versions["git index"] = staged.stdout
    for where, text in versions.items():
        bad = _outputs(json.loads(text))
        assert not bad, f"{rel} ({where}) is not stripped: {bad}; run notebooks/strip_outputs.py"
