"""From a built (blended) sample index to training batches, resumable at any data-parallel size.

The *global order* of samples is fixed by the index (``dataset[0], dataset[1], ...``,
already shuffled and blended). A global batch is the next ``micro_batch x dp_size``
samples; data-parallel rank ``r`` takes its contiguous slice ``[r*micro, (r+1)*micro)``
(Megatron's ``MegatronPretrainingSampler``). Training state is one number, the
*consumed samples*, so a run stopped at k consumed samples with DP size 2 continues
at DP size 1 (or 4) with exactly the same global sequence. A trailing global batch
that cannot be filled is dropped.

Worked example: 10 samples, micro-batch 2, DP size 2, starting at 0::

    step 0: rank 0 gets [0, 1], rank 1 gets [2, 3]      (consumed 4)
    step 1: rank 0 gets [4, 5], rank 1 gets [6, 7]      (consumed 8)
    (samples 8, 9 cannot fill a global batch of 4: dropped)

Resuming that run at consumed=4 with DP size 1, micro-batch 4 yields [4, 5, 6, 7]:
the same samples in the same order.

Each sample of ``seq_length + 1`` tokens becomes ``tokens = s[:-1]``, ``labels = s[1:]``,
a float ``loss_mask`` (0 on padding, and on EOD inputs when ``eod_mask_loss``) and
``position_ids`` (restarting after every EOD when ``reset_position_ids``); with ``source_ids``
also ``source``, the position of its source in the blend (for losses per source).

With ``inter_document_masking`` (megatron-core's option of that name) a sample also
carries ``cu_seqlens``: int32, ``seq_length + 1`` entries, the starts of the documents
within the sample's inputs followed by ``seq_length`` (and padded with it), taken from
the document pieces the sample was cut from, not from EOD ids (data without EOD works);
with ``labels_within_documents`` (best-fit samples) the loss also skips each piece's last input;
``max_seqlen``, the longest piece; and position ids that restart at every piece. A
padded tail of a partial sample is a piece of its own.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from tokenloom.errors import TokenloomError


@dataclass(kw_only=True)
class SampleConfig:
    eod: int | None = None
    """End-of-document id (needed for the two options below)."""
    pad_id: int = -1
    """Id that pads a partial sample; masked out of the loss and replaced by 0 in the inputs."""
    eod_mask_loss: bool = False
    """Do not train on predicting what follows an EOD token (Megatron's --eod-mask-loss)."""
    reset_position_ids: bool = False
    """Restart position ids after each EOD, so packed documents each start at position 0."""
    inter_document_masking: bool = False
    """Add ``cu_seqlens`` / ``max_seqlen`` (document boundaries within the sample) and restart
    position ids at each document (megatron-core's ``inter_document_masking``)."""
    vocab_size: int | None = None
    """A sample holding an id at or above it raises an error naming its source: a guard (one max
    per sample) behind the train preflight, which checks every source before launch."""
    source_ids: bool = False
    """Add ``source``: the position of the sample's source in the blend (:func:`source_of`), for
    losses per source."""
    labels_within_documents: bool = False
    """Best-fit samples: no loss on an input whose label starts the next document piece (the
    last input of every piece but the sample's last), so labels never cross a document."""


class GPTSamples:
    """Map-style dataset: ``dataset[k]`` (seq_length + 1 tokens) -> dict of numpy arrays.

    Picklable whenever ``dataset`` is (indexed sources pickle by path), so it works
    with DataLoader worker processes.
    """

    def __init__(self, dataset, cfg: SampleConfig | None = None):
        self.dataset = dataset
        self.cfg = cfg or SampleConfig()
        if (self.cfg.eod_mask_loss or self.cfg.reset_position_ids) and self.cfg.eod is None:
            raise TokenloomError("eod_mask_loss / reset_position_ids need the EOD id")

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, k: int) -> dict[str, np.ndarray | np.int32 | np.int64]:
        if self.cfg.inter_document_masking or self.cfg.labels_within_documents:
            sample, pieces = self.dataset.documents_of(k)
            sample = np.array(sample, dtype=np.int64)
        else:
            sample = np.array(self.dataset[k], dtype=np.int64)  # a private copy: tokens/labels are views of it
        if self.cfg.vocab_size is not None and len(sample) and sample.max() >= self.cfg.vocab_size:
            raise TokenloomError(f"sample {k} of {source_name(self.dataset, k)} holds token id {int(sample.max())}, "
                                 f"beyond the model's vocabulary ({self.cfg.vocab_size} ids); the data was "
                                 "tokenized with another tokenizer")
        tokens, labels = sample[:-1], sample[1:]
        loss_mask = np.ones(len(tokens), dtype=np.float32)
        if self.cfg.labels_within_documents:
            ends = np.cumsum(pieces)
            loss_mask[ends[ends < len(sample)] - 1] = 0.0
        padded = sample == self.cfg.pad_id
        if padded.any():  # only a kept partial sample is padded
            loss_mask[padded[1:]] = 0.0
            sample[padded] = 0
        positions = np.arange(len(tokens), dtype=np.int64)
        if self.cfg.eod is not None:
            is_eod = tokens == self.cfg.eod
            if self.cfg.eod_mask_loss:
                loss_mask[is_eod] = 0.0
            if self.cfg.reset_position_ids and is_eod.any():
                # position = index - (index just after the last EOD at or before it)
                starts = np.zeros(len(tokens), dtype=np.int64)
                after = np.flatnonzero(is_eod) + 1
                after = after[after < len(tokens)]
                starts[after] = after
                positions = positions - np.maximum.accumulate(starts)
        out: dict[str, np.ndarray | np.int32 | np.int64] = {"tokens": tokens, "labels": labels,
                                                            "loss_mask": loss_mask, "position_ids": positions}
        if self.cfg.inter_document_masking:
            out.update(document_boundaries(pieces, len(tokens)))
        if self.cfg.source_ids:
            out["source"] = np.int64(source_of(self.dataset, k))
        return out


def source_of(dataset, k: int) -> int:
    """The position of sample ``k``'s source among ``dataset``'s sources: a blend's member
    (``dataset.source_of``), 0 for a dataset of one source."""
    return dataset.source_of(k) if hasattr(dataset, "source_of") else 0


def source_name(dataset, k: int) -> str:
    """The path prefix (or description) of the source that sample ``k`` of ``dataset`` comes from."""
    while hasattr(dataset, "locate"):  # a blend: its member's source (a segmented blend's: the source order)
        d, k = dataset.locate(k)
        dataset = dataset.datasets[d] if isinstance(d, int) else d
    source = getattr(dataset, "source", dataset)
    return str(getattr(source, "path_prefix", None) or source)


def document_boundaries(pieces: np.ndarray, seq_length: int) -> dict[str, np.ndarray | np.int32]:
    """``cu_seqlens`` (int32, ``seq_length + 1`` entries padded with ``seq_length``),
    ``max_seqlen`` and restarting ``position_ids`` of inputs cut from pieces of these lengths
    (their sum is ``seq_length`` plus the extra label token)."""
    ends = np.cumsum(pieces)
    starts = np.concatenate([[0], ends[ends < seq_length], [seq_length]]).astype(np.int64)
    cu_seqlens = np.full(seq_length + 1, seq_length, dtype=np.int32)
    cu_seqlens[: len(starts)] = starts
    lengths = np.diff(starts)
    positions = np.arange(seq_length, dtype=np.int64) - np.repeat(starts[:-1], lengths)
    return {"cu_seqlens": cu_seqlens, "max_seqlen": np.int32(lengths.max()), "position_ids": positions}


class ConsumedSamplesSampler:
    """Batches of sample indices for one data-parallel rank, starting after ``consumed_samples``."""

    def __init__(
        self, total_samples: int, consumed_samples: int, micro_batch_size: int, dp_rank: int, dp_size: int
    ):
        if micro_batch_size < 1 or dp_size < 1 or not 0 <= dp_rank < dp_size:
            raise TokenloomError(
                f"bad sampler layout: micro_batch_size={micro_batch_size}, dp_rank={dp_rank}, "
                f"dp_size={dp_size}"
            )
        if not 0 <= consumed_samples <= total_samples:
            raise TokenloomError(
                f"consumed samples {consumed_samples} outside the dataset's {total_samples} "
                "(the index was built for fewer samples than the run asks for)"
            )
        self.total, self.consumed = total_samples, consumed_samples
        self.micro, self.rank, self.size = micro_batch_size, dp_rank, dp_size

    @property
    def global_batch(self) -> int:
        return self.micro * self.size

    def __len__(self) -> int:
        return (self.total - self.consumed) // self.global_batch

    def __iter__(self) -> Iterator[list[int]]:
        lo = self.rank * self.micro
        for start in range(self.consumed, self.total - self.global_batch + 1, self.global_batch):
            yield list(range(start + lo, start + lo + self.micro))


def fingerprint(description: dict) -> str:
    """A stable digest of what fixes the global sample order (stored in checkpoints)."""
    return hashlib.sha256(json.dumps(description, sort_keys=True, default=str).encode()).hexdigest()


def check_fingerprint(saved: str | None, current: str, force: bool = False) -> None:
    """Refuse to resume on different data unless forced (the global order would silently change)."""
    if saved is not None and saved != current and not force:
        raise TokenloomError(
            f"the checkpoint was trained on different data (fingerprint {saved[:12]}, now "
            f"{current[:12]}); resuming would change the sample order. Pass --set force_data=true to "
            "resume anyway"
        )
