"""The checks that keep README.md and docs/ true to the code (used by tests/test_docs.py).

* **Runnable blocks**: a fenced ```bash block right after a ``<!-- runnable -->`` line is run,
  as written, by :func:`run_blocks` (every file's blocks in :data:`PAGES` order, in one scratch
  folder, ``DATA`` set to the shared data folder, ``cli.py`` linked in). Other ```bash blocks
  are examples that are only flag-checked.
* **Flags**: every ``--flag`` on a ``cli.py COMMAND`` line of any shell block exists on that
  command (click's own option names, what ``--help`` prints); every ``--set KEY=`` names a
  config field; a flag quoted in prose (in backticks) is some command's (:func:`flag_errors`).
* **Defaults**: ``<!-- default: KEY -->`` before a sentence: the first ``code`` span after it on
  that line must be the value the code gives KEY (:func:`default_errors`, :data:`RULES`).
* **Fields**: the generated field reference in docs/config.md (between ``<!-- fields -->`` and
  ``<!-- /fields -->``) equals :func:`field_reference` of the code (:func:`field_errors`);
  ``python tests/docs_check.py --write`` regenerates it.

Every check takes the page texts as a ``{name: text}`` dict, so a test can plant a violation in
a copy and see the check fail.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import click

REPO = Path(__file__).resolve().parents[1]
PAGES = ["README.md", "docs/preprocess.md", "docs/build.md", "docs/train.md", "docs/parallel.md",
         "docs/checkpoints.md", "docs/moe.md", "docs/object-storage.md", "docs/faults.md",
         "docs/megatron.md", "docs/gpu.md", "docs/config.md"]
"""Every documentation page, in the order their runnable blocks run (later pages use the
outputs of the README's quick start)."""

FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.MULTILINE | re.DOTALL)
RUNNABLE = "<!-- runnable -->"


def read_pages(root: Path = REPO) -> dict[str, str]:
    return {name: (root / name).read_text(encoding="utf-8") for name in PAGES}


def shell_blocks(text: str) -> list[tuple[int, str, bool]]:
    """``(first line number, body, runnable)`` of every ```bash / ```sh block."""
    out = []
    for m in FENCE.finditer(text):
        if m.group(1) not in ("bash", "sh"):
            continue
        before = text[:m.start()].rstrip("\n").rsplit("\n", 1)[-1].strip()
        out.append((text.count("\n", 0, m.start()) + 2, m.group(2), before == RUNNABLE))
    return out


def commands(body: str) -> list[list[str]]:
    """The shell words of every logical line (``\\`` continuations joined, comments dropped)."""
    joined = re.sub(r"\\\n", " ", body)
    out = []
    for line in joined.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        try:
            out.append(shlex.split(line, comments=True))
        except ValueError:
            out.append(line.split())
    return out


def _cli_group() -> click.Group:
    from tokenloom.cli import main  # lazy: the checks that only read text need no torch import

    return main


def _options(cmd: click.Command) -> set[str]:
    names = {"--help", "-h"}
    for p in cmd.params:
        names.update(getattr(p, "opts", []))
        names.update(getattr(p, "secondary_opts", []))
    return names


def _config_fields() -> list[str]:
    from tokenloom.train.config import TrainConfig, field_rows  # lazy: see _cli_group

    return [r.key for r in field_rows(TrainConfig())]


def flag_errors(pages: dict[str, str]) -> list[str]:
    """``page:line: ...`` for each flag a ``cli.py`` line names that its command lacks, and each
    ``--set KEY=`` whose KEY is no config field."""
    group, fields = _cli_group(), set(_config_fields())
    every_flag = _all_flags(group)
    errors = []
    for name, text in pages.items():
        for line, body, _ in shell_blocks(text):
            for words in commands(body):
                if "cli.py" not in words:
                    continue
                rest = [w.strip("[]|") for w in words[words.index("cli.py") + 1:]]
                cmd: click.Command = group
                while isinstance(cmd, click.Group) and rest and rest[0] in cmd.commands:
                    cmd = cmd.commands[rest.pop(0)]
                known = _options(cmd)
                for i, w in enumerate(rest):
                    flag = w.split("=", 1)[0]
                    if flag.startswith("--") and flag not in known:
                        errors.append(f"{name}:{line}: `cli.py {cmd.name}` has no {flag}")
                    if flag == "--set" and i + 1 < len(rest):
                        key = rest[i + 1].split("=", 1)[0]
                        if key not in fields:
                            errors.append(f"{name}:{line}: --set {key}: no such config field")
        # a flag quoted in prose (`--name ...`) must be some command's (`--moe-*`: a family, skipped)
        for m in re.finditer(r"`(--[\w-]*\w)(?![\w-]*\*)", text):
            if m.group(1) not in every_flag:
                errors.append(f"{name}:{text.count(chr(10), 0, m.start()) + 1}: no command has {m.group(1)}")
    return errors


def _all_flags(cmd: click.Command) -> set[str]:
    if isinstance(cmd, click.Group):
        return set().union(*(_all_flags(c) for c in cmd.commands.values()))
    return _options(cmd)


def _field_default(key: str) -> object:
    from tokenloom.train.config import TrainConfig, field_rows  # lazy: see _cli_group

    rows = {r.key: r.default for r in field_rows(TrainConfig())}
    return rows[key]


def _rule(kind: str, device: str) -> object:
    from tokenloom.train.kernels import selector  # lazy: see _cli_group

    # as on a host where inductor can build kernels (the case the docs describe)
    real = selector.compile_available
    selector.compile_available = lambda _device: True  # type: ignore[assignment]
    try:
        if kind == "kernels-auto":
            return selector.resolve_mode("auto", device)[0]
        return selector.choose_compile("auto", device)[0]
    finally:
        selector.compile_available = real  # type: ignore[assignment]


RULES: dict[str, Callable[[], object]] = {
    "kernels-auto:cuda": lambda: _rule("kernels-auto", "cuda"),
    "kernels-auto:cpu": lambda: _rule("kernels-auto", "cpu"),
    "compile-auto:cuda": lambda: _rule("compile-auto", "cuda"),
    "compile-auto:cpu": lambda: _rule("compile-auto", "cpu"),
}
"""Rule keys a ``<!-- default: KEY -->`` marker may name besides config fields: what ``--kernels
auto`` and ``compile: auto`` resolve to per device (tokenloom.train.kernels.selector;
kernels-auto on CPU assumes a C++ compiler, compile-auto on CUDA the triton package)."""

DEFAULT = re.compile(r"<!-- default: ([\w.:-]+) -->([^\n]*)")


def _shown(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return value if isinstance(value, str) else json.dumps(value)


def default_errors(pages: dict[str, str]) -> list[str]:
    """``page:line: ...`` for each default marker whose quoted value differs from the code's."""
    errors = []
    for name, text in pages.items():
        for m in DEFAULT.finditer(text):
            line, key = text.count("\n", 0, m.start()) + 1, m.group(1)
            quoted = re.search(r"`([^`]*)`", m.group(2))
            if quoted is None:
                errors.append(f"{name}:{line}: default marker {key} quotes no `value` after it")
                continue
            try:
                want = _shown(RULES[key]() if key in RULES else _field_default(key))
            except KeyError:
                errors.append(f"{name}:{line}: default marker {key}: no such config field or rule")
                continue
            if quoted.group(1) != want:
                errors.append(f"{name}:{line}: says {key} is `{quoted.group(1)}`, the code says `{want}`")
    return errors


FIELDS_BEGIN, FIELDS_END = "<!-- fields -->", "<!-- /fields -->"


def field_reference() -> str:
    """The generated field table: one row per ``cli.py config show`` field (key, default, doc)."""
    from tokenloom.train.config import TrainConfig, field_rows  # lazy: see _cli_group

    rows = ["| field | default | meaning |", "| --- | --- | --- |"]
    for r in field_rows(TrainConfig()):
        doc = " ".join(r.doc.split()).replace("|", "\\|")
        rows.append(f"| `{r.key}` | `{_shown(r.default)}` | {doc} |")
    return "\n".join(rows)


def field_errors(pages: dict[str, str]) -> list[str]:
    """Errors unless docs/config.md's generated table equals :func:`field_reference`; names each
    field the page lacks and each it has that the code does not."""
    text = pages["docs/config.md"]
    if FIELDS_BEGIN not in text or FIELDS_END not in text:
        return [f"docs/config.md: no {FIELDS_BEGIN} ... {FIELDS_END} block"]
    have = text.split(FIELDS_BEGIN, 1)[1].split(FIELDS_END, 1)[0].strip()
    want = field_reference()
    if have == want:
        return []
    keys = set(_config_fields())
    listed = set(re.findall(r"^\| `([\w.]+)` \|", have, re.MULTILINE))
    errors = [f"docs/config.md: field {k} is missing" for k in sorted(keys - listed)]
    errors += [f"docs/config.md: field {k} is no config field" for k in sorted(listed - keys)]
    return errors or ["docs/config.md: the field table differs from the code (python tests/docs_check.py --write)"]


def write_reference(root: Path = REPO) -> None:
    path = root / "docs/config.md"
    text = path.read_text(encoding="utf-8")
    head, rest = text.split(FIELDS_BEGIN, 1)
    tail = rest.split(FIELDS_END, 1)[1]
    path.write_text(f"{head}{FIELDS_BEGIN}\n{field_reference()}\n{FIELDS_END}{tail}", encoding="utf-8")


def run_blocks(pages: dict[str, str], workdir: Path, data: Path, timeout: float) -> list[str]:
    """Run every runnable block in page order in ``workdir`` (bash -e, ``DATA`` = ``data``);
    ``page:line: exit N`` plus the output's tail for each block that fails."""
    (workdir / "cli.py").symlink_to(REPO / "cli.py")
    env = dict(os.environ, DATA=str(data), PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
               PATH=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]))
    errors = []
    for name in PAGES:
        for line, body, runnable in shell_blocks(pages.get(name, "")):
            if not runnable:
                continue
            proc = subprocess.run(["bash", "-euo", "pipefail", "-c", body], cwd=workdir, env=env,
                                  capture_output=True, text=True, timeout=timeout)
            if proc.returncode:
                tail = (proc.stdout + proc.stderr)[-2000:]
                errors.append(f"{name}:{line}: exit {proc.returncode}\n{tail}")
    return errors


if __name__ == "__main__":
    if sys.argv[1:] == ["--write"]:
        write_reference()
    else:
        sys.exit("usage: python tests/docs_check.py --write   (regenerate docs/config.md's field table)")
