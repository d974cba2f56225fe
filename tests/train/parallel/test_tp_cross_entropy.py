"""Vocab-parallel cross entropy equals ``F.cross_entropy`` on the gathered logits."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from tp_helpers import assert_close, det_randn, run_ranks

from tokenloom.train.kernels.cross_entropy import cross_entropy_reference
from tokenloom.train.parallel.tp_cross_entropy import (
    vocab_parallel_cross_entropy,
    vocab_parallel_lm_head_cross_entropy,
)

S, B, H, V = 8, 3, 6, 32


def _targets(seed: int) -> torch.Tensor:
    t = torch.randint(0, V, (S, B), generator=torch.Generator().manual_seed(seed))
    t[1, 0] = t[5, 2] = -100  # ignored tokens
    return t


def _check_logits_path(rank: int, world: int, group) -> None:
    logits = det_randn(S, B, V, seed=1, scale=4.0)
    targets = _targets(2)
    grad_losses = det_randn(S, B, seed=3)
    for eps in (0.0, 0.1):
        ref = logits.clone().requires_grad_(True)
        ref_losses = F.cross_entropy(
            ref.view(-1, V), targets.view(-1), reduction="none", label_smoothing=eps
        ).view(S, B)
        ref_losses.backward(grad_losses)
        local = logits.chunk(world, -1)[rank].clone().requires_grad_(True)
        losses = vocab_parallel_cross_entropy(local, targets, group, label_smoothing=eps)
        assert losses.shape == (S, B) and losses.dtype == torch.float32
        assert_close(losses, ref_losses.detach(), f"eps={eps} losses")
        losses.backward(grad_losses)
        assert_close(local.grad, ref.grad.chunk(world, -1)[rank], f"eps={eps} dlogits")

    # [b, s, v] layout and a bf16 input (computed in fp32, grad returned in bf16).
    local = logits.transpose(0, 1).chunk(world, -1)[rank].bfloat16().requires_grad_(True)
    losses = vocab_parallel_cross_entropy(local, targets.T, group)
    ref = F.cross_entropy(logits.bfloat16().float().view(-1, V), targets.view(-1), reduction="none")
    assert_close(losses, ref.view(S, B).T, "bf16 [b, s, v] losses", atol=1e-5)
    losses.sum().backward()
    assert local.grad.dtype == torch.bfloat16


def _check_fused_path(rank: int, world: int, group) -> None:
    hidden_full = det_randn(S, B, H, seed=11)
    weight_full = det_randn(V, H, seed=12)
    targets = _targets(13)
    mask = (det_randn(S, B, seed=14) > -0.5).float()
    ref_h = hidden_full.clone().requires_grad_(True)
    ref_w = weight_full.clone().requires_grad_(True)
    ref_loss = cross_entropy_reference(ref_h, ref_w, targets, loss_mask=mask)
    ref_loss.backward()
    for sequence_parallel in (False, True):
        what = f"fused sp={sequence_parallel}"
        h = hidden_full.chunk(world, 0)[rank] if sequence_parallel else hidden_full
        h = h.clone().requires_grad_(True)
        w = weight_full.chunk(world, 0)[rank].clone().requires_grad_(True)
        loss = vocab_parallel_lm_head_cross_entropy(
            h, w, targets, group, loss_mask=mask, chunk_size=5, sequence_parallel=sequence_parallel
        )
        assert_close(loss, ref_loss.detach(), what + " loss")
        loss.backward()
        expected_dh = ref_h.grad.chunk(world, 0)[rank] if sequence_parallel else ref_h.grad
        assert_close(h.grad, expected_dh, what + " dhidden")
        assert_close(w.grad, ref_w.grad.chunk(world, 0)[rank], what + " dweight")


def _ce_worker(rank: int, world: int, tp: int) -> None:
    groups = [dist.new_group(list(range(s, s + tp))) for s in range(0, world, tp)]
    group = groups[rank // tp]
    _check_logits_path(dist.get_rank(group), tp, group)
    _check_fused_path(dist.get_rank(group), tp, group)


@pytest.mark.slow
@pytest.mark.parametrize("world,tp", [(2, 2), (4, 4)], ids=["w2tp2", "w4tp4"])
def test_vocab_parallel_cross_entropy_matches_full(tmp_path, world, tp):
    run_ranks(_ce_worker, world, tmp_path, tp)


def test_single_process_equals_torch():
    logits = det_randn(5, V, seed=21, scale=3.0).requires_grad_(True)
    targets = torch.randint(0, V, (5,), generator=torch.Generator().manual_seed(22))
    losses = vocab_parallel_cross_entropy(logits, targets, None, label_smoothing=0.2)
    ref = F.cross_entropy(logits, targets, reduction="none", label_smoothing=0.2)
    assert_close(losses, ref)
    (g,) = torch.autograd.grad(losses.sum(), logits)
    (g_ref,) = torch.autograd.grad(ref.sum(), logits)
    assert_close(g, g_ref)


def test_shape_mismatch_raises():
    with pytest.raises(ValueError, match="leading dims"):
        vocab_parallel_cross_entropy(torch.zeros(2, 3, 8), torch.zeros(3, 2, dtype=torch.long), None)
