"""The package's modules import each other without cycles at import time (README, "Layout"):
the `from ... import` statements at the top level of every module under mlx_v41/, resolved to
modules, form a graph with no cycle. Imports inside functions (deferred) are not counted."""

import ast
import collections
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "mlx_v41"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def top_level_imports(modules: dict) -> dict:
    """{module: modules its top-level `from X import Y` statements load (X, and X.Y when Y
    is a submodule)}; `from . import m` inside a package counts only m."""
    edges = collections.defaultdict(set)
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        for node in ast.parse(path.read_text()).body:
            if not isinstance(node, ast.ImportFrom):
                continue
            if node.level:
                base = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            subs = {f"{target}.{a.name}" for a in node.names} & modules.keys()
            if subs and node.module is None:  # `from . import m`: the package is loading
                edges[name] |= subs - {name}
                continue
            edges[name] |= ({target} & modules.keys() | subs) - {name}
    return edges


def cycles(edges: dict) -> list:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in list(edges):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles_between_modules():
    modules = {module_name(p): p for p in ROOT.rglob("*.py")}
    edges = top_level_imports(modules)
    assert edges["mlx_v41.generation.api"], "the parser found no imports"  # it reads them
    assert cycles(edges) == []


def test_the_check_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    with pytest.raises(AssertionError):
        assert cycles({"x": {"y"}, "y": {"x"}}) == []
