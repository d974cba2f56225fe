"""Weight-gradient accumulation fusion (Megatron's ``gradient_accumulation_fusion``): a linear's
weight-gradient GEMM writes straight into the wrapper's gradient buffer, saving autograd's fresh
tensor and the scaled copy into the bucket (``bench/ddp_bench.py``).

Contract: :func:`linear`'s backward hands ``grad_out`` and the input to the weight's *sink* (set by
DDP or ZeRO-1), which runs the GEMM into the buffer, scale in ``alpha`` / ``beta`` (``beta=0`` first:
the stale buffer is not read); autograd gets None, and the post-accumulate-grad hook still runs. A
declining sink (False) leaves the grad to autograd.

* **One consumer per backward**: the sink scales as it writes, so a tied weight's second grad would
  land unscaled; each layer's ``wgrad_fusion`` switch is off on the LM head.
* **Compiled blocks** cannot call the sink, so their backward calls the opaque custom op
  ``tokenloom::linear_backward_to_sink`` (declined: it accumulates ``weight.grad`` itself); leaf
  weights only, while any sink is installed. The sequence-parallel linear fuses only eagerly.
* **Under autocast** bf16 operands write fp32 main grads (:func:`gemm_into`), never rounded to bf16.
* **``backward()`` only**, as torch DDP; numerics equal autograd's up to rounding.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

WgradSink = Callable[[torch.Tensor, torch.Tensor], bool]
"""``sink(grad_out_2d, input_2d) -> taken``: write ``grad_out_2d^T @ input_2d`` into the buffer, or
return False to leave it to autograd."""

_SINK_ATTR = "wgrad_sink"
_sinks_installed = 0
_any_sink = False
"""Whether any weight has a sink: what a traced graph reads and guards on."""


def set_wgrad_sink(weight: torch.Tensor, sink: WgradSink | None) -> None:
    """Install (None: remove) ``weight``'s sink."""
    global _sinks_installed, _any_sink
    had = hasattr(weight, _SINK_ATTR)
    if sink is None:
        if had:
            delattr(weight, _SINK_ATTR)
            _sinks_installed -= 1
    else:
        setattr(weight, _SINK_ATTR, sink)
        _sinks_installed += 0 if had else 1
    _any_sink = _sinks_installed > 0


def wgrad_sink(weight: torch.Tensor) -> WgradSink | None:
    """The sink installed on ``weight``, if any."""
    return getattr(weight, _SINK_ATTR, None)


def fusion_sink(x: torch.Tensor, weight: torch.Tensor) -> WgradSink | None:
    """The sink for an eager matmul by ``weight``, or None where fusion does not apply; for layers
    with their own autograd Function (the sequence-parallel linear)."""
    if torch.compiler.is_compiling() or torch.is_autocast_enabled(x.device.type):  # see the module docstring
        return None
    return wgrad_sink(weight) if _fusion_applies(x, weight) else None


def _fusion_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    if not (torch.is_grad_enabled() and weight.requires_grad):
        return False
    if torch.compiler.is_compiling():
        # x needs grad, or the graph drops the op and its sink call; a non-leaf has no .grad to fill
        return _any_sink and x.requires_grad and weight.is_leaf
    return wgrad_sink(weight) is not None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` whose backward hands the weight gradient to the weight's sink."""
    if _fusion_applies(x, weight):
        return _LinearWgradFusion.apply(x, weight, bias)
    return F.linear(x, weight, bias)


def shared_weight_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` for a weight with a second consumer (a tied LM head): the weight grad comes as a
    tensor owning its storage, bit-equal to ``F.linear``'s. Why: autograd adds the second grad in
    place only into an owning first one; ``F.linear``'s is a transposed view, so the sum would be a
    third weight-sized tensor."""
    if torch.is_grad_enabled() and weight.requires_grad:
        return _SharedWeightLinear.apply(x, weight, bias)
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """``nn.Linear`` (same state dict and numerics) whose forward is :func:`linear` (tp = 1 layers)."""

    wgrad_fusion: bool = True
    """Use the sink (a weight used once per backward); off: :func:`shared_weight_linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.wgrad_fusion:
            return linear(x, self.weight, self.bias)
        return shared_weight_linear(x, self.weight, self.bias)


@functools.cache
def out_dtype_gemm(device_type: str) -> bool:
    """Whether bf16 ``addmm(..., out_dtype=float32)`` runs on ``device_type`` (probed once)."""
    try:
        out = torch.zeros(1, 1, device=device_type)
        one = torch.ones(1, 1, dtype=torch.bfloat16, device=device_type)
        torch.addmm(out, one, one, out_dtype=torch.float32, beta=0, alpha=1, out=out)
    except (NotImplementedError, RuntimeError, TypeError):
        return False
    return True


def gemm_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, beta: float, alpha: float) -> None:
    """``out = beta * out + alpha * a @ b`` in place (``beta=0`` never reads ``out``); narrower
    operands use ``out_dtype`` where :func:`out_dtype_gemm`, else a GEMM and an fp32 cast-add."""
    if a.dtype == out.dtype:
        if beta == 0:
            torch.addmm(out, a, b, beta=0, alpha=alpha, out=out)
        else:
            out.addmm_(a, b, beta=beta, alpha=alpha)
    elif out_dtype_gemm(out.device.type):
        torch.addmm(out, a, b, out_dtype=out.dtype, beta=beta, alpha=alpha, out=out)
    elif beta == 0:
        out.copy_(a.mm(b)).mul_(alpha)
    else:
        out.mul_(beta).add_(a.mm(b), alpha=alpha)


class _LinearWgradFusion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.x_dtype = x.dtype
        if torch.is_autocast_enabled(x.device.type):  # saved as autocast's linear saves it
            x = x.to(torch.get_autocast_dtype(x.device.type))
        ctx.save_for_backward(x, weight)
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        grad2 = grad.reshape(-1, grad.shape[-1])
        grad_b = grad2.sum(0) if need_b else None
        if torch.compiler.is_compiling():  # traced: the sink runs inside the opaque op
            return linear_backward_to_sink(grad, x, weight).to(ctx.x_dtype), None, grad_b
        # grad is in the forward's compute dtype (autocast's, or the weight's): no copy without autocast
        grad_x = grad.matmul(weight.to(grad.dtype)).to(ctx.x_dtype) if need_x else None
        grad_w = None
        if need_w:
            x2 = x.reshape(-1, x.shape[-1])
            sink = wgrad_sink(weight)
            if sink is None or not sink(grad2, x2):
                grad_w = grad2.t().mm(x2)
        return grad_x, grad_w, grad_b


class _SharedWeightLinear(_LinearWgradFusion):  # the same forward; a backward with no sink
    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        grad2 = grad.reshape(-1, grad.shape[-1])
        grad_x = grad.matmul(weight.to(grad.dtype)) if need_x else None
        grad_w = grad2.t().mm(x.reshape(-1, x.shape[-1])) if need_w else None
        return grad_x, grad_w, grad2.sum(0) if need_b else None


@torch.library.custom_op("tokenloom::linear_backward_to_sink", mutates_args=())
def linear_backward_to_sink(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Compiled backward of :func:`linear`: returns the input grad and hands ``grad^T x`` to the
    sink, or accumulates it into ``weight.grad`` without one."""
    grad2, x2 = grad.reshape(-1, grad.shape[-1]), x.reshape(-1, x.shape[-1])
    sink = wgrad_sink(weight)
    if sink is None or not sink(grad2, x2):
        grad_w = grad2.t().mm(x2)
        if weight.grad is None:
            weight.grad = grad_w.to(weight.dtype)
        else:
            weight.grad.add_(grad_w)
    return grad.matmul(weight.to(grad.dtype))


@linear_backward_to_sink.register_fake
def _(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return grad.new_empty(*grad.shape[:-1], weight.shape[1])
