"""SwiGLU: ``silu(gate) * up`` in fp32, rounded once to ``gate.dtype`` (plain bf16 rounds twice).
Takes two tensors; for Megatron's one ``[..., 2 * ffn]`` GEMM pass ``*h.chunk(2, dim=-1)``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._common import upcast


def swiglu_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gate, up: same shape [..., ffn]. Returns ``silu(gate) * up`` in ``gate.dtype``."""
    return (F.silu(upcast(gate)) * upcast(up)).to(gate.dtype)
