"""GPT samples over one token source: document, sample and shuffle index (Megatron-exact).

Policy (Megatron's, kept bit for bit so a run can switch between the two): every
*sequence* is a "document"; a split's documents are repeated for E epochs and
shuffled with ``numpy.random.RandomState(seed)``; the flattened token stream is
cut into windows of ``seq_length + 1`` tokens that share their boundary token
(sample j's last label is sample j+1's first input), so no token is lost except
the tail of the last epoch (< seq_length tokens); samples are visited through a
shuffled index. If the final epoch would contribute under 80% of an epoch's
samples it is shuffled apart, so it is consumed only after all earlier epochs.
``packing="best-fit"`` is the other policy (:func:`build_packed_indices`): whole documents
packed into samples with padding, so no document of up to a sample is cut; its arrays
are tokenloom's own, not Megatron's.

Worked example (also a unit test): five sequences of lengths 3, 5, 2, 4, 6 (20
tokens), ``seq_length=4``, ``seed=1234``, the extra token on, 5 samples asked:

* epochs: 5 * 4 + 1 = 21 tokens needed > 20, so E = 2; the final epoch gives
  5 - (20 - 1) // 4 = 1 sample < int(0.8 * 4), so it is shuffled separately;
* document index (int32), epoch 1 then epoch 2: ``[4 0 1 2 3 | 3 2 1 0 4]``;
* sample index (int32), (position in document index, offset) where sample j starts:
  ``[[0 0] [0 4] [1 2] [2 3] [4 0] [5 0] [6 0] [7 2] [8 1] [9 2]]`` -- 9 samples over
  2 * 20 - 1 = 39 tokens. Sample 0 is tokens 0-4 of sequence 4; sample 1 starts on
  that last token (position 0, offset 4) and reads 2 + 3 tokens: the rest of
  sequence 4 and all of sequence 0 (position 1, offsets 0 to 2 + 1);
* shuffle index (uint32): ``[2 0 3 1 | 5 8 4 6 7]`` -- the 4 samples that fit in
  epoch 1 first, then the ones touching epoch 2.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Literal, Protocol

import numpy as np

from tokenloom.blending import helpers
from tokenloom.blending.split import Split
from tokenloom.errors import TokenloomError

PACKINGS = ("concat", "best-fit")
"""How samples are cut from documents (:attr:`GPTDatasetConfig.packing`)."""

FINAL_EPOCH_THRESHOLD = 0.80
"""A final epoch giving fewer than this fraction of an epoch's samples is shuffled apart."""


class TokenSource(Protocol):
    """What the index needs from a token file (``tokenloom.indexed.IndexedDataset``, a mock)."""

    @property
    def sequence_lengths(self) -> np.ndarray: ...  # int32, one per sequence
    @property
    def path_prefix(self) -> str | None: ...

    def __len__(self) -> int: ...

    def get(self, idx: int, offset: int = 0, length: int | None = None) -> np.ndarray: ...


@dataclass(frozen=True, kw_only=True)
class GPTDatasetConfig:
    """How GPT samples are cut from token sources (Megatron's ``GPTDatasetConfig``)."""

    seq_length: int
    """Tokens per sample (Megatron's ``sequence_length``); a sample reads seq_length + 1 tokens."""

    seed: int = 1234
    """Seed of the document and sample shuffles; every dataset and split starts from it."""

    split: str | None = "969, 30, 1"
    """Train/valid/test weights over each source's sequences, e.g. "969,30,1"; None with per-split blends."""

    add_extra_token: bool = True
    """Read seq_length + 1 tokens per sample so inputs and labels are both seq_length long."""

    drop_last_partial_validation_sequence: bool = True
    """Drop the last, partial, validation sample (train and test always drop it)."""

    pad_id: int = -1
    """Token that pads the last partial sample when it is kept."""

    packing: Literal["concat", "best-fit"] = "concat"
    """ "concat": Megatron's windows over the concatenated documents; "best-fit": documents
    (longer ones cut into sample-sized pieces) packed whole into samples, the rest padding."""

    mode: Literal["megatron", "exact"] = "megatron"
    """ "megatron" reproduces Megatron's arrays; "exact" counts a kept partial sample in
    exact arithmetic (Megatron rounds in float32 and drops it past 2^24 tokens)."""

    def __post_init__(self) -> None:
        if self.seq_length < 1:
            raise TokenloomError(f"seq_length must be >= 1, got {self.seq_length}")
        if not 0 <= self.seed < 2**32:
            raise TokenloomError(f"seed must be in [0, 2^32), got {self.seed}")
        if self.packing not in PACKINGS:
            raise TokenloomError(f"packing must be one of {', '.join(PACKINGS)}, got {self.packing!r}")
        if self.packing == "best-fit" and self.seq_length + self.add_extra_token < 2:
            raise TokenloomError("best-fit packing needs samples of at least 2 tokens")
        if self.mode not in ("megatron", "exact"):
            raise TokenloomError(f"mode must be 'megatron' or 'exact', got {self.mode!r}")


PACKER = 2
"""Best-fit's algorithm, in its cache keys: bumped whenever its samples change for the same
inputs (2: the refill), so indices cached by an older packer are built again."""


def key_fields(config: GPTDatasetConfig) -> dict:
    """``config`` as cache keys take it: every field, but ``packing`` only when it is not
    "concat" (so the keys of concatenated indices did not change when packing came), and then
    with :data:`PACKER`."""
    fields = asdict(config)
    if fields["packing"] == "concat":
        del fields["packing"]
    else:
        fields["packer"] = PACKER
    return fields


@dataclass(frozen=True)
class GPTIndices:
    """The three arrays that define a GPT dataset, plus how they were derived.

    Two layouts, told apart by ``document_index.ndim`` (:attr:`packed`): Megatron's
    (concat) and best-fit's, where ``document_index`` holds the samples' parts and
    ``sample_index`` is a 1-D pointer into them.
    """

    document_index: np.ndarray
    """concat: int32, the split's sequence ids, E times, shuffled. best-fit: int32 [P, 3], the
    parts (sequence id, token offset, length) of every sample, sample after sample."""
    sample_index: np.ndarray
    """concat: int32 or int64 [n + 1, 2], (position in document_index, token offset) where sample
    j starts. best-fit: int64 [n + 1], sample j is parts ``sample_index[j]:sample_index[j + 1]``."""
    shuffle_index: np.ndarray
    """uint32 (int64 past 2^32 - 2 samples): the order in which samples are served."""
    num_epochs: int
    separate_final_epoch: bool
    tokens_per_epoch: int

    def __len__(self) -> int:
        return self.sample_index.shape[0] - 1

    @property
    def packed(self) -> bool:
        """True for best-fit indices (parts), False for Megatron's."""
        return self.document_index.ndim == 2


def count_epochs(tokens_per_epoch: int, num_samples: int | None, seq_length: int, extra: int) -> int:
    """Smallest E >= 1 with E * tokens_per_epoch >= num_samples * seq_length + extra."""
    if num_samples is None:
        return 1
    needed = num_samples * seq_length + extra
    if tokens_per_epoch <= 0:
        if needed <= 0:
            return 1
        raise TokenloomError(f"{num_samples} samples requested from a split with no tokens")
    return max(1, -(-needed // tokens_per_epoch))


def epoch_plan(
    tokens_per_epoch: int, num_samples: int | None, config: GPTDatasetConfig
) -> tuple[int, bool, int]:
    """``(num_epochs, separate_final_epoch, samples before the final epoch)`` for one split."""
    seq_length, extra = config.seq_length, int(config.add_extra_token)
    num_epochs = count_epochs(tokens_per_epoch, num_samples, seq_length, extra)
    if num_epochs == 1 or num_samples is None:  # no num_samples: one epoch
        return 1, False, 0
    num_before_final = ((num_epochs - 1) * tokens_per_epoch - extra) // seq_length
    num_from_final = num_samples - num_before_final
    per_epoch = (tokens_per_epoch - extra) // seq_length
    assert 0 <= num_from_final <= per_epoch + 1, (num_from_final, per_epoch)
    return num_epochs, num_from_final < int(FINAL_EPOCH_THRESHOLD * per_epoch), num_before_final


def build_document_index(
    documents: np.ndarray, num_epochs: int, rng: helpers.Shuffler, separate_final_epoch: bool
) -> np.ndarray:
    """``documents`` tiled ``num_epochs`` times and shuffled (the last epoch apart if asked)."""
    if separate_final_epoch and num_epochs > 1:
        first = build_document_index(documents, num_epochs - 1, rng, False)
        return np.concatenate([first, build_document_index(documents, 1, rng, False)])
    index = np.tile(documents.astype(np.int32, copy=False), num_epochs)
    helpers.shuffle(rng, index)
    return index


def build_shuffle_index(num_first: int, total: int, rng: helpers.Shuffler) -> np.ndarray:
    """``[0, num_first)`` shuffled, then ``[num_first, total)`` shuffled."""
    dtype = np.uint32 if total < np.iinfo(np.uint32).max - 1 else np.int64
    first = np.arange(num_first, dtype=dtype)
    helpers.shuffle(rng, first)
    if num_first == total:
        return first
    last = np.arange(num_first, total, dtype=dtype)
    helpers.shuffle(rng, last)
    return np.concatenate([first, last])


def _total_length(sequence_lengths: np.ndarray, documents: np.ndarray) -> int:
    """Sum of the documents' lengths: a slice when they are a contiguous range (splits always
    are; strictly increasing with span == count proves it), else a gather."""
    n = len(documents)
    if n and int(documents[-1]) - int(documents[0]) + 1 == n and bool(np.all(documents[1:] > documents[:-1])):
        lo = int(documents[0])
        return int(np.sum(sequence_lengths[lo : lo + n], dtype=np.int64))
    return int(np.sum(sequence_lengths[documents], dtype=np.int64))


def build_gpt_indices(
    sequence_lengths: np.ndarray,
    documents: np.ndarray,
    num_samples: int | None,
    split: Split,
    config: GPTDatasetConfig,
) -> GPTIndices:
    """Document, sample and shuffle index of one split of one source (a pure function).

    ``documents`` are the split's sequence ids (int32, see ``split.split_documents``);
    ``num_samples`` None means one epoch. Same arrays as Megatron's GPTDataset.
    """
    if sequence_lengths.dtype != np.int32:
        raise TypeError(f"sequence_lengths must be int32, got {sequence_lengths.dtype}")
    if config.packing == "best-fit":
        return build_packed_indices(sequence_lengths, documents, num_samples, config)
    seq_length, extra = config.seq_length, int(config.add_extra_token)
    tokens_per_epoch = _total_length(sequence_lengths, documents)
    num_epochs, separate, num_before_final = epoch_plan(tokens_per_epoch, num_samples, config)

    rng = helpers.SeededStream(config.seed)  # RandomState(seed)'s draws, without seeding one per index
    document_index = build_document_index(documents, num_epochs, rng, separate)
    drop_last = config.drop_last_partial_validation_sequence if split == Split.valid else True
    if num_epochs * tokens_per_epoch - extra < 0:  # an empty split: no samples (Megatron's result for S > 1)
        sample_index = np.zeros((1, 2), dtype=np.int32)
    else:
        sample_index = helpers.build_sample_idx(
            sequence_lengths,
            document_index,
            seq_length,
            num_epochs,
            tokens_per_epoch,
            drop_last,
            config.add_extra_token,
            exact_ceil=config.mode == "exact",
        )
    num_built = sample_index.shape[0] - 1
    shuffle_index = build_shuffle_index(num_before_final if separate else num_built, num_built, rng)
    return GPTIndices(document_index, sample_index, shuffle_index, num_epochs, separate, tokens_per_epoch)


def build_packed_indices(
    sequence_lengths: np.ndarray, documents: np.ndarray, num_samples: int | None, config: GPTDatasetConfig
) -> GPTIndices:
    """Best-fit indices of one split of one source (a pure function; ``packing="best-fit"``).

    A sample holds ``seq_length + 1`` tokens (with the extra token), as a concat sample does,
    but of whole documents: inputs are its first ``seq_length`` tokens, labels its last, and a
    label is trained only inside the document of its input (the loader masks each document's
    last input and the padding). So a document of up to ``seq_length + 1`` tokens fits whole;
    a longer one is cut into pieces of ``seq_length + 1`` tokens starting every ``seq_length``
    (each piece shares its first token with the last of the piece before, so every label of
    the document is trained once). Per epoch: the split's documents are shuffled with the
    seed, their pieces packed by best-fit decreasing (``helpers.pack_best_fit``; equal
    lengths keep the shuffled order, so each epoch packs differently), then refilled: where the
    room left adds up to whole samples, the emptiest samples that hold only last pieces of cut
    documents (fragments already) are poured into the others' room, those pieces cut again, so
    an epoch is as few samples as its tokens need wherever enough such pieces exist (what the
    cut pieces alone cannot reach: :func:`fewest_packed_samples`); the epoch's samples are
    shuffled; epochs follow each other whole. As many epochs are built as ``num_samples``
    needs (one when None). The trade-off against concat: padding (the room best fit leaves)
    instead of documents cut at sample boundaries. The packer is our own C++ (a segment tree
    over room values): the bin-packing packages on PyPI (binpacking, prtpy) are Python loops,
    far from packing 10 M documents in seconds.
    """
    extra = int(config.add_extra_token)
    capacity, step = config.seq_length + extra, config.seq_length
    rng = helpers.SeededStream(config.seed)
    tokens_per_epoch = _total_length(sequence_lengths, documents)
    parts: list[np.ndarray] = []
    starts: list[np.ndarray] = []
    orders: list[np.ndarray] = []
    built = 0
    while not orders or (num_samples is not None and built < num_samples):
        order = np.array(documents, dtype=np.int32)
        helpers.shuffle(rng, order)
        epoch_parts, epoch_starts = helpers.pack_best_fit(sequence_lengths, order, capacity, step)
        del order
        count = len(epoch_starts) - 1
        if count == 0:
            if num_samples:
                raise TokenloomError(f"{num_samples} samples requested from a split with no tokens")
            break
        samples = np.arange(built, built + count, dtype=np.uint32 if built + count < 2**32 - 1 else np.int64)
        helpers.shuffle(rng, samples)
        if starts:  # later epochs' pointers continue the earlier ones'
            epoch_starts = epoch_starts[1:] + starts[-1][-1]
        parts.append(epoch_parts)
        starts.append(epoch_starts)
        orders.append(samples)
        built += count
    if not orders:
        parts, starts, orders = [np.zeros((0, 3), np.int32)], [np.zeros(1, np.int64)], [np.zeros(0, np.uint32)]
    dtype = np.uint32 if built < np.iinfo(np.uint32).max - 1 else np.int64
    one = len(orders) == 1  # one epoch: the packer's arrays as they are (no copies)
    return GPTIndices(
        parts[0] if one else np.concatenate(parts),
        starts[0] if one else np.concatenate(starts),
        orders[0].astype(dtype, copy=False) if one else np.concatenate([o.astype(dtype) for o in orders]),
        num_epochs=max(1, len(orders)),
        separate_final_epoch=False,
        tokens_per_epoch=tokens_per_epoch,
    )


@dataclass(frozen=True)
class PackingCost:
    """What best-fit packing cost one split of one source (the plan's packing columns)."""

    samples: int
    """Samples built (all epochs)."""
    padding: int
    """Padding tokens in them."""
    padding_share: float
    """padding / (samples x tokens per sample)."""
    cut: int
    """Documents of one epoch cut into pieces: those longer than a sample."""
    concat_cut: int
    """Documents of one epoch that concatenation would cut at a sample boundary (taken in the
    split's order; Megatron's shuffled order cuts about as many)."""


def packing_cost(indices: GPTIndices, lengths: np.ndarray, config: GPTDatasetConfig) -> PackingCost:
    """:class:`PackingCost` of best-fit ``indices`` over documents of these ``lengths`` (one epoch)."""
    capacity = config.seq_length + int(config.add_extra_token)
    lengths = np.asarray(lengths, dtype=np.int64)
    samples = len(indices)
    used = int(np.sum(indices.document_index[:, 2], dtype=np.int64)) if samples else 0
    padding = samples * capacity - used
    return PackingCost(samples, padding, padding / max(1, samples * capacity), int(np.sum(lengths > capacity)),
                       concat_cuts(lengths, config.seq_length))


def packed_pieces(lengths: np.ndarray, config: GPTDatasetConfig) -> np.ndarray:
    """The sizes (int64) of the pieces best fit packs documents of these ``lengths`` into
    before the refill: a document of up to a sample whole, a longer one as pieces of a sample
    starting every ``seq_length`` tokens (:func:`build_packed_indices`), the last one the rest.
    Empty documents give none."""
    capacity, step = config.seq_length + int(config.add_extra_token), config.seq_length
    lengths = np.asarray(lengths, dtype=np.int64)
    lengths = lengths[lengths > 0]
    long = lengths > capacity
    count = np.where(long, (lengths - (capacity - step) + step - 1) // step, 1)
    last = lengths - (count - 1) * step
    return np.concatenate([np.full(int(np.sum(count - 1)), capacity, dtype=np.int64), last])


def fewest_packed_samples(lengths: np.ndarray, config: GPTDatasetConfig) -> int:
    """A lower bound on the samples of any packing of the :func:`packed_pieces` of documents of
    these ``lengths`` (one epoch): Martello and Toth's L2 bound for bin packing. For each K up to
    half a sample, the pieces over ``capacity - K`` and those over half a sample each need a
    sample of their own (no two of the latter share one), and the pieces of K to half a sample
    need at least the room they lack beside the latter; K = 0 is the total tokens over the sample
    size. No packing of these pieces, uncut, has fewer samples; the refill goes under it only by
    cutting last pieces again (:func:`build_packed_indices`). Sorting
    the pieces is the cost (O(P log P)), plus a binary search per distinct small size."""
    capacity = config.seq_length + int(config.add_extra_token)
    pieces = np.sort(packed_pieces(lengths, config))
    if not len(pieces):
        return 0
    sums = np.concatenate([[0], np.cumsum(pieces)])
    half = int(np.searchsorted(pieces, capacity // 2, side="right"))  # pieces[:half] are <= capacity / 2
    small = np.unique(pieces[:half])
    ks = np.concatenate([[0], small])
    lo = np.searchsorted(pieces, ks, side="left")  # J3 = pieces[lo:half]: from K to half a sample
    hi = np.searchsorted(pieces, capacity - ks, side="right")  # J2 = pieces[half:hi], J1 = pieces[hi:]
    big = len(pieces) - half  # |J1| + |J2|
    room = (hi - half) * capacity - (sums[hi] - sums[half])  # what J2's samples leave
    rest = np.maximum(0, -(-(sums[half] - sums[lo] - room) // capacity))
    return int(np.max(big + rest))


def concat_cuts(lengths: np.ndarray, seq_length: int) -> int:
    """Documents of these lengths, laid end to end, that no window of ``seq_length + 1`` tokens
    starting at a multiple of ``seq_length`` holds whole (Megatron's samples)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    lengths = lengths[lengths > 0]
    ends = np.cumsum(lengths)
    starts = ends - lengths
    last = ends - 1  # the document's last token
    window = np.maximum(-(-last // seq_length) - 1, 0)  # the first window whose end reaches it
    return int(np.sum(window * seq_length > starts))


class GPTDataset:
    """Samples of ``seq_length (+1)`` tokens from one split of one source.

    ``documents`` are the split's sequence ids: an int32 array, or a ``range`` when the
    indices are given (a blend loaded from the cache keeps no id array per member).
    """

    def __init__(
        self,
        source: TokenSource,
        documents: np.ndarray,
        num_samples: int | None,
        split: Split,
        config: GPTDatasetConfig,
        indices: GPTIndices | None = None,
    ) -> None:
        self.source = source
        self.documents = documents
        self.num_samples = num_samples
        self.split = split
        self.config = config
        self.indices = indices if indices is not None else build_gpt_indices(
            source.sequence_lengths, documents, num_samples, split, config
        )

    def __len__(self) -> int:
        return len(self.indices)

    def __repr__(self) -> str:
        return (
            f"GPTDataset({self.source.path_prefix!r}, split={self.split.name}, samples={len(self)}, "
            f"epochs={self.indices.num_epochs}, sequences={len(self.documents)})"
        )

    def __getitem__(self, k: int) -> np.ndarray:
        """Sample k (in shuffled order): ``seq_length + x`` tokens as int64, padded with pad_id if partial."""
        return self.read(int(self.indices.shuffle_index[k]))

    def documents_of(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Sample k and the lengths of the document pieces it is made of, in order (a padded
        tail counts as one more piece): what document-isolated attention needs."""
        parts = self.read_parts(int(self.indices.shuffle_index[k]))
        return np.concatenate(parts, dtype=np.int64), np.array([len(p) for p in parts], dtype=np.int64)

    def read(self, j: int) -> np.ndarray:
        """Unshuffled sample j: the tokens between sample_index rows j and j + 1 (+ x)."""
        return np.concatenate(self.read_parts(j), dtype=np.int64)

    def read_parts(self, j: int) -> list[np.ndarray]:
        """Unshuffled sample j as its document pieces (and a pad piece if it is partial)."""
        extra = int(self.config.add_extra_token)
        get = self.source.get
        if self.indices.packed:
            p0, p1 = self.indices.sample_index[j : j + 2].tolist()
            parts = [get(d, offset=o, length=n) for d, o, n in self.indices.document_index[p0:p1].tolist()]
            return self._padded(parts)
        # One slice and one tolist() per array: element-wise indexing of mapped arrays
        # costs about a microsecond per access, which dominates short samples.
        p0, o0, p1, o1 = self.indices.sample_index[j : j + 2].ravel().tolist()
        docs = self.indices.document_index[p0 : p1 + 1].tolist()
        if p0 == p1:
            parts = [get(docs[0], offset=o0, length=o1 - o0 + extra)]
        else:
            parts = [get(docs[0], offset=o0)]
            parts += [get(d) for d in docs[1:-1]]
            parts.append(get(docs[-1], offset=0, length=o1 + extra))
        return self._padded(parts)

    def layout(self, j: int) -> tuple[list[tuple[int, int, int]], int]:
        """Unshuffled sample j as ``([(sequence id, offset, length), ...], padding tokens)``,
        without reading a token (what ``build --dump-samples`` writes)."""
        extra = int(self.config.add_extra_token)
        want = self.config.seq_length + extra
        if self.indices.packed:
            p0, p1 = self.indices.sample_index[j : j + 2].tolist()
            rows = [(d, o, n) for d, o, n in self.indices.document_index[p0:p1].tolist()]
        else:
            p0, o0, p1, o1 = self.indices.sample_index[j : j + 2].ravel().tolist()
            docs = self.indices.document_index[p0 : p1 + 1].tolist()
            lengths = self.source.sequence_lengths
            if p0 == p1:
                rows = [(docs[0], o0, min(o1 - o0 + extra, int(lengths[docs[0]]) - o0))]
            else:
                rows = [(docs[0], o0, int(lengths[docs[0]]) - o0)]
                rows += [(d, 0, int(lengths[d])) for d in docs[1:-1]]
                rows.append((docs[-1], 0, min(o1 + extra, int(lengths[docs[-1]]))))
            rows = [r for r in rows if r[2] > 0]
        return rows, want - sum(r[2] for r in rows)

    def _padded(self, parts: list[np.ndarray]) -> list[np.ndarray]:
        want = self.config.seq_length + int(self.config.add_extra_token)
        have = sum(len(part) for part in parts)
        if have < want:
            parts.append(np.full(want - have, self.config.pad_id, dtype=np.int64))
        return [part for part in parts if len(part)]
