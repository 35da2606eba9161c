"""The import graph of the source tree, read with `ast` (nothing is imported), and the layering
rules of docs/architecture.md checked over it. Used by tests/test_layering.py, which runs the
rules on the repository and on small synthetic trees that break each rule on purpose.

Every import counts, at any depth (a function-level import is still a dependency) except
those under `if TYPE_CHECKING:`. `from pkg import name` is an import of `pkg.name` when that
is a module of the tree, else of `pkg`.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Iterable, Optional

PACKAGES = ("jaxdecode", "models", "serving")
APPS = ("jaxdecode.cli",)               # the composition root: may import models and serving
JAX = ("jax", "jaxlib", "flax")


def module_name(root: Path, file: Path) -> str:
    parts = list(file.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _type_checking_only(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST) -> Iterable[ast.AST]:
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _type_checking_only(node):
            stack.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        stack.extend(ast.iter_child_nodes(node))


class ImportGraph:
    """module name -> the absolute names it imports, for every .py file of `packages` under
    `root` (a repository checkout or a synthetic tree)."""

    def __init__(self, root: Path, packages: Iterable[str] = PACKAGES):
        self.root = Path(root)
        self.files: dict[str, Path] = {}
        for pkg in packages:
            for file in sorted((self.root / pkg).rglob("*.py")):
                self.files[module_name(self.root, file)] = file
        self.imports: dict[str, set[str]] = {m: self._read(m, f) for m, f in self.files.items()}

    def _read(self, module: str, file: Path) -> set[str]:
        tree = ast.parse(file.read_text(encoding="utf-8"), str(file))
        package = module if file.name == "__init__.py" else module.rpartition(".")[0]
        out: set[str] = set()
        for node in _imports(tree):
            if isinstance(node, ast.Import):
                out.update(alias.name for alias in node.names)
                continue
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                out.add(sub if sub in self.files else base)
        return out

    def exists(self, module: str) -> bool:
        return module in self.files

    def under(self, prefix: str) -> list[str]:
        return [m for m in self.files if m == prefix or m.startswith(prefix + ".")]

    def internal(self, name: str) -> Optional[str]:
        """The tree's module that an imported name refers to (its longest known prefix)."""
        parts = name.split(".")
        for i in range(len(parts), 0, -1):
            cand = ".".join(parts[:i])
            if cand in self.files:
                return cand
        return None


def _is(name: str, targets: Iterable[str]) -> bool:
    return any(name == t or name.startswith(t + ".") for t in targets)


def forbidden(graph: ImportGraph, sources: Iterable[str], targets: Iterable[str],
              exempt: Iterable[str] = (), allowed: Iterable[str] = ()) -> list[str]:
    """'module imports name' for each direct import of `targets` (but not of `allowed`) by a
    module of `sources` outside `exempt`."""
    sources, targets, exempt, allowed = map(tuple, (sources, targets, exempt, allowed))
    return sorted(f"{m} imports {name}" for m in graph.files
                  if _is(m, sources) and not _is(m, exempt)
                  for name in graph.imports[m] if _is(name, targets) and not _is(name, allowed))


def reaches_jax(graph: ImportGraph, sources: Iterable[str], jax: Iterable[str] = JAX) -> list[str]:
    """Import chains from a module of `sources` to jax, through the tree's own modules (a
    module that imports only jax-free modules of the tree is jax-free)."""
    jax = tuple(jax)
    found = []
    for start in sorted(m for m in graph.files if _is(m, sources)):
        seen, stack = {start}, [(start, [start])]
        while stack:
            m, path = stack.pop()
            for name in sorted(graph.imports[m]):
                if _is(name, jax):
                    found.append(" -> ".join(path + [name]))
                    continue
                dep = graph.internal(name)
                if dep is not None and dep not in seen:
                    seen.add(dep)
                    stack.append((dep, path + [dep]))
    return found


def unit(module: str) -> str:
    """The node of the cycle check: a top-level module or subpackage of a package
    (`jaxdecode.host.stop` -> `jaxdecode.host`), or the package's own __init__."""
    return ".".join(module.split(".")[:2])


def cycles(graph: ImportGraph) -> list[list[str]]:
    """The strongly connected components (more than one unit) of the unit graph."""
    edges: dict[str, set[str]] = {}
    for m, names in graph.imports.items():
        for name in names:
            dep = graph.internal(name)
            if dep is not None and unit(dep) != unit(m):
                edges.setdefault(unit(m), set()).add(unit(dep))
        edges.setdefault(unit(m), set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


# -- the rules (docs/architecture.md, "Dependency rules") --------------------------------------

class Rule:
    """A named check over an ImportGraph; `requires` names the module the rule is about: where
    the tree does not have it yet, the rule does not apply (the test skips, saying so)."""

    def __init__(self, name: str, check, requires: Optional[str] = None):
        self.name, self.check, self.requires = name, check, requires

    def applies(self, graph: ImportGraph) -> bool:
        return self.requires is None or graph.exists(self.requires)

    def violations(self, graph: ImportGraph) -> list[str]:
        return self.check(graph)


RULES = {r.name: r for r in (
    Rule("host_never_imports_jax", lambda g: reaches_jax(g, ["jaxdecode.host"]), "jaxdecode.host"),
    Rule("library_never_imports_models_or_serving",
         lambda g: forbidden(g, ["jaxdecode"], ["models", "serving"], exempt=APPS)),
    Rule("serving_never_imports_cli", lambda g: forbidden(g, ["serving"], ["jaxdecode.cli"])),
    Rule("models_import_only_the_model_api",
         lambda g: forbidden(g, ["models"], ["jaxdecode"],
                             allowed=["jaxdecode.model_api", "jaxdecode.invariance"])),
    Rule("no_import_cycles", lambda g: [" <-> ".join(c) for c in cycles(g)]),
    Rule("device_never_imports_host_engine_models_serving",
         lambda g: forbidden(g, ["jaxdecode.device"], ["jaxdecode.host", "jaxdecode.engine",
                                                       "jaxdecode.cli", "models", "serving"]),
         "jaxdecode.device"),
    Rule("scheduler_never_imports_jax",
         lambda g: reaches_jax(g, ["jaxdecode.engine.scheduler"]), "jaxdecode.engine.scheduler"),
)}
