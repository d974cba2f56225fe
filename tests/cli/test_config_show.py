"""``cli.py config show``: every TrainConfig field, sections too, with value, default and doc."""

from __future__ import annotations

import dataclasses
import typing

from tl_testing import run_cli

from tokenloom.config import field_docs
from tokenloom.train.config import TrainConfig


def dataclass_fields(cls: type, where: str = "") -> list[tuple[str, str]]:
    """(dotted key, doc) of every field of ``cls`` and of the dataclasses its fields name."""
    out = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        out.append((where + f.name, field_docs(cls)[f.name]))
        inner = [a for a in typing.get_args(hints[f.name]) if a is not type(None)] or [hints[f.name]]
        if len(inner) == 1 and dataclasses.is_dataclass(inner[0]):
            out += dataclass_fields(inner[0], f"{where}{f.name}.")
    return out


def test_config_show_lists_every_field_with_value_default_and_doc(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("train_iters: 7\noptim: {lr: 1.0e-3}\n")
    done = run_cli("config", "show", "--config", config, "--set", "data.blend={prefixes: [[1, a]]}")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    shown = [(line[2:].split(" = ")[0], doc.strip()) for line, doc in zip(lines, lines[1:], strict=False)
             if not line.startswith("      ")]
    assert shown == dataclass_fields(TrainConfig)
    assert "* train_iters = 7  (default: 1000)" in lines and "* optim.lr = 0.001  (default: 0.0006)" in lines
    assert "  seed = 1234  (default: 1234)" in lines
    assert '  data.blend.prefixes = [[1.0, "a"]]  (default: (required))' in lines
    # the blend replaced the mock data of TrainConfig's default (DataConfig's own default has none)
    assert "  data.mock = null  (default: null)" in lines
    assert "  data.mock.num_sequences = null  (default: 10000)" in lines  # an unset section's field: no '*'
    assert "  model = (section)  (default: (section))" in lines


def test_config_show_refuses_a_misspelled_key_in_one_line(tmp_path):
    done = run_cli("config", "show", "--set", "optim.lrr=1")
    assert done.returncode == 1
    assert done.stderr.strip() == "error: unknown config key in --set: optim.lrr (did you mean optim.lr?)"
