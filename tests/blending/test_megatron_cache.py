"""Megatron's cache layout without Megatron: round trip, key text, hit rule."""

from __future__ import annotations

import json

import numpy as np

from tokenloom.blending.blend import Blend, BlendConfig, BlendedDataset
from tokenloom.blending.gpt import GPTDatasetConfig
from tokenloom.blending.megatron_cache import MegatronCacheBuilder, cache_key
from tokenloom.blending.mock import MockSource

SOURCES = {
    name: MockSource(100, 0, num_sequences=2000, max_length=80, seed=seed) for seed, name in enumerate("ab")
}
TOKENIZER = {"class": "DummyTokenizer"}


def builder(path):
    config = BlendConfig(
        gpt=GPTDatasetConfig(seq_length=32, split="969, 30, 1"), blend=Blend(("a", "b"), (1.0, 2.0))
    )
    return MegatronCacheBuilder(config, TOKENIZER, path, open_source=SOURCES.__getitem__)


def test_round_trip_and_hit(tmp_path):
    first = builder(tmp_path)
    built = first.build([100, 10, 10])
    assert (first.builds, first.hits) == (9, 0)
    again = builder(tmp_path)
    loaded = again.build([100, 10, 10])
    assert (again.builds, again.hits) == (0, 9)
    for b, got in zip(built, loaded, strict=True):
        assert isinstance(got, BlendedDataset) and isinstance(got.dataset_index, np.memmap)
        np.testing.assert_array_equal(b.dataset_index, got.dataset_index)
        for mb, ml in zip(b.datasets, got.datasets, strict=True):
            for name in ("document_index", "sample_index", "shuffle_index"):
                got = getattr(ml.indices, name)
                assert got.dtype == getattr(mb.indices, name).dtype
                np.testing.assert_array_equal(got, getattr(mb.indices, name))
            assert ml.indices.num_epochs == mb.indices.num_epochs
            np.testing.assert_array_equal(ml[3], mb[3])


def test_description_text(tmp_path):
    builder(tmp_path).build([100, 10, 10])
    texts = sorted(tmp_path.glob("*-GPTDataset-train-description.txt"))
    assert len(texts) == 2
    text = texts[0].read_text()
    assert not text.endswith("\n")
    assert texts[0].name.startswith(cache_key(text))
    mapping = json.loads(text)
    assert list(mapping) == [
        "class",
        "dataset_path",
        "num_samples",
        "index_split",
        "random_seed",
        "sequence_length",
        "split",
        "split_matrix",
        "tokenizer",
    ]
    assert mapping["split"] == "969, 30, 1" and mapping["tokenizer"] == TOKENIZER
    assert '"split_matrix": [\n        [\n            0,\n' in text  # Megatron's integer leading edge
    assert mapping["num_samples"] in (35, 68)  # the buffered budgets: ceil(ceil(100 w) * 1.005)
    [blend] = tmp_path.glob("*-BlendedDataset-train-description.txt")
    blend_mapping = json.loads(blend.read_text())
    assert blend_mapping["weights"] == [1 / 3, 2 / 3] and blend_mapping["size"] == 34 + 67
