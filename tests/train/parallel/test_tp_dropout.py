"""Dropout at tp = 2 through the tensor-parallel RNG tracker (issue 15, acceptance 2), and
exact resume of a dropout run (the tracker's stream is in the checkpoint), and activation
recompute that replays the stream.

Masks are read as the ``bernoulli_`` draws of one training forward of the tiny GPT (4
layers), in call order: per layer one attention-probability mask ``[b, heads/tp, s, s]``
(a tensor-parallel region: heads are split) between the embedding / residual masks
``[b, s, h]`` (replicated activations, or ``[s/tp, b, h]`` slices under sequence
parallelism). One 2-rank launch, so ``slow``."""

from __future__ import annotations

import pytest
import torch
from compose_helpers import launch, logged_losses

pytestmark = pytest.mark.slow
STEPS, HALF = 6, 3


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tp_dropout")
    ckpt = tmp / "ckpt"
    common = dict(tp=2, dropout=0.1, train_iters=STEPS, eval_interval=STEPS)
    scenarios = [
        ("dropout_masks", dict(out=str(tmp / "masks"))),
        ("dropout_masks", dict(out=str(tmp / "masks_sp"), sp=True)),
        ("train", dict(out=str(tmp / "full"), **common)),
        ("train", dict(out=str(tmp / "save"), exit_interval=HALF, checkpoint_dir=str(ckpt), **common)),
        ("train", dict(out=str(tmp / "resumed"), resume=str(ckpt / f"iter_{HALF:07d}"),
                       checkpoint_dir=str(tmp / "ckpt2"), **common)),
        ("train", dict(out=str(tmp / "recompute"), recompute=True, **common)),
    ]
    results = launch(scenarios, 2, tmp)
    names = ["masks", "masks_sp", "full", "save", "resumed", "recompute"]
    return {name: [r[i] for r in results] for i, name in enumerate(names)}


@pytest.mark.parametrize("name", ["masks", "masks_sp"])
def test_masks_differ_inside_tp_regions_agree_outside_and_repeat(runs, name):
    (first0, again0), (first1, _) = runs[name]
    assert len(first0) == 1 + 4 * 3  # embedding, then per layer: attention, two residuals
    for a, b in zip(first0, again0, strict=True):
        assert torch.equal(a, b)  # a rerun repeats every mask
    attention = [i for i, m in enumerate(first0) if m.dim() == 4]
    assert attention == [1, 4, 7, 10]
    for i, (m0, m1) in enumerate(zip(first0, first1, strict=True)):
        assert m0.shape == m1.shape
        inside = i in attention or name == "masks_sp"  # under sp every activation is a per-rank slice
        assert torch.equal(m0, m1) != inside, f"mask {i} of {name}"


def test_dropout_run_resumes_exactly(runs):
    full = logged_losses(runs["full"])
    assert len(full) == STEPS
    assert logged_losses(runs["save"]) == full[:HALF]
    assert logged_losses(runs["resumed"]) == full[HALF:]  # the same masks after the restart


def test_recompute_replays_the_tp_dropout_stream(runs):
    """Activation recompute of every block redraws the same masks in backward (tracker
    states replayed), so the run is the run without recompute."""
    assert logged_losses(runs["recompute"]) == logged_losses(runs["full"])
