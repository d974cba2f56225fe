"""tokenloom's writer is byte-identical to megatron-core's IndexedDatasetBuilder; each reads the other."""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tl_testing import import_megatron

from tokenloom.indexed import IndexedDataset, IndexedDatasetWriter

mcore = import_megatron("megatron.core.datasets.indexed_dataset")
pytestmark = pytest.mark.interop


def _write_both(root: Path, docs, dtype):
    """docs: list of documents, each a list of sequences (lists of ids)."""
    ours, theirs = root / "ours", root / "theirs"
    builder = mcore.IndexedDatasetBuilder(f"{theirs}.bin", dtype=dtype)
    with IndexedDatasetWriter(ours, dtype=dtype) as writer:
        for doc in docs:
            flat = np.asarray([t for seq in doc for t in seq], dtype=np.int64)
            lengths = [len(seq) for seq in doc]
            writer.add_document(flat, lengths)
            builder.add_document(flat.astype(dtype), lengths)
    builder.finalize(f"{theirs}.idx")
    return ours, theirs


def _assert_same_content(ours_reader, theirs_reader, docs):
    seqs = [seq for doc in docs for seq in doc]
    assert len(ours_reader) == len(theirs_reader) == len(seqs)
    np.testing.assert_array_equal(ours_reader.sequence_lengths, theirs_reader.sequence_lengths)
    np.testing.assert_array_equal(ours_reader.document_indices, theirs_reader.document_indices)
    for i, seq in enumerate(seqs):
        assert ours_reader[i].tolist() == theirs_reader[i].tolist() == seq
        if len(seq) > 1:
            assert ours_reader.get(i, 1, len(seq) - 1).tolist() == theirs_reader.get(i, 1, len(seq) - 1).tolist()
    if len(seqs) >= 2:
        a = [x.tolist() for x in ours_reader[0:2]]
        b = [x.tolist() for x in theirs_reader[0:2]]
        assert a == b


def _check(docs, dtype):
    with tempfile.TemporaryDirectory() as tmp:
        ours, theirs = _write_both(Path(tmp), docs, dtype)
        for ext in (".bin", ".idx"):
            assert Path(f"{ours}{ext}").read_bytes() == Path(f"{theirs}{ext}").read_bytes(), ext
        if not any(seq for doc in docs for seq in doc):
            # megatron-core cannot mmap an empty .bin ("cannot mmap an empty file"); ours can.
            assert len(IndexedDataset(theirs)) == sum(len(doc) for doc in docs)
            return
        # Each tool reads the other's files.
        _assert_same_content(IndexedDataset(theirs), mcore.IndexedDataset(str(ours)), docs)
        assert mcore.IndexedDataset(str(theirs)).sequence_lengths.dtype == IndexedDataset(ours).sequence_lengths.dtype


def _documents(max_id):
    seq = st.lists(st.integers(0, max_id), min_size=0, max_size=12)
    return st.lists(st.lists(seq, min_size=0, max_size=4), min_size=1, max_size=60)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(docs=_documents(65499))
def test_uint16_byte_identical(docs):
    _check(docs, np.uint16)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(docs=_documents(2**31 - 1))
def test_int32_byte_identical(docs):
    _check(docs, np.int32)


@pytest.mark.parametrize("dtype, vocab", [(np.uint16, 50257), (np.int32, 128256)])
def test_thousands_of_documents(dtype, vocab):
    rng = np.random.default_rng(1234)
    docs = []
    for _ in range(3000):
        n_seq = int(rng.choice([0, 1, 1, 1, 2, 3]))
        docs.append([rng.integers(0, vocab, size=int(rng.integers(0, 40))).tolist() for _ in range(n_seq)])
    _check(docs, dtype)
