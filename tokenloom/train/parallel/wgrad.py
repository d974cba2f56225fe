"""Weight-gradient accumulation fusion: a linear layer's weight gradient written by its GEMM
straight into a gradient buffer (Megatron's ``gradient_accumulation_fusion``).

Why: without it autograd computes each weight gradient into a fresh tensor, which the data-parallel wrapper
copies (scaled by ``1 / world``) into its bucket: one more pass over every gradient and a gradient-sized
allocation per weight. ``bench/ddp_bench.py`` measures it.

Contract: the backward of :func:`linear` hands ``grad_out`` and the input to the weight's *sink* (installed
by the wrapper that owns the buffer: our DDP, or ZeRO-1 with ``overlap_grad_reduce``), which runs the GEMM
into the buffer, scaling in ``alpha``/``beta``: ``view = s * g^T x`` for the first contribution since
``zero_grad`` (``param.grad`` is None; ``beta=0``, the stale buffer is not read), ``view = s * view + s *
g^T x`` when accumulating. Autograd then gets ``None`` for the weight; the weight's post-accumulate-grad
hook still runs, so the wrapper's readiness bookkeeping is unchanged.

Invariants and limits:

* **Only for a weight used once per backward**: the sink scales while it writes, so a second consumer (a
  tied embedding) would add its grad unscaled. Every layer that uses it (:class:`Linear`, the
  tensor-parallel linears) has a ``wgrad_fusion`` switch, which the model turns off on its (possibly tied)
  LM head.
* **Compiled blocks too**: traced code cannot call the sink (a Python side effect), so the compiled backward
  calls one opaque custom op, ``tokenloom::linear_backward_to_sink``, which computes the input grad and runs
  the sink at run time; the forward stays traced, the backward's two library GEMMs are hidden from inductor.
  A traced graph cannot decide at run time whether to return a weight grad, so for a declining sink (or
  none) the op itself accumulates into ``weight.grad`` as autograd would. Leaf weights only. A graph takes
  this path while any sink is installed (a guarded flag: the first install or last removal recompiles). The
  sequence-parallel linear fuses only when eager.
* **Under autocast** (bf16) the operands are bf16 and the buffer holds fp32 main grads: :func:`gemm_into`
  writes the fp32 product into the bucket view with ``addmm(..., out_dtype=torch.float32)`` where the device
  has that kernel (CUDA: Megatron's fused wgrad kernel without an extension; bench/RESULTS.md's notes), else
  as the bf16 GEMM and one fused cast-add. The product is never rounded to bf16. The forward saves the input
  in the autocast dtype; the sequence-parallel linear keeps autograd's path under autocast.
* The sink may decline (returns False), e.g. when ``param.grad`` was replaced by a tensor that is not its
  view; the backward then returns the weight's grad as autograd would.
* **``backward()`` only**, as torch DDP: ``torch.autograd.grad`` through a wrapped model would still write
  the weight grads into the buffer.
* Numerics: the same product in one GEMM with the scaling inside it, equal to autograd's up to rounding.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

WgradSink = Callable[[torch.Tensor, torch.Tensor], bool]
"""``sink(grad_out_2d, input_2d) -> taken``: write ``grad_out_2d^T @ input_2d`` (the weight's
gradient) into the weight's gradient buffer and return True, or return False to leave it
to autograd."""

_SINK_ATTR = "wgrad_sink"
_sinks_installed = 0
_any_sink = False
"""Whether some weight in this process has a sink: what a traced graph reads (and guards on)
instead of a sink attribute, so compiled blocks take the fused path only where a wrapper
installed sinks."""


def set_wgrad_sink(weight: torch.Tensor, sink: WgradSink | None) -> None:
    """Install (or with None remove) the sink that :func:`linear` hands ``weight``'s
    gradient to."""
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
    """The sink a matmul of ``x`` by ``weight`` about to run eagerly should hand its weight
    gradient to, or None where the fusion does not apply (no sink, no grad needed, compiling,
    autocast: see the module docstring). For layers with their own autograd Function (the
    sequence-parallel linear, eager only); others call :func:`linear`."""
    if torch.compiler.is_compiling() or torch.is_autocast_enabled(x.device.type):  # see the module docstring
        return None
    return wgrad_sink(weight) if _fusion_applies(x, weight) else None


def _fusion_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    if not (torch.is_grad_enabled() and weight.requires_grad):
        return False
    if torch.compiler.is_compiling():
        # x: the op's input grad must be used, or the graph would drop the op and its sink
        # call; a leaf: a weight computed in the forward has no .grad for the op to fill
        return _any_sink and x.requires_grad and weight.is_leaf
    return wgrad_sink(weight) is not None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` whose backward hands the weight's gradient to the
    weight's sink when it has one (and the conditions in the module docstring hold)."""
    if _fusion_applies(x, weight):
        return _LinearWgradFusion.apply(x, weight, bias)
    return F.linear(x, weight, bias)


def shared_weight_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for a weight with a second consumer in the same backward
    (the LM head tied to the token embedding): its backward returns the weight's gradient as a
    tensor that owns its storage, ``grad^T x`` in one GEMM, the product ``F.linear``'s backward
    computes, bit for bit (no sink: the other consumer's gradient is not scaled).

    Why: autograd holds the first gradient of a weight used twice until the second arrives and
    adds the second into it in place only when the first owns its storage; ``F.linear``'s is a
    transposed view, so their sum would be a third weight-sized tensor next to both (under
    autocast the cast back to the weight's dtype already owns its storage). Under autocast the
    operands are cast as autocast casts them and autograd casts the gradients back. Without
    grad (or for a weight that needs none) it is ``F.linear``."""
    if torch.is_grad_enabled() and weight.requires_grad:
        return _SharedWeightLinear.apply(x, weight, bias)
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters, names, state dict and forward numerics) whose forward
    is :func:`linear`: the one-rank layer the model's ``TensorParallel`` factories return."""

    wgrad_fusion: bool = True
    """Hand the weight gradient to the weight's sink: only for a weight used once per
    backward (the model turns it off on its LM head, which may be tied). Off, the forward is
    :func:`shared_weight_linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.wgrad_fusion:
            return linear(x, self.weight, self.bias)
        return shared_weight_linear(x, self.weight, self.bias)


@functools.cache
def out_dtype_gemm(device_type: str) -> bool:
    """Whether ``device_type`` has the mixed-precision GEMM ``addmm(..., out_dtype=float32)``
    from bf16 operands (CUDA does, torch's CPU build does not); probed once per device type."""
    try:
        out = torch.zeros(1, 1, device=device_type)
        one = torch.ones(1, 1, dtype=torch.bfloat16, device=device_type)
        torch.addmm(out, one, one, out_dtype=torch.float32, beta=0, alpha=1, out=out)
    except (NotImplementedError, RuntimeError, TypeError):
        return False
    return True


def gemm_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, beta: float, alpha: float) -> None:
    """``out = beta * out + alpha * a @ b`` in place, ``out`` possibly a strided view of a bucket;
    ``beta=0`` never reads ``out`` (a stale buffer may hold anything). Operands of ``out``'s dtype:
    one ``addmm``. Lower-precision operands (autocast's bf16 into fp32 main grads): one
    ``addmm(..., out_dtype=out.dtype)`` where the device has it (:func:`out_dtype_gemm`), else the
    GEMM in the operands' dtype and a cast-add into ``out`` (fp32 arithmetic)."""
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
    """A compiled graph's backward of :func:`linear`: returns ``grad @ weight`` (the input
    grad) and hands ``grad^T x`` to ``weight``'s sink, or, without one or when it declines,
    accumulates it into ``weight.grad`` as autograd would (the graph returns no weight grad).
    Under autocast ``grad`` and ``x`` are in its dtype and the products too."""
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
