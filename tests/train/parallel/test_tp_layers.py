"""TP layers equal the full one-process layer built from the same full weight.

Every rank builds the full ``nn.Linear`` / ``nn.Embedding`` from a seed, shards it with
``from_linear`` / ``from_embedding``, runs the same replicated input (or its sequence
shard), and compares outputs, input gradients and weight-gradient shards with the full
layer's, fp32, to 1e-6. The upstream gradient is replicated (a loss computed once on
the full output), so the reference is plain autograd on the full layer.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from tp_helpers import assert_close, det_randn, run_ranks

from tokenloom.errors import TokenloomError
from tokenloom.train.model.config import GPTConfig
from tokenloom.train.model.gpt import GPT
from tokenloom.train.parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    normal_init,
    shard,
    sync_sequence_parallel_grads,
    unshard,
)

S, B, IN, OUT, VOCAB = 8, 2, 12, 16, 32


def _linear(in_f: int, out_f: int, bias: bool, seed: int) -> nn.Linear:
    torch.manual_seed(seed)
    layer = nn.Linear(in_f, out_f, bias=bias)
    if bias:
        with torch.no_grad():
            layer.bias.normal_()  # nonzero so that bias placement is checked
    return layer


def _reference(layer: Callable[[torch.Tensor], torch.Tensor], inp: torch.Tensor, grad_out: torch.Tensor):
    x = inp.clone().requires_grad_(True)
    out = layer(x)
    out.backward(grad_out)
    return out.detach(), x.grad


def _check_column(rank: int, world: int, group) -> None:
    x_full = det_randn(S, B, IN, seed=1)
    g_full = det_randn(S, B, OUT, seed=2)
    for bias in (True, False):
        for gather_output, sequence_parallel in ((False, False), (True, False), (False, True)):
            what = f"column bias={bias} gather={gather_output} sp={sequence_parallel}"
            full = _linear(IN, OUT, bias, seed=3)
            ref_out, ref_dx = _reference(full, x_full, g_full)
            layer = ColumnParallelLinear.from_linear(
                full, group=group, gather_output=gather_output, sequence_parallel=sequence_parallel
            )
            assert layer.weight.shape == (OUT // world, IN)
            x = (x_full.chunk(world, 0)[rank] if sequence_parallel else x_full).clone().requires_grad_(True)
            out = layer(x)
            if gather_output:
                assert_close(out, ref_out, what + " out")
                out.backward(g_full)
            else:
                assert_close(out, ref_out.chunk(world, -1)[rank], what + " out")
                out.backward(g_full.chunk(world, -1)[rank])
            expected_dx = ref_dx.chunk(world, 0)[rank] if sequence_parallel else ref_dx
            assert_close(x.grad, expected_dx, what + " dx")
            assert_close(layer.weight.grad, full.weight.grad.chunk(world, 0)[rank], what + " dW")
            if bias:
                assert_close(layer.bias.grad, full.bias.grad.chunk(world, 0)[rank], what + " db")
            state = layer.full_state_dict()
            assert_close(state["weight"], full.weight.detach(), what + " full_state_dict")

    # skip_bias_add returns the (sharded) bias for a later fused add.
    full = _linear(IN, OUT, True, seed=4)
    out, bias = ColumnParallelLinear.from_linear(full, group=group, skip_bias_add=True)(x_full)
    assert_close(out + bias, full(x_full).detach().chunk(world, -1)[rank], "column skip_bias_add")


def _check_row(rank: int, world: int, group) -> None:
    x_full = det_randn(S, B, OUT, seed=11)
    g_full = det_randn(S, B, IN, seed=12)
    for bias in (True, False):
        for input_is_parallel, sequence_parallel in ((False, False), (True, False), (True, True)):
            what = f"row bias={bias} parallel_in={input_is_parallel} sp={sequence_parallel}"
            full = _linear(OUT, IN, bias, seed=13)
            ref_out, ref_dx = _reference(full, x_full, g_full)
            layer = RowParallelLinear.from_linear(
                full, group=group, input_is_parallel=input_is_parallel, sequence_parallel=sequence_parallel
            )
            assert layer.weight.shape == (IN, OUT // world)
            x = x_full.chunk(world, -1)[rank] if input_is_parallel else x_full
            x = x.clone().requires_grad_(True)
            out = layer(x)
            if sequence_parallel:
                assert_close(out, ref_out.chunk(world, 0)[rank], what + " out")
                out.backward(g_full.chunk(world, 0)[rank])
            else:
                assert_close(out, ref_out, what + " out")
                out.backward(g_full)
            expected_dx = ref_dx.chunk(world, -1)[rank] if input_is_parallel else ref_dx
            assert_close(x.grad, expected_dx, what + " dx")
            assert_close(layer.weight.grad, full.weight.grad.chunk(world, 1)[rank], what + " dW")
            if bias:
                assert layer.bias.sequence_parallel == sequence_parallel
                sync_sequence_parallel_grads(layer, group)  # no-op unless sequence parallel
                assert_close(layer.bias.grad, full.bias.grad, what + " db")
            assert_close(layer.full_state_dict()["weight"], full.weight.detach(), what + " full_state_dict")

    full = _linear(OUT, IN, True, seed=14)
    out, bias = RowParallelLinear.from_linear(full, group=group, skip_bias_add=True)(x_full)
    assert_close(out + bias, full(x_full).detach(), "row skip_bias_add")


def _check_embedding(rank: int, world: int, group) -> None:
    ids = torch.randint(0, VOCAB, (B, S), generator=torch.Generator().manual_seed(21))
    torch.manual_seed(22)
    full = nn.Embedding(VOCAB, IN)
    ref = full(ids)
    g_full = det_randn(B, S, IN, seed=23)
    ref.backward(g_full)
    for sequence_parallel in (False, True):
        what = f"embedding sp={sequence_parallel}"
        layer = VocabParallelEmbedding.from_embedding(full, group=group, sequence_parallel=sequence_parallel)
        assert layer.weight.shape == (VOCAB // world, IN)
        out = layer(ids)
        if sequence_parallel:  # [s/tp, b, h]
            assert_close(out, ref.detach().transpose(0, 1).chunk(world, 0)[rank], what + " out")
            out.backward(g_full.transpose(0, 1).chunk(world, 0)[rank])
        else:
            assert_close(out, ref.detach(), what + " out")
            out.backward(g_full)
        assert_close(layer.weight.grad, full.weight.grad.chunk(world, 0)[rank], what + " dW")
        assert_close(layer.full_state_dict()["weight"], full.weight.detach(), what + " full_state_dict")


def _check_init_equals_one_process(rank: int, world: int, group) -> None:
    """Seeded master init then split: gathered shards equal the one-process draw."""

    def init():
        return normal_init(0.02, torch.Generator().manual_seed(5))

    layers = [
        ColumnParallelLinear(IN, OUT, group=group, init_method=init()),
        RowParallelLinear(OUT, IN, group=group, init_method=init()),
        VocabParallelEmbedding(VOCAB, IN, group=group, init_method=init()),
    ]
    for layer, shape in zip(layers, [(OUT, IN), (IN, OUT), (VOCAB, IN)], strict=True):
        expected = torch.empty(shape).normal_(0.0, 0.02, generator=torch.Generator().manual_seed(5))
        assert torch.equal(layer.full_state_dict()["weight"], expected), type(layer).__name__
    # Default: global RNG, the same on every rank when seeded alike; biases start at zero.
    torch.manual_seed(7)
    layer = ColumnParallelLinear(IN, OUT, group=group)
    torch.manual_seed(7)
    expected = torch.empty(OUT, IN).normal_(0.0, 0.02)
    assert torch.equal(layer.full_state_dict()["weight"], expected)
    assert not layer.bias.any()


def _check_swiglu_mlp(rank: int, world: int, group) -> None:
    """The one-process llama MLP (fused [gate, up] fc) equals Column(split_sizes) -> Row."""
    cfg = GPTConfig(
        arch="llama", vocab_size=32, seq_len=S, n_layers=1, n_heads=2, d_model=IN, ffn_hidden_size=8
    )
    mlp = GPT(cfg).blocks["0"].mlp
    x_full = det_randn(S, B, IN, seed=32)
    g_full = det_randn(S, B, IN, seed=33)
    ref_out, ref_dx = _reference(lambda x: mlp(x)[0], x_full, g_full)
    inner = cfg.ffn_size
    fc = ColumnParallelLinear.from_linear(mlp.fc, group=group, split_sizes=[inner, inner])
    proj = RowParallelLinear.from_linear(mlp.proj, group=group, input_is_parallel=True)
    x = x_full.clone().requires_grad_(True)
    gate, up = fc(x).chunk(2, dim=-1)
    out = proj(F.silu(gate) * up)
    assert_close(out, ref_out, "swiglu out")
    out.backward(g_full)
    assert_close(x.grad, ref_dx, "swiglu dx")
    assert_close(fc.weight.grad, shard(mlp.fc.weight.grad, 0, rank, world, [inner, inner]), "swiglu fc dW")
    assert_close(fc.full_state_dict()["weight"], mlp.fc.weight.detach(), "swiglu fc full_state_dict")


def _layers_worker(rank: int, world: int, tp: int) -> None:
    groups = [dist.new_group(list(range(s, s + tp))) for s in range(0, world, tp)]
    group = groups[rank // tp]
    tp_rank = dist.get_rank(group)
    _check_column(tp_rank, tp, group)
    _check_row(tp_rank, tp, group)
    _check_embedding(tp_rank, tp, group)
    _check_init_equals_one_process(tp_rank, tp, group)
    _check_swiglu_mlp(tp_rank, tp, group)


@pytest.mark.slow
@pytest.mark.parametrize("world,tp", [(2, 2), (4, 4), (4, 2)], ids=["w2tp2", "w4tp4", "w4tp2"])
def test_layers_match_full_layer(tmp_path, world, tp):
    run_ranks(_layers_worker, world, tmp_path, tp)


def test_shard_unshard_roundtrip_with_blocks():
    full = torch.arange(24.0).view(12, 2)
    shards = [shard(full, 0, r, 2, [8, 2, 2]) for r in range(2)]
    assert shards[0][:, 0].tolist() == [0, 2, 4, 6, 16, 20]  # q rows 0-3, k row 0, v row 0
    assert torch.equal(unshard(shards, 0, [8, 2, 2]), full)
    assert torch.equal(unshard([shard(full, 1, r, 2) for r in range(2)], 1), full)


def test_single_process_layers_equal_torch_layers():
    full = _linear(IN, OUT, True, seed=41)
    x = det_randn(3, IN, seed=42)
    assert_close(ColumnParallelLinear.from_linear(full, group=None)(x), full(x))
    assert_close(RowParallelLinear.from_linear(full, group=None)(x), full(x))
    emb = nn.Embedding(VOCAB, IN)
    ids = torch.tensor([[0, 5, 31]])
    assert_close(VocabParallelEmbedding.from_embedding(emb, group=None)(ids), emb(ids))


def test_bad_options_raise():
    with pytest.raises(TokenloomError, match="gather_output"):
        ColumnParallelLinear(IN, OUT, group=None, gather_output=True, sequence_parallel=True)
    with pytest.raises(TokenloomError, match="input_is_parallel"):
        RowParallelLinear(IN, OUT, group=None, sequence_parallel=True)
    with pytest.raises(TokenloomError, match="add up"):
        ColumnParallelLinear(IN, OUT, group=None, split_sizes=[8, 4])
