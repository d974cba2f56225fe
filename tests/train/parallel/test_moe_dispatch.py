"""The two expert-parallel token dispatchers (``model.moe_token_dispatcher_type``) on one MoE layer
against the layer in one process: every rank's output and input gradient, the router's gradient
summed over the ranks, and each rank's expert gradients equal the one-process ones, with biases
(GPT-2) and SwiGLU (Llama), the grouped GEMM and the loop over experts, at ep 2 (two experts per
rank, top-2) and ep 4 (one expert per rank, fewer than top-k: the allgather buffer is smaller
than every (token, expert) pair); the allgather path calls no all-to-all. Two launches (2 and 4 gloo ranks), so ``slow``."""

from __future__ import annotations

import contextlib
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from tp_helpers import run_ranks

from tokenloom.train.model.blocks import MoE
from tokenloom.train.model.config import GPTConfig
from tokenloom.train.parallel.layers import TensorParallel

pytestmark = pytest.mark.slow
TOKENS, D, E = 6, 16, 4


def _layer(arch: str, grouped: bool, dispatcher: str) -> MoE:
    cfg = GPTConfig(arch=arch, vocab_size=64, seq_len=8, n_layers=1, n_heads=2, d_model=D, moe_ffn_hidden_size=32,
                    num_experts=E, moe_router_topk=2, moe_grouped_gemm=grouped, moe_token_dispatcher_type=dispatcher)
    moe = MoE(cfg, TensorParallel())
    moe.to_empty(device="cpu")
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return moe


def _close(got: torch.Tensor, expected: torch.Tensor, what: tuple) -> None:
    assert got.shape == expected.shape and (got - expected).abs().max().item() < 1e-5, what


def _check_dispatchers(rank: int, world: int) -> None:
    gen = torch.Generator().manual_seed(1)
    xs, ws = torch.randn(world, 2, TOKENS, D, generator=gen), torch.randn(world, 2, TOKENS, D, generator=gen)
    for arch in ("gpt2", "llama"):
        for grouped in (True, False):
            ref = _layer(arch, grouped, "alltoall")
            x_ref = xs.clone().requires_grad_()
            y_ref = ref(x_ref.view(-1, TOKENS, D))[0].view_as(xs)
            (y_ref * ws).sum().backward()
            for dispatcher in ("alltoall", "allgather"):
                moe = _layer(arch, grouped, dispatcher)
                moe.expert_parallel(dist.group.WORLD, world, rank)
                x = xs[rank].clone().requires_grad_()
                # the allgather path exchanges no split sizes and no rows by all-to-all
                refused = mock.patch.object(dist, "all_to_all_single", side_effect=AssertionError("all-to-all"))
                with refused if dispatcher == "allgather" else contextlib.nullcontext():
                    y = moe(x)[0]
                    (y * ws[rank]).sum().backward()
                what = (arch, grouped, dispatcher)
                _close(y, y_ref[rank], what)
                _close(x.grad, x_ref.grad[rank], what)
                router = moe.router.weight.grad.clone()
                dist.all_reduce(router)
                _close(router, ref.router.weight.grad, what)
                first, local = moe.experts.first, E // world
                for name, p in moe.experts.named_parameters():
                    _close(p.grad, getattr(ref.experts, name).grad[first:first + local], (*what, name))


@pytest.mark.parametrize("world", [2, 4])
def test_dispatchers_equal_one_process(tmp_path, world):
    run_ranks(_check_dispatchers, world, tmp_path)
