"""No import circles among laionkit's modules: every import (top-level, inside functions, under
TYPE_CHECKING) of every module under laionkit/ is an edge, and the graph has no strongly connected
component of more than one module (nor a module importing itself)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "laionkit"
def modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The laionkit modules ``name`` imports; ``from P import m`` of a submodule m is an edge to P.m."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    edges = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            edges.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parent, *([base] if base else [])])
            for alias in node.names:
                edges.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base)
    return {edge for edge in edges if edge in known and edge != name} | ({name} & edges)


def circles() -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted, in order."""
    known = modules()
    graph = {name: imports(name, path, known) for name, path in known.items()}
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1 or node in graph[node]:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def test_no_import_circles_among_laionkit_modules():
    found = circles()
    assert not found, "import circles among laionkit modules:\n" + "\n".join(" <-> ".join(c) for c in found)


if __name__ == "__main__":
    for component in circles():
        print(" <-> ".join(component))
