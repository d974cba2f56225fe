"""``select_kernels``: which implementation each mode resolves to, errors, and the log line."""

from __future__ import annotations

import logging

import pytest
import torch

from tokenloom.train.kernels import OPS, KernelSet, rope_cache, select_kernels, selector
from tokenloom.train.kernels.compiled import compile_available


def test_reference_mode_exposes_every_op():
    kernels = select_kernels("reference", "cpu")
    assert isinstance(kernels, KernelSet) and kernels.mode == "reference"
    assert set(kernels.sources) == set(OPS)
    assert all(callable(getattr(kernels, op)) for op in OPS)
    assert kernels.sources["attention"] == "sdpa"
    assert {src for op, src in kernels.sources.items() if op != "attention"} == {"reference"}


def test_reference_mode_runs_a_tiny_block():
    k = select_kernels("reference", "cpu")
    x = torch.randn(2, 6, 16)
    cos, sin = rope_cache(6, 4)
    q = k.rope(x.view(2, 6, 4, 4).transpose(1, 2), cos, sin)
    y = k.attention(q, q, q).transpose(1, 2).reshape(2, 6, 16)
    y = k.bias_dropout_add(y, None, x, 0.0, False)
    h = k.swiglu(k.rms_norm(y, torch.ones(16)), y)
    loss = k.cross_entropy(k.layer_norm(h, torch.ones(16)), torch.randn(10, 16), torch.randint(0, 10, (2, 6)))
    assert torch.isfinite(loss)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU rule")
def test_auto_on_cpu():
    expected = "compiled" if compile_available("cpu") else "reference"
    assert select_kernels("auto", "cpu").mode == expected
    assert select_kernels().mode == expected  # device defaults to CPU without CUDA


def test_auto_rules(monkeypatch):
    monkeypatch.setattr(selector, "triton_available", lambda device_type="cuda": device_type == "cuda")
    monkeypatch.setattr(selector, "compile_available", lambda device_type: device_type != "mps")
    assert selector._resolve("auto", "cuda")[0] == "triton"
    assert selector._resolve("auto", "cpu")[0] == "compiled"
    assert selector._resolve("auto", "mps")[0] == "reference"
    monkeypatch.setattr(selector, "triton_available", lambda device_type="cuda": False)
    assert selector._resolve("auto", "cuda")[0] == "reference"


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
def test_auto_on_cuda_prefers_triton():
    from tokenloom.train.kernels.triton_ops import triton_available

    kernels = select_kernels("auto", "cuda")
    assert kernels.mode == ("triton" if triton_available("cuda") else "reference")
