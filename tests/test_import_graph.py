"""The package's import graph, read from the source: no import circle and no module over
600 lines (issue 45). Modules are named as they install, through pyproject's package-dir
(kvledger.engine is engine/, ...); every import counts, TYPE_CHECKING and function-level
ones too, since each is a dependency a reader has to hold in mind.

KNOWN_* list what is still there today and is being fixed on another branch. An entry
that is gone fails the test, so the lists can only shrink."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAX_LINES = 600

KNOWN_CIRCLES: list[set[str]] = []
KNOWN_OVERSIZED: set[str] = set()


def modules(root: Path) -> dict[str, Path]:
    """Every module of the package under `root`, by its installed name, as
    [tool.setuptools.package-dir] maps packages to folders."""
    config = tomllib.loads((root / "pyproject.toml").read_text())
    package_dir: dict[str, str] = config["tool"]["setuptools"]["package-dir"]
    found: dict[str, Path] = {}
    for package, folder in package_dir.items():
        base = root / folder
        for path in sorted(base.rglob("*.py")):
            rel = path.relative_to(base).with_suffix("").parts
            if rel[-1] == "__init__":
                rel = rel[:-1]
            name = ".".join((package, *rel))
            # a folder mapped by a longer package name is that package's (kvledger/ holds no layer, but be exact)
            owner = max((p for p in package_dir if name == p or name.startswith(p + ".")), key=len)
            if owner == package:
                found[name] = path
    return found


def imported(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The package's modules that module `name` (at `path`) imports anywhere in its source.
    A name imported from a package is its submodule where there is one; a package's own
    ancestors are not counted (Python has begun them before the module runs)."""
    targets: set[str] = set()
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            candidates = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = name.split(".")
                anchor = parts[: len(parts) - node.level + (1 if is_package else 0)]
                base = ".".join([*anchor, base] if base else anchor)
            candidates = [base, *(f"{base}.{a.name}" for a in node.names)]
        else:
            continue
        for candidate in candidates:
            while candidate and candidate not in known:
                candidate = candidate.rpartition(".")[0]
            if candidate and candidate != name and not name.startswith(candidate + "."):
                targets.add(candidate)
    return targets


def circles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[set[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, edges = work[-1]
            w = next(edges, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                component = set()
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    component.add(w)
                    if w == v:
                        break
                if len(component) > 1:
                    found.append(component)
    return found


def import_graph(root: Path) -> tuple[dict[str, set[str]], dict[str, Path]]:
    known = modules(root)
    return {name: imported(name, path, known) for name, path in known.items()}, known


def unexpected_circles(found: list[set[str]], allowed: list[set[str]]) -> tuple[list[set[str]], list[set[str]]]:
    """Circles not within an allowed one, and allowed ones no circle is left within (stale)."""
    new = [c for c in found if not any(c <= a for a in allowed)]
    stale = [a for a in allowed if not any(c <= a for c in found)]
    return new, stale


def oversized(root: Path, known: dict[str, Path]) -> dict[str, int]:
    sizes = {str(p.relative_to(root)): len(p.read_text().splitlines()) for p in known.values()}
    return {path: n for path, n in sizes.items() if n > MAX_LINES}


def test_the_package_has_no_import_circle_but_the_known_ones():
    graph, _ = import_graph(ROOT)
    new, stale = unexpected_circles(circles(graph), KNOWN_CIRCLES)
    assert new == [], f"import circles: {[sorted(c) for c in new]}"
    assert stale == [], f"gone, take them out of KNOWN_CIRCLES: {[sorted(c) for c in stale]}"


def test_no_module_is_over_600_lines_but_the_known_ones():
    _, known = import_graph(ROOT)
    big = oversized(ROOT, known)
    new = {path: n for path, n in big.items() if path not in KNOWN_OVERSIZED}
    assert new == {}, f"over {MAX_LINES} lines: {new}"
    gone = sorted(KNOWN_OVERSIZED - set(big))
    assert gone == [], f"no longer over {MAX_LINES} lines, take them out of KNOWN_OVERSIZED: {gone}"


def _tree(tmp: Path, files: dict[str, str]) -> Path:
    (tmp / "pyproject.toml").write_text('[tool.setuptools.package-dir]\nkvledger = "kvledger"\n'
                                        '"kvledger.low" = "low"\n"kvledger.high" = "high"\n')
    for rel, source in {"kvledger/__init__.py": "", "low/__init__.py": "", "high/__init__.py": "", **files}.items():
        (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp / rel).write_text(source)
    return tmp


def test_a_circle_is_found_through_package_dir_type_checking_and_function_imports(tmp_path):
    root = _tree(tmp_path, {
        "low/a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from kvledger.high.b import B\n",
        "high/b.py": "def f():\n    from ..low import a\n",  # relative, function-level
        "high/c.py": "import kvledger.low.a\n",  # no way back: not in a circle
    })
    graph, known = import_graph(root)
    assert known["kvledger.low.a"] == root / "low/a.py"
    assert graph["kvledger.high.b"] == {"kvledger.low", "kvledger.low.a"}  # the package it names, and the module
    assert circles(graph) == [{"kvledger.low.a", "kvledger.high.b"}]


def test_the_allowlist_only_shrinks():
    allowed = [{"a", "b", "c"}]
    assert unexpected_circles([{"a", "b", "c"}], allowed) == ([], [])
    assert unexpected_circles([{"a", "b"}], allowed) == ([], [])  # smaller: still within
    assert unexpected_circles([{"a", "d"}], allowed) == ([{"a", "d"}], [{"a", "b", "c"}])  # new; old gone
    assert unexpected_circles([], allowed) == ([], [{"a", "b", "c"}])


def test_a_module_over_600_lines_is_found(tmp_path):
    root = _tree(tmp_path, {"low/big.py": "x = 1\n" * 601, "low/fine.py": "x = 1\n" * 600})
    _, known = import_graph(root)
    assert oversized(root, known) == {"low/big.py": 601}
