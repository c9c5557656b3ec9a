"""No import cycle anywhere in the package, at any level of the code.

Every ``import`` and ``from ... import`` of every module is read with ``ast``:
at module level, inside functions and under ``if TYPE_CHECKING:``. A name
imported from a package's ``__init__`` (its public face) counts as an import
of the module that defines it, as the face's own imports say; the faces
themselves are not nodes (a face re-exports, and importing a submodule runs
its package's face first, so faces are excepted).
"""

from __future__ import annotations

import ast
from pathlib import Path

import lm_coupling

PACKAGE = Path(lm_coupling.__file__).resolve().parent
ROOT = PACKAGE.name


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _trees() -> dict[str, tuple[Path, ast.Module]]:
    return {
        _module_name(path): (path, ast.parse(path.read_text(encoding="utf-8")))
        for path in sorted(PACKAGE.rglob("*.py"))
    }


def _absolute(node: ast.ImportFrom, name: str, is_package: bool) -> str:
    """The absolute module of a ``from`` import (relative ones resolved)."""
    if not node.level:
        return node.module or ""
    base = name.split(".")
    base = base if is_package else base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


def _face_homes(trees) -> dict[str, dict[str, str]]:
    """Per package face: each name it imports -> the module it comes from."""
    homes: dict[str, dict[str, str]] = {}
    for name, (path, tree) in trees.items():
        if path.name != "__init__.py":
            continue
        own: dict[str, str] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                module = _absolute(node, name, True)
                for alias in node.names:
                    own[alias.asname or alias.name] = module
        homes[name] = own
    return homes


def import_graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports (faces resolved, faces not nodes)."""
    trees = _trees()
    faces = _face_homes(trees)
    modules = {name for name, (path, _) in trees.items() if path.name != "__init__.py"}

    def resolve(target: str) -> set[str]:
        return {target} if target in modules else set()

    def through_face(package: str, attr: str, seen=frozenset()) -> set[str]:
        full = f"{package}.{attr}"
        if full in modules:
            return {full}
        if full in faces:  # a subpackage: its face
            return set()
        home = faces.get(package, {}).get(attr)
        if home is None or (package, attr) in seen:
            return set()
        if home in modules:
            return {home}
        return through_face(home, attr, seen | {(package, attr)}) if home in faces else set()

    graph: dict[str, set[str]] = {}
    for name in sorted(modules):
        _, tree = trees[name]
        found: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                module = _absolute(node, name, False)
                if module.split(".")[0] != ROOT:
                    continue
                if module in faces:
                    for alias in node.names:
                        found |= through_face(module, alias.name)
                else:
                    found |= resolve(module)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] == ROOT:
                        found |= resolve(alias.name)
        graph[name] = found - {name}
    return graph


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """The graph's cycles: its strongly connected components of two or more modules."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(node: str) -> None:  # Tarjan's algorithm
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return out


def test_the_package_has_no_import_cycle():
    graph = import_graph()
    assert len(graph) > 100  # every module was read
    cycles = strongly_connected(graph)
    assert not cycles, "import cycles (modules that import each other, at any level):\n" + (
        "\n".join(" <-> ".join(c) for c in cycles)
    )


def test_the_check_finds_a_cycle_and_reads_every_level():
    assert strongly_connected({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert strongly_connected({"a": {"b"}, "b": set()}) == []
    graph = import_graph()
    # A function-level import and one under TYPE_CHECKING are both edges.
    assert "lm_coupling.capture.collector" in graph["lm_coupling.geometry"]
    assert "lm_coupling.harness.run_config" in graph["lm_coupling.harness.model"]
