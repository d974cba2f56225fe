"""Losses per source of a blend: token-weighted sums kept on the device, read at log time.

The last pipeline stage adds each micro-batch's masked token losses and counts by sample
``source`` into one ``[2, sources]`` float64 device tensor; the loop reduces it over dp and reads
it once per log or evaluation. A source's loss is its tokens' summed loss over their count (its
samples alone, whatever the mix); the blended loss stays the mean of micro-batch means, so the two
agree only when micro-batches keep equal token counts. A source with no kept token has null.
"""

from __future__ import annotations

import torch


class SourceLosses:
    """Device-side sums of per-token losses and kept-token counts, per source."""

    def __init__(self, num_sources: int, device: torch.device) -> None:
        self.sums = torch.zeros(2, num_sources, dtype=torch.float64, device=device)
        """Row 0: summed losses of kept tokens; row 1: kept tokens (exact in float64 below 2^53)."""

    def add(self, losses: torch.Tensor, loss_mask: torch.Tensor | None, source: torch.Tensor) -> None:
        """Add per-token ``losses`` [batch, seq] under ``loss_mask`` (None: all) by ``source`` [batch] (negative: skipped)."""
        losses = losses.detach().double()
        mask = torch.ones_like(losses) if loss_mask is None else loss_mask.to(losses.dtype)
        counted = (source >= 0).to(losses.dtype)
        index = source.clamp(min=0)
        self.sums[0].index_add_(0, index, (losses * mask).sum(dim=1) * counted)
        self.sums[1].index_add_(0, index, mask.sum(dim=1) * counted)

    def take(self) -> torch.Tensor:
        """The sums so far (a copy); the accumulator starts again from zero."""
        out = self.sums.clone()
        self.sums.zero_()
        return out


def losses_by_name(names: list[str], sums: torch.Tensor) -> dict[str, float | None]:
    """``{name: loss}`` from reduced ``[2, sources]`` sums on the host; None where no token was kept."""
    total, count = sums.tolist()
    return {n: (s / c if c > 0 else None) for n, s, c in zip(names, total, count, strict=True)}
