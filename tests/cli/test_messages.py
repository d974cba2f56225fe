"""Messages name options that exist (issue 20), and boolean pairs say what each form does (issue 19).

Every ``--flag`` quoted in a help text must be an option of the command showing it. Every
``--flag`` quoted in a message string (an error, a warning, a hint: a string literal with a
space in it, docstrings excluded) in ``tokenloom/`` must be an option of a command that runs
that code (:data:`SCOPES`), or one of :data:`OTHER_TOOLS`.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import click
import pytest

from tokenloom.cli import main

ROOT = Path(__file__).resolve().parents[2] / "tokenloom"
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9]*(?:[-_][a-z0-9]+)*")


def commands(group: click.Group = main, prefix: tuple = ()):
    for name, cmd in group.commands.items():
        if isinstance(cmd, click.Group):
            yield from commands(cmd, (*prefix, name))
        else:
            yield " ".join((*prefix, name)), cmd


COMMANDS = dict(commands())


def options(*names: str) -> set[str]:
    return {opt for name in names for p in COMMANDS[name].params for opt in (*p.opts, *p.secondary_opts)} | {"--help"}


SCOPES = [
    ("train/generate.py", ["generate"]),
    ("train/checkpoint/hf.py", ["export", "train"]),
    ("train/", ["train", "demo"]),
    ("blending/", ["build", "train"]),
    ("indexed/validate.py", ["verify"]),
    ("preprocess/", ["preprocess", "merge", "tokenizer train"]),
    ("tokenizers/", ["preprocess", "tokenizer train", "tokenizer inspect", "train", "generate"]),
    ("indexed/", ["inspect", "verify", "merge", "preprocess", "build", "train"]),
    ("demo.py", ["demo"]),
    ("", list(COMMANDS)),
]
"""Source path under tokenloom/ (first match) -> the commands whose code it is."""

OTHER_TOOLS = {
    "--config": "python -m tokenloom.train.loop/launch's own argument (what torchrun starts), in their usage text",
}
"""Flags of other tools that messages may quote, with why."""


@pytest.mark.parametrize("name", list(COMMANDS))
def test_help_texts_quote_options_of_their_command(name):
    cmd = COMMANDS[name]
    texts = [cmd.help or "", cmd.epilog or "", *(getattr(p, "help", None) or "" for p in cmd.params)]
    unknown = {f for text in texts for f in FLAG.findall(text)} - options(name)
    assert not unknown, f"{name} --help quotes options it does not have: {sorted(unknown)}"


def message_strings(tree: ast.Module) -> list[tuple[int, str, str | None]]:
    """(line, text, enclosing top-level function) of every string literal that is not a docstring."""
    docstrings = {id(node.value) for node in ast.walk(tree)
                  if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)}
    parts = {id(v) for node in ast.walk(tree) if isinstance(node, ast.JoinedStr) for v in node.values}
    out = []
    for top in tree.body:
        where = top.name if isinstance(top, ast.FunctionDef) else None
        for node in ast.walk(top):
            if isinstance(node, ast.JoinedStr):
                text = "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings | parts:
                text = node.value
            else:
                continue
            if " " in text.strip():  # a message; single tokens are command lines being built
                out.append((node.lineno, text, where))
    return out


def named_command(before: str) -> str | None:
    """The command a flag belongs to when the text names it right before the flag."""
    words = before.split()
    return next((c for c in (" ".join(words[-2:]), " ".join(words[-1:])) if c in COMMANDS), None)


def test_messages_quote_options_that_exist():
    callbacks = {cmd.callback.__name__: name for name, cmd in COMMANDS.items()}
    problems = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        scope = next(names for prefix, names in SCOPES if rel.startswith(prefix))
        for line, text, where in message_strings(ast.parse(path.read_text())):
            owners = [callbacks[where]] if rel == "cli.py" and where in callbacks else scope
            for match in FLAG.finditer(text):
                named = named_command(text[:match.start()])  # "as preprocess --output-prefix wrote"
                if match.group() not in options(*([named] if named else owners)) | OTHER_TOOLS.keys():
                    problems.append(f"tokenloom/{rel}:{line}: {match.group()} is no option of "
                                    f"{named or ' / '.join(owners)}")
    assert not problems, "\n".join(problems)


def test_the_check_sees_a_wrong_flag():
    tree = ast.parse('def f():\n    """Not --checked."""\n    raise E(f"pass --force-data to {x} resume")\n')
    assert [FLAG.findall(t) for _, t, _ in message_strings(tree)] == [["--force-data"]]
    assert "--force-data" not in options("train") and named_command("as build ") == "build"


@pytest.mark.parametrize("name", list(COMMANDS))
def test_boolean_pairs_describe_both_forms(name):
    """A ``--x/--no-x`` pair's help says what ``--x`` does, then ``--no-x: ...``, and marks the
    default form with "(the default)"; a lone ``--no-x`` off-switch is not allowed (its help,
    taken from the config field, would describe the other form)."""
    for p in COMMANDS[name].params:
        if not isinstance(p, click.Option) or not p.is_flag or p.hidden:
            continue
        assert not any(o.startswith("--no-") for o in p.opts), f"{name} {p.opts}: make it a --x/--no-x pair"
        if not p.secondary_opts:
            continue
        (off,) = p.secondary_opts
        on_part, sep, off_part = p.help.partition(f" {off}: ")
        assert sep, f"{name} {p.opts[0]}/{off}: the help does not say what {off} does: {p.help!r}"
        default_on = bool(p.default)
        assert ("(the default)" in on_part) == default_on and ("(the default)" in off_part) != default_on, p.help
