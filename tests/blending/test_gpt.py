"""GPT document/sample/shuffle index and sample reading (no Megatron needed)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenloom.blending import gpt
from tokenloom.blending.gpt import (
    GPTDataset,
    GPTDatasetConfig,
    build_gpt_indices,
    build_shuffle_index,
    count_epochs,
)
from tokenloom.blending.split import Split
from tokenloom.errors import TokenloomError


class ArraySource:
    """In-memory token source: sequence i is ``tokens[starts[i]:starts[i+1]]``."""

    path_prefix = "memory"

    def __init__(self, lengths):
        self.sequence_lengths = np.asarray(lengths, dtype=np.int32)
        self.starts = np.concatenate([[0], np.cumsum(self.sequence_lengths, dtype=np.int64)])
        self.tokens = np.arange(self.starts[-1], dtype=np.int64) + 100  # token value = global position + 100

    def __len__(self):
        return len(self.sequence_lengths)

    def get(self, idx, offset=0, length=None):
        if length is None:
            length = int(self.sequence_lengths[idx]) - offset
        start = self.starts[idx] + offset
        return self.tokens[start : start + length]


def test_module_docstring_worked_example():
    indices = build_gpt_indices(
        np.array([3, 5, 2, 4, 6], np.int32),
        np.arange(5, dtype=np.int32),
        5,
        Split.train,
        GPTDatasetConfig(seq_length=4, seed=1234),
    )
    assert indices.num_epochs == 2 and indices.separate_final_epoch
    assert indices.document_index.dtype == np.int32
    assert indices.document_index.tolist() == [4, 0, 1, 2, 3, 3, 2, 1, 0, 4]
    assert indices.sample_index.dtype == np.int32
    assert indices.sample_index.tolist() == [
        [0, 0],
        [0, 4],
        [1, 2],
        [2, 3],
        [4, 0],
        [5, 0],
        [6, 0],
        [7, 2],
        [8, 1],
        [9, 2],
    ]
    assert indices.shuffle_index.dtype == np.uint32
    assert indices.shuffle_index.tolist() == [2, 0, 3, 1, 5, 8, 4, 6, 7]
    assert "[4 0 1 2 3 | 3 2 1 0 4]" in gpt.__doc__ and "[2 0 3 1 | 5 8 4 6 7]" in gpt.__doc__
    assert "[[0 0] [0 4] [1 2] [2 3] [4 0] [5 0] [6 0] [7 2] [8 1] [9 2]]" in gpt.__doc__


def flattened(source: ArraySource, document_index: np.ndarray) -> np.ndarray:
    return np.concatenate([source.get(int(d)) for d in document_index] + [np.zeros(0, np.int64)])


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 30), min_size=1, max_size=25),
    seq_length=st.integers(1, 40),
    num_samples=st.one_of(st.none(), st.integers(0, 60)),
    extra=st.booleans(),
    keep_partial=st.booleans(),
    seed=st.integers(0, 2**31),
)
def test_samples_are_windows_of_the_shuffled_stream(
    lengths, seq_length, num_samples, extra, keep_partial, seed
):
    source = ArraySource(lengths)
    documents = np.arange(len(source), dtype=np.int32)
    config = GPTDatasetConfig(
        seq_length=seq_length,
        seed=seed,
        add_extra_token=extra,
        drop_last_partial_validation_sequence=not keep_partial,
    )
    total = sum(lengths)
    if total == 0 and (num_samples or extra) and num_samples is not None:
        with pytest.raises(TokenloomError, match="no tokens"):
            GPTDataset(source, documents, num_samples, Split.valid, config)
        return
    ds = GPTDataset(source, documents, num_samples, Split.valid, config)
    assert num_samples is None or len(ds) >= num_samples
    assert sorted(ds.indices.shuffle_index.tolist()) == list(range(len(ds)))
    stream = flattened(source, ds.indices.document_index)
    width = seq_length + int(extra)
    for j in range(len(ds)):
        window = stream[j * seq_length : j * seq_length + width]
        got = ds.read(j)
        assert len(got) == width
        np.testing.assert_array_equal(got[: len(window)], window)
        assert (got[len(window) :] == -1).all()
    if len(ds):
        np.testing.assert_array_equal(ds[0], ds.read(int(ds.indices.shuffle_index[0])))


def test_epochs_and_final_epoch_threshold():
    assert count_epochs(20, None, 4, 1) == 1
    assert count_epochs(20, 4, 4, 1) == 1  # 17 tokens needed
    assert count_epochs(20, 5, 4, 1) == 2  # 21 needed
    assert count_epochs(20, 10, 4, 0) == 2  # 40 needed: exactly two epochs
    # 100 tokens per epoch, S = 10, x = 1: 9 samples per epoch.
    lengths = np.full(10, 10, np.int32)
    docs = np.arange(10, dtype=np.int32)
    config = GPTDatasetConfig(seq_length=10)
    # 16 samples: 9 before the final epoch, 7 from it; 7 < int(0.8 * 9) = 7 is false
    assert not build_gpt_indices(lengths, docs, 16, Split.train, config).separate_final_epoch
    separate = build_gpt_indices(lengths, docs, 15, Split.train, config)
    assert separate.separate_final_epoch and separate.num_epochs == 2
    # earlier-epoch samples come first in the shuffle
    assert sorted(separate.shuffle_index[:9].tolist()) == list(range(9))


def test_shuffle_index_dtype_rule():
    rng = np.random.RandomState(0)
    assert build_shuffle_index(5, 5, rng).dtype == np.uint32
    assert build_shuffle_index(3, 5, np.random.RandomState(0)).tolist()[3:] in ([3, 4], [4, 3])


def test_empty_split_with_samples_is_an_error_not_a_hang():
    # Megatron's epoch loop never ends here.
    with pytest.raises(TokenloomError, match="no tokens"):
        build_gpt_indices(
            np.array([5, 5], np.int32), np.zeros(0, np.int32), 3, Split.test, GPTDatasetConfig(seq_length=4)
        )
    one_epoch = build_gpt_indices(
        np.array([5, 5], np.int32), np.zeros(0, np.int32), None, Split.test, GPTDatasetConfig(seq_length=4)
    )
    assert len(one_epoch) == 0 and one_epoch.sample_index.tolist() == [[0, 0]]


def test_config_validation():
    with pytest.raises(TokenloomError, match="seq_length"):
        GPTDatasetConfig(seq_length=0)
    with pytest.raises(TokenloomError, match="mode"):
        GPTDatasetConfig(seq_length=8, mode="fast")


def test_exact_mode_only_changes_kept_partial_count():
    lengths = np.full(2**13, 2**12, np.int32)
    lengths[-1] += 3
    docs = np.arange(len(lengths), dtype=np.int32)
    kw = dict(seq_length=4096, drop_last_partial_validation_sequence=False)
    megatron = build_gpt_indices(lengths, docs, None, Split.valid, GPTDatasetConfig(**kw))
    exact = build_gpt_indices(lengths, docs, None, Split.valid, GPTDatasetConfig(mode="exact", **kw))
    assert len(exact) == len(megatron) + 1
    np.testing.assert_array_equal(exact.sample_index[:-1], megatron.sample_index)
    train = [
        build_gpt_indices(lengths, docs, None, Split.train, GPTDatasetConfig(mode=m, **kw))
        for m in ("megatron", "exact")
    ]
    np.testing.assert_array_equal(train[0].sample_index, train[1].sample_index)
