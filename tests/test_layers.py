"""The layers of plait, one way: config.py at the bottom imports nothing of plait, and no modules
import each other in a circle (lazy imports inside functions count: they are the same tie). An
import of plait.a.b also runs plait/a/__init__.py, so it counts as an import of both."""

import ast
from pathlib import Path

from conftest import ROOT

PACKAGE = ROOT / "plait"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports() -> dict[str, set[str]]:
    """Every plait module -> the plait modules it imports (anywhere in the file)."""
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
            else:
                continue
            for target in targets:
                parts = target.split(".")
                found |= {".".join(parts[:i]) for i in range(2, len(parts) + 1)} & modules.keys()
        found.discard(name)
        graph[name] = found - {m for m in found if name.startswith(m + ".")}  # a package's own parents
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
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
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_config_is_the_bottom_layer():
    """config.py imports nothing of plait but the names of the flavors (a list, below it)."""
    graph = imports()
    assert graph["plait.config"] == {"plait.flavor_names"} and graph["plait.flavor_names"] == set()


def test_no_modules_import_each_other_in_a_circle():
    assert circles(imports()) == []
