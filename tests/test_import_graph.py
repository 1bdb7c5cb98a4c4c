"""engine/ and gateway/ import each other without cycles: every import counts, inside functions too, except those
under `if TYPE_CHECKING:` (never run)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("engine", "gateway")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(module: str, path: Path, modules: set[str]) -> set[str]:
    """The project modules `module` imports: `from X import y` counts as X.y when that is a module, else X."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue
            if isinstance(child, ast.Import):
                names.update(alias.name for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    parent = package.split(".")[: len(package.split(".")) - (child.level - 1)]
                    base = ".".join([*parent, base] if base else parent)
                names.update(f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in child.names)
            visit(child)

    visit(ast.parse(path.read_text()))
    found = set()
    for name in names:
        while name and name not in modules:  # `import a.b.func`-like names resolve to their module
            name = name.rpartition(".")[0]
        if name and name != module:
            found.add(name)
    return found


def import_graph() -> dict[str, set[str]]:
    paths = {module_name(p): p for package in PACKAGES for p in (ROOT / package).rglob("*.py")}
    return {m: imported(m, p, set(paths)) for m, p in paths.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The graph's strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            nxt = next(edges, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_cycles_are_found() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert cycles(graph) == [["a", "b", "c"]]


def test_the_graph_sees_imports_inside_functions() -> None:
    graph = import_graph()
    assert "engine.model.attention_triton" in graph["engine.model.attention"]  # imported inside functions only
    assert "gateway.server" not in graph["gateway.http.readiness"]  # only under TYPE_CHECKING


def test_engine_and_gateway_have_no_import_cycles() -> None:
    assert cycles(import_graph()) == []


def test_the_engine_package_gives_every_public_name_torch_backed_ones_on_first_use() -> None:
    import importlib

    import engine

    assert set(engine.LAZY) <= set(engine.__all__) <= set(dir(engine))
    for name in engine.__all__:
        assert getattr(engine, name) is not None
    for name, module in engine.LAZY.items():
        assert getattr(engine, name) is getattr(importlib.import_module(module), name)
    with pytest.raises(AttributeError, match="no_such_name"):
        engine.no_such_name  # noqa: B018
