"""Helpers shared by the op modules."""

from __future__ import annotations

import torch


def upcast(t: torch.Tensor) -> torch.Tensor:
    """``t`` in fp32, or unchanged if it is already fp32 or wider (fp64 stays fp64 for gradcheck)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))
