"""The layout's rules: no import circle, the layers' arrows point one way (speculators <- actors <-
cluster), and no module of theirs over MAX_MODULE_LINES lines.

The graph is read from the sources (ast), so that check imports nothing. Every import statement
counts, in a function too: an import moved into a function to dodge a circle still closes it when
the function runs. Only `if TYPE_CHECKING:` blocks, which never run, are left out of the circles.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ("speculators", "actors", "cluster")
MUST_NOT_IMPORT = {"speculators": ("ray", "actors", "cluster"), "actors": ("cluster",)}
"""What each layer must never import (the top-level package of an import)."""
MAX_MODULE_LINES = 450
"""A module past this does more than one job: split it by job, not by line count."""


def project_modules() -> dict[str, Path]:
    """Dotted name -> source file, for every module of the layers' packages."""
    modules = {}
    for layer in LAYERS:
        for path in (ROOT / layer).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


class _Imports(ast.NodeVisitor):
    """The dotted names a module's import statements name (`from a import b` names a and a.b)."""

    def __init__(self, module: str, package: bool, typing_too: bool):
        self.base = module.split(".") if package else module.split(".")[:-1]
        self.typing_too, self.names = typing_too, []

    def visit_If(self, node: ast.If) -> None:
        if self.typing_too or not _is_type_checking(node.test):
            self.generic_visit(node)
        else:
            for child in node.orelse:
                self.visit(child)

    def visit_Import(self, node: ast.Import) -> None:
        self.names += [alias.name for alias in node.names]

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        parts = self.base[:len(self.base) - node.level + 1] if node.level else []
        module = ".".join([*parts, *([node.module] if node.module else [])])
        self.names += [module, *(f"{module}.{alias.name}" for alias in node.names)]


def imported(module: str, path: Path, typing_too: bool = False) -> list[str]:
    visitor = _Imports(module, path.name == "__init__.py", typing_too)
    visitor.visit(ast.parse(path.read_text(), str(path)))
    return visitor.names


def import_graph() -> dict[str, set[str]]:
    """Module -> the project modules it imports (a name resolved to its longest module prefix)."""
    modules, graph = project_modules(), {}
    for module, path in modules.items():
        targets = set()
        for name in imported(module, path):
            parts = name.split(".")
            while parts and ".".join(parts) not in modules:
                parts.pop()
            if parts:
                targets.add(".".join(parts))
        graph[module] = targets - {module}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One circle of the graph (its modules, the first repeated at the end), or None."""
    done, path = set(), []

    def visit(module: str) -> list[str] | None:
        if module in path:
            return [*path[path.index(module):], module]
        if module in done:
            return None
        path.append(module)
        for target in sorted(graph[module]):
            if cycle := visit(target):
                return cycle
        path.pop()
        done.add(module)
        return None

    for module in sorted(graph):
        if cycle := visit(module):
            return cycle
    return None


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_function_level_imports_count():
    source = "def f():\n    from cluster.x import y\nif TYPE_CHECKING:\n    import cluster.z\n"
    visitor = _Imports("cluster.m", package=False, typing_too=False)
    visitor.visit(ast.parse(source))
    assert visitor.names == ["cluster.x", "cluster.x.y"]


def test_no_import_circle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_layers_point_one_way():
    wrong = [f"{module} imports {name}" for module, path in project_modules().items()
             for name in imported(module, path, typing_too=True)
             if name.split(".")[0] in MUST_NOT_IMPORT.get(module.split(".")[0], ())]
    assert not wrong, wrong


def test_no_module_of_the_layers_is_too_long():
    long = {module: lines for module, path in project_modules().items()
            if (lines := len(path.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not long, long
