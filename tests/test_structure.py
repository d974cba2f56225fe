"""The package's shape, read from the source of every module in ``tokenloom/``.

Every ``import`` statement counts: absolute and relative (``level`` resolved against the
importing module's package), at module level and inside functions (a lazy import hides an
edge from Python, not from the design). The graph has one node per module (a package's
``__init__`` is the package's node); ``from pkg import sub`` is an edge to the submodule
when there is one, else to ``pkg``. The implicit "a submodule imports its package's
``__init__``" edge is left out: it is Python's doing, not a dependency the code chose.

Checks (each shown to fail on a planted violation in a fake package below):

* stage order: a module imports only its own layer or layers below it (``LAYERS``);
* room order inside ``train``: a module imports only its own room or rooms below it (``ROOMS``);
* no import circle (strongly connected components of more than one module, or a self-loop);
* no private (``_name``) name imported across modules (a private *module* may be imported
  from inside its own package: the underscore makes it package-private);
* imports at module top: one inside a function carries its reason on the same line,
  ``# lazy: <reason>`` (start-up time, an optional dependency, not loading CUDA/inductor).
"""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest
from tl_testing import REPO, limit_s

# lowest first; a module may import its own layer and those before it
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("base", ("tokenloom", "tokenloom._native", "tokenloom.errors", "tokenloom.fsio", "tokenloom.objstore",
              "tokenloom.native", "tokenloom.config", "tokenloom.info")),
    ("contracts", ("tokenloom.indexed", "tokenloom.corpus")),
    ("tokenizers", ("tokenloom.tokenizers",)),
    ("clean", ("tokenloom.clean",)),
    ("preprocess", ("tokenloom.preprocess",)),
    ("blending", ("tokenloom.blending",)),
    ("train", ("tokenloom.train",)),
    ("entry points", ("tokenloom.demo", "tokenloom.cli")),
]
LAZY_MARK = "# lazy:"

# the rooms of the train stage, lowest first (the same rule as LAYERS, one level down): a module
# takes the room of its longest matching prefix, so "run" holds what no other room names
ROOMS: list[tuple[str, tuple[str, ...]]] = [
    ("kernels", ("tokenloom.train.kernels",)),
    ("parallel", ("tokenloom.train.parallel",)),
    ("model", ("tokenloom.train.model",)),
    ("optim", ("tokenloom.train.optim",)),
    ("run setup", ("tokenloom.train.config", "tokenloom.train.data", "tokenloom.train.dist",
                   "tokenloom.train.staged_gloo", "tokenloom.train.runtime", "tokenloom.train.host_alloc")),
    ("checkpoint", ("tokenloom.train.checkpoint",)),
    ("run", ("tokenloom.train",)),
]


@dataclass(frozen=True)
class Import:
    module: str  # the importing module
    target: str  # the module node the statement depends on
    names: tuple[str, ...]  # the names taken by "from ... import", () for "import x"
    inside_target: bool  # the target is the importing module's own package (its private names serve it)
    line: int
    in_function: bool


def module_files(root: Path) -> dict[str, Path]:
    """Module name -> file, for every ``.py`` under ``root/tokenloom``."""
    files = {}
    for path in sorted((root / "tokenloom").rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return files


def resolve(module: str, is_package: bool, level: int, name: str | None) -> str:
    """The absolute module of ``from <level dots><name> import ...`` written in ``module``."""
    if level == 0:
        return name or ""
    package = module.split(".") if is_package else module.split(".")[:-1]
    base = package[: len(package) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def node_of(target: str, modules: dict[str, Path]) -> str | None:
    """The graph node ``target`` lands on: itself, or its nearest enclosing module in the package."""
    while target:
        if target in modules:
            return target
        target = target.rpartition(".")[0]
    return None


def imports(root: Path) -> list[Import]:
    """Every import of a ``tokenloom`` module by a ``tokenloom`` module, with where it sits."""
    modules = module_files(root)
    out = []
    for module, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        in_function: set[int] = set()
        for fn in ast.walk(tree):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                in_function.update(id(n) for n in ast.walk(fn) if n is not fn)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                pairs = [(alias.name, ()) for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = resolve(module, path.name == "__init__.py", node.level, node.module)
                pairs = []
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    pairs.append((sub, ()) if sub in modules else (base, (alias.name,)))
            else:
                continue
            for target, names in pairs:
                if target == "tokenloom" or target.startswith("tokenloom."):
                    node_name = node_of(target, modules) or target
                    inside = modules.get(node_name, Path()).name == "__init__.py" and \
                        module.rpartition(".")[0] == node_name
                    out.append(Import(module, node_name, names, inside, node.lineno, id(node) in in_function))
    return out


def layer(module: str, order: list[tuple[str, tuple[str, ...]]] = LAYERS) -> int:
    """The index in ``order`` of the entry whose longest prefix covers ``module``; -1 for none."""
    best, index = "", -1
    for i, (_, prefixes) in enumerate(order):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > len(best):
                best, index = prefix, i
    return index


def cross_room_imports(found: list[Import]) -> list[str]:
    """Imports between train modules that go up ``ROOMS`` (a module outside train has no room)."""
    bad = []
    for imp in found:
        here, there = layer(imp.module, ROOMS), layer(imp.target, ROOMS)
        if here >= 0 and there > here:
            bad.append(f"{imp.module}:{imp.line} (room {ROOMS[here][0]}) imports {imp.target} (room {ROOMS[there][0]})")
    return bad


def upward_imports(found: list[Import]) -> list[str]:
    bad = []
    for imp in found:
        here, there = layer(imp.module), layer(imp.target)
        if here < 0 or there < 0:
            bad.append(f"{imp.module}: {imp.target} is in no layer (add it to LAYERS)")
        elif there > here:
            bad.append(f"{imp.module}:{imp.line} ({LAYERS[here][0]}) imports {imp.target} ({LAYERS[there][0]})")
    return bad


def edges_of(found: list[Import]) -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {}
    for imp in found:
        edges.setdefault(imp.module, set())
        edges.setdefault(imp.target, set())
        if imp.target != imp.module:
            edges[imp.module].add(imp.target)
    return edges


def strongly_connected(edges: dict[str, set[str]]) -> list[set[str]]:
    """The graph's strongly connected components (Tarjan): modules that import each other, maybe via others."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(edges.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = set(stack[stack.index(node):])
            del stack[stack.index(node):]
            on_stack.difference_update(component)
            components.append(component)

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return components


def cycles(found: list[Import]) -> list[list[str]]:
    return [sorted(c) for c in strongly_connected(edges_of(found)) if len(c) > 1]


def private_imports(found: list[Import]) -> list[str]:
    bad = []
    for imp in found:
        if not imp.inside_target:  # a package's private names (e.g. a compiled _native) serve its own modules
            bad += [f"{imp.module}:{imp.line}: from {imp.target} import {n}" for n in imp.names
                    if n.startswith("_") and not (n.startswith("__") and n.endswith("__"))]
        private_module = imp.target.rpartition(".")[2].startswith("_")
        own_package = imp.module.rpartition(".")[0] == imp.target.rpartition(".")[0]
        if not imp.names and private_module and not own_package and imp.target != imp.module:
            bad.append(f"{imp.module}:{imp.line}: imports the private module {imp.target} from another package")
    return bad


def unexplained_lazy_imports(root: Path) -> list[str]:
    """Imports inside functions (of any module, stdlib and third-party too) without ``# lazy: <reason>``."""
    bad = []
    for module, path in module_files(root).items():
        text = path.read_text(encoding="utf-8")
        lines = text.splitlines()
        for fn in ast.walk(ast.parse(text)):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    first = lines[node.lineno - 1]
                    reason = first.partition(LAZY_MARK)[2].strip() if LAZY_MARK in first else ""
                    if not reason:
                        bad.append(f"{module}:{node.lineno}: {first.strip()}")
    return sorted(set(bad))


# --- the real package -------------------------------------------------------------------


@pytest.fixture(scope="module")
def found() -> list[Import]:
    found = imports(REPO)
    assert len({i.module for i in found}) >= 50  # the package was found
    return found


def test_stage_order_only_downwards(found):
    bad = upward_imports(found)
    assert not bad, "\n".join(bad)


def test_train_rooms_only_downwards(found):
    bad = cross_room_imports(found)
    assert not bad, "\n".join(bad)


def test_every_train_package_is_a_room():
    """Each folder of ``tokenloom/train`` is named in ``ROOMS`` (a new one takes its place in the order)."""
    rooms = {prefix for _, prefixes in ROOMS for prefix in prefixes}
    bad = [f"tokenloom.train.{p.parent.name}" for p in sorted((REPO / "tokenloom" / "train").glob("*/__init__.py"))
           if f"tokenloom.train.{p.parent.name}" not in rooms]
    assert not bad, f"train packages in no room of ROOMS: {bad}"


def test_no_import_circle(found):
    assert not cycles(found), cycles(found)


def test_no_private_names_across_modules(found):
    bad = private_imports(found)
    assert not bad, "\n".join(bad)


def test_the_loop_leaves_data_resume_to_train_data(found):
    """The loop holds one ``train.data.TrainData``; blending's resume rules stay behind it."""
    bad = [f"{i.module}:{i.line} imports {i.target}" for i in found
           if i.module == "tokenloom.train.loop" and i.target.startswith("tokenloom.blending")]
    assert not bad, "\n".join(bad)


def test_imports_inside_functions_say_why():
    bad = unexplained_lazy_imports(REPO)
    assert not bad, f"an import inside a function needs '{LAZY_MARK} <reason>' on its line:\n" + "\n".join(bad)


def test_every_module_has_a_layer():
    bad = [m for m in module_files(REPO) if layer(m) < 0]
    assert not bad, f"modules in no layer of LAYERS: {bad}"


def test_architecture_page_names_every_layer_and_package():
    """ARCHITECTURE.md describes the layers this test enforces and every package of ``tokenloom/``."""
    page = (REPO / "ARCHITECTURE.md").read_text(encoding="utf-8")
    packages = sorted(p.parent.name for p in (REPO / "tokenloom").glob("*/__init__.py"))
    missing = [f"{name}/" for name in packages if f"`{name}/`" not in page]
    missing += [f"layer {name}" for name, _ in LAYERS if f"| {name} |" not in page]
    missing += [f"room {name}" for name, _ in ROOMS if f"| {name} |" not in page]
    assert not missing, f"ARCHITECTURE.md does not mention {missing}"


FIRST_IMPORTS = {
    # the manifest is a contract: reading one must not load the preprocess pipeline or any tokenizer
    "tokenloom.indexed.manifest": ("tokenloom.preprocess", "tokenloom.tokenizers", "tokenloom.corpus"),
    "tokenloom.corpus.documents": ("tokenloom.preprocess", "tokenloom.tokenizers"),
    "tokenloom.tokenizers.train": ("tokenloom.preprocess",),
    "tokenloom.preprocess.worker": ("tokenloom.blending", "tokenloom.train"),
    # the reason of preprocess's lazy tokenizer imports: merging outputs loads no tokenizer library
    "tokenloom.preprocess.merge": ("tokenloom.tokenizers", "tokenizers", "sentencepiece", "torch"),
    "tokenloom.blending.sources": ("tokenloom.preprocess", "tokenloom.train"),
}


@pytest.mark.parametrize("module", sorted(FIRST_IMPORTS))
def test_each_side_imports_first_in_a_fresh_interpreter(module):
    """A module works as the very first import of a process, and loads nothing of the stages it must not."""
    code = textwrap.dedent(f"""
        import sys
        import {module}
        print(" ".join(m for m in sys.modules if m.startswith({FIRST_IMPORTS[module]!r})))
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=limit_s(120))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == [], f"importing {module} loaded {proc.stdout.strip()}"


# --- each check fails on a planted violation ---------------------------------------------


def plant(tmp_path: Path, files: dict[str, str]) -> Path:
    """A fake ``tokenloom`` package under ``tmp_path`` with these files (and every ``__init__.py``)."""
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
        for parent in path.relative_to(tmp_path).parents:
            init = tmp_path / parent / "__init__.py"
            if parent != Path(".") and not init.exists():
                init.write_text("")
    return tmp_path


def test_resolve_relative_imports():
    assert resolve("tokenloom.train.kernels.selector", False, 1, "cross_entropy") == \
        "tokenloom.train.kernels.cross_entropy"
    assert resolve("tokenloom.train.kernels", True, 1, None) == "tokenloom.train.kernels"
    assert resolve("tokenloom.train.kernels.selector", False, 2, "model") == "tokenloom.train.model"


def test_planted_upward_import_fails(tmp_path):
    root = plant(tmp_path, {
        "tokenloom/tokenizers/train.py": "from ..preprocess import pipeline\n",  # relative, up a stage
        "tokenloom/preprocess/pipeline.py": "from tokenloom.tokenizers import train\n",
    })
    assert upward_imports(imports(root)) == [
        "tokenloom.tokenizers.train:1 (tokenizers) imports tokenloom.preprocess.pipeline (preprocess)"]


def test_planted_cross_room_import_fails(tmp_path):
    root = plant(tmp_path, {
        "tokenloom/train/model/gpt.py": "from tokenloom.train.checkpoint import commit\n",  # model up to checkpoint
        "tokenloom/train/checkpoint/commit.py": "from tokenloom.train.model import gpt\nimport tokenloom.train.config\n",
        "tokenloom/train/config.py": "from . import loop\n",  # run setup up to the run, relative
        "tokenloom/train/loop.py": "from tokenloom.train.checkpoint import commit\nfrom tokenloom.indexed import x\n",
        "tokenloom/train/parallel/ddp.py": "from tokenloom.train.kernels import rope\n",
        "tokenloom/train/kernels/rope.py": "",
    })
    assert cross_room_imports(imports(root)) == [
        "tokenloom.train.config:1 (room run setup) imports tokenloom.train.loop (room run)",
        "tokenloom.train.model.gpt:1 (room model) imports tokenloom.train.checkpoint.commit (room checkpoint)",
    ]


def test_planted_circle_fails(tmp_path):
    root = plant(tmp_path, {
        "tokenloom/train/a.py": "from . import b\n",
        "tokenloom/train/b.py": "def f():\n    from .c import g  # lazy: hides the circle from Python\n",
        "tokenloom/train/c.py": "import tokenloom.train.a\n",
        "tokenloom/train/d.py": "from tokenloom.train import a\n",  # into the circle, not part of it
    })
    assert cycles(imports(root)) == [["tokenloom.train.a", "tokenloom.train.b", "tokenloom.train.c"]]


def test_package_init_edge_is_left_out(tmp_path):
    root = plant(tmp_path, {
        "tokenloom/preprocess/__init__.py": "from tokenloom.preprocess.pipeline import run\n",
        "tokenloom/preprocess/pipeline.py": "from tokenloom.preprocess.worker import init\n",
        "tokenloom/preprocess/worker.py": "import os\n",
    })
    assert cycles(imports(root)) == []


def test_planted_private_import_fails(tmp_path):
    root = plant(tmp_path, {
        "tokenloom/train/kernels/cross_entropy.py": "def _logits_grad(): ...\n",
        "tokenloom/train/kernels/selector.py": "from .cross_entropy import _logits_grad\n",
        "tokenloom/train/kernels/_common.py": "",
        "tokenloom/train/kernels/rope.py": "from ._common import x\nfrom tokenloom import __version__\n",
        "tokenloom/train/loop.py": "from tokenloom.train.kernels import _common\n",
        "tokenloom/native.py": "from tokenloom import _native\n",  # a compiled module of its own package
        "tokenloom/train/kernels/layer_norm.py": "from tokenloom.train import _private\n",  # not its package
    })
    assert sorted(private_imports(imports(root))) == [
        "tokenloom.train.kernels.layer_norm:1: from tokenloom.train import _private",
        "tokenloom.train.kernels.selector:1: from tokenloom.train.kernels.cross_entropy import _logits_grad",
        "tokenloom.train.loop:1: imports the private module tokenloom.train.kernels._common from another package",
    ]


def test_planted_lazy_import_without_reason_fails(tmp_path):
    root = plant(tmp_path, {
        "tokenloom/train/loop.py": """\
            import os


            def run():
                import json
                import torch  # lazy: loads CUDA only when training
                from tokenloom.train import (  # lazy:
                    model,
                )
                return json, torch, model, os
            """,
    })
    assert unexplained_lazy_imports(root) == [
        "tokenloom.train.loop:5: import json", "tokenloom.train.loop:7: from tokenloom.train import (  # lazy:"]


# --- what bench/ and scripts/ import from the package ---------------------------------------


def module_file(root: Path, module: str) -> Path | None:
    """The source of ``module`` under ``root`` (a module or a package's ``__init__``), or None."""
    base = root.joinpath(*module.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def top_level_names(path: Path) -> set[str]:
    """The names a module binds at its top level: definitions, assignments and imports."""
    names: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
    return names


def unresolved_imports(root: Path, files: list[Path]) -> list[str]:
    """Every ``from tokenloom... import name`` (lazy ones included) in ``files`` whose module or
    name the package under ``root`` does not have, as ``file:line: module.name``."""
    errors = []
    for f in files:
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "tokenloom":
                path = module_file(root, node.module)
                for a in node.names:
                    if path is None or (a.name not in top_level_names(path)
                                        and module_file(root, f"{node.module}.{a.name}") is None):
                        errors.append(f"{f.name}:{node.lineno}: {node.module}.{a.name}")
            elif isinstance(node, ast.Import):
                errors += [f"{f.name}:{node.lineno}: {a.name}" for a in node.names
                           if a.name.split(".")[0] == "tokenloom" and module_file(root, a.name) is None]
    return errors


def test_bench_and_scripts_import_what_the_package_has():
    """The benches and scripts run outside the suite, and their imports sit inside functions:
    a move of a module (the rooms of ``train/``) must not leave one behind."""
    files = sorted((REPO / "bench").glob("*.py")) + sorted((REPO / "scripts").glob("*.py")) + [REPO / "cli.py"]
    assert unresolved_imports(REPO, files) == []


def test_planted_stale_bench_import_fails(tmp_path):
    root = plant(tmp_path, {"tokenloom/train/model/config.py": "class GPTConfig: ...\n"})
    bench = tmp_path / "bench.py"
    bench.write_text("def f():\n    from tokenloom.train.model import GPTConfig\n"
                     "    from tokenloom.train.model.config import GPTConfig as C\n    import tokenloom.gone\n")
    assert unresolved_imports(root, [bench]) == ["bench.py:2: tokenloom.train.model.GPTConfig",
                                                 "bench.py:4: tokenloom.gone"]
