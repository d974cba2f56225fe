"""``build --dump-samples``: a built dataset's samples in training order, one JSON line each.

Each line is ``{"sample": i, "parts": [[source, document, offset, length], ...], "padding": p}``:
sample ``i`` of the order the trainer reads, made of ``length`` tokens of ``document`` (the
sequence id in the source's ``.idx``) from token ``offset`` on, part after part, then ``p``
padding tokens. ``source`` is the source's display name
(:func:`~tokenloom.blending.args.source_names`). A concat (Megatron) sample reads
``seq_length + 1`` tokens whose last is the next sample's first, so consecutive samples
share one token; a best-fit sample's parts never overlap within an epoch except for the one
shared token between the pieces of a cut document. No token is read: the parts come from the
indices alone. This module owns the format; users audit a blend with it, tests check packing.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

from tokenloom.blending.args import source_names
from tokenloom.blending.blend import BlendedDataset
from tokenloom.blending.gpt import GPTDataset
from tokenloom.errors import TokenloomError
from tokenloom.fsio import atomic_writer, os_error_message


def sample_layouts(dataset: GPTDataset | BlendedDataset, num: int | None = None) -> Iterator[dict]:
    """The first ``num`` (all when None) samples of ``dataset`` as dump records, in order."""
    members = list(dataset.datasets) if isinstance(dataset, BlendedDataset) else [dataset]
    names = source_names([str(m.source.path_prefix or "mock") for m in members])
    total = len(dataset) if num is None else min(num, len(dataset))
    for i in range(total):
        d, k = dataset.locate(i) if isinstance(dataset, BlendedDataset) else (0, i)
        member = members[d]
        parts, padding = member.layout(int(member.indices.shuffle_index[k]))
        yield {"sample": i, "parts": [[names[d], doc, offset, length] for doc, offset, length in parts],
               "padding": padding}


def dump_samples(dataset: GPTDataset | BlendedDataset, path: str | os.PathLike, num: int | None = None) -> int:
    """Write :func:`sample_layouts` to ``path`` as JSON lines (whole or not at all); the count."""
    if num is not None and num < 0:
        raise TokenloomError(f"--num must be >= 0, got {num}")
    count = 0
    try:
        with atomic_writer(path, "w", encoding="utf-8") as f:
            for record in sample_layouts(dataset, num):
                f.write(json.dumps(record, separators=(",", ":")) + "\n")
                count += 1
    except OSError as exc:  # named by the file asked for, not its temporary name
        raise TokenloomError(os_error_message(OSError(exc.errno, exc.strerror, os.fspath(path)))) from None
    return count
