"""Acceptance: bad inputs give the documented behaviour in strict and quarantine modes."""

from __future__ import annotations

import json
from collections import namedtuple

import pytest
from preprocess_helpers import REPO, preprocess, write_jsonl
from tl_testing import limit_s

from tokenloom.errors import TokenloomError
from tokenloom.indexed import IndexedDataset, manifest

Case = namedtuple("Case", "line reason")

GOOD = b'{"text": "fine"}\n'
CASES = {
    "invalid-json": Case(b'{"text": "unterminated\n', "invalid JSON"),
    "invalid-utf8": Case(b'{"text": "caf\xe9"}\n', "invalid UTF-8 at byte 13"),
    "lone-surrogate": Case(b'{"text": "a\\ud800b"}\n', "unpaired surrogate"),
    "missing-key": Case(b'{"body": "no text key"}\n', "missing key 'text'"),
    "number": Case(b'{"text": 42}\n', "key 'text' is a int, not a string"),
    "null": Case(b'{"text": null}\n', "key 'text' is null"),
    "not-object": Case(b'["text"]\n', "not an object"),
    # orjson reads these differently from the stdlib json (as Megatron reads them): the stdlib decides
    "big-int": Case(b'{"text": 123456789012345678901234567890}\n', "key 'text' is a int, not a string"),
    "nan": Case(b'{"text": NaN}\n', "key 'text' is a float, not a string"),
    "big-int-in-list": Case(b'{"text": ["a", 18446744073709551616]}\n', "key 'text' is a list, not a string"),
}


def _file(tmp_path, bad_line):
    path = tmp_path / "in.jsonl"
    path.write_bytes(GOOD + bad_line + GOOD + b"\n" + GOOD)  # the blank line is skipped, not a record
    return path


def _published(tmp_path):
    return sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("out") and p.suffix in (".bin", ".idx"))


@pytest.mark.parametrize("case", list(CASES))
def test_strict_mode_stops_with_file_and_line(tmp_path, case):
    path = _file(tmp_path, CASES[case].line)
    with pytest.raises(TokenloomError) as info:
        preprocess(tmp_path, [path])
    assert f"{path}:2: " in str(info.value) and CASES[case].reason in str(info.value)
    assert _published(tmp_path) == [] and not (tmp_path / "out.partial").exists()


@pytest.mark.parametrize("case", list(CASES))
def test_quarantine_mode_counts_and_rejects(tmp_path, case):
    path = _file(tmp_path, CASES[case].line)
    out = preprocess(tmp_path, [path], max_bad_fraction=0.5, append_eod=True)
    assert IndexedDataset(out).num_documents == 3
    rejects = [json.loads(x) for x in (tmp_path / "out.rejects.jsonl").read_text().splitlines()]
    assert len(rejects) == 1 and rejects[0]["line"] == 2 and rejects[0]["file"] == str(path)
    assert CASES[case].reason in rejects[0]["reason"]
    counts = manifest.read(out)["counts"]
    assert counts["bad_records"] == 1 and counts["records"] == 4


def test_quarantine_fails_above_the_fraction(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_bytes(GOOD + b"nope\n" + b"nope\n" + GOOD)
    with pytest.raises(TokenloomError, match=r"2 of 4 records were bad \(50.00% > --max-bad-fraction 10.00%\)"):
        preprocess(tmp_path, [path], max_bad_fraction=0.1)
    assert _published(tmp_path) == []
    assert len((tmp_path / "out.rejects.jsonl").read_text().splitlines()) == 2


def test_empty_file_and_empty_documents(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_bytes(b"")
    docs = write_jsonl(tmp_path / "d.jsonl", [{"text": ""}, {"text": "a"}, {"text": ""}])
    out = preprocess(tmp_path, [empty, docs], append_eod=True)
    ds = IndexedDataset(out)
    assert ds.num_documents == 3 and len(ds) == 1 and ds[0].tolist() == [97, 256]
    counts = manifest.read(out)["counts"]
    assert counts["empty_documents"] == 2 and counts["documents"] == 3
    only_empty = preprocess(tmp_path, [empty], name="only_empty")
    assert IndexedDataset(only_empty).num_documents == 0


def test_fifty_megabyte_document(tmp_path):
    text = ("all work and no play makes jack a dull boy " * 1_200_000)[:50_000_000]
    path = write_jsonl(tmp_path / "big.jsonl", [{"text": "small"}, {"text": text}])
    out = preprocess(tmp_path, [path], append_eod=True)
    ds = IndexedDataset(out)
    assert ds.sequence_lengths.tolist() == [6, 50_000_001]
    assert bytes(ds.get(1, 0, 12).astype("u1")) == b"all work and"


def _truncated_zst(tmp_path, n=20000):
    import zstandard

    data = "".join(json.dumps({"text": f"document number {i}"}) + "\n" for i in range(n)).encode()
    comp = zstandard.ZstdCompressor().compress(data)
    path = tmp_path / "t.jsonl.zst"
    path.write_bytes(comp[: len(comp) // 2])
    return path


def test_truncated_zst(tmp_path):
    path = _truncated_zst(tmp_path)
    with pytest.raises(TokenloomError, match="truncated or corrupt jsonl.zst input"):
        preprocess(tmp_path, [path])
    assert _published(tmp_path) == []
    out = preprocess(tmp_path, [path], max_bad_fraction=0.01)
    rejects = (tmp_path / "out.rejects.jsonl").read_text().splitlines()
    assert len(rejects) == 1 and "rest of the file is skipped" in rejects[0]
    assert 0 < IndexedDataset(out).num_documents < 20000


def test_corrupt_zst_is_a_bad_line_not_a_traceback(tmp_path):
    """zstandard's ZstdError (damaged frame data) is reported like truncation; the space estimate,
    which samples the same input first, does not trip over a sample with nothing decodable."""
    import zstandard

    data = "".join(json.dumps({"text": f"document number {i}"}) + "\n" for i in range(20000)).encode()
    comp = bytearray(zstandard.ZstdCompressor().compress(data))
    comp[zstandard.frame_header_size(bytes(comp))] |= 0b110  # the first block's type: 3, reserved
    path = tmp_path / "c.jsonl.zst"
    path.write_bytes(bytes(comp))
    with pytest.raises(TokenloomError, match=r"c.jsonl.zst:1: truncated or corrupt jsonl.zst input \(zstd decompressor error"):
        preprocess(tmp_path, [path])
    assert _published(tmp_path) == []


def test_no_space_is_refused_before_work(tmp_path, monkeypatch):
    import shutil

    path = write_jsonl(tmp_path / "d.jsonl", [{"text": "x" * 1000}])
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage._replace(free=100))
    with pytest.raises(TokenloomError, match="not enough disk space"):
        preprocess(tmp_path, [path])
    assert _published(tmp_path) == []
    preprocess(tmp_path, [path], check_space=False)


@pytest.mark.parametrize("args, message", [
    (["--input", "{tmp}/in.jsonl", "--output-prefix", "{tmp}/out", "--tokenizer-type", "byte"], "in.jsonl:2: "),
    (["--input", "{tmp}/missing.jsonl", "--output-prefix", "{tmp}/out", "--tokenizer-type", "byte"],
     "no such file"),
    (["--input", "{tmp}/in.jsonl", "--output-prefix", "{tmp}/out", "--tokenizer", "{tmp}/nope"], "nope"),
    (["--input", "{tmp}/in.jsonl", "--output-prefix", "{tmp}/out"], "--tokenizer"),
    (["--input", "{tmp}/in.jsonl", "--output-prefix", "{tmp}/out", "--tokenizer-type", "byte",
      "--max-bad-fraction", "2"], "--max-bad-fraction"),
])
def test_cli_user_errors_are_one_line(tmp_path, args, message):
    import subprocess
    import sys

    _file(tmp_path, CASES["invalid-json"].line)
    cmd = [sys.executable, str(REPO / "cli.py"), "preprocess", "--no-progress",
           *[a.format(tmp=tmp_path) for a in args]]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=limit_s(120))
    assert out.returncode == 1, out
    assert "Traceback" not in out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], out.stderr


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_cli_corrupt_parquet_is_one_line(tmp_path, damage):
    """pyarrow's ArrowInvalid becomes one line naming the file; nothing is published."""
    import subprocess
    import sys

    import pyarrow as pa
    import pyarrow.parquet as pq

    good = tmp_path / "good.parquet"
    pq.write_table(pa.table({"text": [f"document {i}" for i in range(5000)]}), good)
    data = good.read_bytes()
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(b"PAR1" + bytes(range(256)) * 4 if damage == "garbage" else data[: len(data) // 2])
    cmd = [sys.executable, str(REPO / "cli.py"), "preprocess", "--no-progress", "--input", str(good),
           "--input", str(bad), "--output-prefix", str(tmp_path / "out"), "--tokenizer-type", "byte"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=limit_s(120))
    assert out.returncode == 1, out
    assert "Traceback" not in out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {bad}: not a readable parquet input ("), out.stderr
    assert _published(tmp_path) == []
