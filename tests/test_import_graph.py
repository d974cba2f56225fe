"""No import cycle between tokenloom.tokenizers and tokenloom.preprocess.

The graph has one node per module (a package's ``__init__`` is the package's node) and an edge
for every ``import`` statement of the source, at module level or inside a function (a lazy
import hides a cycle from Python, not from the design). Only edges between modules of the two
packages are kept. Implicit "a submodule imports its package's ``__init__``" edges are left out:
``tokenloom/preprocess/__init__.py`` re-exports the pipeline, so with them any use of a
preprocess module from tokenizers would count as a cycle.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from tl_testing import REPO

PACKAGES = ("tokenloom.tokenizers", "tokenloom.preprocess")


def module_files(root: Path) -> dict[str, Path]:
    files = {}
    for package in PACKAGES:
        for path in sorted((root / Path(*package.split("."))).glob("*.py")):
            files[package if path.stem == "__init__" else f"{package}.{path.stem}"] = path
    return files


def import_edges(root: Path) -> dict[str, set[str]]:
    files = module_files(root)
    edges: dict[str, set[str]] = {name: set() for name in files}
    for name, path in files.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                # "from pkg import sub" imports the submodule when there is one
                targets = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in files else node.module
                           for a in node.names]
            edges[name].update(t for t in targets if t in files and t != name)
    return edges


def strongly_connected(edges: dict[str, set[str]]) -> list[set[str]]:
    """The graph's strongly connected components (Tarjan): modules that import each other, maybe via others."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    components: list[set[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(edges[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = set(stack[stack.index(node):])
            del stack[stack.index(node):]
            components.append(component)

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return components


def cross_package_cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Groups of modules that import each other and lie in both packages (cycles within one package,
    such as a tokenizer's ``__reduce__`` calling ``load_tokenizer``, are not what this test is about)."""
    return [sorted(c) for c in strongly_connected(edges)
            if all(any(m == p or m.startswith(p + ".") for m in c) for p in PACKAGES)]


def test_no_cycle_between_tokenizers_and_preprocess():
    edges = import_edges(REPO)
    assert len(edges) >= 10  # both packages were found
    cycles = cross_package_cycles(edges)
    assert not cycles, f"modules of both packages import each other: {cycles}"


def test_cycle_finder_sees_a_cycle(tmp_path):
    """The check can fail: the cycle the issue reported (documents -> worker -> tokenizers -> train)."""
    for package in PACKAGES:
        (tmp_path / Path(*package.split("."))).mkdir(parents=True)
    files = {
        "tokenloom/preprocess/documents.py": "from tokenloom.preprocess.worker import decode_chunk\n",
        "tokenloom/preprocess/worker.py": "def init():\n    from tokenloom.tokenizers import load_tokenizer\n",
        "tokenloom/tokenizers/__init__.py": "from tokenloom.tokenizers.train import train_tokenizer\n",
        "tokenloom/tokenizers/train.py": "def f():\n    from tokenloom.preprocess.documents import iter_documents\n",
    }
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    assert cross_package_cycles(import_edges(tmp_path)) == [[
        "tokenloom.preprocess.documents", "tokenloom.preprocess.worker", "tokenloom.tokenizers",
        "tokenloom.tokenizers.train"]]


def test_each_side_imports_first_in_a_fresh_interpreter():
    """Either package's entry into the other works as the very first import of a process."""
    for module in ("tokenloom.corpus.documents", "tokenloom.tokenizers.train", "tokenloom.preprocess.worker"):
        code = f"import {module}"
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
        assert proc.returncode == 0, proc.stderr
