"""Shared op cases for the implementation-vs-reference tests.

Kernel tests run on CPU. Without CUDA, Triton kernels run in Triton's interpreter:
``TRITON_INTERPRET=1`` must be set before the kernels are decorated, i.e. before
``tokenloom.train.kernels._triton_kernels`` is first imported, so it is set here.

A test that takes an ``op_case`` argument runs once per :data:`OP_CASES` entry. Each case
carries our reference and an ``independent`` formulation written with torch's own
functions (``F.rms_norm``, ``F.layer_norm``, ``F.gelu``, ``F.silu``, RoPE as a complex
rotation): the compiled and Triton implementations are checked against both, so a
reference and an implementation derived from it cannot agree on the same mistake.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tokenloom.train.kernels import (  # noqa: E402  (after TRITON_INTERPRET)
    bias_dropout_add_reference,
    bias_gelu_reference,
    layer_norm_reference,
    rms_norm_reference,
    rope_reference,
    swiglu_reference,
)
from tokenloom.train.model.blocks import rope_tables
from tokenloom.train.model.config import GPTConfig  # noqa: E402


@dataclass(frozen=True)
class OpCase:
    name: str
    op: str
    """Attribute of ``KernelSet`` this case exercises."""
    reference: Callable
    build: Callable[[torch.dtype, torch.device], list]
    """Positional arguments; floating tensors that require grad get gradients compared."""
    independent: Callable
    """The same op with torch's functions, taking the same arguments."""

    def run(self, fn: Callable, dtype: torch.dtype, device: str = "cpu", seed: int = 0):
        """(output, grads of the grad-requiring inputs) for ``fn`` on this case's inputs."""
        torch.manual_seed(seed)
        args = self.build(dtype, torch.device(device))
        leaves = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
        out = fn(*args)
        dy = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed + 1)).to(out)
        return out, torch.autograd.grad(out, leaves, dy)


def _t(*shape, dtype, device, scale=1.0, shift=0.0, grad=True):
    t = (shift + scale * torch.randn(*shape)).to(device=device, dtype=dtype)
    return t.requires_grad_(grad)


def _rope_complex(x, cos, sin):
    """Rotate each pair (x_i, x_{i+d/2}) by the angle whose cos/sin the tables hold."""
    half = x.shape[-1] // 2
    turned = torch.complex(x[..., :half].float(), x[..., half:].float()) * torch.complex(cos[:, :half], sin[:, :half])
    return torch.cat([turned.real, turned.imag], dim=-1).to(x.dtype)


def _ln(x, w, b, eps=1e-5):
    return F.layer_norm(x.float(), x.shape[-1:], w.float(), None if b is None else b.float(), eps).to(x.dtype)


def _gelu(x, b, approximate):
    return F.gelu(x.float() + (0 if b is None else b.float()), approximate=approximate).to(x.dtype)


def _rope_args(dtype, device):
    cos, sin = rope_tables(GPTConfig(arch="llama", seq_len=7, d_model=16, n_heads=1), device)
    return [_t(2, 3, 7, 16, dtype=dtype, device=device), cos, sin]


OP_CASES = [
    OpCase(
        "rms_norm",
        "rms_norm",
        rms_norm_reference,
        lambda d, dev: [
            _t(3, 5, 48, dtype=d, device=dev),
            _t(48, dtype=d, device=dev, scale=0.1, shift=1.0),
            1e-5,
        ],
        lambda x, w, eps: F.rms_norm(x.float(), x.shape[-1:], w.float(), eps).to(x.dtype),
    ),
    OpCase(
        "layer_norm",
        "layer_norm",
        layer_norm_reference,
        lambda d, dev: [
            _t(3, 5, 48, dtype=d, device=dev, shift=0.5),
            _t(48, dtype=d, device=dev, scale=0.1, shift=1.0),
            _t(48, dtype=d, device=dev, scale=0.1),
            1e-5,
        ],
        _ln,
    ),
    OpCase(
        "layer_norm_no_bias",
        "layer_norm",
        layer_norm_reference,
        lambda d, dev: [
            _t(3, 5, 48, dtype=d, device=dev),
            _t(48, dtype=d, device=dev, scale=0.1, shift=1.0),
            None,
        ],
        _ln,
    ),
    OpCase(
        "swiglu",
        "swiglu",
        swiglu_reference,
        lambda d, dev: [_t(3, 5, 40, dtype=d, device=dev), _t(3, 5, 40, dtype=d, device=dev)],
        lambda g, u: (F.silu(g.float()) * u.float()).to(g.dtype),
    ),
    OpCase(
        "bias_gelu_tanh",
        "bias_gelu",
        bias_gelu_reference,
        lambda d, dev: [_t(3, 5, 40, dtype=d, device=dev), _t(40, dtype=d, device=dev), "tanh"],
        _gelu,
    ),
    OpCase(
        "bias_gelu_exact",
        "bias_gelu",
        bias_gelu_reference,
        lambda d, dev: [_t(3, 5, 40, dtype=d, device=dev), _t(40, dtype=d, device=dev), "none"],
        _gelu,
    ),
    OpCase(
        "gelu_no_bias",
        "bias_gelu",
        bias_gelu_reference,
        lambda d, dev: [_t(3, 5, 40, dtype=d, device=dev), None, "tanh"],
        _gelu,
    ),
    OpCase("rope", "rope", rope_reference, _rope_args, _rope_complex),
    OpCase(
        "bias_dropout_add_eval",
        "bias_dropout_add",
        bias_dropout_add_reference,
        lambda d, dev: [
            _t(3, 5, 40, dtype=d, device=dev),
            _t(40, dtype=d, device=dev),
            _t(3, 5, 40, dtype=d, device=dev),
            0.1,
            False,
        ],
        lambda x, b, r, p, training: (x.float() + b.float() + r.float()).to(x.dtype),
    ),
]


TRITON_OPS = ("rms_norm", "layer_norm", "swiglu", "bias_gelu", "rope")
"""The ops with a Triton kernel (``tokenloom.train.kernels.triton_ops``); the others use the
compiled or eager version in triton mode."""


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "op_case" in metafunc.fixturenames:
        metafunc.parametrize("op_case", OP_CASES, ids=[c.name for c in OP_CASES])
    if "triton_case" in metafunc.fixturenames:
        cases = [c for c in OP_CASES if c.op in TRITON_OPS]
        metafunc.parametrize("triton_case", cases, ids=[c.name for c in cases])
