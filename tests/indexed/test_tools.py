"""verify / inspect / merge, on synthetic data and on the real Megatron fixtures."""

from __future__ import annotations

import numpy as np
import pytest

from tokenloom.errors import FormatError, TokenloomError
from tokenloom.indexed import IndexedDataset, IndexedDatasetWriter, inspect, merge, verify
from tokenloom.indexed.format import HEADER_SIZE


def _make(prefix, docs, dtype=None, vocab_size=100):
    with IndexedDatasetWriter(prefix, dtype=dtype, vocab_size=vocab_size) as w:
        for doc in docs:
            w.add_document(doc)
    return prefix


def test_verify_counts_and_optional_checks(tmp_path):
    p = _make(tmp_path / "d", [[5, 6, 99], [], [7, 99]])
    report = verify(p, vocab_size=100, eod=99)
    assert (report["sequences"], report["documents"], report["tokens"]) == (2, 3, 5)
    with pytest.raises(FormatError, match="outside the vocabulary"):
        verify(p, vocab_size=50)
    with pytest.raises(FormatError, match=r"1 non-empty document\(s\) do not end with EOD 7 \(first: document 0\)"):
        verify(_make(tmp_path / "f", [[5, 6, 8], [], [7]]), eod=7)


def _rewrite_idx_array(prefix, offset, values, dtype):
    with open(f"{prefix}.idx", "r+b") as f:
        f.seek(offset)
        f.write(np.asarray(values, dtype=dtype).tobytes())


def test_verify_catches_bad_pointers_and_document_index(tmp_path):
    p = _make(tmp_path / "d", [[1, 2], [3], [4, 5, 6]])
    n = 3
    _rewrite_idx_array(p, HEADER_SIZE + 4 * n + 8, [10], "<i8")  # pointer of sequence 1
    with pytest.raises(FormatError, match="sequence 1 pointer"):
        verify(p)
    p = _make(tmp_path / "e", [[1, 2], [3], [4, 5, 6]])
    _rewrite_idx_array(p, HEADER_SIZE + 12 * n + 8, [2, 1], "<i8")  # document index 0, 2, 1, 3
    with pytest.raises(FormatError, match="decreases at document 1"):
        verify(p)
    p = _make(tmp_path / "f", [[1, 2], [3], [4, 5, 6]])
    _rewrite_idx_array(p, HEADER_SIZE + 12 * n, [1], "<i8")
    with pytest.raises(FormatError, match="starts at 1"):
        verify(p)


def test_inspect_hash_is_dtype_independent(tmp_path):
    docs = [[1, 2, 3], [], [40000, 5]]
    a = inspect(_make(tmp_path / "a", docs, dtype=np.uint16, vocab_size=None))
    b = inspect(_make(tmp_path / "b", docs, dtype=np.int32, vocab_size=None))
    assert a["dtype"] == "uint16" and b["dtype"] == "int32"
    assert a["token_sha256"] == b["token_sha256"]
    assert a["empty_documents"] == 1
    assert a["sequence_length"]["max"] == 3 and a["sequence_length"]["histogram"] == [0, 0, 2]
    c = inspect(_make(tmp_path / "c", [[1, 2, 3], [], [40000, 6]], dtype=np.uint16, vocab_size=None))
    assert c["token_sha256"] != a["token_sha256"]


def test_merge_concatenates_in_order(tmp_path):
    a = _make(tmp_path / "a", [[1, 2], []])
    b = _make(tmp_path / "b", [[3], [4, 5, 6]])
    report = merge(tmp_path / "m", [a, b])
    assert report["documents"] == 4
    m = IndexedDataset(tmp_path / "m")
    assert [m[i].tolist() for i in range(len(m))] == [[1, 2], [3], [4, 5, 6]]
    assert m.document_indices.tolist() == [0, 1, 1, 2, 3]
    assert m.sequence_pointers.tolist() == [0, 4, 6]
    verify(tmp_path / "m")


def test_merge_rejects_dtype_mismatch(tmp_path):
    a = _make(tmp_path / "a", [[1]], dtype=np.uint16, vocab_size=None)
    b = _make(tmp_path / "b", [[1]], dtype=np.int32, vocab_size=None)
    with pytest.raises(TokenloomError, match="dtypes differ"):
        merge(tmp_path / "m", [a, b])
    assert not (tmp_path / "m.idx").exists() and not (tmp_path / "m.bin").exists()


@pytest.mark.parametrize("name, tokens", [("test_text_document", 5000), ("fim_text_document", 7600)])
def test_real_megatron_fixtures(shared_data, name, tokens):
    prefix = shared_data / "megatron-fixtures" / name
    report = verify(prefix)
    assert (report["sequences"], report["documents"], report["tokens"]) == (1000, 1000, tokens)
    info = inspect(prefix)
    assert info["dtype"] == "int32" and info["idx_bytes"] == 20042
    ds = IndexedDataset(prefix)
    assert ds.document_indices.tolist() == list(range(1001))


def test_fim_fixture_documents_are_llama3_bos_eos(shared_data):
    report = verify(shared_data / "megatron-fixtures" / "fim_text_document", vocab_size=128256, eod=128001)
    assert report["checked"] == ["structure", "vocab", "eod"]
