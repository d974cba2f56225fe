"""Every command documents itself; help text comes from the config dataclasses' field docstrings."""

from __future__ import annotations

import click
import pytest
from click.testing import CliRunner

from tokenloom.cli import main


def _commands(group: click.Group, prefix=()):
    for name, cmd in group.commands.items():
        yield (*prefix, name), cmd
        if isinstance(cmd, click.Group):
            yield from _commands(cmd, (*prefix, name))


COMMANDS = list(_commands(main))


def test_command_list():
    names = {" ".join(path) for path, _ in COMMANDS}
    assert {"info", "inspect", "verify", "merge", "preprocess", "build", "tokenizer train", "tokenizer inspect",
            "demo"} <= names


@pytest.mark.parametrize("path", [p for p, _ in COMMANDS], ids=lambda p: " ".join(p))
def test_help_and_every_option_documented(path):
    result = CliRunner().invoke(main, [*path, "--help"])
    assert result.exit_code == 0, result.output
    cmd = dict(COMMANDS)[path]
    assert cmd.help, f"{' '.join(path)} has no help"
    for param in cmd.params:
        if isinstance(param, click.Option) and param.name != "help":
            assert param.help, f"{' '.join(path)} {param.opts[0]} has no help text"
