"""build-stage speed: index build and sample loading, tokenloom vs megatron-core, same data, same run.

Sources are synthetic and sparse: a real ``.idx`` (random sequence lengths) and a ``.bin``
that is one big hole (created with truncate; nothing close to its size is written), so
the bench needs neither real data nor disk space. Rows:

* cold index build of a 3-source blend (>= 2 M train samples, several G tokens) vs
  megatron-core's BlendedMegatronDatasetBuilder, each into a fresh cache directory that is
  removed after the run (both compute and save every array; ours also hashes every
  source's .idx for its content key); the two alternate, best of 5 each - target <= 0.5x.
  Removing the directory matters on a VM: pages the guest touches for the first time
  cost far more than reused ones, so a growing page cache slows whichever side runs later;
* a warm build from the cache vs megatron-core's warm build from its own cache (both caches
  filled by a first build; the two alternate, best of 5) - target <= 50 ms for ours, which
  is also shown against that constant. A new process sees the same as these repeats: our
  source digests are memoised in the cache, not in the process;
* loader samples/s at seq 2048 from the blend: tokenloom's GPTSamples over the blend vs
  megatron-core's BlendedDataset ``__getitem__`` (tokens, labels, masks, positions), the same
  random sample ids, the two alternating, best of 7 each - target >= 2x.

Usage: python bench/blend_bench.py [--sequences N] [--samples N]   (needs the [interop] extra)
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _table import best_interleaved, print_table, timed, timed_in_fresh_dir  # noqa: E402

from tokenloom.blending.build import BuildConfig, build  # noqa: E402
from tokenloom.blending.loader import GPTSamples, SampleConfig  # noqa: E402
from tokenloom.blending.sources import clear_memo  # noqa: E402
from tokenloom.indexed.format import write_index  # noqa: E402


def sparse_source(prefix: Path, num_sequences: int, max_length: int, seed: int) -> str:
    lengths = np.random.default_rng(seed).integers(1, max_length, size=num_sequences, dtype=np.int32)
    with open(f"{prefix}.bin", "wb") as f:
        f.truncate(int(lengths.sum(dtype=np.int64)) * 2)
    write_index(f"{prefix}.idx", np.uint16, lengths, np.arange(num_sequences + 1, dtype=np.int64))
    return str(prefix)


class BenchTokenizer:  # what megatron's GPTDatasetConfig needs from a tokenizer
    vocab_size = 32000
    eod = 0
    unique_identifiers = {"class": "BenchTokenizer"}


def check_equal(ours, theirs) -> int:
    """Every array of every split: the blend's two indices and each member's document, sample
    and shuffle indices, against megatron-core's. Returns how many arrays were compared."""
    checked = 0
    for split, (mine, other) in enumerate(zip(ours.datasets, theirs, strict=True)):
        if mine is None or other is None:
            assert mine is None and other is None, f"split {split}: one side has no dataset"
            continue
        pairs = [(mine.dataset_index, other.dataset_index, "dataset_index"),
                 (mine.dataset_sample_index, other.dataset_sample_index, "dataset_sample_index")]
        for k, (m, o) in enumerate(zip(mine.datasets, other.datasets, strict=True)):
            pairs += [(m.indices.document_index, o.document_index, f"member {k} document_index"),
                      (m.indices.sample_index, o.sample_index, f"member {k} sample_index"),
                      (m.indices.shuffle_index, o.shuffle_index, f"member {k} shuffle_index")]
        for a, b, name in pairs:
            assert np.array_equal(np.asarray(a), np.asarray(b)), f"split {split} {name} differs from megatron-core's"
            checked += 1
    return checked


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sequences", type=int, default=2_000_000, help="sequences per source (3 sources)")
    ap.add_argument("--max-length", type=int, default=2048, help="sequence lengths are uniform in [1, max)")
    ap.add_argument("--samples", type=int, default=2_000_000, help="train samples")
    ap.add_argument("--seq-length", type=int, default=2048)
    ap.add_argument("--reads", type=int, default=10000, help="samples read in the loader rows")
    args = ap.parse_args()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import torch.distributed as dist
        from megatron.core.datasets import gpt_dataset as mgpt
        from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder

    tmp = Path(tempfile.mkdtemp(prefix="tl-blend-bench-"))
    prefixes = [sparse_source(tmp / f"src{i}", args.sequences, args.max_length, seed=i) for i in range(3)]
    weights = [0.5, 0.3, 0.2]
    tokens = 3 * args.sequences * args.max_length // 2
    sizes = [args.samples, args.samples // 100, args.samples // 1000]
    split = "98,1,1"
    if not dist.is_initialized():  # megatron-core 0.16.1 blends want a process group
        dist.init_process_group("gloo", store=dist.FileStore(str(tmp / "store"), 1), rank=0, world_size=1)

    def megatron(cache_dir=None):
        config = mgpt.GPTDatasetConfig(
            random_seed=1234, sequence_length=args.seq_length, blend=(prefixes, weights), split=split,
            tokenizer=BenchTokenizer(), reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False,
            path_to_cache=cache_dir or tempfile.mkdtemp(dir=tmp))  # None would cache beside the sources
        return BlendedMegatronDatasetBuilder(mgpt.GPTDataset, sizes, lambda: True, config).build()

    def ours(cache_dir=None):
        return build(BuildConfig(data=list(zip(weights, prefixes, strict=True)), split=split,
                                 seq_length=args.seq_length, num_samples=tuple(sizes), cache_dir=cache_dir))

    def cold(fn):  # the memo cleared: count the digest of every source each time, as a new process would
        return timed_in_fresh_dir(fn, tmp, before=clear_memo)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t_ours, t_theirs = best_interleaved([cold(ours), cold(megatron)], repeat=5)
        theirs = megatron()
    cache, their_cache = str(tmp / "cache"), str(tmp / "megatron-cache")
    ours(cache)  # fill both caches
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        megatron(their_cache)
        t_warm, t_their_warm = best_interleaved([timed(ours, cache), timed(megatron, their_cache)], repeat=5)
    result = ours(cache)
    checked = check_equal(result, theirs)

    ids = np.random.default_rng(0).integers(0, len(result.train), size=args.reads).tolist()
    samples = GPTSamples(result.train, SampleConfig(eod=0))

    def read_ours() -> float:
        start = time.perf_counter()
        for k in ids:
            samples[k]
        return time.perf_counter() - start

    def read_theirs() -> float:
        start = time.perf_counter()
        for k in ids:
            theirs[0][k]
        return time.perf_counter() - start

    # alternating, best of 7: one pass takes 0.1-0.5 s, short enough for a burst of other
    # load to land on one side only (best of 3, one side after the other, read 1.3x-2.6x)
    r_ours, r_theirs = best_interleaved([read_ours, read_theirs], repeat=7)
    rows = [
        ("cold build, 3-source blend (target <= 0.5x)", f"{t_ours:.2f} s", f"{t_theirs:.2f} s",
         f"{t_ours / t_theirs:.2f}x"),
        ("warm build from cache, vs megatron-core's warm build", f"{t_warm * 1e3:.1f} ms",
         f"{t_their_warm * 1e3:.1f} ms", f"{t_warm / t_their_warm:.2f}x"),
        ("warm build from cache vs the 50 ms target (a constant)", f"{t_warm * 1e3:.1f} ms", "50 ms",
         f"{t_warm / 0.05:.2f}x"),
        (f"loader samples/s, seq {args.seq_length} (target >= 2x)", f"{args.reads / r_ours:.0f}",
         f"{args.reads / r_theirs:.0f}", f"{r_theirs / r_ours:.2f}x"),
    ]
    print_table(f"build: 3 sparse sources x {args.sequences} sequences ({tokens / 1e9:.1f} G tokens), "
                f"{args.samples} train samples of {args.seq_length}; baseline megatron-core 0.16.1 "
                f"({checked} arrays checked equal: every index of every split and member)", rows)


if __name__ == "__main__":
    main()
