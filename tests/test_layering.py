"""The layering of DESIGN.md section 2, checked on the sources: dependencies point one way.

    pytrio (SDK, no torch) --local transport only--> trio_server --Engine--> trio_engine
    trio_server may use pytrio.types and pytrio.errors: the wire types shared with the SDK.
    trio_cli (the ``trio`` entry point) sits above all three; none of them imports it.

The import graph is built with ``ast`` from every ``import`` statement under src/,
wherever it sits: module level, inside a function (a lazy import is still a
dependency), and under ``if TYPE_CHECKING:`` (a cycle through type hints is still a
cycle a reader has to untangle). Nodes are modules (``pytrio.training``); a package's
``__init__`` is the package's name (``pytrio.transport``). ``from pkg import name``
is an edge to ``pkg.name`` when that is a module, else to ``pkg``.
"""

from __future__ import annotations

import ast
from collections.abc import Callable, Iterable
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parent.parent / "src"
PACKAGES = ("pytrio", "trio_server", "trio_engine", "trio_cli")

Graph = dict[str, set[str]]


# --------------------------------------------------------------------------- the graph


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _resolve_relative(module: str, is_package: bool, level: int, target: str | None) -> str:
    # ``from .x import y`` in a.b.c means a.b.x; in a/b/__init__.py it means a.b.x too.
    base = module.split(".") if is_package else module.split(".")[:-1]
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join([*base, target] if target else base)


def imports_of(path: Path, module: str, modules: set[str]) -> set[str]:
    """Every module ``path`` (the module named ``module``) imports, anywhere in the file."""
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            source = (_resolve_relative(module, is_package, node.level, node.module) if node.level
                      else node.module or "")
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                found.add(submodule if submodule in modules else source)
    return found


def build_graph(root: Path, packages: Iterable[str]) -> Graph:
    """Module -> the modules it imports (external ones included; filter with ``internal``)."""
    files = {module_name(p, root): p for package in packages for p in sorted((root / package).rglob("*.py"))}
    modules = set(files)
    return {name: imports_of(path, name, modules) for name, path in files.items()}


def in_package(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def subgraph(graph: Graph, keep: Callable[[str], bool]) -> Graph:
    return {m: {d for d in deps if d in graph and keep(d)} for m, deps in graph.items() if keep(m)}


def tangles(graph: Graph) -> list[tuple[list[str], list[str]]]:
    """(the modules, one cycle path) of each strongly connected component that has a cycle.

    Tarjan's algorithm finds the components; a breadth-first search inside each gives
    the shortest cycle through its smallest module (first module repeated at the end),
    so the message is short and stable. Breaking that cycle may leave others in the
    component, hence the full member list.
    """
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def visit(v: str) -> None:  # recursion depth = module count: fine at this size
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            components.append(component)

    for v in sorted(graph):
        if v not in index:
            visit(v)

    found = []
    for component in components:
        start = min(component)
        if len(component) == 1 and start not in graph[start]:
            continue
        parent: dict[str, str] = {}
        frontier = [start]
        while frontier and start not in parent:
            nxt = []
            for v in frontier:
                for w in sorted(graph[v] & component):
                    if w not in parent:
                        parent[w] = v
                        nxt.append(w)
            frontier = nxt
        path = [start]
        while len(path) == 1 or path[-1] != start:
            path.append(parent[path[-1]])
        found.append((sorted(component), path[::-1]))
    return sorted(found)


def cycles(graph: Graph) -> list[list[str]]:
    return [path for _, path in tangles(graph)]


GRAPH = build_graph(SRC, PACKAGES)


def edges(graph: Graph) -> Iterable[tuple[str, str]]:
    return ((m, d) for m, deps in sorted(graph.items()) for d in sorted(deps))


# --------------------------------------------------------------------------- the rules


@pytest.mark.parametrize("scope", [*PACKAGES, "src"])
def test_no_import_cycles(scope: str) -> None:
    # Per package too, so a package's own cycles are named apart from cross-package ones.
    graph = subgraph(GRAPH, lambda m: scope == "src" or in_package(m, scope))
    found = tangles(graph)
    assert not found, f"import cycles in {scope}:\n" + "\n".join(
        f"  {' -> '.join(path)}   (modules in this tangle: {', '.join(members)})" for members, path in found)


# (importer package, imported package, may this importer import that module?, why)
RULES: dict[str, tuple[str, str, Callable[[str, str], bool], str]] = {
    "engine-imports-no-server": (
        "trio_engine", "trio_server", lambda importer, target: False,
        "the engine knows nothing of the service above it"),
    "engine-imports-no-sdk": (
        "trio_engine", "pytrio", lambda importer, target: False,
        "the engine knows nothing of the SDK"),
    "sdk-imports-server-only-in-local-transport": (
        "pytrio", "trio_server", lambda importer, target: importer == "pytrio.transport.local",
        "only the local transport runs the server in-process"),
    "sdk-imports-no-engine": (
        "pytrio", "trio_engine", lambda importer, target: False,
        "the SDK never imports torch or the engine"),
    "server-imports-only-wire-types-from-sdk": (
        "trio_server", "pytrio", lambda importer, target: target in {"pytrio.types", "pytrio.errors"},
        "the server shares only the wire types (pytrio.types, pytrio.errors) with the SDK"),
    **{f"{layer}-imports-no-entry-point": (
        layer, "trio_cli", lambda importer, target: False,
        "the command line composes the layers; a layer that imported it would import them all")
       for layer in ("pytrio", "trio_server", "trio_engine")},
}


@pytest.mark.parametrize("rule", list(RULES))
def test_layer_rule(rule: str) -> None:
    importer_pkg, target_pkg, allowed, why = RULES[rule]
    bad = [f"  {m} imports {d}" for m, d in edges(GRAPH)
           if in_package(m, importer_pkg) and in_package(d, target_pkg) and not allowed(m, d)]
    assert not bad, f"{rule}: {why}\n" + "\n".join(bad)


# --------------------------------------------------------------------------- the checker itself


def test_graph_sees_the_known_edges() -> None:
    """Guard against a graph that is silently empty, which would make every rule pass."""
    assert {"pytrio", "pytrio.transport", "pytrio.transport.local", "trio_server.core", "trio_engine.host"} <= set(GRAPH)
    assert "trio_server.core" in GRAPH["pytrio.transport.local"]  # an import inside a function
    assert "pytrio.types" in GRAPH["pytrio.transport"]  # ``from ..types import`` in a package __init__


def test_graph_builder_on_a_sample_tree(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    files = {
        "__init__.py": "from .a import A\n",
        "a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .b import B\nA = 1\n",
        "b.py": "def f():\n    from . import a\n    import pkg.sub.c\nB = 2\n",
        "sub/__init__.py": "from .. import b\nfrom . import c\nfrom .c import C\n",
        "sub/c.py": "from ..a import A\nfrom pkg import A as A2\nimport os\nC = 3\n",
    }
    for name, text in files.items():
        (pkg / name).write_text(text)
    graph = build_graph(tmp_path, ["pkg"])
    assert graph == {
        "pkg": {"pkg.a"},
        "pkg.a": {"typing", "pkg.b"},
        "pkg.b": {"pkg.a", "pkg.sub.c"},
        "pkg.sub": {"pkg.b", "pkg.sub.c"},
        "pkg.sub.c": {"pkg.a", "pkg", "os"},
    }
    assert cycles(graph) == [["pkg", "pkg.a", "pkg.b", "pkg.sub.c", "pkg"]]
    assert cycles(subgraph(graph, lambda m: m != "pkg")) == [["pkg.a", "pkg.b", "pkg.a"]]
