"""The package is one stack that only points down (docs/architecture.md): every import between
modules of mlx_v41/ and of convert/ (installed as mlx_v41.convert), read from the source with
the imports inside functions included, goes to a module of the same layer or of a layer below,
and the modules import each other without cycles."""

import ast
import collections
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "mlx_v41"
CONVERTER = ROOT.parent / "convert"  # the package mlx_v41.convert, by pyproject's package-dir

# The stack, bottom first: each folder (or top-level module) imports only from itself and the
# layers before it. The `__main__` modules and the top-level command modules
# (`python -m mlx_v41.generate`, ...) are command entry points (the cli layer);
# `mlx_v41/__init__.py` is the public API on top of everything.
STACK = ("errors", "sizes", "numerics", "kernels", "cache", "model", "generation", "chat",
         "checkpoint", "convert", "distributed", "server", "cli")
ENTRY_POINTS = {"mlx_v41.__main__", *(f"mlx_v41.{command}" for command in
                                      ("generate", "perplexity", "compare", "inspect", "demo",
                                       "launch"))}


def module_name(path: Path) -> str:
    if path.is_relative_to(CONVERTER):
        parts = ["mlx_v41", "convert", *path.relative_to(CONVERTER).with_suffix("").parts]
    else:
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_modules() -> dict:
    return {module_name(p): p for p in [*ROOT.rglob("*.py"), *CONVERTER.rglob("*.py")]}


def imports(modules: dict) -> dict:
    """{module: the package's modules it imports anywhere in its source (`from X import Y`
    counts X, and X.Y when Y is a submodule; `from . import m` counts only m)}."""
    edges = collections.defaultdict(set)
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                edges[name] |= {a.name for a in node.names} & modules.keys() - {name}
                continue
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


def layer(module: str) -> int:
    """The module's height in STACK (the public API above it all)."""
    if module == "mlx_v41":
        return len(STACK)
    if module in ENTRY_POINTS or module.endswith(".__main__"):
        return STACK.index("cli")
    return STACK.index(module.split(".")[1])


def upward(edges: dict) -> list:
    return sorted(f"{a} -> {b}" for a, targets in edges.items() for b in targets
                  if layer(b) > layer(a))


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


def test_every_module_has_a_layer():
    modules = package_modules()
    assert len(modules) > 50, "the walk found too few modules"
    for name in modules:
        layer(name)  # a folder missing from STACK raises ValueError here


def test_no_import_points_up_the_stack():
    edges = imports(package_modules())
    assert "mlx_v41.numerics.quant" in edges["mlx_v41.kernels.act_fp8"], \
        "the parser found no imports"
    assert "mlx_v41.checkpoint.converted" in edges["mlx_v41.convert.pipeline"], \
        "the converter's imports were not read"
    assert upward(edges) == []


def test_numerics_imports_nothing_else_of_the_package():
    edges = imports(package_modules())
    outside = {f"{a} -> {b}" for a, targets in edges.items() if a.startswith("mlx_v41.numerics")
               for b in targets if not b.startswith("mlx_v41.numerics")}
    assert outside == set()


def test_no_import_cycles_between_modules():
    edges = imports(package_modules())
    assert cycles(edges) == []


def test_the_checks_find_an_upward_edge_and_a_cycle():
    assert upward({"mlx_v41.kernels.norm": {"mlx_v41.model.layers", "mlx_v41.numerics.norm"},
                   "mlx_v41.chat.__main__": {"mlx_v41.cli.chat"}}) == \
        ["mlx_v41.kernels.norm -> mlx_v41.model.layers"]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    with pytest.raises(AssertionError):
        assert cycles({"x": {"y"}, "y": {"x"}}) == []


def test_function_level_imports_are_read(tmp_path):
    source = tmp_path / "mlx_v41" / "kernels" / "x.py"
    source.parent.mkdir(parents=True)
    source.write_text("def f():\n    from ..model import layers\n")
    modules = {"mlx_v41.kernels.x": source, "mlx_v41.model.layers": source,
               "mlx_v41.model": source}
    assert imports(modules)["mlx_v41.kernels.x"] == {"mlx_v41.model", "mlx_v41.model.layers"}


SERVER_APIS = ("openai", "responses", "anthropic")  # mlx_v41/server/<api>/: one package each


def api_of(module: str):
    """The server API package a module belongs to (None: shared, engine or app)."""
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[1] == "server" and parts[2] in SERVER_APIS \
        else None


def cross_api(edges: dict) -> list:
    """Imports from one API's package into another's, or from the shared server modules and the
    engine into any API's (only `server.app`, which mounts them all, may)."""
    bad = []
    for a, targets in edges.items():
        if not a.startswith("mlx_v41.server") or a == "mlx_v41.server.app":
            continue
        bad += [f"{a} -> {b}" for b in targets
                if api_of(b) is not None and api_of(b) != api_of(a)]
    return sorted(bad)


def test_server_apis_import_only_shared_modules():
    edges = imports(package_modules())
    assert {"mlx_v41.server.openai.routes", "mlx_v41.server.anthropic.routes",
            "mlx_v41.server.responses.routes"} <= edges["mlx_v41.server.app"]
    assert cross_api(edges) == []
    assert cross_api({"mlx_v41.server.anthropic.routes": {"mlx_v41.server.openai.bodies"},
                      "mlx_v41.server.serving": {"mlx_v41.server.responses.store"},
                      "mlx_v41.server.app": {"mlx_v41.server.openai.routes"}}) == \
        ["mlx_v41.server.anthropic.routes -> mlx_v41.server.openai.bodies",
         "mlx_v41.server.serving -> mlx_v41.server.responses.store"]
