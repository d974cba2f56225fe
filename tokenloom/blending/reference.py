"""Pure-numpy references for the C++ index builders in ``csrc/helpers.cpp``.

Same names, signatures, results and errors as the native functions; used when the
extension is missing and, in the tests, as the second opinion on random inputs.
The sample index is vectorised (a ``searchsorted`` over cumulative token counts);
the two greedy blends are sequential by nature and run as plain Python loops
(fine as a fallback, slow for 100 M-sample blends; see bench/RESULTS.md, notes).
"""

from __future__ import annotations

import bisect
import sys

import numpy as np

MAX_DATASETS = int(np.iinfo(np.int16).max)  # the dataset index is int16


def _checked(arr: object, name: str, dtype: type, writable: bool = False) -> np.ndarray:
    """``arr`` if it is a 1-D C-contiguous array of exactly ``dtype``; never converts."""
    if not isinstance(arr, np.ndarray):
        raise TypeError(
            f"argument '{name}' must be a numpy array of dtype {np.dtype(dtype).name}, "
            f"got {type(arr).__name__}"
        )
    if arr.dtype != np.dtype(dtype) or not arr.dtype.isnative:
        raise TypeError(
            f"argument '{name}' must have dtype {np.dtype(dtype).name} (native byte order), got {arr.dtype}"
        )
    if arr.ndim != 1:
        raise ValueError(f"argument '{name}' must be 1-D, got {arr.ndim} dimensions")
    if not arr.flags.c_contiguous:
        raise ValueError(f"argument '{name}' must be C-contiguous")
    if writable and not arr.flags.writeable:
        raise ValueError(f"argument '{name}' must be writable")
    return arr


def _check_length(have: int, need: int, name: str) -> None:
    if have < need:
        raise ValueError(f"argument '{name}' has {have} elements, needs at least {need}")


def _check_num_datasets(num_datasets: int, allow_zero: bool) -> None:
    lowest = 0 if allow_zero else 1
    if num_datasets < lowest:
        raise ValueError(f"num_datasets must be >= {lowest}, got {num_datasets}")
    if num_datasets > MAX_DATASETS:
        raise ValueError(
            f"at most {MAX_DATASETS} datasets can be blended (the dataset index is int16), got {num_datasets}"
        )


def count_samples(total_tokens: int, seq_length: int, drop_last: bool, exact_ceil: bool = False) -> int:
    """Rows (minus one) of the sample index for ``total_tokens = E*T - x`` tokens.

    ``drop_last`` floors; otherwise Megatron rounds up in *single precision*
    (``ceil(float32(total) / float32(S))``), which undercounts past 2**24 tokens;
    ``exact_ceil`` rounds up exactly instead. Division truncates toward zero, as in C.
    """
    if drop_last or exact_ceil:
        quotient = abs(total_tokens) // seq_length
        if total_tokens < 0:
            return -quotient
        return quotient + int(exact_ceil and not drop_last and total_tokens % seq_length > 0)
    return int(np.ceil(np.float32(total_tokens) / np.float32(seq_length)))


def _build_sample_idx(
    sizes, doc_idx, seq_length, num_epochs, tokens_per_epoch, drop_last, add_extra_token, exact_ceil, dtype
):
    sizes = _checked(sizes, "sizes", np.int32)
    doc_idx = _checked(doc_idx, "doc_idx", np.int32)
    if seq_length < 1:
        raise ValueError(f"seq_length must be >= 1, got {seq_length}")
    if num_epochs < 1:
        raise ValueError(f"num_epochs must be >= 1, got {num_epochs}")
    if tokens_per_epoch < 0:
        raise ValueError(f"tokens_per_epoch must be >= 0, got {tokens_per_epoch}")
    if add_extra_token not in (0, 1):
        raise ValueError(f"add_extra_token must be 0 or 1, got {add_extra_token}")
    if len(doc_idx) - 1 > np.iinfo(dtype).max:
        raise ValueError(
            f"doc_idx has {len(doc_idx)} entries, too many for a {np.dtype(dtype).name} sample index; "
            "use build_sample_idx_int64"
        )
    total_tokens = int(num_epochs) * int(tokens_per_epoch) - add_extra_token
    if total_tokens >= 2**63:
        raise ValueError("num_epochs * tokens_per_epoch overflows int64")
    num_samples = count_samples(total_tokens, seq_length, drop_last, exact_ceil)
    if num_samples < 0:
        raise ValueError(f"num_epochs * tokens_per_epoch - add_extra_token is negative ({total_tokens})")
    if num_samples > 0 and len(doc_idx) == 0:
        raise ValueError(f"doc_idx is empty but {num_samples} samples are requested")

    out = np.zeros((num_samples + 1, 2), dtype=dtype)
    if num_samples == 0:
        return out
    # Sample s (1-based) ends at global token s*S + x; its row is the sequence that
    # holds that end (the first one, across empty sequences) and the offset x before
    # it. Ends past the last token clamp to (last, len(last) - x).
    bad = (doc_idx < 0) | (doc_idx >= len(sizes))
    if bad.any():
        pos = int(np.argmax(bad))
        raise ValueError(f"doc_idx[{pos}] = {doc_idx[pos]} is out of range for sizes of length {len(sizes)}")
    lengths = sizes[doc_idx].astype(np.int64)
    if (lengths < 0).any():
        seq = int(doc_idx[np.argmax(lengths < 0)])
        raise ValueError(f"sizes[{seq}] = {sizes[seq]} is negative")
    ends_cum = np.cumsum(lengths)  # ends_cum[p] = tokens up to the end of position p
    ends = np.arange(1, num_samples + 1, dtype=np.int64) * seq_length + add_extra_token
    pos = np.searchsorted(ends_cum, ends, side="left")
    past = pos >= len(doc_idx)
    pos[past] = len(doc_idx) - 1
    starts_cum = ends_cum - lengths
    offset = ends - add_extra_token - starts_cum[pos]
    offset[past] = lengths[-1] - add_extra_token
    out[1:, 0] = pos
    out[1:, 1] = offset
    return out


def build_sample_idx_int32(
    sizes: np.ndarray,
    doc_idx: np.ndarray,
    seq_length: int,
    num_epochs: int,
    tokens_per_epoch: int,
    drop_last: bool = True,
    add_extra_token: int = 1,
    exact_ceil: bool = False,
) -> np.ndarray:
    """The GPT sample index as int32 ``[n + 1, 2]``: (position in ``doc_idx``, token offset)."""
    return _build_sample_idx(
        sizes,
        doc_idx,
        seq_length,
        num_epochs,
        tokens_per_epoch,
        drop_last,
        add_extra_token,
        exact_ceil,
        np.int32,
    )


def build_sample_idx_int64(
    sizes: np.ndarray,
    doc_idx: np.ndarray,
    seq_length: int,
    num_epochs: int,
    tokens_per_epoch: int,
    drop_last: bool = True,
    add_extra_token: int = 1,
    exact_ceil: bool = False,
) -> np.ndarray:
    """As :func:`build_sample_idx_int32`, stored as int64."""
    return _build_sample_idx(
        sizes,
        doc_idx,
        seq_length,
        num_epochs,
        tokens_per_epoch,
        drop_last,
        add_extra_token,
        exact_ceil,
        np.int64,
    )


def build_blending_indices(
    dataset_index: np.ndarray,
    dataset_sample_index: np.ndarray,
    weights: np.ndarray,
    num_datasets: int,
    size: int,
    verbose: bool = False,
) -> None:
    """Fill the first ``size`` entries of the outputs by the greedy largest-error rule.

    Step i picks the lowest d maximising ``w[d] * max(i, 1) - count[d]`` (Megatron's
    ``max(i, 1)`` kept), records ``(d, count[d])`` and increments ``count[d]``.
    """
    _checked(dataset_index, "dataset_index", np.int16, writable=True)
    _checked(dataset_sample_index, "dataset_sample_index", np.int64, writable=True)
    _checked(weights, "weights", np.float64)
    _check_num_datasets(num_datasets, allow_zero=False)
    if size < 0:
        raise ValueError(f"size must be >= 0, got {size}")
    _check_length(len(weights), num_datasets, "weights")
    _check_length(len(dataset_index), size, "dataset_index")
    _check_length(len(dataset_sample_index), size, "dataset_sample_index")
    if verbose:
        print("> building indices for blended datasets ...")
    w = [float(x) for x in weights[:num_datasets]]
    counts = [0] * num_datasets
    chosen = np.empty(size, dtype=np.int16)
    drawn = np.empty(size, dtype=np.int64)
    for i in range(size):
        t = float(max(i, 1))
        best, best_error = 0, w[0] * t - counts[0]
        for d in range(1, num_datasets):
            error = w[d] * t - counts[d]
            if error > best_error:
                best, best_error = d, error
        chosen[i] = best
        drawn[i] = counts[best]
        counts[best] += 1
    dataset_index[:size] = chosen
    dataset_sample_index[:size] = drawn
    if verbose:
        print(" > sample ratios:")
        for d in range(num_datasets):
            print(f"   dataset {d}, input: {w[d]:g}, achieved: {counts[d] / size:g}")


def build_exhaustive_blending_indices(
    dataset_index: np.ndarray, dataset_sample_index: np.ndarray, sizes: np.ndarray, num_datasets: int
) -> None:
    """Fill the outputs with every sample of every dataset once (``sum(sizes)`` entries).

    Weights are ``sizes / sum(sizes)``; the greedy rule of :func:`build_blending_indices`
    runs over the datasets not yet exhausted.
    """
    _checked(dataset_index, "dataset_index", np.int16, writable=True)
    _checked(dataset_sample_index, "dataset_sample_index", np.int64, writable=True)
    _checked(sizes, "sizes", np.int64)
    _check_num_datasets(num_datasets, allow_zero=True)
    _check_length(len(sizes), num_datasets, "sizes")
    limits = [int(s) for s in sizes[:num_datasets]]
    for d, s in enumerate(limits):
        if s < 1:
            raise ValueError(f"sizes[{d}] must be >= 1, got {s}")
    total = sum(limits)
    if total >= 2**63:
        raise ValueError("sum of sizes overflows")
    _check_length(len(dataset_index), total, "dataset_index")
    _check_length(len(dataset_sample_index), total, "dataset_sample_index")
    w = [s / float(total) for s in limits]  # same float64 division as the C++
    counts = [0] * num_datasets
    live = list(range(num_datasets))
    chosen = np.empty(total, dtype=np.int16)
    drawn = np.empty(total, dtype=np.int64)
    for i in range(total):
        t = float(max(i, 1))
        best_pos, best_error = 0, -sys.float_info.max
        for k, d in enumerate(live):
            error = w[d] * t - counts[d]
            if error > best_error:
                best_pos, best_error = k, error
        best = live[best_pos]
        chosen[i] = best
        drawn[i] = counts[best]
        counts[best] += 1
        if counts[best] == limits[best]:
            del live[best_pos]
    dataset_index[:total] = chosen
    dataset_sample_index[:total] = drawn


def pack_best_fit(sizes: np.ndarray, doc_idx: np.ndarray, capacity: int, step: int) -> tuple[np.ndarray, np.ndarray]:
    """One epoch packed by best-fit decreasing (``csrc/helpers.cpp`` ``pack_best_fit``): the
    same samples in the same order. A plain loop with a ``bisect`` over the open samples' rooms
    (a fallback: fine for tests, slow for millions of documents)."""
    sizes = _checked(sizes, "sizes", np.int32)
    doc_idx = _checked(doc_idx, "doc_idx", np.int32)
    if capacity < 2:
        raise ValueError(f"capacity must be >= 2, got {capacity}")
    if not 1 <= step <= capacity:
        raise ValueError(f"step must lie in [1, capacity], got {step}")
    bad = np.flatnonzero((doc_idx < 0) | (doc_idx >= len(sizes)))
    if len(bad):
        p = int(bad[0])
        raise ValueError(f"doc_idx[{p}] = {int(doc_idx[p])} is out of range for sizes of length {len(sizes)}")
    lengths = sizes[doc_idx].astype(np.int64)
    if len(lengths) and lengths.min() < 0:
        d = int(doc_idx[int(np.argmin(lengths))])
        raise ValueError(f"sizes[{d}] = {int(sizes[d])} is negative")
    overlap = capacity - step
    pieces = np.where(lengths > capacity, (lengths - overlap + step - 1) // step, 1)
    last = np.where(lengths > capacity, lengths - (pieces - 1) * step, lengths)
    full = np.where(lengths > capacity, pieces - 1, 0) + (last == capacity)
    tail = np.where(last == capacity, 0, last)
    order = np.flatnonzero(tail > 0)
    order = order[np.argsort(capacity - tail[order], kind="stable")]
    rooms: list[int] = []  # sorted rooms of the open samples, one entry per (room, sample) via stacks
    stacks: dict[int, list[int]] = {}
    members: list[list[int]] = []
    for p in order.tolist():
        t = int(tail[p])
        at = bisect.bisect_left(rooms, t)
        if at == len(rooms):
            b = len(members)
            members.append([])
            left = capacity - t
        else:
            room = rooms[at]
            stack = stacks[room]
            b = stack.pop()
            if not stack:
                del rooms[at]
            left = room - t
        if left > 0:
            stack = stacks.setdefault(left, [])
            if not stack:
                bisect.insort(rooms, left)
            stack.append(b)
        members[b].append(p)
    rooms_left = [capacity - int(tail[m].sum()) for m in map(np.array, members)]
    emptied, poured = _refill(members, rooms_left, lengths, tail, capacity, overlap)
    into: dict[int, list[tuple[int, int, int]]] = {}  # sample -> the parts poured into it, in order
    for b, p, at, n in poured:
        into.setdefault(b, []).append((int(doc_idx[p]), at, n))
    rows, counts = [], []
    for b, m in enumerate(members):
        if b in emptied:
            continue
        held = [(int(doc_idx[p]), int(lengths[p] - tail[p]), int(tail[p])) for p in sorted(m)] + into.get(b, [])
        rows += held
        counts.append(len(held))
    rows += [(int(doc_idx[p]), f * step, capacity) for p in range(len(doc_idx)) for f in range(int(full[p]))]
    counts += [1] * int(full.sum())
    sample_index = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(counts, out=sample_index[1:])
    return np.array(rows, dtype=np.int32).reshape(-1, 3), sample_index


def _refill(members: list[list[int]], room: list[int], lengths: np.ndarray, tail: np.ndarray, capacity: int,
            overlap: int) -> tuple[set[int], list[tuple[int, int, int, int]]]:
    """``pack_best_fit``'s refill (the C++ ``Refill``): which samples of last pieces only are
    emptied, and the parts (sample, position, offset, length) poured into the others' rooms."""
    whole = [any(lengths[p] <= capacity for p in m) for m in members]
    candidates = sorted((b for b in range(len(members)) if not whole[b] and room[b] > 0), key=lambda b: -room[b])
    candidates = candidates[: sum(room) // capacity]
    rooms = sorted((b for b in range(len(members)) if room[b] > overlap), key=lambda b: -room[b])

    def pour(k: int) -> list[tuple[int, int, int, int]] | None:
        gone = set(candidates[:k])
        free = [b for b in rooms if b not in gone]
        out, g, left = [], 0, room[free[0]] if free else 0
        for p in (p for b in candidates[:k] for p in sorted(members[b])):
            rest, at = int(tail[p]), int(lengths[p] - tail[p])
            while True:
                if left <= overlap:
                    g += 1
                    if g >= len(free):
                        return None
                    left = room[free[g]]
                take = min(rest, left)
                out.append((free[g], p, at, take))
                left -= take
                if take == rest:
                    break
                at, rest, left = at + take - overlap, rest - take + overlap, 0
        return out

    lo, hi = 0, len(candidates)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if pour(mid) is not None else (lo, mid - 1)
    return set(candidates[:lo]), pour(lo) or []
