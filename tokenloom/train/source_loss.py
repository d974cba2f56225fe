"""Losses per source of a blend: token-weighted sums kept on the device, read at log time.

Every sample of a blend carries ``source``, the position of its source in the blend
(:func:`tokenloom.blending.loader.source_of`). The last pipeline stage adds each
micro-batch's masked per-token losses and kept-token counts into one ``[2, sources]``
float64 tensor on the device with ``index_add_``: nothing is read on the host per step. The
loop reduces that tensor over data-parallel ranks and reads it once per evaluation or log
interval (:meth:`~tokenloom.train.strategy.Strategy.sums_for_log`), so the cost is one small
collective there, and per micro-batch a few ops on ``[micro_batch]`` tensors.

A source's loss is the sum of its tokens' losses over every rank and micro-batch divided by
their count: the loss of that source's samples alone, whatever the mix they came in. The
blended loss stays what it was (the mean of micro-batch means), so the sources' losses
weighted by their token shares give it only when every micro-batch keeps as many tokens.
A source with no kept token in the samples read has no loss (null).
"""

from __future__ import annotations

import torch


class SourceLosses:
    """Device-side sums of per-token losses and kept-token counts, per source."""

    def __init__(self, num_sources: int, device: torch.device) -> None:
        self.sums = torch.zeros(2, num_sources, dtype=torch.float64, device=device)
        """Row 0: summed losses of kept tokens; row 1: kept tokens (exact in float64 below 2^53)."""

    def add(self, losses: torch.Tensor, loss_mask: torch.Tensor | None, source: torch.Tensor) -> None:
        """Add one micro-batch: per-token ``losses`` [batch, seq], its ``loss_mask`` (None: every
        token kept) and each sample's ``source`` [batch]; a negative source is not counted."""
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
