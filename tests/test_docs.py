"""The documents the repository owns: every relative link resolves inside the repository (no
`../shared`), and every rule id that a test name cites is defined in docs/contract.md."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "serving/README.md",
        ROOT / "notebooks/README.md", ROOT / "models/demo/MODEL_CARD.md"]
LINK = re.compile(r"\]\(([^)\s]+)\)")
RULE_IN_TEST = re.compile(r"def test_\w*?_((?:[LOPDSTBCRX])\d+[a-c]?)_")


def test_docs_exist_and_link_only_inside_the_repository():
    assert (ROOT / "docs/contract.md").exists() and (ROOT / "docs/architecture.md").exists()
    for doc in DOCS:
        text = doc.read_text(encoding="utf-8")
        assert "../shared" not in text, doc
        for target in LINK.findall(text):
            if re.match(r"[a-z]+://|#|mailto:", target):
                continue
            path = (doc.parent / target.split("#")[0]).resolve()
            assert path.exists() and ROOT in path.parents, f"{doc.name}: {target}"


def test_rule_ids_cited_by_tests_are_defined_in_the_contract():
    contract = (ROOT / "docs/contract.md").read_text(encoding="utf-8")
    defined = set(re.findall(r"\*\*([LOPDSTBCRX]\d+[a-c]?)\*\*", contract))
    cited = {m for f in (ROOT / "tests").glob("test_*.py")
             for m in RULE_IN_TEST.findall(f.read_text(encoding="utf-8"))}
    assert {"S4", "L2", "X1", "B1", "D2a"} <= cited  # the pattern reads the test names
    sections = set(re.findall(r"carry `(\w+)` in their names", contract))  # S10, X11
    assert sections == {"S10", "X11"}
    assert cited <= defined | sections, sorted(cited - defined - sections)
    every = ({f"L{i}" for i in range(1, 5)} | {f"O{i}" for i in range(1, 4)}
             | {f"P{i}" for i in range(1, 4)} | {f"D{i}" for i in range(1, 7)}
             | {"D2a", "D2b", "D2c"} | {f"S{i}" for i in range(1, 10)}
             | {f"T{i}" for i in range(1, 8)} | {"B1", "R1", "R2", "R3", "R4", "R5", "R6", "R7", "X1"} | {f"C{i}" for i in range(1, 5)})
    assert defined == every, sorted(defined ^ every)  # no rule of the contract lost
