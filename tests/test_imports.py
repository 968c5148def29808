"""No import circles among laionkit's modules: every import (top-level, inside functions, under
TYPE_CHECKING) of every module under laionkit/ is an edge, and the graph has no strongly connected
component of more than one module (nor a module importing itself). And no module outside the
storage package uses an underscored name of it."""

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


STORAGE = "laionkit.common.storage"


def private_storage_uses() -> list[str]:
    """Where a module outside laionkit.common.storage imports an underscored name of it, reads one off the
    package or a module of it (``storage._staging``, ``storage.writes._x``), or calls a private method of its
    classes on anything but ``self`` (``location._listing()``)."""
    known = modules()
    inside = {name for name in known if name == STORAGE or name.startswith(STORAGE + ".")}
    methods = set()
    for name in inside:
        for node in ast.walk(ast.parse(known[name].read_text())):
            if isinstance(node, ast.ClassDef):
                methods.update(item.name for item in node.body if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef)
                               and item.name.startswith("_") and not item.name.startswith("__"))
    found = []
    for name, path in sorted(known.items()):
        if name in inside:
            continue
        tree = ast.parse(path.read_text())
        aliases = set()  # local names bound to the storage package or one of its modules
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                for alias in node.names:
                    if f"{node.module}.{alias.name}" in inside:
                        aliases.add(alias.asname or alias.name)
                    elif node.module in inside and alias.name.startswith("_"):
                        found.append(f"{name}:{node.lineno}: imports {node.module}.{alias.name}")
            elif isinstance(node, ast.Import):
                aliases.update(alias.asname for alias in node.names if alias.name in inside and alias.asname)
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute) or not node.attr.startswith("_") or node.attr.startswith("__"):
                continue
            base = node.value
            while isinstance(base, ast.Attribute):
                base = base.value
            if isinstance(base, ast.Name) and base.id in aliases:
                found.append(f"{name}:{node.lineno}: {ast.unparse(node)}")
            elif node.attr in methods and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                found.append(f"{name}:{node.lineno}: {ast.unparse(node)} (a private method of a storage class)")
    return found


def test_no_module_outside_storage_uses_its_private_names():
    found = private_storage_uses()
    assert not found, "private storage names used outside laionkit.common.storage:\n" + "\n".join(found)


if __name__ == "__main__":
    for component in circles():
        print(" <-> ".join(component))
