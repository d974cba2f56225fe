"""The train package's shape: no import cycle between its modules (lazy imports inside
functions count), and no module imports another module's private (``_name``) names."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "tokenloom"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> list[tuple[str, list[str]]]:
    """(imported module, imported names) of every import statement in the file."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.module, [a.name for a in node.names]))
        elif isinstance(node, ast.Import):
            out.extend((a.name, []) for a in node.names)
    return out


def graph(root: Path) -> dict[str, set[str]]:
    modules = {module_name(p): p for p in root.rglob("*.py")}
    edges: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        for target, names in imports(path):
            for candidate in [target] + [f"{target}.{n}" for n in names]:
                if candidate in modules and candidate != name:
                    edges[name].add(candidate)
    return edges


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


@pytest.mark.parametrize("package", ["train"])
def test_no_import_cycle(package):
    cycle = find_cycle(graph(PACKAGE / package))
    assert cycle is None, " -> ".join(cycle)


def test_no_private_names_across_modules():
    bad = []
    for path in (PACKAGE / "train").rglob("*.py"):
        for target, names in imports(path):
            if target.startswith("tokenloom"):
                bad += [f"{module_name(path)}: from {target} import {n}" for n in names
                        if n.startswith("_") and n != "__version__"]
    assert not bad, "\n".join(bad)
