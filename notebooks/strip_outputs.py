"""Strip outputs and execution counts from notebooks (all of notebooks/ by default), in place.

    python notebooks/strip_outputs.py [NOTEBOOK.ipynb ...]

git keeps the notebooks without outputs (tests/test_notebooks.py checks it).
"""

import sys
from pathlib import Path

import nbformat


def strip(path: Path) -> bool:
    nb = nbformat.read(path, as_version=4)
    changed = False
    for cell in nb.cells:
        if cell.cell_type == "code" and (cell.outputs or cell.execution_count is not None):
            cell.outputs, cell.execution_count = [], None
            changed = True
        if cell.get("metadata", {}).get("execution"):
            del cell.metadata["execution"]
            changed = True
    if changed:
        nbformat.write(nb, path)
    return changed


if __name__ == "__main__":
    paths = [Path(p) for p in sys.argv[1:]] or sorted(Path(__file__).parent.glob("*.ipynb"))
    for p in paths:
        print(f"{p}: {'stripped' if strip(p) else 'clean'}")
