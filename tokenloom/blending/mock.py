"""A synthetic token source for tests and dry runs (Megatron's MockGPTLowLevelDataset).

With the defaults (100 000 sequences, lengths uniform in [1, 4096) drawn by
``numpy.random.default_rng(0)``, content ``1, 2, ..., len-1 (mod vocab), eod``) it is
token for token Megatron's mock source, so ``--mock-data`` runs line up. The
"random" content draws uniform tokens instead, seeded per sequence, so any
sequence can be produced alone without materialising the rest.
"""

from __future__ import annotations

from typing import Literal

import numpy as np

from tokenloom.errors import TokenloomError


class MockSource:
    """Seeded synthetic sequences, read through the same interface as an indexed dataset."""

    path_prefix = None
    dtype = np.int64

    def __init__(
        self,
        vocab_size: int,
        eod: int,
        *,
        num_sequences: int = 100_000,
        min_length: int = 1,
        max_length: int = 4096,
        seed: int = 0,
        content: Literal["ramp", "random"] = "ramp",
    ) -> None:
        if vocab_size < 1 or not 1 <= min_length < max_length:
            raise TokenloomError(
                f"mock source needs vocab_size >= 1 and 1 <= min_length < max_length, got {vocab_size}, "
                f"{min_length}, {max_length}"
            )
        if content not in ("ramp", "random"):
            raise TokenloomError(f"mock content must be 'ramp' or 'random', got {content!r}")
        self.vocab_size, self.eod, self.seed, self.content = vocab_size, eod, seed, content
        rng = np.random.default_rng(seed=seed)
        self.sequence_lengths = rng.integers(min_length, max_length, size=num_sequences, dtype=np.int32)
        """Lengths in [min_length, max_length), the end-of-document token included."""
        self.document_indices = np.arange(num_sequences + 1, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.sequence_lengths)

    def __getitem__(self, idx: int) -> np.ndarray:
        length = int(self.sequence_lengths[idx])
        if self.content == "ramp":
            body = (np.arange(length - 1) + 1) % self.vocab_size
        else:
            body = np.random.default_rng((self.seed, idx)).integers(0, self.vocab_size, size=length - 1)
        return np.concatenate([body, [self.eod]]).astype(np.int64)

    def get(self, idx: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        if length is None:
            length = int(self.sequence_lengths[idx]) - offset
        return self[idx][offset : offset + length]

    def __repr__(self) -> str:
        return (
            f"MockSource(vocab_size={self.vocab_size}, sequences={len(self)}, "
            f"tokens={int(self.sequence_lengths.sum(dtype=np.int64))}, content={self.content!r})"
        )
