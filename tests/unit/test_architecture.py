"""The layout's rules, checked on the source: no import cycle between modules of the package
(module-level and function-level imports alike; ``if TYPE_CHECKING:`` blocks aside), the leaf
modules import nothing of the package, and ``core`` imports no upstream framework."""

from __future__ import annotations

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PKG = os.path.join(ROOT, "replay_plugin")


def _modules() -> dict[str, str]:
    out = {}
    for folder, _, files in os.walk(PKG):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                rel = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                out[rel.removesuffix(".__init__")] = path
    return out


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(module: str, path: str, known: dict[str, str]) -> set[str]:
    """Every module of the package that ``module`` imports anywhere in its body."""
    is_pkg = path.endswith("__init__.py")
    package = module if is_pkg else module.rpartition(".")[0]
    with open(path, encoding="utf-8") as fh:
        tree = ast.parse(fh.read())
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            for alias in node.names:
                found.add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                found.add(sub if sub in known else target)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return {m for m in found if m in known and m != module}


def _graph() -> dict[str, set[str]]:
    known = _modules()
    return {m: _imports(m, p, known) for m, p in known.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def strong(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                strong(w)
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
                out.append(sorted(component))

    for v in graph:
        if v not in index:
            strong(v)
    return out


def test_no_import_cycle():
    assert _cycles(_graph()) == []


def test_the_cycle_check_sees_function_level_imports():
    graph = {"a": {"b"}, "b": {"a"}, "c": set()}
    assert _cycles(graph) == [["a", "b"]]
    g = _graph()
    # doctor imports the registry only inside functions: still an edge
    assert "replay_plugin.registry" in g["replay_plugin.doctor"]


def test_leaf_modules_import_nothing_of_the_package():
    g = _graph()
    for leaf in ("replay_plugin.spec", "replay_plugin.states", "replay_plugin.compat"):
        assert g[leaf] == set(), (leaf, g[leaf])


def test_core_imports_no_framework_or_machinery():
    g = _graph()
    for module, deps in g.items():
        if module.startswith("replay_plugin.core"):
            assert all(d.startswith("replay_plugin.core") for d in deps), (module, deps)
    for module, path in _modules().items():
        if module.startswith("replay_plugin.core"):
            with open(path, encoding="utf-8") as fh:
                tree = ast.parse(fh.read())
            names = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
            names |= {(n.module or "").split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
            assert not names & {"megatron", "vllm", "verl", "skyrl", "transformers"}, module
