"""Pick one implementation per op for a device: :func:`select_kernels` -> :class:`KernelSet`.

Modes:

* ``reference``: eager PyTorch; the plain-PyTorch memory savers stay on (chunked cross entropy,
  SDPA), their oracles being ``cross_entropy_reference`` and ``attention_reference``.
* ``compiled``: ``torch.compile`` of the references where that fuses kernels; ops that are one ATen
  kernel already (fp32 LayerNorm, bias-free GELU) call ATen, and small CPU inputs run eager
  (``compiled.CPU_MIN_NUMEL``); cross entropy compiles its chunk math (small losses: full logits).
* ``triton``: hand-written kernels for the norms, SwiGLU, bias-GELU and RoPE; the rest from
  ``compiled`` where inductor works (eager otherwise).
* ``auto``: ``reference`` on CUDA (under ``compile`` inductor fuses the plain ops faster than our
  kernels, bench/RESULTS.md), ``compiled`` on CPU with a C++ compiler, else ``reference``; never
  the Triton interpreter.

:func:`choose_compile` resolves ``compile`` once: an explicit bool wins; ``auto`` compiles the
blocks on CUDA, not on CPU (the per-op kernels already take the gain, block compile would cost
every CPU run). Forcing a mode the host cannot run raises ``ValueError`` naming what is missing;
the choice is logged once per (requested, resolved, device type).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .attention import attention_sdpa
from .bias_dropout_add import bias_dropout_add_reference
from .bias_gelu import bias_gelu_reference, bias_gelu_with
from .compiled import compile_available, compiled_above
from .cross_entropy import chunked_cross_entropy, full_logits_below, logits_grad, target_and_sumexp
from .layer_norm import layer_norm_reference, layer_norm_with
from .rms_norm import rms_norm_reference
from .rope import rope_reference
from .swiglu import swiglu_reference
from .triton_ops import triton_available

log = logging.getLogger(__name__)

MODES = ("auto", "reference", "compiled", "triton")
OPS = (
    "rms_norm",
    "layer_norm",
    "swiglu",
    "bias_gelu",
    "rope",
    "bias_dropout_add",
    "attention",
    "cross_entropy",
)
_LOGGED: set[tuple[str, str, str]] = set()


@dataclass(frozen=True)
class KernelSet:
    """One callable per op (the ``*_reference`` signatures); ``sources``: op -> ``reference``,
    ``compiled``, ``triton`` or ``sdpa``."""

    mode: str
    device_type: str
    rms_norm: Callable
    layer_norm: Callable
    swiglu: Callable
    bias_gelu: Callable
    rope: Callable
    bias_dropout_add: Callable
    attention: Callable
    cross_entropy: Callable
    sources: dict[str, str] = field(default_factory=dict)

    def __reduce__(self):
        """Pickled as its recipe: compiled closures do not pickle, models holding a set must."""
        return select_kernels, (self.mode, self.device_type)


_REFERENCES: dict[str, Callable] = {
    "rms_norm": rms_norm_reference,
    "layer_norm": layer_norm_reference,
    "swiglu": swiglu_reference,
    "bias_gelu": bias_gelu_reference,
    "rope": rope_reference,
    "bias_dropout_add": bias_dropout_add_reference,
}
"""The ops that ``compiled`` mode compiles whole (attention and cross entropy are special)."""


def _reference_ops() -> dict[str, tuple[Callable, str]]:
    ops = {name: (fn, "reference") for name, fn in _REFERENCES.items()}
    ops["attention"] = (attention_sdpa, "sdpa")
    ops["cross_entropy"] = (chunked_cross_entropy, "reference")
    return ops


def _compiled_ops() -> dict[str, tuple[Callable, str]]:
    aten_first = {"layer_norm": layer_norm_with, "bias_gelu": bias_gelu_with}  # ATen's kernel where it is one
    ops = {}
    for name, fn in _REFERENCES.items():
        kernel = compiled_above(fn, name)
        ops[name] = (aten_first[name](kernel) if name in aten_first else kernel, "compiled")
    ops["attention"] = (attention_sdpa, "sdpa")
    chunk_fns = (compiled_above(target_and_sumexp, "cross_entropy_chunk"),
                 compiled_above(logits_grad, "cross_entropy_chunk"))
    ops["cross_entropy"] = (full_logits_below(functools.partial(chunked_cross_entropy, _fns=chunk_fns)), "compiled")
    return ops


def _triton_ops(device_type: str) -> dict[str, tuple[Callable, str]]:
    from . import triton_ops as t  # lazy: optional dependency (triton)

    t.load_kernels()  # imported now, at build time, not while a compiled block traces
    ops = _compiled_ops() if compile_available(device_type) else _reference_ops()
    ops.update(
        rms_norm=(t.rms_norm_triton, "triton"),
        layer_norm=(t.layer_norm_triton, "triton"),
        swiglu=(t.swiglu_triton, "triton"),
        bias_gelu=(t.bias_gelu_triton, "triton"),
        rope=(t.rope_triton, "triton"),
    )
    return ops


def resolve_mode(mode: str, device_type: str) -> tuple[str, str]:
    """(resolved mode, reason; "forced" when explicit); ``ValueError`` naming what is missing."""
    if mode not in MODES:
        raise ValueError(f"kernel mode must be one of {', '.join(MODES)}; got {mode!r}")
    if mode == "triton" and not triton_available(device_type):
        raise ValueError(
            f"kernel mode 'triton' cannot run on {device_type}: it needs the triton package and a CUDA "
            "device (or TRITON_INTERPRET=1 on CPU, for numerics tests only); use mode 'auto' or 'compiled'"
        )
    if mode == "compiled" and not compile_available(device_type):
        need = "the triton package" if device_type == "cuda" else "a C++ compiler (g++ or $CXX)"
        raise ValueError(f"kernel mode 'compiled' needs {need} on {device_type}; use mode 'reference'")
    if mode != "auto":
        return mode, "forced"
    if device_type == "cuda":
        return "reference", "on CUDA inductor fuses the plain ops faster than our kernels"
    if compile_available(device_type):
        return "compiled", f"torch.compile works on {device_type}"
    return "reference", f"no torch.compile backend for {device_type}"


def choose_compile(setting: bool | str, device_type: str, capturable: bool = True) -> tuple[bool, str]:
    """(whether ``compile`` compiles the blocks, why): "set" for an explicit bool; "auto" is on on
    CUDA with Triton, off elsewhere and where collectives cannot be captured (``capturable``)."""
    if isinstance(setting, bool):
        return setting, "set"
    if setting != "auto":
        raise ValueError(f"compile must be true, false or auto; got {setting!r}")
    if not capturable:
        return False, "off: the blocks' collectives over gloo's staged group cannot be compiled"
    if device_type == "cuda":
        if compile_available("cuda"):
            return True, "fastest on CUDA"
        return False, "inductor needs the triton package on CUDA"
    return False, f"off on {device_type}"


def select_kernels(mode: str = "auto", device: torch.device | str | None = None) -> KernelSet:
    """The :class:`KernelSet` for ``mode`` on ``device`` (default: CUDA if available, else CPU)."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device_type = torch.device(device).type
    resolved, reason = resolve_mode(mode, device_type)
    builders = {"reference": _reference_ops, "compiled": _compiled_ops}
    ops = _triton_ops(device_type) if resolved == "triton" else builders[resolved]()
    key = (mode, resolved, device_type)
    if key not in _LOGGED:
        _LOGGED.add(key)
        log.info("kernels: %s on %s (requested %s: %s)", resolved, device_type, mode, reason)
    return KernelSet(
        mode=resolved,
        device_type=device_type,
        sources={name: src for name, (_, src) in ops.items()},
        **{name: fn for name, (fn, _) in ops.items()},
    )
