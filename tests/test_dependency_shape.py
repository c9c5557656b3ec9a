"""The package's dependencies as contracts: private names only in the adapters; no cycles.

- No module but ``harness/lm_eval_adapter.py`` and ``model/transformers_adapter.py``
  reads or writes a private name (``obj._name``,
  ``getattr(obj, "_name")``, ``obj.__dict__.get("_name")``) that the package does
  not define itself, calls
  a base class's private method through ``super()``, or overrides a private
  method of an lm-eval or transformers class; nor does any string of its code
  (docstrings aside) name one of the private names the adapters use (a search
  of a library's source text for ``_attn_implementation == "sdpa"``, say).
- ``harness/`` has no import cycle (its imports read with ``ast``).
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
from pathlib import Path

import pytest

import lm_coupling

PACKAGE = Path(lm_coupling.__file__).resolve().parent
ADAPTERS = {
    "harness/lm_eval_adapter.py",
    "model/transformers_adapter.py",
}
FOREIGN = ("lm_eval", "transformers")
NAME_FUNCTIONS = {"getattr", "setattr", "hasattr", "delattr"}


def _modules() -> dict[str, ast.Module]:
    return {
        path.relative_to(PACKAGE).as_posix(): ast.parse(path.read_text(encoding="utf-8"))
        for path in sorted(PACKAGE.rglob("*.py"))
    }


def _private(name: object) -> bool:
    return isinstance(name, str) and name.startswith("_") and not name.startswith("__")


def _own_names(modules: dict[str, ast.Module]) -> set[str]:
    """Private names the package defines outside the adapters (functions, classes, attributes)."""
    own: set[str] = set()
    for relative, tree in modules.items():
        if relative in ADAPTERS:
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                own.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                own.add(node.id)
            elif (
                isinstance(node, ast.Attribute)
                and isinstance(node.ctx, ast.Store)
                and isinstance(node.value, ast.Name)
                and node.value.id == "self"
            ):
                own.add(node.attr)
    return {name for name in own if _private(name)}


def _is_super(node: ast.AST) -> bool:
    return isinstance(node, ast.Call) and getattr(node.func, "id", None) == "super"


def _private_uses(tree: ast.Module, own: set[str]) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            if _is_super(node.value) or node.attr not in own:
                found.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.Call) and node.args:
            name = node.args[1] if len(node.args) > 1 else None
            func = node.func
            if isinstance(func, ast.Name) and func.id in NAME_FUNCTIONS:
                constant = getattr(name, "value", None)
            elif (
                isinstance(func, ast.Attribute)
                and func.attr in ("get", "pop", "setdefault")
                and isinstance(func.value, ast.Attribute)
                and func.value.attr == "__dict__"
            ):
                constant = getattr(node.args[0], "value", None)
            else:
                continue
            if _private(constant) and constant not in own:
                found.append((node.lineno, ast.unparse(node)))
    return found


_IDENTIFIER = re.compile(r"(?<![\w.])_[A-Za-z]\w*")


def _docstrings(tree: ast.Module) -> set[int]:
    bodies = [tree, *(n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef)))]
    bodies += [n for n in ast.walk(tree) if isinstance(n, ast.AsyncFunctionDef)]
    return {
        id(node.body[0].value)
        for node in bodies
        if node.body and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }  # fmt: skip


def _adapter_private_names(modules: dict[str, ast.Module], own: set[str]) -> set[str]:
    """The foreign private names the adapters use (attributes, and names in their strings)."""
    names: set[str] = set()
    for relative in ADAPTERS:
        tree = modules[relative]
        docstrings = _docstrings(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and _private(node.attr):
                names.add(node.attr)
            elif (
                isinstance(node, ast.Constant)
                and isinstance(node.value, str)
                and id(node) not in docstrings
            ):
                names.update(_IDENTIFIER.findall(node.value))
    defined = {
        node.name
        for relative in ADAPTERS
        for node in ast.walk(modules[relative])
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
    }
    return {n for n in names if _private(n)} - own - defined


def _private_names_in_text(tree: ast.Module, names: set[str]) -> list[tuple[int, str]]:
    docstrings = _docstrings(tree)
    return [
        (node.lineno, repr(node.value))
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and id(node) not in docstrings
        and set(_IDENTIFIER.findall(node.value)) & names
    ]


def test_private_names_of_lm_eval_and_transformers_are_used_in_the_adapters_only():
    modules = _modules()
    own = _own_names(modules)
    foreign = _adapter_private_names(modules, own)
    assert {"_attn_implementation", "_objs"} <= foreign  # the adapters' uses were read
    offenders = [
        f"{relative}:{line}: {text}"
        for relative, tree in modules.items()
        if relative not in ADAPTERS
        for line, text in [*_private_uses(tree, own), *_private_names_in_text(tree, foreign)]
    ]
    assert not offenders, (
        "private names of another library used outside harness/lm_eval_adapter.py and "
        "model/transformers_adapter.py (move each use into its adapter, with a contract "
        "test):\n" + "\n".join(offenders)
    )


def test_the_grep_finds_a_private_access():
    """The check above can fail: it flags the accesses the adapters exist for."""
    source = (
        "def f(task, config, manager):\n"
        "    task._aggregation_list['x'] = 1\n"
        "    config.__dict__.get('_attn_implementation_internal')\n"
        "    getattr(manager, '_factory')\n"
        "    return super()._model_call(1)\n"
    )
    found = [text for _, text in _private_uses(ast.parse(source), own=set())]
    assert len(found) == 4, found
    text = '"""A docstring naming _objs."""\nBRANCH = "_attn_implementation == \'sdpa\'"\n'
    found = _private_names_in_text(ast.parse(text), {"_attn_implementation", "_objs"})
    assert [line for line, _ in found] == [2], found


@pytest.mark.parametrize(
    "module", ["lm_coupling.harness.model", "lm_coupling.harness.tasks"]
)  # fmt: skip
def test_no_class_overrides_a_private_method_of_lm_eval_or_transformers(module):
    offenders = []
    for _, cls in inspect.getmembers(importlib.import_module(module), inspect.isclass):
        if not cls.__module__.startswith("lm_coupling") or cls.__module__.endswith("_adapter"):
            continue
        foreign = [b for b in cls.__mro__[1:] if b.__module__.split(".")[0] in FOREIGN]
        for name in vars(cls):
            if name == "_abc_impl":  # abc's own bookkeeping of every abstract class
                continue
            if _private(name) and any(name in vars(base) for base in foreign):
                offenders.append(f"{cls.__qualname__}.{name}")
    assert not offenders, (
        f"{offenders} override private methods of lm-eval or transformers; put the override "
        "in the library's adapter (a public hook) instead"
    )


def _harness_imports() -> dict[str, set[str]]:
    """harness module -> the harness modules it imports (at any level of its code)."""
    graph: dict[str, set[str]] = {}
    for path in sorted((PACKAGE / "harness").glob("*.py")):
        name = f"lm_coupling.harness.{path.stem}"
        imported: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module:
                base = node.module
                imported.add(base)
                imported.update(f"{base}.{alias.name}" for alias in node.names)
            elif isinstance(node, ast.Import):
                imported.update(alias.name for alias in node.names)
        graph[name] = {m for m in imported if m.startswith("lm_coupling.harness.")} - {name}
    return {name: {m for m in deps if m in graph} for name, deps in graph.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_harness_has_no_import_cycle():
    cycle = _cycle(_harness_imports())
    assert cycle is None, "import cycle in harness/: " + " -> ".join(cycle or [])


def test_the_cycle_check_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None
