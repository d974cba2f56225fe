"""SwiGLU activation: ``silu(gate) * up`` (the Llama MLP between its two input GEMMs and
the output GEMM).

Takes ``gate`` and ``up`` as two tensors (our MLP has two input projections). Megatron
instead runs one GEMM into ``[..., 2 * ffn]`` and chunks it; pass
``*h.chunk(2, dim=-1)`` for that layout. Computed in fp32 and rounded once to
``gate.dtype``: eager mode pays fp32 temporaries, the fused versions none. The plain
bf16 ``F.silu(gate) * up`` rounds twice, so a good part of its bf16 outputs differ from
this one in the last bit (see bench/RESULTS.md, notes).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._common import upcast


def swiglu_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gate, up: same shape [..., ffn]. Returns ``silu(gate) * up`` in ``gate.dtype``."""
    return (F.silu(upcast(gate)) * upcast(up)).to(gate.dtype)
