"""``select_kernels``: which implementation each mode resolves to, errors, and the log line."""

from __future__ import annotations

import logging

import pytest
import torch

from tokenloom.train.kernels import OPS, KernelSet, choose_compile, select_kernels, selector
from tokenloom.train.kernels.compiled import compile_available
from tokenloom.train.model.blocks import rope_tables
from tokenloom.train.model.config import GPTConfig


def test_reference_mode_exposes_every_op():
    kernels = select_kernels("reference", "cpu")
    assert isinstance(kernels, KernelSet) and kernels.mode == "reference"
    assert set(kernels.sources) == set(OPS)
    assert all(callable(getattr(kernels, op)) for op in OPS)
    assert kernels.sources["attention"] == "sdpa"
    assert {src for op, src in kernels.sources.items() if op != "attention"} == {"reference"}


def test_reference_mode_runs_a_tiny_block():
    """The ops the reference mode hands out, chained as a block, equal the same block
    written with torch's own functions and RoPE as a complex rotation (derived by hand:
    the pair (x_i, x_{i+d/2}) at position t turns by t * 10000^(-2i/d))."""
    torch.manual_seed(0)
    k = select_kernels("reference", "cpu")
    x = torch.randn(2, 6, 16, dtype=torch.float64)
    w_norm, w_out, targets = torch.rand(16, dtype=torch.float64) + 0.5, torch.randn(10, 16, dtype=torch.float64), \
        torch.randint(0, 10, (2, 6))
    cos, sin = (t.double() for t in rope_tables(GPTConfig(arch="llama", seq_len=6, d_model=4, n_heads=1)))
    q = k.rope(x.view(2, 6, 4, 4).transpose(1, 2), cos, sin)
    y = k.attention(q, q, q).transpose(1, 2).reshape(2, 6, 16)
    y = k.bias_dropout_add(y, None, x, 0.0, False)
    h = k.swiglu(k.rms_norm(y, w_norm), y)
    loss = k.cross_entropy(k.layer_norm(h, w_norm), w_out, targets)

    heads = x.view(2, 6, 4, 2, 2).transpose(1, 2)  # [b, h, t, which half, i]
    pairs = torch.complex(heads[..., 0, :], heads[..., 1, :])  # x_i + i * x_{i+d/2}, i = 0, 1
    angles = torch.arange(6, dtype=torch.float64)[:, None] * 10000.0 ** (-torch.arange(2, dtype=torch.float64) / 2)
    turned = pairs * torch.polar(torch.ones_like(angles), angles)
    q_hand = torch.cat([turned.real, turned.imag], dim=-1)
    y_hand = torch.nn.functional.scaled_dot_product_attention(q_hand, q_hand, q_hand, is_causal=True)
    y_hand = y_hand.transpose(1, 2).reshape(2, 6, 16) + x
    normed = y_hand * torch.rsqrt(y_hand.pow(2).mean(-1, keepdim=True) + 1e-5) * w_norm
    h_hand = torch.nn.functional.silu(normed) * y_hand
    logits = torch.nn.functional.layer_norm(h_hand, (16,), w_norm, eps=1e-5) @ w_out.T
    loss_hand = torch.nn.functional.cross_entropy(logits.view(-1, 10), targets.view(-1))
    torch.testing.assert_close(q, q_hand)
    torch.testing.assert_close(loss, loss_hand)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU rule")
def test_auto_on_cpu():
    expected = "compiled" if compile_available("cpu") else "reference"
    assert select_kernels("auto", "cpu").mode == expected
    assert select_kernels().mode == expected  # device defaults to CPU without CUDA


def test_auto_rules(monkeypatch):
    monkeypatch.setattr(selector, "triton_available", lambda device_type="cuda": device_type == "cuda")
    monkeypatch.setattr(selector, "compile_available", lambda device_type: device_type != "mps")
    # a kernel that lost to inductor's fusion of the plain ops is never auto's choice on CUDA
    assert selector.resolve_mode("auto", "cuda")[0] == "reference"
    assert selector.resolve_mode("auto", "cpu")[0] == "compiled"
    assert selector.resolve_mode("auto", "mps")[0] == "reference"
    assert selector.resolve_mode("triton", "cuda") == ("triton", "forced")  # still forceable


def test_compile_is_on_by_default_on_cuda_only(monkeypatch):
    monkeypatch.setattr(selector, "compile_available", lambda device_type: True)
    assert choose_compile("auto", "cuda") == (True, "fastest on CUDA")
    assert choose_compile("auto", "cpu") == (False, "off on cpu")  # CPU defaults unchanged
    assert choose_compile(False, "cuda") == (False, "set") and choose_compile(True, "cpu") == (True, "set")
    monkeypatch.setattr(selector, "compile_available", lambda device_type: False)
    assert choose_compile("auto", "cuda") == (False, "inductor needs the triton package on CUDA")
    with pytest.raises(ValueError, match="compile must be true, false or auto"):
        choose_compile("yes", "cuda")


def test_forced_modes_that_cannot_run_raise(monkeypatch):
    with pytest.raises(ValueError, match="one of auto, reference, compiled, triton"):
        select_kernels("fast", "cpu")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="'triton' cannot run on cpu"):
        select_kernels("triton", "cpu")
    monkeypatch.setattr(selector, "compile_available", lambda device_type: False)
    with pytest.raises(ValueError, match="'compiled' needs a C\\+\\+ compiler"):
        select_kernels("compiled", "cpu")


def test_choice_is_logged_once(caplog, monkeypatch):
    monkeypatch.setattr(selector, "_LOGGED", set())
    with caplog.at_level(logging.INFO, logger="tokenloom.train.kernels.selector"):
        select_kernels("reference", "cpu")
        select_kernels("reference", "cpu")
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["kernels: reference on cpu (requested reference: forced)"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_auto_on_cuda_is_the_reference():
    assert select_kernels("auto", "cuda").mode == "reference"
