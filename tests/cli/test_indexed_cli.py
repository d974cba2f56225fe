"""The indexed commands as a user runs them: exit codes and one-line errors, no tracebacks."""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
from tl_testing import run_cli

from tokenloom.indexed import IndexedDataset, IndexedDatasetWriter


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


# --------------------------------------------------------------------------- verify with the manifest (issue 39)


def _invoke(*args):
    from click.testing import CliRunner

    from tokenloom.cli import main

    return CliRunner().invoke(main, [str(a) for a in args])


@pytest.fixture
def gpt2_dataset(tmp_path, shared_data):
    """tinyshakespeare's first 200 speeches in GPT-2 ids (vocabulary 50257, EOD 50256), with its manifest."""
    lines = (shared_data / "tinyshakespeare" / "tinyshakespeare.jsonl").read_text().splitlines()[:200]
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("\n".join(lines) + "\n")
    done = _invoke("preprocess", "--input", corpus, "--output-prefix", tmp_path / "g", "--tokenizer",
                   shared_data / "tokenizers" / "gpt2" / "gpt2.tiktoken", "--append-eod", "--workers", 1,
                   "--no-progress")
    assert done.exit_code == 0, done.output
    return tmp_path / "g"


def _one_line(result) -> str:
    assert result.exit_code == 1, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in result.output, result.output
    return lines[0]


def test_verify_checks_what_the_manifest_knows_without_flags(gpt2_dataset):
    ok = _invoke("verify", gpt2_dataset)
    assert ok.exit_code == 0 and "checked structure, counts, vocab, eod" in ok.stdout, ok.output
    assert "not checked" not in ok.stdout
    tokens = np.memmap(f"{gpt2_dataset}.bin", dtype=np.uint16, mode="r+")
    position = 1000
    doc = int(np.searchsorted(IndexedDataset(gpt2_dataset).document_indices,
                              np.searchsorted(IndexedDataset(gpt2_dataset).sequence_pointers, 2 * position,
                                              side="right") - 1, side="right")) - 1
    tokens[position] = 65535  # what the issue's user wrote: a uint16 id beyond GPT-2's 50257
    tokens.flush()
    del tokens
    line = _one_line(_invoke("verify", gpt2_dataset))
    assert line.startswith(f"error: {gpt2_dataset}.bin: token id 65535 at token {position} (document {doc}, ")
    assert "outside the vocabulary [0, 50257)" in line and f"{gpt2_dataset}.manifest.json" in line, line


def test_verify_checks_the_manifests_eod_and_counts(gpt2_dataset):
    ds = IndexedDataset(gpt2_dataset)
    last = int(ds.sequence_pointers[0] // 2 + ds.sequence_lengths[0] - 1)  # the first document's EOD
    tokens = np.memmap(f"{gpt2_dataset}.bin", dtype=np.uint16, mode="r+")
    tokens[last] = 11
    tokens.flush()
    del tokens
    assert "do not end with EOD 50256 (first: document 0)" in _one_line(_invoke("verify", gpt2_dataset))
    manifest = json.loads(Path(f"{gpt2_dataset}.manifest.json").read_text())
    manifest["counts"]["documents"] += 1
    Path(f"{gpt2_dataset}.manifest.json").write_text(json.dumps(manifest))
    line = _one_line(_invoke("verify", gpt2_dataset))
    assert f"{ds.num_documents} documents, but {gpt2_dataset}.manifest.json records" in line, line
    assert f"in {ds.num_documents + 1}: the files come from different runs" in line and "preprocess again" in line


def test_verify_without_a_manifest_says_what_it_could_not_check(gpt2_dataset):
    Path(f"{gpt2_dataset}.manifest.json").unlink()
    ok = _invoke("verify", gpt2_dataset)
    assert ok.exit_code == 0, ok.output
    assert ok.stdout.strip().endswith("checked structure; not checked: vocab (no g.manifest.json; pass "
                                      "--vocab-size), eod (no g.manifest.json; pass --eod), counts (no "
                                      "g.manifest.json)"), ok.stdout
    flagged = _invoke("verify", gpt2_dataset, "--vocab-size", 50257, "--eod", 50256)
    assert "checked structure, vocab, eod; not checked: counts" in flagged.stdout, flagged.output


# --------------------------------------------------------------------------- hints that point to the fix (issue 39)


def _build(prefix):
    return _invoke("build", "--data", prefix, "--split", "1", "--seq-length", 8, "--num-samples", 10)


@pytest.mark.parametrize("change", ["cut by half", "appended to"])
def test_a_bin_of_the_wrong_size_says_damaged_or_mismatched_with_both_sizes(gpt2_dataset, change):
    size = Path(f"{gpt2_dataset}.bin").stat().st_size
    if change == "cut by half":
        os.truncate(f"{gpt2_dataset}.bin", size // 2)
    else:
        with open(f"{gpt2_dataset}.bin", "ab") as f:
            f.write(b"\0" * 100)
    now = Path(f"{gpt2_dataset}.bin").stat().st_size
    for result in (_invoke("verify", gpt2_dataset), _build(gpt2_dataset)):
        line = _one_line(result)
        assert f"{gpt2_dataset}.bin is {now} bytes" in line and f"than the {size} bytes" in line, line
        assert "the pair is damaged" in line and "mismatched" in line and line.endswith("preprocess again"), line
        assert "change the split" not in line


def test_an_idx_of_another_dataset_is_called_foreign(gpt2_dataset, tmp_path, shared_data):
    other = tmp_path / "other.jsonl"
    other.write_text("".join(json.dumps({"text": f"another dataset, line {i}"}) + "\n" for i in range(7)))
    assert _invoke("preprocess", "--input", other, "--output-prefix", tmp_path / "o", "--tokenizer",
                   shared_data / "tokenizers" / "gpt2" / "gpt2.tiktoken", "--append-eod", "--workers", 1,
                   "--no-progress").exit_code == 0
    shutil.copy(tmp_path / "o.idx", f"{gpt2_dataset}.idx")
    for result in (_invoke("verify", gpt2_dataset), _build(gpt2_dataset)):
        line = _one_line(result)
        assert line.startswith(f"error: {gpt2_dataset}.idx holds 7 sequences in 7 documents, but "
                               f"{gpt2_dataset}.manifest.json records 200 in 200"), line
        assert "the .idx is foreign" in line and line.endswith("preprocess again"), line
