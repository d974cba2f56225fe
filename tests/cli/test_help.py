"""Every command documents itself; help text comes from the config dataclasses' field docstrings."""

from __future__ import annotations

import shlex

import click
import pytest
from click.testing import CliRunner
from tl_testing import limit_s, run_cli

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


@pytest.mark.parametrize("path", ["tokenloom.train.config:TrainConfig", "tokenloom.train.model.config:GPTConfig",
                                  "tokenloom.train.optim.adamw:OptimConfig", "tokenloom.train.launch:Nodes",
                                  "tokenloom.preprocess.config:PreprocessConfig",
                                  "tokenloom.blending.build:BuildConfig",
                                  "tokenloom.tokenizers.train:TrainTokenizerConfig", "tokenloom.demo:DemoConfig"])
def test_help_read_from_source_equals_the_imported_class(path):
    import importlib

    from tokenloom.config import field_docs, source_field_docs

    module, name = path.split(":")
    assert source_field_docs(path) == field_docs(getattr(importlib.import_module(module), name))


def test_help_read_from_source_of_a_class_with_a_string_at_column_0(tmp_path, monkeypatch):
    """Only the class's lines are parsed, up to the next top-level line; a string in the class
    with a line at column 0 ends that cut early, and the whole module is read instead."""
    import sys

    from tokenloom.config import source_field_docs

    (tmp_path / "tl_docs_probe.py").write_text(
        'import dataclasses\n\n\n@dataclasses.dataclass\nclass A:\n    x: int = 1\n    """The x."""\n'
        '    y: str = """a\nb"""\n    """The y."""\n\n\nclass B:\n    z: int = 2\n    """The z."""\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    assert source_field_docs("tl_docs_probe:A") == {"x": "The x.", "y": "The y."}
    assert source_field_docs("tl_docs_probe:B") == {"z": "The z."}
    sys.modules.pop("tl_docs_probe", None)


def test_preprocess_does_not_import_torch(tmp_path):
    """torch costs ~1.5 s and ~150 MB per process: preprocess, its workers and --help do without it."""
    import subprocess
    import sys

    from tl_testing import REPO

    (tmp_path / "c.jsonl").write_text('{"text": "hello world"}\n')
    probe = (f"import sys, runpy; sys.argv = ['cli.py', 'preprocess', '--input', {str(tmp_path / 'c.jsonl')!r}, "
             f"'--output-prefix', {str(tmp_path / 'out')!r}, '--tokenizer-type', 'byte', '--workers', '2', "
             f"'--no-progress']\ntry:\n    runpy.run_path({str(REPO / 'cli.py')!r}, run_name='__main__')\n"
             "except SystemExit as e:\n    assert not e.code, e.code\n"
             "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=limit_s(120), cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "False", out.stdout


def _commands(group, prefix=""):
    for name, command in group.commands.items():
        yield f"{prefix}{name}", command
        if hasattr(command, "commands"):
            yield from _commands(command, f"{prefix}{name} ")


def test_every_command_help_ends_with_examples_whose_flags_exist():
    """Each command's --help ends with one or two lines a user can paste (cli.EXAMPLES); every flag an
    example names is one of that command's options, so an example cannot outlive a renamed flag."""
    from tokenloom import cli

    names = dict(_commands(cli.main))
    assert set(names) == set(cli.EXAMPLES), set(names) ^ set(cli.EXAMPLES)
    for name, command in names.items():
        text = CliRunner().invoke(cli.main, [*name.split(), "--help"]).output
        examples = cli.EXAMPLES[name]
        assert 1 <= len(examples) <= 2 and text.rstrip().endswith(examples[-1]), (name, text[-300:])
        flags = {o for p in command.params for o in (*p.opts, *p.secondary_opts)}
        for example in examples:
            words = shlex.split(example)
            assert words[:1 + len(name.split())] == ["tokenloom", *name.split()], example
            unknown = [w.split("=")[0] for w in words if w.startswith("--") and w.split("=")[0] not in flags]
            assert not unknown, (example, unknown)


def test_pasted_examples_run():
    """The examples that need no files of the user's run as printed."""
    from tokenloom import cli

    for example in (*cli.EXAMPLES["info"], *cli.EXAMPLES["config show"][:1]):
        done = run_cli(*shlex.split(example)[1:])
        assert done.returncode == 0, (example, done.stderr)
