"""A built blend's plan as a picture: requested vs realised share per source and split (PNG)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tokenloom.blending.build import BuildResult
from tokenloom.blending.split import Split


def plot_plan(result: BuildResult, path: str) -> None:
    """Bar chart of requested vs realised share per source and split."""
    import matplotlib  # lazy: start-up time, matplotlib loads only when a plot is asked for

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # lazy: start-up time, matplotlib loads only when a plot is asked for

    splits = sorted({r.split for r in result.plan}, key=lambda s: Split[s])
    fig, axes = plt.subplots(1, len(splits), figsize=(5 * len(splits), 4), squeeze=False)
    for ax, split in zip(axes[0], splits, strict=True):
        rows = [r for r in result.plan if r.split == split]
        x = np.arange(len(rows))
        ax.bar(x - 0.2, [r.requested for r in rows], 0.4, label="requested")
        ax.bar(x + 0.2, [r.realised for r in rows], 0.4, label="realised")
        ax.set_xticks(x, [Path(r.prefix).name for r in rows], rotation=30, ha="right")
        ax.set_title(f"{split} (epochs: {', '.join(str(r.epochs) for r in rows)})")
        ax.set_ylabel("share of samples")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
