"""No import cycles among kvrun's modules: a static check over the source (ast), so it sees
every runtime import, at module level and inside functions, whether or not a test runs it.

Imports under `if TYPE_CHECKING:` do not count. `from .pkg import name` is an edge to
pkg.name where that is a module, else to pkg; `from . import sibling` is an edge to the
sibling, not to the package's __init__; `import a.b` is an edge to a.b.

`python tests/test_imports.py [MODULE ...]` prints the table of imports between top-level
kvrun modules (subpackages as one row each), or among the modules named.
"""

from __future__ import annotations

import ast
import re
import sys
from collections.abc import Iterator
from itertools import pairwise
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KV = "kvrun.kv"


def package_dirs() -> dict[str, Path]:
    """pyproject.toml's package-dir mapping: kvrun -> kvrun/, kvrun.kernels -> kernels/, ..."""
    text = (ROOT / "pyproject.toml").read_text()
    return {pkg: ROOT / folder for pkg, folder in re.findall(r'"(kvrun[\w.]*)" = "(\w+)"', text)}


def module_files() -> dict[str, Path]:
    """Every kvrun module by dotted name (a package by its __init__.py)."""
    out: dict[str, Path] = {}
    for pkg, folder in package_dirs().items():
        for path in folder.rglob("*.py"):
            parts = path.relative_to(folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join((pkg, *parts))] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(node: ast.AST, lazy: bool = False) -> Iterator[tuple[ast.stmt, bool]]:
    """(import statement, inside a function) for every runtime import under node."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.Import | ast.ImportFrom):
            yield child, lazy
        elif isinstance(child, ast.If) and _is_type_checking(child.test):
            for stmt in child.orelse:  # the else branch runs
                yield from _imports(ast.Module(body=[stmt], type_ignores=[]), lazy)
        else:
            inner = lazy or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
            yield from _imports(child, inner)


def _targets(stmt: ast.stmt, module: str, is_pkg: bool, known: set[str]) -> Iterator[str]:
    """The kvrun modules one import statement loads (by the rules of the module docstring)."""
    if isinstance(stmt, ast.Import):
        for alias in stmt.names:
            if alias.name in known:
                yield alias.name
        return
    if stmt.level:
        base = module.split(".") if is_pkg else module.split(".")[:-1]
        base = base[: len(base) - (stmt.level - 1)]
        target = ".".join(base + ([stmt.module] if stmt.module else []))
    else:
        target = stmt.module or ""
    for alias in stmt.names:
        sub = f"{target}.{alias.name}"
        if sub in known:
            yield sub
        elif target in known:
            yield target


def module_imports(source: str, module: str, is_pkg: bool, known: set[str]) -> dict[str, bool]:
    """The kvrun modules `module` imports: {name: True if only inside functions (lazy)}."""
    edges: dict[str, bool] = {}
    for stmt, lazy in _imports(ast.parse(source)):
        for target in _targets(stmt, module, is_pkg, known):
            if target != module:
                edges[target] = edges.get(target, True) and lazy
    return edges


def import_graph() -> dict[str, dict[str, bool]]:
    """importer -> {imported: True if only inside functions (lazy), False if at module level}."""
    files = module_files()
    known = set(files)
    return {
        m: module_imports(path.read_text(), m, path.name == "__init__.py", known)
        for m, path in files.items()
    }


def knots(graph: dict[str, dict[str, bool]]) -> list[list[str]]:
    """The strongly connected sets of two or more modules (each one reaches every other)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    sccs: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            scc = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                scc.append(w)
                if w == v:
                    break
            if len(scc) > 1:
                sccs.append(sorted(scc))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(graph)))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sccs


def cycles(graph: dict[str, dict[str, bool]]) -> list[list[str]]:
    """One cycle (a path back to its start) through every knot."""
    return [_cycle_in(graph, k) for k in knots(graph)]


def _cycle_in(graph: dict[str, dict[str, bool]], scc: list[str]) -> list[str]:
    """A shortest cycle through the first module of a strongly connected set (BFS)."""
    members, start = set(scc), scc[0]
    prev = {start: None}
    queue = [start]
    for v in queue:
        for w in sorted(graph[v]):
            if w == start:
                path = [v]
                while prev[path[-1]] is not None:
                    path.append(prev[path[-1]])
                return [*reversed(path), start]
            if w in members and w not in prev:
                prev[w] = v
                queue.append(w)
    raise AssertionError(f"no cycle through {start}")


def _show(found: list[list[str]], graph) -> str:
    """Each knot as one of its cycles, and all its modules where the cycle leaves some out."""

    def arrow(a: str, b: str) -> str:
        return " -(lazy)-> " if graph[a][b] else " -> "

    lines = []
    for knot in found:
        c = _cycle_in(graph, knot)
        lines.append(c[0] + "".join(arrow(a, b) + b for a, b in pairwise(c)))
        if len(knot) > len(c) - 1:
            lines.append(f"  (one cycle of a knot of {len(knot)} modules: {', '.join(knot)})")
    return "import cycles:\n  " + "\n  ".join(lines)


def test_no_import_cycles_outside_kv():
    """No cycle runs through a module outside kvrun/kv/."""
    graph = import_graph()
    found = [k for k in knots(graph) if any(not m.startswith(KV) for m in k)]
    assert not found, _show(found, graph)


def test_no_import_cycles():
    """No cycle anywhere in kvrun, kvrun/kv/ included."""
    graph = import_graph()
    found = knots(graph)
    assert not found, _show(found, graph)


def test_the_graph_sees_lazy_relative_and_dotted_imports():
    known = {"kvrun", "kvrun.a", "kvrun.b", "kvrun.c", "kvrun.e", "kvrun.f", "kvrun.g"}
    known |= {"kvrun.p", "kvrun.p.x", "kvrun.p.y"}
    src = (
        "from typing import TYPE_CHECKING\n"
        "import torch\n"
        "from . import a\n"  # a sibling: kvrun.a, not kvrun's __init__
        "from .b import thing\n"
        "import kvrun.p.x\n"
        "from .p import y, name\n"  # y is a module; name lives in kvrun/p/__init__.py
        "if TYPE_CHECKING:\n    from . import f\nelse:\n    from . import g\n"
        "def later():\n    from .c import thing\n    from .a import other\n"
        "class K:\n    def m(self):\n        if TYPE_CHECKING:\n            from .e import z\n"
    )
    assert module_imports(src, "kvrun.m", False, set(known)) == {
        "kvrun.a": False, "kvrun.b": False, "kvrun.p.x": False, "kvrun.p.y": False,
        "kvrun.p": False, "kvrun.g": False, "kvrun.c": True,
    }  # fmt: skip
    src = "from . import x\nfrom .. import b\nfrom ..c import z\n"
    want = {"kvrun.p.x": False, "kvrun.b": False, "kvrun.c": False}
    assert module_imports(src, "kvrun.p.y", False, known) == want
    assert module_imports(src, "kvrun.p", True, known) == want
    graph = {"a": {"b": False}, "b": {"c": True}, "c": {"a": False}, "d": {"a": False}}
    assert cycles(graph) == [["a", "b", "c", "a"]]
    graph = {"a": {"b": False}, "b": {"a": False, "c": False}, "c": {"b": True}}  # two cycles
    assert knots(graph) == [["a", "b", "c"]] and cycles(graph) == [["a", "b", "a"]]
    assert "a knot of 3 modules: a, b, c" in _show(knots(graph), graph)
    assert "kvrun.kernels.dense_decode" in import_graph()  # the package-dir mapping


# ---------------------------------------------------------------------- the table
def _top(module: str) -> str:
    """kvrun.x for kvrun.x.y...: a subpackage counts as one module."""
    return ".".join(module.split(".")[:2])


def table(names: list[str] | None = None) -> str:
    """Markdown table: each top-level kvrun module (or each of `names`, short names allowed)
    and the ones it imports (lazy ones marked `*`: imported only inside functions)."""
    graph = import_graph()
    top: dict[str, dict[str, bool]] = {}
    for a, edges in graph.items():
        for b, lazy in edges.items():
            ta, tb = _top(a), _top(b)
            if ta != tb:
                row = top.setdefault(ta, {})
                row[tb] = row.get(tb, True) and lazy
            top.setdefault(ta, {})
    if names:
        want = [n if n.startswith("kvrun") else f"kvrun.{n}" for n in names]
        top = {m: {b: lz for b, lz in top.get(m, {}).items() if b in want} for m in want}
    rows = ["| module | imports (`*`: only inside functions) |", "|---|---|"]
    for m in sorted(top):
        deps = ", ".join(
            b.removeprefix("kvrun.") + ("*" if lz else "") for b, lz in sorted(top[m].items())
        )
        rows.append(f"| {m.removeprefix('kvrun.')} | {deps or '-'} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(table(sys.argv[1:] or None))
