"""No measurements in ``tokenloom/``: ratio and time literals, torch versions and issue numbers
live in bench/RESULTS.md, under the bench that measures them, and code points there by name.

The scan reads every ``tokenloom/**/*.py`` whole (code, comments and docstrings). Its patterns
are tuned so that ordinary code passes: hex (``0x1F``), products (``2 * x``), shapes written with
spaces (``4 x 64``), dtype names (``np.int64``) and sizes (``1 << 20``, ``4 MiB``).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "tokenloom"

PATTERNS: dict[str, re.Pattern[str]] = {
    # 0.97x, 1.6x, 4x, (0.43x), 0.97 x, 2 × the; not 0x1F (a word character follows), 4 x 64 or
    # pp 2 x vpp (an integer, a spaced letter x: a product) nor 2 × 64 (a number follows)
    "ratio": re.compile(r"(?<![\w.])\d+(?:\.\d+)?[x×](?!\w)|(?<![\w.])\d+\.\d+ [x×]|(?<![\w.])\d+ ×(?! *\d)"),
    # 3 ms, 0.350 ms, ~1 s, 50-100 us, 2 µs, 10s
    "time": re.compile(r"(?<![\w.])\d+(?:\.\d+)? ?(?:ms|µs|us|ns|s)\b"),
    "torch version": re.compile(r"\b(?:py)?torch \d+\.\d+", re.IGNORECASE),
    # issue 16, issue #16, Issue16, #457 in prose; not a URL's issues/457
    "issue number": re.compile(r"\bissues? ?#?\d+|(?<![\w&/])#\d+\b", re.IGNORECASE),
}


def offences(path: Path) -> list[str]:
    """``path:line: kind: 'match'`` for every measurement literal in the file."""
    found = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        for kind, pattern in PATTERNS.items():
            found += [f"{path}:{number}: {kind}: {m.group(0)!r}" for m in pattern.finditer(line)]
    return found


def test_tokenloom_holds_no_ratio_time_version_or_issue_literals():
    files = sorted(PACKAGE.rglob("*.py"))
    assert len(files) > 50  # the package itself, not an empty glob
    found = [o for f in files for o in offences(f)]
    assert not found, "move these measurements to bench/RESULTS.md and name the bench:\n" + "\n".join(found)


@pytest.mark.parametrize("line, kind", [
    ('"""Step time 0.97x torch DDP\'s."""', "ratio"),
    ("# the rebuilt one measured (0.43x) here", "ratio"),
    ("x = 1  # about 4x faster", "ratio"),
    ("# 2 × the tokens", "ratio"),
    ("# ours 0.97 x torch's", "ratio"),
    ('"""Backward takes 3 ms less."""', "time"),
    ("# 0.350 ms against 0.435 ms", "time"),
    ("# a fixed cost of ~50-100 us", "time"),
    ("# start-up ~1 s per worker", "time"),
    ('"""Built like PyTorch\'s (torch 2.13)."""', "torch version"),
    ("# seen on PyTorch 2.11", "torch version"),
    ("# at issue 16's size", "issue number"),
    ("# see Megatron-LM #457", "issue number"),
])
def test_a_planted_literal_fails_the_scan(tmp_path, line, kind):
    planted = tmp_path / "planted.py"
    planted.write_text(f"def f():\n    pass\n{line}\n")
    found = offences(planted)
    assert found and all(f": {kind}: " in o for o in found), found


def test_ordinary_code_passes_the_scan(tmp_path):
    clean = tmp_path / "clean.py"
    clean.write_text("\n".join([
        "MASK = 0x1F  # hex, 0xFF too",
        "y = 2 * x + x1",
        "h = np.zeros((4, 64), dtype=np.int64)  # a 4 x 64 int64 table, uint16 tokens",
        "CHUNK = 1 << 20  # 1 MB, 4 MiB at most; 2 x workers chunks in flight",
        "shape = '[tokens x hidden]'  # 128 x 128 tiles, pp 2 x vpp 2, 2 × 64",
        "timeout_s = 600  # seconds; see https://github.com/NVIDIA/Megatron-LM/issues/457",
        "fmt = f'{ratio:.2f}x {share:.1%}'",
    ]) + "\n")
    assert offences(clean) == []


MAX_MODULE_DOCSTRING = 40
"""Lines a module docstring may span (the style rule): longer ones repeat what the functions'
docstrings say, or belong in docs/."""


def long_module_docstrings(files: list[Path]) -> list[str]:
    """``path: N lines`` for every module whose docstring spans more than the limit."""
    found = []
    for path in files:
        tree = ast.parse(path.read_text(encoding="utf-8"))
        doc = tree.body[0] if tree.body else None
        if isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant) and isinstance(doc.value.value, str):
            lines = (doc.end_lineno or doc.lineno) - doc.lineno + 1
            if lines > MAX_MODULE_DOCSTRING:
                found.append(f"{path}: {lines} lines")
    return found


def test_no_module_docstring_over_40_lines():
    found = long_module_docstrings(sorted(PACKAGE.rglob("*.py")))
    assert not found, f"module docstrings over {MAX_MODULE_DOCSTRING} lines (trim the repetition):\n" + "\n".join(found)


def test_a_planted_long_module_docstring_fails(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text('"""' + "line\n" * 41 + '"""\n')
    assert long_module_docstrings([planted]) == [f"{planted}: 42 lines"]
    planted.write_text('"""' + "line\n" * 39 + '"""\nx = 1\n')
    assert long_module_docstrings([planted]) == []


MAX_PROSE_SHARE = 0.20
"""The largest share of ``tokenloom/``'s non-blank lines that may be prose."""


def prose_lines(source: str) -> tuple[int, int]:
    """(non-blank lines, prose lines) of a module's source. Prose: every line of a docstring (of
    the module, a class or a function, and the attribute docstrings that follow an assignment)
    and every line that holds only a comment. Trailing comments after code count as code."""
    lines = source.splitlines()
    nonblank = {i for i, line in enumerate(lines, 1) if line.strip()}
    prose: set[int] = set()

    def is_string(node: ast.stmt) -> bool:
        return isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)

    for node in ast.walk(ast.parse(source)):
        body = getattr(node, "body", None)
        if not isinstance(body, list) or not body:
            continue
        docs = [body[0]] if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) else []
        docs += [cur for prev, cur in zip(body, body[1:], strict=False) if isinstance(prev, (ast.Assign, ast.AnnAssign))]
        for doc in filter(is_string, docs):
            prose.update(range(doc.lineno, (doc.end_lineno or doc.lineno) + 1))
    prose.update(i for i in nonblank if lines[i - 1].lstrip().startswith("#"))
    return len(nonblank), len(prose & nonblank)


def prose_share(paths: list[Path]) -> float:
    counts = [prose_lines(path.read_text(encoding="utf-8")) for path in paths]
    return sum(p for _, p in counts) / max(1, sum(n for n, _ in counts))


def test_prose_is_at_most_a_fifth_of_the_package():
    paths = sorted(PACKAGE.rglob("*.py"))
    share = prose_share(paths)
    worst = sorted(((p / n, path) for path in paths for n, p in [prose_lines(path.read_text(encoding="utf-8"))]
                    if n >= 100), reverse=True)[:5]
    assert share <= MAX_PROSE_SHARE, (f"prose is {share:.1%} of tokenloom/'s non-blank lines (at most "
                                      f"{MAX_PROSE_SHARE:.0%}); the most prose-heavy modules: "
                                      + ", ".join(f"{path.relative_to(PACKAGE)} {r:.0%}" for r, path in worst))


def test_the_prose_count_sees_docstrings_and_comments(tmp_path):
    source = ('"""Module\ndoc."""\n\nimport os  # trailing: code\n\n# a comment\nX = 1\n"""X\'s doc."""\n\n\n'
              'def f():\n    """One."""\n    return os.sep\n')
    assert prose_lines(source) == (9, 5)
    planted = tmp_path / "planted.py"
    planted.write_text(source)
    assert prose_share([planted]) == 5 / 9 > MAX_PROSE_SHARE
