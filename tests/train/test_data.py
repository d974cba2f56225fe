"""TrainData: the data's part of a checkpoint round-trips (state_dict -> load_state_dict), and
a resume on other data is refused (or forced) as the loop's resume suites expect."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tokenloom.errors import TokenloomError
from tokenloom.indexed import IndexedDatasetWriter
from tokenloom.train.config import TrainConfig
from tokenloom.train.data import BlendDataConfig, DataConfig, MockDataConfig, TrainData
from tokenloom.train.loop import run
from tokenloom.train.metrics import read_metrics
from tokenloom.train.model.config import GPTConfig
from tokenloom.train.optim.adamw import OptimConfig

SIZES = (40, 0, 0)


def mock_data(seed: int = 0) -> TrainData:
    cfg = DataConfig(mock=MockDataConfig(num_sequences=200, max_length=100, seed=seed))
    return TrainData(cfg, seq_len=16, vocab_size=64, sizes=SIZES)


@pytest.fixture
def blend_sources(tmp_path) -> tuple[str, str]:
    rng = np.random.default_rng(0)
    for name in ("a", "b"):
        with IndexedDatasetWriter(tmp_path / name, vocab_size=96) as writer:
            for _ in range(80):
                writer.add_document(rng.integers(0, 95, size=int(rng.integers(20, 120))).tolist() + [95])
    return str(tmp_path / "a"), str(tmp_path / "b")


def blend_data(prefixes: list[tuple[float, str]], cache: Path) -> TrainData:
    cfg = DataConfig(blend=BlendDataConfig(prefixes=prefixes, split="90,9,1", cache_dir=str(cache)))
    return TrainData(cfg, seq_len=32, vocab_size=96, sizes=SIZES)


def saved(data: TrainData) -> dict:
    """``data``'s state as a checkpoint's state.json gives it back."""
    return json.loads(json.dumps(data.state_dict()))


def test_mock_round_trip():
    data = mock_data()
    data.consumed = 8
    state = saved(data)
    assert set(state) == {"consumed_samples", "data_fingerprint", "data_description"}
    assert state["consumed_samples"] == 8
    resumed = mock_data()
    assert resumed.consumed == 0
    assert resumed.load_state_dict(state) == []
    assert resumed.consumed == 8 and resumed.state_dict() == state


def test_mock_on_other_data_is_refused_unless_forced():
    data = mock_data()
    data.consumed = 8
    other = mock_data(seed=1)
    with pytest.raises(TokenloomError, match="trained on different data"):
        other.load_state_dict(saved(data))
    assert other.consumed == 0
    assert other.load_state_dict(saved(data), force=True) == []
    assert other.consumed == 8


def test_blend_round_trip_keeps_the_history(blend_sources, tmp_path):
    a, b = blend_sources
    data = blend_data([(0.5, a), (0.5, b)], tmp_path / "cache")
    data.consumed = 8
    state = saved(data)
    assert len(state["data_history"]["segments"]) == 1
    assert sum(s["samples"] for s in state["data_consumed"]) == 8
    resumed = blend_data([(0.5, a), (0.5, b)], tmp_path / "cache")
    assert resumed.load_state_dict(state, where="ckpt") == []
    assert resumed.consumed == 8 and resumed.state_dict() == state


def test_blend_with_new_weights_continues_the_history(blend_sources, tmp_path):
    a, b = blend_sources
    data = blend_data([(0.5, a), (0.5, b)], tmp_path / "cache")
    data.consumed = 8
    resumed = blend_data([(0.2, a), (0.8, b)], tmp_path / "cache")
    notes = resumed.load_state_dict(saved(data), where="ckpt")
    assert any(n.startswith("the blend changed at sample 8 (segment 2)") for n in notes)
    segments = resumed.state_dict()["data_history"]["segments"]
    assert len(segments) == 2 and resumed.state_dict()["consumed_samples"] == 8
    # the first 8 samples are the saved run's, in its order
    assert all(np.array_equal(resumed.train[i], data.train[i]) for i in range(8))


def test_a_longer_run_on_the_same_blend_says_nothing_of_a_changed_blend(blend_sources, tmp_path):
    """A longer train_iters draws a new segment (its blend is built for more samples) but the
    blend did not change: no note says it did (issue 40)."""
    a, b = blend_sources
    data = blend_data([(0.5, a), (0.5, b)], tmp_path / "cache")
    data.consumed = 8
    cfg = DataConfig(blend=BlendDataConfig(prefixes=[(0.5, a), (0.5, b)], split="90,9,1",
                                           cache_dir=str(tmp_path / "cache")))
    longer = TrainData(cfg, seq_len=32, vocab_size=96, sizes=(60, 0, 0))
    assert longer.load_state_dict(saved(data), where="ckpt") == []
    assert len(longer.state_dict()["data_history"]["segments"]) == 2
    assert all(np.array_equal(longer.train[i], data.train[i]) for i in range(8))


def test_blend_saved_without_history_on_other_data_is_refused(blend_sources, tmp_path):
    a, b = blend_sources
    data = blend_data([(0.5, a), (0.5, b)], tmp_path / "cache")
    state = saved(data)
    del state["data_history"]
    other = blend_data([(0.2, a), (0.8, b)], tmp_path / "cache")
    with pytest.raises(TokenloomError, match="ckpt was trained on other data and saved before blends could change"):
        other.load_state_dict(state, where="ckpt")
    assert other.load_state_dict(state, where="ckpt", force=True) == []


def test_best_fit_resume_mid_epoch_continues_exactly(tmp_path, blend_sources):
    """A best-fit blend run of 6 steps equals 3 steps, a checkpoint (mid-epoch), ``resume="auto"``
    and 3 more, loss for loss; a resume that switches the packing is refused by name."""
    a, b = blend_sources

    def cfg(out: Path, packing: str = "best-fit", **kw) -> TrainConfig:
        data = DataConfig(blend=BlendDataConfig(prefixes=[(0.4, a), (0.6, b)], split="90,9,1",
                                                cache_dir=str(tmp_path / "cache")), packing=packing)
        base = dict(model=GPTConfig(vocab_size=96, make_vocab_size_divisible_by=32, seq_len=32, n_layers=1,
                                    n_heads=2, d_model=32),
                    data=data, optim=OptimConfig(lr=3e-3, min_lr=3e-4, warmup_iters=2), micro_batch_size=2,
                    global_batch_size=4, train_iters=6, eval_interval=3, eval_iters=1, log_interval=1,
                    output_dir=str(out), progress=False, plot=False)
        return TrainConfig(**(base | kw))

    def losses(out: Path, key: str = "train_loss") -> list[tuple[int, float]]:
        return [(r["iter"], r[key]) for r in read_metrics(out / "metrics.jsonl") if key in r]

    run(cfg(tmp_path / "straight"))
    run(cfg(tmp_path / "split", exit_interval=3, resume="auto"))
    assert [i for i, _ in losses(tmp_path / "split")] == [1, 2, 3]
    run(cfg(tmp_path / "split", resume="auto"))
    assert losses(tmp_path / "split") == losses(tmp_path / "straight")  # exact, all 6 steps
    assert losses(tmp_path / "split", "val_loss") == losses(tmp_path / "straight", "val_loss")
    built = TrainData(cfg(tmp_path / "x").data, seq_len=32, vocab_size=96, sizes=(32, 4, 0))
    member = built.train.blends[0].datasets[0]
    assert member.indices.packed and len(member.indices) > 3 * 4  # the checkpoint falls inside epoch 1
    built.consumed = 16
    concat = TrainData(cfg(tmp_path / "x", packing="concat").data, seq_len=32, vocab_size=96, sizes=(32, 4, 0))
    with pytest.raises(TokenloomError, match="data.packing 'best-fit' -> 'concat'"):
        concat.load_state_dict(saved(built))
    with pytest.raises(TokenloomError, match="data.packing 'concat' -> 'best-fit'"):
        built.load_state_dict(saved(concat))


def test_a_saved_concat_config_masks_documents_once_switched_to_best_fit(tmp_path):
    """inter_document_masking's default (None) follows packing where it is used, so a config saved
    from a concat run keeps None, and ``--set data.packing=best-fit`` on it masks documents; an
    explicit value is kept either way."""
    from tokenloom.train.config import config_to_dict, load_config

    cfg = TrainConfig(model=GPTConfig(vocab_size=64, seq_len=16, n_layers=1, n_heads=2, d_model=16),
                      data=DataConfig(mock=MockDataConfig()), optim=OptimConfig(), output_dir=str(tmp_path))
    assert not cfg.data.masks_documents
    saved = tmp_path / "config.json"
    saved.write_text(json.dumps(config_to_dict(cfg)))
    assert json.loads(saved.read_text())["data"]["inter_document_masking"] is None
    assert load_config(saved, ["data.packing=best-fit"]).data.masks_documents
    assert not load_config(saved, ["data.packing=best-fit", "data.inter_document_masking=false"]).data.masks_documents
    assert load_config(saved, ["data.inter_document_masking=true"]).data.masks_documents
