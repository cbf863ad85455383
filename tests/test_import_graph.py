"""The package's shape: no import cycles between its modules, and no module too long to read.

The import graph is read from the source with ``ast`` (nothing is imported): every ``import``
and ``from ... import`` at any depth counts, inside functions and methods too, since a cycle
hidden in a function is still a cycle (it only moves the failure to the first call). Relative
imports are resolved against the importing module; ``from pkg import name`` is an edge to the
submodule ``pkg.name`` where that is a module, else to ``pkg``; an import of a name that is not
a module of ours goes to its nearest enclosing module that is. Parent packages implicitly run by
an import (``import a.b`` runs ``a/__init__``) are not edges: every module would then sit in a
cycle with the package's ``__init__``.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = "interlace"
ROOT = Path(__file__).resolve().parent.parent
MAX_LINES = 600


def modules(root: Path = ROOT, package: str = PACKAGE) -> dict[str, Path]:
    """Dotted module name → source file, for every ``.py`` file of ``package`` under ``root``."""
    found = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _nearest(name: str, mods: dict[str, Path]) -> str | None:
    """``name`` or its nearest enclosing module that is one of ``mods``."""
    while name not in mods and "." in name:
        name = name.rsplit(".", 1)[0]
    return name if name in mods else None


def imports_of(module: str, path: Path, mods: dict[str, Path], package: str = PACKAGE) -> set[str]:
    """The modules of ``mods`` that ``module`` imports, at any depth of its source."""
    is_package = path.name == "__init__.py"
    targets: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == package or alias.name.startswith(package + "."):
                    targets.add(_nearest(alias.name, mods))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if not (source == package or source.startswith(package + ".")):
                continue
            for alias in node.names:
                full = f"{source}.{alias.name}"
                targets.add(full if full in mods else _nearest(source, mods))
    targets.discard(None)
    targets.discard(module)
    return targets


def import_graph(root: Path = ROOT, package: str = PACKAGE) -> dict[str, set[str]]:
    mods = modules(root, package)
    return {m: imports_of(m, p, mods, package) for m, p in mods.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm, iterative),
    each sorted, in sorted order."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            v, children = work[-1]
            for w in children:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    component = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        component.append(w)
                        if w == v:
                            break
                    if len(component) > 1:
                        components.append(sorted(component))
    return sorted(components)


def a_cycle(component: list[str], graph: dict[str, set[str]]) -> list[str]:
    """A shortest cycle from the component's first module back to itself, inside the component."""
    members = set(component)
    first = component[0]
    parent: dict[str, str] = {}
    frontier = [first]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & members):
                if w == first:  # v's path from first, then back to first
                    path = [v]
                    while path[-1] != first:
                        path.append(parent[path[-1]])
                    return path[::-1] + [first]
                if w not in parent:
                    parent[w] = v
                    nxt.append(w)
        frontier = nxt
    return component  # unreachable for a strongly connected component


def long_modules(root: Path = ROOT, package: str = PACKAGE, limit: int = MAX_LINES) -> dict[str, int]:
    counts = {m: len(p.read_text().splitlines()) for m, p in modules(root, package).items()}
    return {m: n for m, n in sorted(counts.items()) if n > limit}


def test_no_import_cycles():
    graph = import_graph()
    found = cycles(graph)
    assert not found, "import cycles (imports inside functions count):\n" + "\n".join(
        f"{', '.join(c)}; e.g. {' -> '.join(a_cycle(c, graph))}" for c in found)


def test_no_module_over_600_lines():
    found = long_modules()
    assert not found, f"modules over {MAX_LINES} lines:\n" + "\n".join(f"{m}: {n}" for m, n in found.items())


def test_the_walker_sees_relative_nested_and_submodule_imports(tmp_path):
    """The graph itself: a cycle through a relative import inside a function is found, and
    ``from pkg import submodule`` is an edge to the submodule, not to the package."""
    pkg = tmp_path / "toy"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from toy.sub import b\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from ..c import g\n")
    (pkg / "c.py").write_text("import toy.a\ng = 1\n")
    (pkg / "d.py").write_text("from . import c\nfrom .sub import nothing_here\n")
    graph = import_graph(tmp_path, "toy")
    assert graph["toy.a"] == {"toy.sub.b"}
    assert graph["toy.sub.b"] == {"toy.c"}
    assert graph["toy.d"] == {"toy.c", "toy.sub"}
    assert cycles(graph) == [["toy.a", "toy.c", "toy.sub.b"]]
    assert a_cycle(["toy.a", "toy.c", "toy.sub.b"], graph) == ["toy.a", "toy.sub.b", "toy.c", "toy.a"]
    (pkg / "c.py").write_text("g = 1\n" + "x = 1\n" * 5)
    assert cycles(import_graph(tmp_path, "toy")) == []
    assert long_modules(tmp_path, "toy", limit=5) == {"toy.c": 6}
