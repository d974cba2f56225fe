"""Triton implementations of the norm, activation and RoPE ops, as autograd functions.

Importing this module never needs Triton; the kernels (:mod:`._triton_kernels`) load on first use.
They run on CUDA with Triton, or on CPU under ``TRITON_INTERPRET=1`` (numerics only; set before
the kernels' import, as ``@triton.jit`` reads it then), which is how GPU-less tests check them.
Hand-written, like nanotron's and Liger's, for the row-wise and elementwise ops only; cross
entropy, bias-dropout-add and attention come from the compiled or SDPA paths. Speed against
``torch.compile`` is not measured yet: TODO(kernels-bench). No gradient reaches the RoPE tables
(buffers); inputs are made contiguous (a strided ``q`` pays one copy).
"""

from __future__ import annotations

import importlib.util
import os

import torch

_ELEMENTWISE_BLOCK = 1024
_MAX_ROW = 65536


def triton_importable() -> bool:
    return importlib.util.find_spec("triton") is not None


def triton_available(device_type: str = "cuda") -> bool:
    """Can the kernels run on ``device_type`` here (see the module docstring)?"""
    if not triton_importable():
        return False
    if device_type == "cuda":
        return torch.cuda.is_available()
    return device_type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"


_KERNELS = None
"""The jitted kernels, set by :func:`load_kernels`: a module global, not a cached lookup dynamo traces."""


def load_kernels():
    """Import the jitted kernels once and return them (the selector calls it at build time)."""
    global _KERNELS
    if _KERNELS is None:
        from . import _triton_kernels  # lazy: optional dependency, the kernels import triton

        _KERNELS = _triton_kernels
    return _KERNELS


def _row_block(n: int) -> int:
    if n > _MAX_ROW:
        raise ValueError(f"Triton norm kernels hold one row per block; hidden {n} > {_MAX_ROW}")
    return _next_power_of_2(n)


def _programs(device: torch.device, n_rows: int) -> int:
    """Programs for the row-looping backward kernels: a few per SM on CUDA."""
    if device.type == "cuda":
        return max(1, min(n_rows, 4 * torch.cuda.get_device_properties(device).multi_processor_count))
    return max(1, min(n_rows, 4))


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        n = x.shape[-1]
        x2 = x.reshape(-1, n).contiguous()
        y = torch.empty_like(x2)
        rstd = torch.empty(x2.shape[0], dtype=torch.float32, device=x.device)
        load_kernels().rms_norm_fwd[(x2.shape[0],)](x2, weight, y, rstd, n, eps, BLOCK=_row_block(n))
        ctx.save_for_backward(x2, weight, rstd)
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        x2, weight, rstd = ctx.saved_tensors
        n_rows, n = x2.shape
        dy2 = dy.reshape(-1, n).contiguous()
        dx = torch.empty_like(x2)
        programs = _programs(x2.device, n_rows)
        dw_partial = torch.empty(programs, n, dtype=torch.float32, device=x2.device)
        load_kernels().rms_norm_bwd[(programs,)](
            dy2, x2, weight, rstd, dx, dw_partial, n_rows, n, _cdiv(n_rows, programs), BLOCK=_row_block(n)
        )
        return dx.view(dy.shape), dw_partial.sum(0).to(weight.dtype), None


class _LayerNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps):
        n = x.shape[-1]
        x2 = x.reshape(-1, n).contiguous()
        y = torch.empty_like(x2)
        mean = torch.empty(x2.shape[0], dtype=torch.float32, device=x.device)
        rstd = torch.empty_like(mean)
        load_kernels().layer_norm_fwd[(x2.shape[0],)](
            x2, weight, weight if bias is None else bias, y, mean, rstd, n, eps,
            HAS_BIAS=bias is not None, BLOCK=_row_block(n),
        )  # fmt: skip
        ctx.save_for_backward(x2, weight, mean, rstd)
        ctx.has_bias, ctx.bias_dtype = bias is not None, None if bias is None else bias.dtype
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        x2, weight, mean, rstd = ctx.saved_tensors
        n_rows, n = x2.shape
        dy2 = dy.reshape(-1, n).contiguous()
        dx = torch.empty_like(x2)
        programs = _programs(x2.device, n_rows)
        partial = torch.empty(2, programs, n, dtype=torch.float32, device=x2.device)
        load_kernels().layer_norm_bwd[(programs,)](
            dy2, x2, weight, mean, rstd, dx, partial[0], partial[1], n_rows, n,
            _cdiv(n_rows, programs), BLOCK=_row_block(n),
        )  # fmt: skip
        db = partial[1].sum(0).to(ctx.bias_dtype) if ctx.has_bias else None
        return dx.view(dy.shape), partial[0].sum(0).to(weight.dtype), db, None


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        gate, up = gate.contiguous(), up.contiguous()
        y = torch.empty_like(gate)
        grid = (_cdiv(gate.numel(), _ELEMENTWISE_BLOCK),)
        load_kernels().swiglu_fwd[grid](gate, up, y, gate.numel(), BLOCK=_ELEMENTWISE_BLOCK)
        ctx.save_for_backward(gate, up)
        return y

    @staticmethod
    def backward(ctx, dy):
        gate, up = ctx.saved_tensors
        dg, du = torch.empty_like(gate), torch.empty_like(up)
        grid = (_cdiv(gate.numel(), _ELEMENTWISE_BLOCK),)
        load_kernels().swiglu_bwd[grid](dy.contiguous(), gate, up, dg, du, gate.numel(), BLOCK=_ELEMENTWISE_BLOCK)
        return dg, du


class _BiasGelu(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, bias, approximate):
        x = x.contiguous()
        y = torch.empty_like(x)
        grid = (_cdiv(x.numel(), _ELEMENTWISE_BLOCK),)
        load_kernels().bias_gelu_fwd[grid](
            x, x if bias is None else bias, y, x.numel(), x.shape[-1],
            HAS_BIAS=bias is not None, TANH=approximate == "tanh", BLOCK=_ELEMENTWISE_BLOCK,
        )  # fmt: skip
        ctx.save_for_backward(x, bias)
        ctx.approximate = approximate
        return y

    @staticmethod
    def backward(ctx, dy):
        x, bias = ctx.saved_tensors
        dx = torch.empty_like(x)
        grid = (_cdiv(x.numel(), _ELEMENTWISE_BLOCK),)
        load_kernels().bias_gelu_bwd[grid](
            dy.contiguous(), x, x if bias is None else bias, dx, x.numel(), x.shape[-1],
            HAS_BIAS=bias is not None, TANH=ctx.approximate == "tanh", BLOCK=_ELEMENTWISE_BLOCK,
        )  # fmt: skip
        db = None if bias is None else dx.reshape(-1, x.shape[-1]).float().sum(0).to(bias.dtype)
        return dx, db, None


def _rope_launch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backward: bool) -> torch.Tensor:
    x = x.contiguous()
    y = torch.empty_like(x)
    half = x.shape[-1] // 2
    n_rows = x.numel() // x.shape[-1]
    load_kernels().rope_fwd_bwd[(n_rows,)](
        x, cos, sin, y, x.shape[-2], HALF=half, BLOCK=_next_power_of_2(half), BACKWARD=backward
    )
    return y


class _Rope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin):
        seq, head_dim = x.shape[-2], x.shape[-1]
        if head_dim % 2 or cos.shape != (seq, head_dim) or sin.shape != (seq, head_dim):
            raise ValueError(
                f"rope expects x [..., seq, even head_dim] and cos/sin [seq, head_dim]; got x "
                f"{tuple(x.shape)}, cos {tuple(cos.shape)}, sin {tuple(sin.shape)} (slice the tables to seq)"
            )
        cos, sin = cos.float().contiguous(), sin.float().contiguous()
        ctx.save_for_backward(cos, sin)
        return _rope_launch(x, cos, sin, backward=False)

    @staticmethod
    def backward(ctx, dy):
        cos, sin = ctx.saved_tensors
        return _rope_launch(dy, cos, sin, backward=True), None, None


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """Same contract as :func:`.rms_norm.rms_norm_reference`."""
    return _RMSNorm.apply(x, weight, eps)


def layer_norm_triton(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, eps: float = 1e-5
) -> torch.Tensor:
    """Same contract as :func:`.layer_norm.layer_norm_reference`."""
    return _LayerNorm.apply(x, weight, bias, eps)


def swiglu_triton(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Same contract as :func:`.swiglu.swiglu_reference`."""
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(f"gate {tuple(gate.shape)} {gate.dtype} and up {tuple(up.shape)} {up.dtype} differ")
    return _SwiGLU.apply(gate, up)


def bias_gelu_triton(
    x: torch.Tensor, bias: torch.Tensor | None = None, approximate: str = "tanh"
) -> torch.Tensor:
    """Same contract as :func:`.bias_gelu.bias_gelu_reference`."""
    if approximate not in ("tanh", "none"):
        raise ValueError(f"approximate must be 'tanh' or 'none', got {approximate!r}")
    return _BiasGelu.apply(x, bias, approximate)


def rope_triton(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Same contract as :func:`.rope.rope_reference` (cos/sin exactly [seq, head_dim])."""
    return _Rope.apply(x, cos, sin)
