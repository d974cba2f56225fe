"""Write and random-read throughput: tokenloom's indexed format vs megatron-core's, same data, same run.

Usage: python bench/indexed_bench.py [--documents N] [--reads N]
Needs the [interop] extra (megatron-core) for the baseline.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import warnings
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _table import best_interleaved, best_of, print_table, timed  # noqa: E402

from tokenloom.indexed import IndexedDataset, IndexedDatasetWriter  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--documents", type=int, default=100_000)
    ap.add_argument("--reads", type=int, default=200_000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets.indexed_dataset import IndexedDataset as MReader
        from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder as MBuilder

    rng = np.random.default_rng(args.seed)
    lengths = rng.integers(1, 1024, size=args.documents)
    tokens = rng.integers(0, 50257, size=int(lengths.sum()), dtype=np.int64).astype(np.uint16)
    docs = np.split(tokens, np.cumsum(lengths)[:-1])
    total = tokens.size
    tmp = Path(tempfile.mkdtemp(prefix="tl-bench-"))

    def write_ours():
        with IndexedDatasetWriter(tmp / "ours", dtype=np.uint16) as w:
            for doc in docs:
                w.add_document(doc)

    def write_theirs():
        b = MBuilder(str(tmp / "theirs.bin"), dtype=np.uint16)
        for doc in docs:
            b.add_document(doc, [doc.size])
        b.finalize(str(tmp / "theirs.idx"))

    # alternated (ours, theirs, ours, ...) so drifting load reaches both sides alike
    t_ours, t_theirs = best_interleaved([timed(write_ours), timed(write_theirs)], repeat=5)
    assert (tmp / "ours.idx").read_bytes() == (tmp / "theirs.idx").read_bytes()

    ours, theirs = IndexedDataset(tmp / "ours"), MReader(str(tmp / "theirs"))
    idx = rng.integers(0, args.documents, size=args.reads)
    offs = (rng.random(args.reads) * (lengths[idx] // 2)).astype(np.int64)
    take = (lengths[idx] - offs).astype(np.int64)

    def reads(ds):
        def run():
            s = 0
            for i in idx.tolist():
                s += ds[i].size
            return s
        return run

    def gets(ds):
        def run():
            for i, o, n in zip(idx.tolist(), offs.tolist(), take.tolist(), strict=True):
                ds.get(i, offset=o, length=n)
        return run

    r_ours, r_theirs = best_of(reads(ours)), best_of(reads(theirs))
    g_ours, g_theirs = best_of(gets(ours)), best_of(gets(theirs))
    mtok = total / 1e6
    rows = [
        ("write (M tokens/s; ours also fsyncs both files)", f"{mtok / t_ours:.1f}", f"{mtok / t_theirs:.1f}", f"{t_theirs / t_ours:.2f}x"),
        ("random ds[i] (k reads/s)", f"{args.reads / r_ours / 1e3:.0f}", f"{args.reads / r_theirs / 1e3:.0f}",
         f"{r_theirs / r_ours:.2f}x"),
        ("random get(i, off, n) (k reads/s)", f"{args.reads / g_ours / 1e3:.0f}",
         f"{args.reads / g_theirs / 1e3:.0f}", f"{g_theirs / g_ours:.2f}x"),
    ]
    print_table(f"indexed format: {args.documents} documents, {total / 1e6:.1f} M uint16 tokens; "
                "baseline = megatron-core 0.16.1 (ratio > 1: tokenloom faster)", rows)


if __name__ == "__main__":
    main()
