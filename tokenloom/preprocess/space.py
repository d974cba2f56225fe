"""The disk-space check before a run: the output size extrapolated from a tokenized sample.

A run tokenizes the first chunk of a few inputs spread over the list (the sample is
written nowhere: its results are the first the pool returns), extrapolates tokens and
index entries per input byte to every input of the same format, and refuses to start
when the disk cannot hold the output plus the checkpoint's copy of the index.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tokenloom.corpus.readers import (
    Chunk,
    ChunkReader,
    Input,
    text_expansion,
)
from tokenloom.errors import TokenloomError
from tokenloom.preprocess.worker import EncodedChunk

SAMPLE_INPUTS = 8
SAMPLE_BYTES = 1 << 20


@dataclass
class SpaceEstimate:
    """Output size extrapolated from tokenizing a sample: bytes of ``.bin`` and of ``.idx`` files."""

    bin_bytes: int
    idx_bytes: int
    extra: int = 0  # what else the run holds until it ends (dedup's run files and copy)

    @property
    def output(self) -> int:
        return self.bin_bytes + self.idx_bytes

    @property
    def peak(self) -> int:
        """What the run holds at most: the output plus the checkpoint's copy of the index, plus ``extra``."""
        return self.bin_bytes + 2 * self.idx_bytes + self.extra


def sample_chunks(inputs: list[Input], keys: list[str], txt_unit: str) -> list[tuple[Input, Chunk]]:
    """The first chunk of up to ``SAMPLE_INPUTS`` inputs spread over the list (~``SAMPLE_BYTES`` of text)."""
    if not inputs:
        return []
    picks = sorted({round(x) for x in np.linspace(0, len(inputs) - 1, min(SAMPLE_INPUTS, len(inputs)))})
    samples = []
    for k in picks:
        chunks = ChunkReader([inputs[k]], keys, max(1 << 16, SAMPLE_BYTES // len(picks)), txt_unit=txt_unit).chunks()
        first = next(chunks, None)
        chunks.close()
        if first is not None and first.raw_bytes:
            samples.append((inputs[k], first))
    return samples


def estimate_output(inputs: list[Input], samples: list[tuple[Input, EncodedChunk, float]], itemsize: int,
                    num_keys: int) -> SpaceEstimate:
    """Extrapolate sampled (input, encoded chunk, raw bytes read) to every input, per input format.

    Costs one tokenized chunk per sampled input (~1 MiB of text in all). The sample is
    the start of each file, so a corpus whose documents change character along a file is
    estimated from its beginning (on the shared corpora it lands close; see bench/RESULTS.md).
    """
    by_format: dict[str, np.ndarray] = {}
    for inp, result, raw in samples:
        if raw <= 0:  # nothing decodable in the sample (a corrupt input, reported when it is read)
            continue
        tokens = sum(int(o.tokens.size) for o in result.outputs.values())
        index = sum(12 * len(o.sequence_lengths) + 8 * len(o.sequences_per_document) for o in result.outputs.values())
        by_format[inp.format] = by_format.get(inp.format, np.zeros(3)) + (tokens * itemsize, index, raw)
    total = sum(by_format.values(), np.zeros(3)) if by_format else np.array([0.0, 0.0, 1.0])
    bin_bytes, idx_bytes = 0.0, float((34 + 8) * num_keys)
    for inp in inputs:
        b, i, raw = by_format.get(inp.format, total)
        bin_bytes += inp.size * b / raw
        idx_bytes += inp.size * i / raw
    return SpaceEstimate(int(bin_bytes), int(idx_bytes))


def stored_bytes(inp: Input, chunk: Chunk) -> float:
    """The input bytes a chunk's records take on disk (compressed inputs: their text over the expansion)."""
    if not inp.compressed:
        return chunk.raw_bytes
    text = sum(map(len, chunk.lines)) + sum(len(v) for values in chunk.columns.values() for v in values)
    return text / max(text_expansion(inp), 1e-9)


def check_space(partial: Path, estimate: SpaceEstimate, staging: bool = False) -> None:
    """Refuse to start when the disk of ``partial`` cannot hold the run (an object-store output is
    completed in a local ``staging`` folder first: that disk must hold it all)."""
    directory = os.path.dirname(os.path.abspath(partial))
    free = shutil.disk_usage(directory).free
    if estimate.peak > free:
        where = "the local staging folder of the object-store output " if staging else ""
        elsewhere = "put it elsewhere with --staging-dir, " if staging else ""
        raise TokenloomError(f"not enough disk space in {where}{directory}: the output is estimated at "
                             f"{megabytes(estimate.output)} ({megabytes(estimate.peak)} while running) but only "
                             f"{megabytes(free)} are free (free space, {elsewhere}or pass --no-space-check)")


def megabytes(n: int) -> str:
    return f"{n / 1e6:,.1f} MB"
