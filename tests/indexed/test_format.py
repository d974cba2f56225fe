"""Writer/reader round trips, range checks, corrupt files and atomic publication."""

from __future__ import annotations

import os
import pickle
import signal
import struct
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from tokenloom.errors import FormatError, TokenloomError
from tokenloom.indexed import IndexedDataset, IndexedDatasetWriter, optimal_dtype
from tokenloom.indexed.format import HEADER_SIZE, MAGIC


def _write(prefix, docs, **kw):
    with IndexedDatasetWriter(prefix, **kw) as w:
        for doc in docs:
            if isinstance(doc, tuple):
                w.add_document(doc[0], lengths=doc[1])
            else:
                w.add_document(doc)
    return IndexedDataset(prefix)


def test_optimal_dtype_follows_megatron():
    assert optimal_dtype(50257) == np.uint16
    assert optimal_dtype(65499) == np.uint16
    assert optimal_dtype(65500) == np.int32
    assert optimal_dtype(None) == np.int32


def test_round_trip_with_empty_and_multi_sequence_documents(tmp_path):
    docs = [[1, 2, 3], [], ([4, 5, 6, 7], [1, 3]), [8], ([], [])]
    ds = _write(tmp_path / "d", docs, vocab_size=100)
    assert ds.dtype == np.uint16
    assert len(ds) == 4 and ds.num_documents == 5 and ds.num_tokens == 8
    assert ds.sequence_lengths.tolist() == [3, 1, 3, 1]
    assert ds.sequence_pointers.tolist() == [0, 6, 8, 14]
    assert ds.document_indices.tolist() == [0, 1, 1, 3, 4, 4]
    assert ds[0].tolist() == [1, 2, 3] and ds[-1].tolist() == [8]
    assert [a.tolist() for a in ds[1:3]] == [[4], [5, 6, 7]]
    assert ds.get(2, offset=1, length=2).tolist() == [6, 7]
    assert ds.get(2, offset=1).tolist() == [6, 7]
    with pytest.raises(IndexError):
        ds[4]
    with pytest.raises(IndexError):
        ds.get(0, offset=2, length=5)


def test_reads_are_zero_copy_views(tmp_path):
    ds = _write(tmp_path / "d", [[1, 2, 3]], vocab_size=10)
    arr = ds[0]
    assert not arr.flags.owndata and not arr.flags.writeable


def test_batched_add_documents_equals_one_by_one(tmp_path):
    a = _write(tmp_path / "a", [[1, 2], [], ([3, 4, 5], [2, 1])], vocab_size=10)
    with IndexedDatasetWriter(tmp_path / "b", vocab_size=10) as w:
        w.add_documents([1, 2, 3, 4, 5], [2, 2, 1], [1, 0, 2])
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"a{ext}").read_bytes() == (tmp_path / f"b{ext}").read_bytes()
    assert a.document_indices.tolist() == [0, 1, 1, 3]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="sync_file_range is Linux's")
def test_the_bin_is_written_back_while_it_grows(tmp_path, monkeypatch):
    """Every _WRITEBACK bytes the kernel is asked to start writing the .bin (so the final fsync waits
    for the tail only); both add paths count, and the bytes are those of a writer that never asks."""
    from tokenloom.indexed import format as fmt

    calls = []
    real = fmt._sync_file_range()
    monkeypatch.setattr(fmt, "_sync_file_range", lambda: lambda *a: calls.append(a[1:]) or real(*a))
    monkeypatch.setattr(fmt, "_WRITEBACK", 1000)
    docs = [np.arange(i, i + 300, dtype=np.uint16) for i in range(20)]  # 600 bytes each
    with IndexedDatasetWriter(tmp_path / "a", dtype=np.uint16) as w:
        for d in docs[:10]:
            w.add_document(d)  # the no-copy path
        w.add_documents(np.concatenate(docs[10:]), [300] * 10, [1] * 10)
    assert calls == [(0, 0, fmt._SYNC_FILE_RANGE_WRITE)] * 5 + [(0, 0, fmt._SYNC_FILE_RANGE_WRITE)]
    monkeypatch.setattr(fmt, "_WRITEBACK", 1 << 62)
    with IndexedDatasetWriter(tmp_path / "b", dtype=np.uint16) as w:
        for d in docs:
            w.add_document(d)
    assert (tmp_path / "a.bin").read_bytes() == (tmp_path / "b.bin").read_bytes()


def test_out_of_range_ids_are_rejected_not_wrapped(tmp_path):
    with pytest.raises(TokenloomError, match="70000"):
        with IndexedDatasetWriter(tmp_path / "d", dtype=np.uint16) as w:
            w.add_document(np.array([1, 70000], dtype=np.int64))
    with pytest.raises(TokenloomError, match="out of range"):
        with IndexedDatasetWriter(tmp_path / "e", vocab_size=100) as w:
            w.add_document(np.array([100], dtype=np.uint16))
    with pytest.raises(TokenloomError, match="-1"):
        with IndexedDatasetWriter(tmp_path / "f", dtype=np.int32, vocab_size=70000) as w:
            w.add_document(np.array([-1], dtype=np.int32))
    with pytest.raises(TokenloomError, match="token id 100 out of range"):  # the caller's largest id is checked
        with IndexedDatasetWriter(tmp_path / "h", vocab_size=100) as w:
            w.add_documents(np.array([1, 2], dtype=np.uint16), [2], [1], max_id=100)
    with pytest.raises(TokenloomError, match="sum to"):
        with IndexedDatasetWriter(tmp_path / "g", vocab_size=100) as w:
            w.add_document([1, 2, 3], lengths=[1, 1])
    assert not any(p.name.endswith((".bin", ".idx")) for p in tmp_path.iterdir())


def test_failed_writer_publishes_nothing_and_cleans_up(tmp_path):
    with pytest.raises(RuntimeError):
        with IndexedDatasetWriter(tmp_path / "d", vocab_size=10) as w:
            w.add_document([1, 2])
            raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []


def test_pickles_by_path(tmp_path):
    ds = _write(tmp_path / "d", [[1, 2, 3]], vocab_size=10)
    ds[0]  # opened and mapped
    state = pickle.dumps(ds)
    assert len(state) < 300
    assert pickle.loads(state)[0].tolist() == [1, 2, 3]


def test_empty_dataset_opens(tmp_path):
    ds = _write(tmp_path / "d", [[]], vocab_size=10)
    assert len(ds) == 0 and ds.num_documents == 1 and ds.num_tokens == 0


# ------------------------------------------------------------------ corrupt files


@pytest.fixture
def good(tmp_path):
    _write(tmp_path / "d", [[1, 2, 3], [4, 5]], vocab_size=10)
    return tmp_path / "d"


def _patch(path, offset, data):
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def _open(prefix):
    ds = IndexedDataset(prefix)
    len(ds)
    return ds


@pytest.mark.parametrize(
    "corrupt, message",
    [
        (lambda p: _patch(f"{p}.idx", 0, b"NOTMAGIC!"), "not a Megatron indexed dataset"),
        (lambda p: _patch(f"{p}.idx", 9, struct.pack("<Q", 2)), "unknown format version 2"),
        (lambda p: _patch(f"{p}.idx", 17, bytes([42])), "unknown dtype code 42"),
        (lambda p: os.truncate(f"{p}.idx", 20), "truncated header"),
        (lambda p: os.truncate(f"{p}.idx", HEADER_SIZE + 10), "truncated"),
        (lambda p: os.truncate(f"{p}.bin", 4), "the pair is damaged"),
        (lambda p: open(f"{p}.bin", "ab").write(b"xx"), "the pair is damaged"),
        (lambda p: open(f"{p}.idx", "ab").write(b"x"), "unexpected trailing bytes"),
        (lambda p: os.unlink(f"{p}.bin"), "no such file"),
    ],
    ids=["magic", "version", "dtype", "short-header", "truncated", "short-bin", "long-bin", "trailing", "no-bin"],
)
def test_corrupt_files_name_file_and_problem(good, corrupt, message):
    corrupt(good)
    with pytest.raises(FormatError, match=message) as info:
        _open(good)
    assert str(good) in str(info.value)
    assert "\n" not in str(info.value)


def test_magic_constant():
    assert MAGIC == b"MMIDIDX\x00\x00"


# ------------------------------------------------------------------ killed writer

KILLED_WRITER = textwrap.dedent(
    """
    import sys, numpy as np
    from tokenloom.indexed import IndexedDatasetWriter
    w = IndexedDatasetWriter(sys.argv[1], vocab_size=50000)
    rng = np.random.default_rng(0)
    print("started", flush=True)
    while True:
        w.add_document(rng.integers(0, 50000, size=4096))
    """
)


def test_sigkilled_writer_leaves_no_final_files(tmp_path):
    prefix = tmp_path / "killed"
    proc = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, str(prefix)], stdout=subprocess.PIPE)
    assert proc.stdout.readline().strip() == b"started"
    # Let it write a few MB, then kill it without any chance to clean up.
    deadline = 200
    while deadline and sum(p.stat().st_size for p in tmp_path.iterdir()) < 4 << 20:
        deadline -= 1
        subprocess.run(["sleep", "0.05"])
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names, "the writer should have left its temporary file"
    assert not (tmp_path / "killed.bin").exists() and not (tmp_path / "killed.idx").exists()
    assert all(".tmp-" in n for n in names)


@pytest.mark.parametrize("block_tokens", [1, 7, 1 << 22])
def test_add_kept_copies_exactly_the_kept_documents(tmp_path, block_tokens):
    """What preprocess --dedup writes: the kept documents of a dataset (empty ones too), a block at a time."""
    rng = np.random.default_rng(0)
    docs = []
    with IndexedDatasetWriter(tmp_path / "src", dtype=np.uint16) as w:
        for _ in range(300):
            lengths = rng.integers(0, 40, int(rng.integers(0, 4))).tolist()
            tokens = rng.integers(0, 1000, sum(lengths)).astype(np.uint16)
            w.add_document(tokens, lengths=lengths)
            docs.append((tokens, lengths))
    keep = rng.random(300) < 0.6
    with IndexedDatasetWriter(tmp_path / "kept", dtype=np.uint16) as w:
        w.add_kept(tmp_path / "src", keep, block_tokens=block_tokens)
    with IndexedDatasetWriter(tmp_path / "ref", dtype=np.uint16) as w:
        for (tokens, lengths), k in zip(docs, keep, strict=True):
            if k:
                w.add_document(tokens, lengths=lengths)
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"kept{ext}").read_bytes() == (tmp_path / f"ref{ext}").read_bytes()
