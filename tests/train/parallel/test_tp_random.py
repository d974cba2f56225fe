"""RNG tracker: dropout masks differ across tp ranks inside ``fork()``, agree outside,
agree across dp ranks, and replay on rerun and under activation recompute."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
import torch.utils.checkpoint
from tp_helpers import run_ranks

from tokenloom.errors import TokenloomError
from tokenloom.train.parallel.mappings import all_gather_first_dim
from tokenloom.train.parallel.random import (
    MODEL_PARALLEL_RNG,
    RNGStatesTracker,
    checkpoint,
    model_parallel_manual_seed,
)
from tokenloom.train.parallel.state import ParallelState

N = 256


def _masks(tracker: RNGStatesTracker) -> torch.Tensor:
    """[3, N] dropout masks: default stream, model-parallel stream, default stream again."""
    ones = torch.ones(N)
    outside = F.dropout(ones, 0.5)
    with tracker.fork():
        inside = F.dropout(ones, 0.5)
    after = F.dropout(ones, 0.5)
    return torch.stack([outside, inside, after]) > 0


def _random_worker(rank: int, world: int) -> None:
    state = ParallelState.create(tp=2)  # world 4: tp 2 x dp 2
    tracker = RNGStatesTracker("cpu")
    first = []
    for _ in range(2):
        model_parallel_manual_seed(1234, state.tp_rank, tracker)
        first.append(_masks(tracker))
    assert torch.equal(first[0], first[1]), "rerun with the same seed gives the same masks"
    masks = all_gather_first_dim(first[0].to(torch.uint8).unsqueeze(0), dist.group.WORLD).bool()
    for other in range(world):
        same_tp_rank = state.layout.coords(other)[0] == state.tp_rank
        assert torch.equal(masks[other, 0], masks[rank, 0]), "default stream agrees across all ranks"
        assert torch.equal(masks[other, 2], masks[rank, 2])
        assert torch.equal(masks[other, 1], masks[rank, 1]) == same_tp_rank, (
            f"model-parallel stream of ranks {rank} and {other}: equal iff same tp rank"
        )


@pytest.mark.slow
def test_dropout_masks_across_tp_and_dp_ranks(tmp_path):
    run_ranks(_random_worker, 4, tmp_path)


def test_fork_leaves_default_stream_untouched():
    tracker = model_parallel_manual_seed(7, tp_rank=0, tracker=RNGStatesTracker())
    with_fork = _masks(tracker)
    torch.manual_seed(7)
    plain = torch.stack([F.dropout(torch.ones(N), 0.5) for _ in range(2)]) > 0
    assert torch.equal(with_fork[[0, 2]], plain)
    with tracker.fork():  # the stream advances: a second fork draws a new mask
        again = F.dropout(torch.ones(N), 0.5) > 0
    assert not torch.equal(again, with_fork[1])


def test_states_roundtrip_and_errors():
    tracker = model_parallel_manual_seed(3, tp_rank=1, tracker=RNGStatesTracker())
    saved = tracker.get_states()
    with tracker.fork(MODEL_PARALLEL_RNG):
        a = torch.rand(8)
    tracker.set_states(saved)
    with tracker.fork(MODEL_PARALLEL_RNG):
        b = torch.rand(8)
    assert torch.equal(a, b)
    with pytest.raises(TokenloomError, match="already"):
        tracker.add("other", 3 + 2718 + 1)
    with pytest.raises(TokenloomError, match="not set up"):
        with tracker.fork("missing"):
            pass


def test_checkpoint_replays_tracker_streams():
    tracker = RNGStatesTracker()
    weight = torch.randn(16, 16)

    def block(x: torch.Tensor) -> torch.Tensor:
        h = F.dropout(x @ weight, 0.5)
        with tracker.fork():
            h = F.dropout(h, 0.5)
        return h.tanh()

    def run(mode: str) -> tuple[torch.Tensor, torch.Tensor]:
        model_parallel_manual_seed(11, 0, tracker)
        x = torch.randn(4, 16, requires_grad=True)
        if mode == "ours":
            out = checkpoint(block, x, tracker=tracker)
        elif mode == "torch":
            out = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
        else:
            out = block(x)
        out.sum().backward()
        return out.detach(), x.grad

    plain, ours, torch_only = run("none"), run("ours"), run("torch")
    assert torch.equal(plain[0], ours[0]) and torch.equal(plain[1], ours[1])
    # Without the tracker snapshot the recompute draws a fresh model-parallel mask.
    assert torch.equal(plain[0], torch_only[0]) and not torch.equal(plain[1], torch_only[1])
