"""A built blend's plan as people and programs read it: an aligned table and JSON.

The plan rows themselves (per split and source: documents, tokens, requested and realised
share, epochs, cache key) are computed by :mod:`tokenloom.blending.build`.
"""

from __future__ import annotations

import json

from tokenloom.blending.build import BuildConfig, BuildResult
from tokenloom.blending.split import Split


def format_plan(result: BuildResult, cfg: BuildConfig) -> str:
    head: tuple[str, ...] = (
        "split",
        "source",
        "documents",
        "tokens",
        "requested",
        "realised",
        "samples",
        "epochs",
        "cache key",
    )
    rows: list[tuple[str, ...]] = [head] + [
        (
            r.split,
            r.prefix,
            str(r.documents),
            str(r.tokens),
            f"{r.requested:.4f}",
            f"{r.realised:.4f}",
            str(r.samples),
            str(r.epochs),
            r.cache_key,
        )
        for r in result.plan
    ]
    if cfg.packing != "concat":  # what packing cost: its padding, and the documents it cut
        head = (*head, "padding", "cut (concat)")
        rows = [head] + [(*row, f"{r.padding} ({100 * (r.padding_share or 0):.2f}%)", f"{r.cut} ({r.concat_cut})")
                         for row, r in zip(rows[1:], result.plan, strict=True)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in rows]
    totals = ", ".join(
        f"{s.name} {len(d)}" for s, d in zip(Split, result.datasets, strict=True) if d is not None
    )
    lines.append(
        f"samples of {cfg.seq_length}+1 tokens: {totals}; mode {cfg.mode}; packing {cfg.packing}; "
        f"cache {cfg.cache_dir or 'off'} ({result.builds} built, {result.hits} loaded)"
    )
    return "\n".join(lines)


def plan_json(result: BuildResult) -> str:
    return json.dumps(
        {
            "plan": [dict(vars(r)) for r in result.plan],  # flat rows: asdict's deep copy takes seconds at 10k
            "keys": result.keys,
            "fingerprint": result.fingerprint,
            "builds": result.builds,
            "hits": result.hits,
        },
        indent=2,
    )
