"""The indexed commands as a user runs them: exit codes and one-line errors, no tracebacks."""

from __future__ import annotations

import json
import os
import struct

import pytest
from tl_testing import run_cli

from tokenloom.indexed import IndexedDatasetWriter


@pytest.fixture
def dataset(tmp_path):
    with IndexedDatasetWriter(tmp_path / "d", vocab_size=100) as w:
        w.add_document([1, 2, 99])
        w.add_document([3, 99])
    return tmp_path / "d"


def test_info_reports_native_and_torch():
    out = run_cli("info")
    assert out.returncode == 0, out.stderr
    assert "native extension" in out.stdout and "torch devices" in out.stdout and "gloo" in out.stdout


def test_inspect_and_verify(dataset):
    out = run_cli("inspect", dataset, "--json")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert (report["sequences"], report["documents"], report["tokens"]) == (2, 2, 5)
    out = run_cli("verify", dataset, "--vocab-size", 100, "--eod", 99)
    assert out.returncode == 0 and out.stdout.startswith("OK"), out.stderr


def test_merge_command(dataset, tmp_path):
    out = run_cli("merge", "--output-prefix", tmp_path / "m", dataset, f"{dataset}.idx")
    assert out.returncode == 0, out.stderr
    assert json.loads(run_cli("inspect", tmp_path / "m", "--json").stdout)["documents"] == 4


def _corruptions(prefix):
    yield "magic", lambda: open(f"{prefix}.idx", "r+b").write(b"XXXXXXXXX")
    yield "version", lambda: _patch(f"{prefix}.idx", 9, struct.pack("<Q", 7))
    yield "dtype", lambda: _patch(f"{prefix}.idx", 17, bytes([99]))
    yield "truncated", lambda: os.truncate(f"{prefix}.idx", 40)
    yield "bin size", lambda: os.truncate(f"{prefix}.bin", 2)


def _patch(path, offset, data):
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


@pytest.mark.parametrize("case", ["magic", "version", "dtype", "truncated", "bin size"])
@pytest.mark.parametrize("command", ["inspect", "verify"])
def test_corrupt_file_one_line_error(dataset, case, command):
    dict(_corruptions(dataset))[case]()
    out = run_cli(command, dataset)
    assert out.returncode != 0
    assert "Traceback" not in out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and str(dataset) in lines[0], out.stderr


def test_verify_failure_exit_code(dataset):
    out = run_cli("verify", dataset, "--eod", 3)
    assert out.returncode == 1 and "do not end with EOD 3" in out.stderr and "Traceback" not in out.stderr


def test_missing_dataset(tmp_path):
    out = run_cli("inspect", tmp_path / "nope")
    assert out.returncode == 1 and "no such file" in out.stderr and "Traceback" not in out.stderr


@pytest.mark.parametrize("name, tokens", [("test_text_document", 5000), ("fim_text_document", 7600)])
def test_real_megatron_fixtures_via_cli(shared_data, name, tokens):
    prefix = shared_data / "megatron-fixtures" / name
    out = run_cli("verify", prefix)
    assert out.returncode == 0 and f"1000 sequences, 1000 documents, {tokens} tokens" in out.stdout
    report = json.loads(run_cli("inspect", prefix, "--json").stdout)
    assert (report["sequences"], report["documents"], report["tokens"]) == (1000, 1000, tokens)
