"""Past 2^31 tokens and 4 GiB of .bin, with sparse files (nothing close to 4 GiB is really written)."""

from __future__ import annotations

import os

import numpy as np
import pytest

from tokenloom.indexed import IndexedDataset, merge, verify
from tokenloom.indexed.format import write_index

GIB = 1 << 30


def _sparse_dataset(prefix, lengths, dtype, tail):
    """A dataset of the given sequence lengths whose .bin is a hole except ``tail`` at its end."""
    dtype = np.dtype(dtype)
    lengths = np.asarray(lengths, dtype=np.int32)
    size = int(lengths.astype(np.int64).sum()) * dtype.itemsize
    with open(f"{prefix}.bin", "wb") as f:
        f.truncate(size)
        f.seek(size - len(tail) * dtype.itemsize)
        f.write(np.asarray(tail, dtype=dtype).tobytes())
    write_index(f"{prefix}.idx", dtype, lengths, np.arange(len(lengths) + 1, dtype=np.int64))
    return prefix


def _real_size(path):
    return os.stat(path).st_blocks * 512


@pytest.fixture
def big(tmp_path):
    # 3 sequences of about 2^30 uint16 tokens: > 2^31 tokens, > 6 GiB, last pointer > 2^32.
    lengths = [GIB + 1, GIB + 2, GIB + 5]
    return _sparse_dataset(tmp_path / "big", lengths, np.uint16, [7, 8, 9]), lengths


def test_pointers_and_last_token_past_4gib(big):
    prefix, lengths = big
    ds = IndexedDataset(prefix)
    assert ds.num_tokens == sum(lengths) > 2**31
    assert ds.sequence_pointers.dtype == np.int64
    assert ds.sequence_pointers.tolist() == [0, 2 * (GIB + 1), 2 * (2 * GIB + 3)]
    assert ds.sequence_pointers[-1] > 2**32
    assert ds.get(2, offset=lengths[2] - 3, length=3).tolist() == [7, 8, 9]
    assert int(ds[-1][-1]) == 9
    assert _real_size(f"{prefix}.bin") < 1 << 20
    verify(prefix)


def test_merge_of_two_large_datasets_keeps_pointers(tmp_path, big):
    prefix, lengths = big
    other = _sparse_dataset(tmp_path / "other", [5, GIB + 3], np.uint16, [1, 2, 3])
    merge(tmp_path / "merged", [prefix, other, prefix])
    m = IndexedDataset(tmp_path / "merged")
    all_lengths = lengths + [5, GIB + 3] + lengths
    expected = np.concatenate([[0], np.cumsum(all_lengths[:-1], dtype=np.int64)]) * 2
    assert m.sequence_pointers.tolist() == expected.tolist()
    assert m.num_tokens == sum(all_lengths) > 2**32
    assert m.get(4, offset=GIB, length=3).tolist() == [1, 2, 3]
    assert m[-1][-3:].tolist() == [7, 8, 9]
    assert m[2][-3:].tolist() == [7, 8, 9]
    assert m.document_indices.tolist() == list(range(9))
    assert _real_size(f"{tmp_path / 'merged'}.bin") < 8 << 20, "merge should preserve holes"
    verify(tmp_path / "merged")
