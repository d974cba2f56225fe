"""Mixture-of-experts layer (tokenloom.train.model.moe and model.MoE), issue 43 acceptance 1: with
k = E and a uniform router the layer is a dense MLP of the experts' stacked weights scaled by the
routing probabilities, and the auxiliary losses equal their closed forms on hand-built routings."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from tokenloom.errors import TokenloomError
from tokenloom.train.model.blocks import MLP, MoE
from tokenloom.train.model.config import GPTConfig
from tokenloom.train.model.gpt import GPT
from tokenloom.train.model.moe import (
    AttachAuxLoss,
    grouped_mm,
    grouped_mm_usable,
    load_balancing_loss,
    permute,
    route,
    unpermute,
    z_loss,
)
from tokenloom.train.parallel.layers import TensorParallel


def config(**kw) -> GPTConfig:
    base = dict(vocab_size=64, seq_len=8, n_layers=2, n_heads=2, d_model=16, ffn_hidden_size=32, num_experts=4,
                moe_router_topk=2)
    return GPTConfig(**{**base, **kw})


def built(module: nn.Module, seed: int = 0) -> nn.Module:
    """``module`` (made on meta) with random values, biases included."""
    module.to_empty(device="cpu")
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return module


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
@pytest.mark.parametrize("grouped", [True, False])
def test_all_experts_with_uniform_router_is_the_scaled_dense_mlp(arch, grouped):
    E = 4
    cfg = config(arch=arch, moe_router_topk=E, moe_grouped_gemm=grouped)
    moe = built(MoE(cfg, TensorParallel()))
    with torch.no_grad():
        moe.router.weight.zero_()  # uniform routing: every gate is 1 / E
    dense = built(MLP(GPTConfig(**{**vars(cfg), "num_experts": None, "ffn_hidden_size": E * 32}),
                      TensorParallel()))
    ex, inner = moe.experts, 32
    with torch.no_grad():
        if arch == "llama":  # [gate of every expert; up of every expert]
            fc = [ex.fc[e, :, :inner].T for e in range(E)] + [ex.fc[e, :, inner:].T for e in range(E)]
        else:
            fc = [ex.fc[e].T for e in range(E)]
        dense.fc.weight.copy_(torch.cat(fc))
        dense.proj.weight.copy_(torch.cat([ex.proj[e].T for e in range(E)], dim=1) / E)
        if arch == "gpt2":
            dense.fc.bias.copy_(ex.fc_bias.reshape(-1))
            dense.proj.bias.copy_(ex.proj_bias.mean(0))
    x = torch.randn(3, 5, 16)
    got, expected = moe(x)[0], dense(x)[0]
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_router_top_k_softmax_and_no_token_dropped():
    logits_in = torch.tensor([[0.0, 3.0, 1.0, 2.0], [5.0, 0.0, 0.0, 4.0]])
    logits, chosen, gates = route(logits_in, torch.eye(4), 2)  # weight eye: logits = x
    assert chosen.tolist() == [[1, 3], [0, 3]]
    torch.testing.assert_close(gates, torch.tensor([[3.0, 2.0], [5.0, 4.0]]).softmax(-1))
    assert logits.dtype == torch.float32
    x = torch.arange(6.0).view(3, 2)
    experts = torch.tensor([[2, 0], [2, 1], [0, 2]])
    rows, order, expert_of_row, counts = permute(x, experts, 3)
    assert counts.tolist() == [2, 1, 3] and expert_of_row.tolist() == [0, 0, 1, 2, 2, 2]
    assert rows[:, 0].tolist() == [0.0, 4.0, 2.0, 0.0, 2.0, 4.0]  # each expert's tokens in token order
    back = unpermute(rows, order, torch.full((3, 2), 0.5), 3)
    torch.testing.assert_close(back, x)  # each token: two copies at gate 1/2


def test_grouped_gemm_equals_loop_over_experts():
    gen = torch.Generator().manual_seed(1)
    x, w = torch.randn(10, 16, generator=gen), torch.randn(3, 16, 8, generator=gen)
    counts = torch.tensor([4, 0, 6])
    expected = torch.cat([x[:4] @ w[0], x[4:] @ w[2]])
    torch.testing.assert_close(grouped_mm(x, w, counts, True), expected)
    torch.testing.assert_close(grouped_mm(x, w, counts, False), expected)


@pytest.mark.gpu
@pytest.mark.parametrize("compiled", [False, True])
def test_grouped_gemm_on_cuda_in_bf16_equals_the_loop(compiled):
    """On a Hopper GPU under bf16 autocast the experts run as ``torch._grouped_mm`` (eager and
    compiled); its output and gradients equal the loop over experts' within bf16 rounding,
    with an expert that gets no token."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("needs a Hopper (or newer) CUDA device")
    gen = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(96, 64, device="cuda", generator=gen)
    w = torch.randn(4, 64, 32, device="cuda", generator=gen) / 8
    counts = torch.tensor([40, 0, 24, 32], device="cuda")
    results = []
    for grouped in (True, False):
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
        fn = torch.compile(grouped_mm) if compiled else grouped_mm
        with torch.autocast("cuda", torch.bfloat16):
            assert grouped_mm_usable(xi, wi)
            out = fn(xi, wi, counts, grouped)
        out.float().square().sum().backward()
        results.append((out.float(), xi.grad, wi.grad))
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, atol=0.05, rtol=0.02)


def probs_logits(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor(rows).log()  # softmax(log p) = p for rows summing to one


ROWS = [[0.9, 0.1], [0.8, 0.2], [0.3, 0.7], [0.6, 0.4]]  # top-1: experts 0, 0, 1, 0


def test_load_balancing_loss_closed_form():
    logits = probs_logits(ROWS)
    chosen = logits.topk(1).indices
    # E / (T^2 k) * sum_e P_e c_e with P = (2.6, 1.4), c = (3, 1)
    assert load_balancing_loss(logits, chosen, 1, "aux_loss").item() == pytest.approx(2 / 16 * (2.6 * 3 + 1.4 * 1))
    # per sequence of 2: P = (1.7, .3), c = (2, 0) and P = (.9, 1.1), c = (1, 1); averaged
    seq = (2 / 4 * (1.7 * 2) + 2 / 4 * (0.9 + 1.1)) / 2
    assert load_balancing_loss(logits, chosen, 2, "seq_aux_loss").item() == pytest.approx(seq)
    uniform = torch.zeros(6, 3)
    balanced = torch.tensor([[0, 1], [1, 2], [2, 0], [0, 1], [1, 2], [2, 0]])
    assert load_balancing_loss(uniform, balanced, 1, "aux_loss").item() == pytest.approx(1.0)


def test_z_loss_closed_form():
    assert z_loss(torch.zeros(5, 4)).item() == pytest.approx(math.log(4) ** 2)
    logits = torch.tensor([[0.0, 0.0], [math.log(3.0), 0.0]])
    assert z_loss(logits).item() == pytest.approx((math.log(2) ** 2 + math.log(4) ** 2) / 2)


def test_aux_loss_reaches_backward_scaled_and_leaves_the_output():
    w = torch.ones(3, requires_grad=True)
    x = torch.randn(4, requires_grad=True)
    y = AttachAuxLoss.apply(x * 1.0, (w * 2).sum(), 0.25)
    torch.testing.assert_close(y, x)
    y.sum().backward()
    torch.testing.assert_close(w.grad, torch.full((3,), 0.5))
    torch.testing.assert_close(x.grad, torch.ones(4))


def test_layer_gradient_is_that_of_output_plus_weighted_losses():
    cfg = config(moe_aux_loss_coeff=0.1, moe_z_loss_coeff=0.01)
    moe = built(MoE(cfg, TensorParallel()))
    x = torch.randn(2, 5, 16)
    moe(x)[0].sum().backward()
    got = moe.router.weight.grad.clone()
    moe.zero_grad()
    moe.aux_coeff = moe.z_coeff = 0.0
    logits, chosen, _ = route(x.reshape(-1, 16), moe.router.weight, 2)
    (moe(x)[0].sum() + 0.1 * load_balancing_loss(logits, chosen, 2, "aux_loss") + 0.01 * z_loss(logits)).backward()
    torch.testing.assert_close(got, moe.router.weight.grad)


def test_model_stats_count_each_training_forward_once_even_recomputed():
    cfg = config(arch="llama", recompute_layers=(0,), moe_layer_freq=2, moe_aux_loss_coeff=0.01)
    model = GPT(cfg)
    assert list(model.moe_layers()) == [0] and isinstance(model.blocks["1"].mlp, MLP)
    tokens = torch.randint(0, 64, (2, 8))
    model(tokens, tokens).backward()
    model(tokens, tokens).backward()
    stats = model.moe_layers()[0].take_stats()
    assert stats[:4].sum().item() == 2 * 2 * 8 * 2  # forwards x tokens x k
    assert stats[-1].item() == 2 and stats[4].item() > 0
    assert model.moe_layers()[0].take_stats().sum().item() == 0  # cleared
    model.eval()
    with torch.no_grad():
        model(tokens, tokens)
    assert model.moe_layers()[0].take_stats().sum().item() == 0  # evaluation is not counted


def test_active_and_total_parameters():
    cfg = config(arch="llama", num_experts=8, moe_router_topk=2)
    model = GPT(cfg, device="meta")
    expert = 16 * 64 + 32 * 16  # swiglu fc [d, 2 inner] and proj [inner, d]
    assert model.num_params() - model.num_active_params() == cfg.n_layers * 6 * expert
    assert GPT(config(num_experts=None), device="meta").num_active_params() == \
        GPT(config(num_experts=None), device="meta").num_params()


@pytest.mark.parametrize("kw, message", [
    (dict(num_experts=4, moe_router_topk=5), "moe_router_topk"),
    (dict(moe_layer_freq=0), "moe_layer_freq"),
    (dict(moe_router_load_balancing_type="sinkhorn"), "moe_router_load_balancing_type"),
])
def test_bad_moe_config_names_the_field(kw, message):
    with pytest.raises(TokenloomError, match=message):
        config(**kw)
