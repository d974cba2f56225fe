"""Blends: budgets, Megatron's case table, errors that say what to change."""

from __future__ import annotations

import numpy as np
import pytest

from tokenloom.blending.blend import (
    Blend,
    BlendBuilder,
    BlendConfig,
    BlendedDataset,
    build_blend_indices,
    build_mock_datasets,
    sample_budgets,
)
from tokenloom.blending.gpt import GPTDataset, GPTDatasetConfig
from tokenloom.blending.mock import MockSource
from tokenloom.blending.split import Split
from tokenloom.errors import TokenloomError


def sources() -> dict[str, MockSource]:
    made = {}
    for seed, name in enumerate(["a", "b", "c"]):
        made[name] = MockSource(1000, 0, num_sequences=200 * (seed + 1), max_length=300, seed=seed)
        made[name].path_prefix = name
    return made


SOURCES = sources()


def build(sizes, **kw):
    gpt = GPTDatasetConfig(seq_length=kw.pop("seq_length", 64), split=kw.pop("split", "90,5,5"))
    return BlendBuilder(BlendConfig(gpt=gpt, **kw), open_source=SOURCES.__getitem__).build(sizes)


def test_sample_budgets():
    assert sample_budgets([0.3, 0.7], [1000, 10, 3]) == [[300, 3, 1], [700, 7, 3]]
    assert sample_budgets([0.3, 0.7], [1000, 10, 3], 0.005) == [[302, 4, 2], [704, 8, 4]]
    assert sample_budgets([0.001, 0.999], [2000, 0, 0], 0.005) == [[3, 0, 0], [2008, 0, 0]]


def test_weighted_blend():
    train, valid, test = build([1000, 50, 10], blend=Blend(("a", "b"), (1.0, 3.0)))
    assert isinstance(train, BlendedDataset)
    assert train.weights == [0.25, 0.75] and len(train) == train.size == 1000
    assert [ds.num_samples for ds in train.datasets] == [252, 754]  # ceil(ceil(1000 w) * 1.005)
    assert np.bincount(train.dataset_index).tolist() == [250, 750]
    assert train.dataset_index.dtype == np.int16 and train.dataset_sample_index.dtype == np.int64
    d, k = train.locate(17)
    np.testing.assert_array_equal(train[17], train.datasets[d][k])
    assert len(valid) == 13 + 38 and len(test) == 3 + 8  # sum of ceil(size * w): may exceed the request
    assert "a: weight 0.25, draws 250" in repr(train)


def test_unweighted_blends():
    train, valid, test = build([500, None, 10**9], blend=Blend(("a", "b", "c")))
    assert train.size == 500 and len(train) == 500
    assert train.weights == pytest.approx(
        np.array([len(d) for d in train.datasets]) / sum(map(len, train.datasets))
    )
    assert valid.size is None and valid.weights == [len(d) for d in valid.datasets]
    assert len(valid) == sum(len(d) for d in valid.datasets)  # exhaustive: every sample once
    for d, member in enumerate(valid.datasets):
        assert sorted(valid.dataset_sample_index[valid.dataset_index == d]) == list(range(len(member)))
    assert len(test) == sum(len(d) for d in test.datasets)  # capped at what exists


def test_single_source_is_a_plain_gpt_dataset():
    train, valid, test = build([100, None, 5], blend=Blend(("a",)))
    assert all(isinstance(ds, GPTDataset) for ds in (train, valid, test))
    assert train.num_samples == 100 and valid.num_samples is None


def test_blend_per_split():
    per_split = (Blend(("a", "b"), (1.0, 1.0)), Blend(("c",), (5.0,)), None)
    train, valid, test = build([100, 20, 7], blend_per_split=per_split, split=None)
    assert isinstance(train, BlendedDataset) and isinstance(valid, GPTDataset) and test is None
    assert len(train.datasets[0].documents) == len(SOURCES["a"])  # whole source
    assert valid.num_samples == 20  # a lone per-split source ignores its weight, as in Megatron


def test_mock_datasets():
    source = MockSource(500, 0, num_sequences=300, max_length=100)
    datasets = build_mock_datasets(GPTDatasetConfig(seq_length=32), [10, 5, 5], source)
    assert [ds.split for ds in datasets] == list(Split)
    assert [len(ds.documents) for ds in datasets] == [100, 100, 100]


def test_user_errors():
    with pytest.raises(TokenloomError, match="sample count"):
        build([100, None, 10], blend=Blend(("a", "b"), (1.0, 1.0)))
    with pytest.raises(TokenloomError, match="> 0"):
        Blend(("a", "b"), (1.0, 0.0))
    with pytest.raises(TokenloomError, match="2 prefixes but 1 weights"):
        Blend(("a", "b"), (1.0,))
    with pytest.raises(TokenloomError, match="split to None"):
        build([1, 1, 1], blend_per_split=(Blend(("a",)), None, None))
    with pytest.raises(TokenloomError, match="either blend or blend_per_split"):
        BlendConfig(
            gpt=GPTDatasetConfig(seq_length=8), blend=Blend(("a",)), blend_per_split=(None, None, None)
        )
    with pytest.raises(TokenloomError, match="multiple_validation_sets needs blend_per_split"):
        BlendConfig(gpt=GPTDatasetConfig(seq_length=8), blend=Blend(("a",)), multiple_validation_sets=True)
    with pytest.raises(TokenloomError, match="no blend"):
        build([1, 1, 1])
    with pytest.raises(TokenloomError, match="3 entries"):
        build([1, 1], blend=Blend(("a",)))


def test_empty_member_and_overdraw_are_clear_errors():
    gpt = GPTDatasetConfig(seq_length=64, split="1")
    a = GPTDataset(SOURCES["a"], np.arange(200, dtype=np.int32), None, Split.train, gpt)
    empty = GPTDataset(SOURCES["b"], np.zeros(0, dtype=np.int32), None, Split.train, gpt)
    with pytest.raises(TokenloomError, match="no samples.*'b'"):
        BlendedDataset([a, empty], [len(a), len(empty)], None)
    with pytest.raises(
        TokenloomError, match=r"draws \d+ samples from a, which has only \d+; raise mid_level"
    ):
        BlendedDataset([a, a], [0.5, 0.5], 2 * len(a) + 4)
    index, sample = build_blend_indices([0.5, 0.5], 6, [3, 3])
    assert index.tolist() == [0, 1, 0, 1, 0, 1] and sample.tolist() == [0, 0, 1, 1, 2, 2]
