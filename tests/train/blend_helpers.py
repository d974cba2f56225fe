"""Helpers shared by the blend-resume and data-schedule tests: small .bin/.idx sources, a tiny
train config on a blend, and the samples a run draws (which source, which position of its order)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tokenloom.blending.segments import SegmentedBlend
from tokenloom.indexed import IndexedDatasetWriter
from tokenloom.train.config import TrainConfig
from tokenloom.train.data import BlendDataConfig, DataConfig
from tokenloom.train.launch import launch
from tokenloom.train.metrics import read_metrics
from tokenloom.train.model.config import GPTConfig
from tokenloom.train.optim.adamw import OptimConfig


def sources(tmp: Path, documents: int) -> dict[str, str]:
    """Three seeded sources a, b, c of ``documents`` documents each (vocabulary 96, EOD 95)."""
    rng = np.random.default_rng(0)
    out = {}
    for name in ("a", "b", "c"):
        with IndexedDatasetWriter(tmp / name, vocab_size=96) as writer:
            for _ in range(documents):
                writer.add_document(rng.integers(0, 95, size=int(rng.integers(20, 120))).tolist() + [95])
        out[name] = str(tmp / name)
    return out


def config(out: Path, blend: list[tuple[float, str]], cache: Path, schedule=None, **kw) -> TrainConfig:
    """A 1-layer model on ``blend`` (with ``schedule``, if any), resuming automatically; ``kw`` overrides."""
    data = DataConfig(blend=BlendDataConfig(prefixes=blend, split="90,9,1", cache_dir=str(cache)), schedule=schedule)
    base = dict(
        model=GPTConfig(vocab_size=96, make_vocab_size_divisible_by=32, seq_len=32, n_layers=1, n_heads=2, d_model=32),
        data=data, optim=OptimConfig(lr=3e-3, min_lr=3e-4, warmup_iters=3), micro_batch_size=2,
        global_batch_size=4, train_iters=20, eval_interval=0, log_interval=1, output_dir=str(out), progress=False,
        plot=False, resume="auto",
    )
    return TrainConfig(**(base | kw))


def drawn_by(cfg: TrainConfig, monkeypatch) -> list[tuple[str, int]]:
    """Train in-process; the (source, position in its order) of every train sample read."""
    seen: list[tuple[str, int]] = []
    locate = SegmentedBlend.locate

    def recording(self, i):
        order, k = locate(self, i)
        seen.append((Path(order.source.path_prefix).name, k))
        return order, k

    with monkeypatch.context() as m:
        m.setattr(SegmentedBlend, "locate", recording)
        launch(cfg)
    return seen


def train_losses(out: Path) -> list[tuple[int, float]]:
    return [(r["iter"], r["train_loss"]) for r in read_metrics(out / "metrics.jsonl") if "train_loss" in r]
