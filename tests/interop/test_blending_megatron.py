"""tokenloom.blending vs megatron-core 0.16.1: same arrays (values and dtypes), same samples.

megatron-core is a test-only oracle; it is imported once for the whole module (3-5 s).
tokenloom reads the files with its own reader, megatron with its own. Megatron gets
a fresh ``path_to_cache`` per build (so nothing is ever a cache hit, and nothing is
written next to the shared fixtures, which its default location would do); 0.16.1's
BlendedDataset then needs a process group: a 1-rank gloo group on a file store."""

from __future__ import annotations

import tempfile
import warnings
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tl_testing import import_megatron

from tokenloom.blending import reference
from tokenloom.blending.blend import Blend, BlendBuilder, BlendConfig, BlendedDataset, build_mock_datasets
from tokenloom.blending.gpt import GPTDataset, GPTDatasetConfig, build_gpt_indices
from tokenloom.blending.megatron_cache import MegatronCacheBuilder, cache_key
from tokenloom.blending.mock import MockSource
from tokenloom.blending.split import Split
from tokenloom.indexed import IndexedDataset as OurIndexedDataset  # ours is compared, never megatron's

mbuilder = import_megatron("megatron.core.datasets.blended_megatron_dataset_builder")
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from megatron.core.datasets import blended_dataset as mblended
    from megatron.core.datasets import gpt_dataset as mgpt
    from megatron.core.datasets import helpers_cpp as mhelpers
    from megatron.core.datasets.indexed_dataset import IndexedDataset as MIndexedDataset
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder as MBuilder
    from megatron.core.datasets.utils import Split as MSplit

_native = pytest.importorskip("tokenloom._native", reason="native extension not built")
pytestmark = pytest.mark.interop

SHARED_DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data"
FIXTURES = SHARED_DATA / "megatron-fixtures"


class DummyTokenizer:
    """What megatron's GPTDatasetConfig needs from a tokenizer."""

    vocab_size = 32000
    eod = 0
    unique_identifiers = {"class": "DummyTokenizer"}


_CACHE_ROOT: list[str] = []


@pytest.fixture(scope="module", autouse=True)
def megatron_process_group(tmp_path_factory):
    import torch.distributed as dist

    _CACHE_ROOT[:] = [str(tmp_path_factory.mktemp("megatron-cache"))]
    owned = not dist.is_initialized()
    if owned:
        store = dist.FileStore(str(tmp_path_factory.mktemp("pg") / "store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    if owned:
        dist.destroy_process_group()
    for name in ("test_text_document", "fim_text_document"):
        assert not (FIXTURES / name).exists(), f"something wrote a cache next to the shared fixture {name}"


def fixture_prefix(name: str) -> str:
    prefix = FIXTURES / name
    if not prefix.with_suffix(".idx").exists():
        pytest.skip(f"shared Megatron fixture {prefix}.idx not found (expected under {SHARED_DATA})")
    return str(prefix)


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory) -> dict[str, str]:
    """Three sources written by megatron's IndexedDatasetBuilder (some empty sequences, 1-3 per document)."""
    root = tmp_path_factory.mktemp("synthetic")
    specs = {"small": (300, 0, 200, 1), "medium": (2000, 1, 600, 2), "tiny": (40, 1, 50, 3)}
    prefixes = {}
    for name, (num_sequences, low, high, seed) in specs.items():
        rng = np.random.default_rng(seed)
        prefix = str(root / name)
        builder = MBuilder(prefix + ".bin", dtype=np.uint16)
        lengths = rng.integers(low, high, size=num_sequences)
        start = 0
        while start < num_sequences:
            group = [int(n) for n in lengths[start : start + int(rng.integers(1, 4))]]
            builder.add_document(rng.integers(1, 32000, size=sum(group)), group)
            start += len(group)
        builder.finalize(prefix + ".idx")
        prefixes[name] = prefix
    return prefixes


def megatron_build(
    sizes,
    *,
    seq_length,
    split=None,
    blend=None,
    blend_per_split=None,
    seed=1234,
    add_extra=True,
    drop_last_valid=True,
    surplus=0.005,
    mock=False,
    path_to_cache="fresh",
    multiple_validation_sets=None,
):
    if path_to_cache == "fresh":
        path_to_cache = tempfile.mkdtemp(dir=_CACHE_ROOT[0])
    config = mgpt.GPTDatasetConfig(
        random_seed=seed,
        sequence_length=seq_length,
        blend=blend,
        blend_per_split=blend_per_split,
        split=split,
        tokenizer=DummyTokenizer(),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        add_extra_token_to_sequence=add_extra,
        drop_last_partial_validation_sequence=drop_last_valid,
        mid_level_dataset_surplus=surplus,
        path_to_cache=path_to_cache,
        multiple_validation_sets=multiple_validation_sets,
    )
    cls = mgpt.MockGPTDataset if mock else mgpt.GPTDataset
    return mbuilder.BlendedMegatronDatasetBuilder(cls, sizes, lambda: True, config).build()


def gpt_config(seq_length, split, seed=1234, add_extra=True, drop_last_valid=True):
    return GPTDatasetConfig(
        seq_length=seq_length,
        split=split,
        seed=seed,
        add_extra_token=add_extra,
        drop_last_partial_validation_sequence=drop_last_valid,
    )


def assert_same_array(mine: np.ndarray, theirs: np.ndarray, what: str) -> None:
    assert mine.dtype == theirs.dtype, f"{what}: dtype {mine.dtype} != megatron {theirs.dtype}"
    assert mine.shape == theirs.shape, f"{what}: shape {mine.shape} != megatron {theirs.shape}"
    assert np.array_equal(mine, theirs), f"{what}: values differ"


def assert_same_gpt(mine: GPTDataset, theirs, what: str, samples: int = 25) -> None:
    assert isinstance(theirs, mgpt.GPTDataset), f"{what}: megatron built {type(theirs).__name__}"
    assert mine.split.name == theirs.index_split.name
    assert_same_array(mine.documents, theirs.indices, f"{what} split documents")
    for name in ("document_index", "sample_index", "shuffle_index"):
        assert_same_array(getattr(mine.indices, name), getattr(theirs, name), f"{what} {name}")
    assert len(mine) == len(theirs)
    picks = (
        np.unique(np.linspace(0, len(mine) - 1, num=min(samples, len(mine))).astype(int)) if len(mine) else []
    )
    for k in picks:
        text, _ = theirs._query_document_sample_shuffle_indices(int(k))
        assert_same_array(mine[int(k)], text, f"{what} sample {k}")


def assert_same(mine, theirs, what: str) -> None:
    if mine is None or theirs is None:
        assert mine is None and theirs is None, f"{what}: {mine!r} vs megatron {theirs!r}"
        return
    if isinstance(mine, list):  # multiple validation sets
        assert isinstance(theirs, list) and len(mine) == len(theirs), what
        for d, (m, t) in enumerate(zip(mine, theirs, strict=True)):
            assert_same_gpt(m, t, f"{what} set {d}")
        return
    if isinstance(mine, GPTDataset):
        assert_same_gpt(mine, theirs, what)
        return
    assert isinstance(mine, BlendedDataset) and isinstance(theirs, mblended.BlendedDataset), what
    assert mine.weights == theirs.weights and [type(w) for w in mine.weights] == [
        type(w) for w in theirs.weights
    ]
    assert mine.size == theirs.size
    assert_same_array(mine.dataset_index, theirs.dataset_index, f"{what} dataset_index")
    assert_same_array(mine.dataset_sample_index, theirs.dataset_sample_index, f"{what} dataset_sample_index")
    assert len(mine.datasets) == len(theirs.datasets)
    for d, (m, t) in enumerate(zip(mine.datasets, theirs.datasets, strict=True)):
        assert_same_gpt(m, t, f"{what} member {d}", samples=5)
    for i in (
        np.unique(np.linspace(0, len(mine) - 1, num=min(10, len(mine))).astype(int)) if len(mine) else []
    ):
        d, k = mine.locate(int(i))
        text, _ = theirs.datasets[d]._query_document_sample_shuffle_indices(k)
        assert_same_array(mine[int(i)], text, f"{what} blended sample {i}")


def compare(mine: list, theirs: list) -> None:
    assert len(mine) == len(theirs) == 3
    for split, m, t in zip(Split, mine, theirs, strict=True):
        assert_same(m, t, split.name)


def build_both(sizes, *, seq_length, split=None, prefixes=None, weights=None, per_split=None, **kw):
    """tokenloom and megatron datasets for one configuration (plain tuples -> both APIs)."""
    gpt = gpt_config(
        seq_length, split, kw.get("seed", 1234), kw.get("add_extra", True), kw.get("drop_last_valid", True)
    )
    surplus = kw.get("surplus", 0.005)
    if per_split is not None:
        config = BlendConfig(
            gpt=gpt,
            blend_per_split=tuple(None if b is None else Blend(*b) for b in per_split),
            mid_level_dataset_surplus=surplus,
        )
        theirs = megatron_build(
            sizes,
            seq_length=seq_length,
            blend_per_split=[
                None if b is None else (list(b[0]), None if b[1] is None else list(b[1])) for b in per_split
            ],
            **kw,
        )
    else:
        config = BlendConfig(
            gpt=gpt, blend=Blend(tuple(prefixes), weights), mid_level_dataset_surplus=surplus
        )
        theirs = megatron_build(
            sizes,
            seq_length=seq_length,
            split=split,
            blend=(list(prefixes), None if weights is None else list(weights)),
            **kw,
        )
    mine = BlendBuilder(config, open_source=OurIndexedDataset).build(sizes)
    return mine, theirs


# -- whole-pipeline configurations ----------------------------------------------------------


def test_fixture_single_source():
    test = fixture_prefix("test_text_document")
    mine, theirs = build_both([300, 30, 5], seq_length=32, split="969,30,1", prefixes=[test])
    compare(mine, theirs)
    assert mine[0].indices.num_epochs > 1


def test_fixture_weighted_two_way_blend():
    prefixes = [fixture_prefix("test_text_document"), fixture_prefix("fim_text_document")]
    mine, theirs = build_both(
        [500, 50, 10], seq_length=64, split="969, 30, 1", prefixes=prefixes, weights=(30.0, 70.0)
    )
    compare(mine, theirs)


def test_fixture_sequence_longer_than_split():
    # S = 4096 over a ~7 k-token source: a sample spans most of an epoch, many epochs.
    fim = fixture_prefix("fim_text_document")
    mine, theirs = build_both([10, 2, 2], seq_length=4096, split="98,1,1", prefixes=[fim])
    compare(mine, theirs)
    assert mine[2].indices.num_epochs > 100


def test_one_epoch_keep_partial_no_extra_token(synthetic):
    mine, theirs = build_both(
        [None, None, None],
        seq_length=100,
        split="90,5,5",
        prefixes=[synthetic["medium"]],
        add_extra=False,
        drop_last_valid=False,
    )
    compare(mine, theirs)
    valid = mine[1]
    assert valid.read(len(valid) - 1)[-1] == -1  # the kept partial sample is padded with pad_id


@pytest.mark.parametrize(("train", "separate"), [(500, True), (680, False)])
def test_multi_epoch_final_epoch_rule(synthetic, train, separate):
    mine, theirs = build_both([train, 5, 0], seq_length=128, split="98,2,0", prefixes=[synthetic["small"]])
    compare(mine, theirs)
    assert mine[0].indices.num_epochs == 3
    assert mine[0].indices.separate_final_epoch is separate
    assert mine[2] is None


def test_tiny_weights(synthetic):
    # (split "969,30,1" would leave small's test split empty: megatron loops forever there)
    prefixes = [synthetic["small"], synthetic["medium"]]
    mine, theirs = build_both(
        [2000, 100, 100], seq_length=64, split="90,5,5", prefixes=prefixes, weights=(0.001, 0.999)
    )
    compare(mine, theirs)
    assert np.bincount(mine[0].dataset_index).tolist() == [2, 1998]


def test_exhaustive_three_way(synthetic):
    prefixes = [synthetic["small"], synthetic["medium"], synthetic["tiny"]]
    mine, theirs = build_both([None, None, None], seq_length=48, split="80,10,10", prefixes=prefixes)
    compare(mine, theirs)
    assert mine[0].size is None and len(mine[0]) == sum(len(ds) for ds in mine[0].datasets)


def test_unweighted_with_sizes(synthetic):
    prefixes = [synthetic["small"], synthetic["medium"], synthetic["tiny"]]
    mine, theirs = build_both([1000, 20, 100_000], seq_length=32, split="90,5,5", prefixes=prefixes, seed=7)
    compare(mine, theirs)


def test_single_source_with_weight_goes_through_blend(synthetic):
    mine, theirs = build_both(
        [100, 10, 10], seq_length=32, split="8,1,1", prefixes=[synthetic["small"]], weights=(1.0,)
    )
    compare(mine, theirs)
    assert isinstance(mine[0], BlendedDataset)


def test_blend_per_split(synthetic):
    per_split = [
        ((synthetic["small"], synthetic["medium"]), (1.0, 3.0)),
        ((synthetic["tiny"],), None),
        ((synthetic["small"], synthetic["tiny"]), None),
    ]
    mine, theirs = build_both([800, 40, None], seq_length=64, per_split=per_split, seed=99)
    compare(mine, theirs)


def test_multiple_validation_sets(synthetic):
    blend_per_split = [([synthetic["small"]], None), ([synthetic["medium"], synthetic["tiny"]], None), None]
    theirs = megatron_build(
        [100, 30, None], seq_length=32, blend_per_split=blend_per_split, multiple_validation_sets=True
    )
    config = BlendConfig(
        gpt=gpt_config(32, None),
        multiple_validation_sets=True,
        blend_per_split=tuple(None if b is None else Blend(tuple(b[0]), b[1]) for b in blend_per_split),
    )
    mine = BlendBuilder(config, open_source=OurIndexedDataset).build([100, 30, None])
    compare(mine, theirs)
    assert [ds.num_samples for ds in mine[1]] == [30, 30]


def test_mock_mode():
    theirs = megatron_build([100, 10, 10], seq_length=256, mock=True)
    mine = build_mock_datasets(gpt_config(256, None), [100, 10, 10], MockSource(DummyTokenizer.vocab_size, 0))
    compare(mine, theirs)


def test_float32_ceil_quirk_at_dataset_level():
    # A keep-partial validation split of 2^25 + 3 tokens: megatron (and mode="megatron")
    # counts samples in float32 and drops the partial one; mode="exact" keeps it.
    class Lengths:
        sequence_lengths = np.full(2**13, 2**12, np.int32)
        sequence_lengths[-1] += 3

        def __len__(self):
            return len(self.sequence_lengths)

    source = Lengths()
    documents = np.arange(len(source), dtype=np.int32)
    config = mgpt.GPTDatasetConfig(
        random_seed=5,
        sequence_length=4096,
        split="1",
        tokenizer=DummyTokenizer(),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        drop_last_partial_validation_sequence=False,
    )
    theirs = mgpt.GPTDataset(source, None, documents, None, MSplit.valid, config)
    gpt = gpt_config(4096, "1", seed=5, drop_last_valid=False)
    mine = build_gpt_indices(source.sequence_lengths, documents, None, Split.valid, gpt)
    for name in ("document_index", "sample_index", "shuffle_index"):
        assert_same_array(getattr(mine, name), getattr(theirs, name), name)
    assert len(mine) == 2**13
    exact = build_gpt_indices(
        source.sequence_lengths,
        documents,
        None,
        Split.valid,
        GPTDatasetConfig(
            seq_length=4096, seed=5, split="1", mode="exact", drop_last_partial_validation_sequence=False
        ),
    )
    assert len(exact) == 2**13 + 1


def test_oversampling_is_a_clear_error_where_megatron_raises_index_error(synthetic):
    # The builder's budgets cannot over-draw (a greedy count never exceeds ceil(w * size));
    # a hand-made blend asking for more samples than its members have can.
    from tokenloom.errors import TokenloomError

    gpt = gpt_config(64, "1")
    config = mgpt.GPTDatasetConfig(
        random_seed=1234,
        sequence_length=64,
        split="1",
        tokenizer=DummyTokenizer(),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
    )
    prefixes = [synthetic["tiny"], synthetic["small"]]
    theirs, mine = [], []
    for prefix in prefixes:
        documents = np.arange(len(MIndexedDataset(prefix)), dtype=np.int32)
        theirs.append(mgpt.GPTDataset(MIndexedDataset(prefix), prefix, documents, None, MSplit.train, config))
        mine.append(GPTDataset(OurIndexedDataset(prefix), documents, None, Split.train, gpt))
    size = len(mine[0]) + len(mine[1]) + 10
    with pytest.raises(IndexError, match="oversamples"):
        mblended.BlendedDataset(theirs, [0.5, 0.5], size, config)
    with pytest.raises(TokenloomError, match=r"tiny.*raise mid_level_dataset_surplus"):
        BlendedDataset(mine, [0.5, 0.5], size)


# -- Megatron's cache: shared both ways --------------------------------------------------


def cache_builder(prefixes, weights, path, split="90,5,5", seq_length=64, per_split=None):
    gpt = gpt_config(seq_length, None if per_split else split)
    if per_split:
        config = BlendConfig(
            gpt=gpt, blend_per_split=tuple(None if b is None else Blend(*b) for b in per_split)
        )
    else:
        config = BlendConfig(gpt=gpt, blend=Blend(tuple(prefixes), weights))
    return MegatronCacheBuilder(
        config, DummyTokenizer.unique_identifiers, path, open_source=OurIndexedDataset
    )


def all_megatron_datasets(top):
    for ds in top:
        if isinstance(ds, mblended.BlendedDataset):
            yield ds
            yield from ds.datasets
        elif ds is not None:
            yield ds


def test_megatron_cache_is_a_hit_for_tokenloom(synthetic, tmp_path):
    prefixes = [synthetic["small"], synthetic["medium"]]
    theirs = megatron_build(
        [300, 30, 30],
        seq_length=64,
        split="90,5,5",
        blend=(prefixes, [0.4, 0.6]),
        path_to_cache=str(tmp_path),
    )
    files = sorted(p.name for p in tmp_path.iterdir())
    assert len(files) == 3 * (3 + 2 * 4)
    builder = cache_builder(prefixes, (0.4, 0.6), tmp_path)
    mine = builder.build([300, 30, 30])
    assert (builder.hits, builder.builds) == (9, 0)
    assert sorted(p.name for p in tmp_path.iterdir()) == files  # nothing rewritten or added
    compare(mine, theirs)


def test_tokenloom_cache_is_a_hit_for_megatron(synthetic, tmp_path):
    per_split = [((synthetic["small"], synthetic["tiny"]), (2.0, 1.0)), ((synthetic["medium"],), None), None]
    builder = cache_builder(None, None, tmp_path, per_split=per_split)
    mine = builder.build([200, 20, None])
    assert builder.builds == 4 and builder.hits == 0
    blend_per_split = [
        ([synthetic["small"], synthetic["tiny"]], [2.0, 1.0]),
        ([synthetic["medium"]], None),
        None,
    ]
    theirs = megatron_build(
        [200, 20, None], seq_length=64, blend_per_split=blend_per_split, path_to_cache=str(tmp_path)
    )
    compare(mine, theirs)
    for ds in all_megatron_datasets(theirs):  # loaded from our files, not rebuilt
        split = ds.split if isinstance(ds, mblended.BlendedDataset) else ds.index_split
        base = f"{ds.unique_description_hash}-{type(ds).__name__}-{split.name}"
        assert (tmp_path / f"{base}-description.txt").read_text() == ds.unique_description
        assert cache_key(ds.unique_description) == ds.unique_description_hash
        array = ds.dataset_index if isinstance(ds, mblended.BlendedDataset) else ds.sample_index
        assert isinstance(array, np.memmap)


def test_default_cache_location_next_to_the_prefix(synthetic, tmp_path):
    import shutil

    prefix = str(tmp_path / "copy")
    for ext in (".bin", ".idx"):
        shutil.copy(synthetic["tiny"] + ext, prefix + ext)
    builder = cache_builder([prefix], None, None, split="80,10,10", seq_length=16)
    mine = builder.build([50, 5, 5])
    assert len(list((tmp_path / "copy" / "cache" / "GPTDataset_indices").iterdir())) == 3 * 4
    theirs = megatron_build(
        [50, 5, 5], seq_length=16, split="80,10,10", blend=([prefix], None), path_to_cache=None
    )
    compare(mine, theirs)
    assert all(isinstance(ds.sample_index, np.memmap) for ds in theirs)


def test_mock_cache_shared(tmp_path):
    gpt = gpt_config(128, None)
    source = MockSource(DummyTokenizer.vocab_size, 0)
    builder = MegatronCacheBuilder(
        BlendConfig(gpt=gpt),
        DummyTokenizer.unique_identifiers,
        tmp_path,
        open_source=lambda _: source,
        mock=True,
    )
    mine = build_mock_datasets(gpt, [20, 4, 4], source, builder=builder)
    theirs = megatron_build([20, 4, 4], seq_length=128, mock=True, path_to_cache=str(tmp_path))
    compare(mine, theirs)
    assert all(isinstance(ds.sample_index, np.memmap) for ds in theirs)


# -- the helpers against megatron's compiled ones -----------------------------------------

HELPER_SETTINGS = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@HELPER_SETTINGS
@given(
    lengths=st.lists(st.integers(0, 60), min_size=1, max_size=30),
    epochs=st.integers(1, 3),
    seq_length=st.integers(2, 80),
    drop_last=st.booleans(),
    extra=st.integers(0, 1),
    seed=st.integers(0, 1000),
)
def test_sample_idx_matches_megatron(lengths, epochs, seq_length, drop_last, extra, seed):
    sizes = np.array(lengths, np.int32)
    doc_idx = np.tile(np.arange(len(sizes), dtype=np.int32), epochs)
    np.random.RandomState(seed).shuffle(doc_idx)
    tokens = int(sizes.sum())
    if epochs * tokens - extra < 0:
        return
    args = (sizes, doc_idx, seq_length, epochs, tokens, drop_last, extra)
    for name in ("build_sample_idx_int32", "build_sample_idx_int64"):
        expected = getattr(mhelpers, name)(*args)
        assert_same_array(getattr(_native, name)(*args), expected, f"native {name}")
        assert_same_array(getattr(reference, name)(*args), expected, f"numpy {name}")


def test_sample_idx_matches_megatron_past_2_31_tokens_and_float32_ceil():
    sizes = np.array([2**30 - 7, 2**30 + 11, 5, 2**31 - 1, 999_999_937], np.int32)
    doc_idx = np.array([3, 1, 0, 4, 2, 2, 4, 0, 1, 3], np.int32)
    tokens = int(sizes.astype(np.int64).sum())
    for args in [
        (sizes, doc_idx, 2**27 + 3, 2, tokens, True, 1),
        (sizes, doc_idx, 2**27 + 3, 2, tokens, False, 1),
        (sizes, doc_idx, 4095, 2, tokens, False, 0),  # float32 ceil far past 2^24
        (np.array([2**25 + 3], np.int32), np.array([0], np.int32), 4096, 1, 2**25 + 3, False, 1),
    ]:
        for name in ("build_sample_idx_int32", "build_sample_idx_int64"):
            expected = getattr(mhelpers, name)(*args)
            assert_same_array(getattr(_native, name)(*args), expected, f"native {name}")
            assert_same_array(getattr(reference, name)(*args), expected, f"numpy {name}")


@HELPER_SETTINGS
@given(
    raw=st.lists(st.one_of(st.floats(1e-3, 1.0), st.sampled_from([0.001, 0.999])), min_size=1, max_size=6),
    size=st.integers(0, 3000),
)
def test_blending_indices_match_megatron(raw, size):
    weights = np.array(raw) / np.sum(raw)
    results = []
    for impl in (mhelpers, _native, reference):
        index, sample = np.zeros(size, np.int16), np.zeros(size, np.int64)
        impl.build_blending_indices(index, sample, weights, len(weights), size, False)
        results.append((index, sample))
    for index, sample in results[1:]:
        assert_same_array(index, results[0][0], "dataset_index")
        assert_same_array(sample, results[0][1], "dataset_sample_index")


@HELPER_SETTINGS
@given(st.lists(st.integers(1, 400), min_size=1, max_size=6))
def test_exhaustive_blending_indices_match_megatron(sizes):
    s = np.array(sizes, np.int64)
    results = []
    for impl in (mhelpers, _native, reference):
        index, sample = np.zeros(int(s.sum()), np.int16), np.zeros(int(s.sum()), np.int64)
        impl.build_exhaustive_blending_indices(index, sample, s, len(s))
        results.append((index, sample))
    for index, sample in results[1:]:
        assert_same_array(index, results[0][0], "dataset_index")
        assert_same_array(sample, results[0][1], "dataset_sample_index")
