"""build with many sources: cold build and warm start at 1,000 and 10,000 sources, vs megatron-core.

Sources are synthetic and sparse, as in ``blend_bench.py``: a real ``.idx`` of 200-2,000
documents (lengths uniform in [1, 2048)) and a ``.bin`` that is one hole. One blend of
every source with random weights, split 97,3,0, 1 M train samples of 2,048 tokens
(issue 17's setting). Rows, per source count:

* cold build: a fresh cache directory each time, and this process's memo of source
  records cleared, so ours reads and hashes every ``.idx`` as a new process would;
  megatron-core's BlendedMegatronDatasetBuilder builds and saves every array into its
  own fresh cache. The two alternate, best of ``--repeat``;
* warm start: the same build again on the filled cache (memo cleared again, so ours
  stats every source and reads the records file); megatron-core loads its cache;
* preflight id check (ours only): the largest token id of every source (they have no
  manifest), as ``train``'s preflight reads it before launch: the first pass reads every
  ``.bin`` (here holes) and appends the records, the warm one (memo cleared) reads the
  records file;
* arrays: the train blend's two arrays and every member's three indices are checked
  equal to megatron-core's wherever megatron-core runs.

megatron-core runs up to ``--megatron-max`` sources, 1,000 by default: the largest count at
which it completes this bench here. It keeps descriptors open per source (counted in
/proc/self/fd): 3 after a cold build, 9 after a warm start (each split's dataset maps its three
cached index arrays). Under this machine's 20,000-descriptor limit its cold build at 10,000
sources fails with ``OSError: [Errno 24] Too many open files`` (it died at source 6,663), and
this bench fails the same way at 2,000, 3,000 and 5,000 sources (a cold build alone at 5,000
took 55 s). Usage:
python bench/sources_bench.py [--sources 1000,10000] [--samples N] [--repeat N]   (needs [interop])
"""

from __future__ import annotations

import argparse
import gc
import shutil
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _table import best_interleaved, print_table, timed_in_fresh_dir  # noqa: E402
from blend_bench import BenchTokenizer, sparse_source  # noqa: E402

from tokenloom.blending.build import BuildConfig, build  # noqa: E402
from tokenloom.blending.sources import clear_memo, source_metadata  # noqa: E402


def make_sources(directory: Path, count: int) -> list[str]:
    rng = np.random.default_rng(count)
    directory.mkdir(parents=True)
    return [sparse_source(directory / f"s{i:05d}", int(rng.integers(200, 2001)), 2048, seed=i) for i in range(count)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sources", default="1000,10000", help="comma-separated source counts")
    ap.add_argument("--samples", type=int, default=1_000_000, help="train samples")
    ap.add_argument("--seq-length", type=int, default=2048)
    ap.add_argument("--repeat", type=int, default=2, help="cold builds per side (best of)")
    ap.add_argument("--megatron-max", type=int, default=1000, help="largest source count megatron-core runs")
    args = ap.parse_args()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import torch.distributed as dist
        from megatron.core.datasets import gpt_dataset as mgpt
        from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder

    tmp = Path(tempfile.mkdtemp(prefix="tl-sources-bench-"))
    if not dist.is_initialized():  # megatron-core 0.16.1 blends want a process group
        dist.init_process_group("gloo", store=dist.FileStore(str(tmp / "store"), 1), rank=0, world_size=1)
    split = "97,3,0"  # no test split: 0.1% of a 200-document source is no document
    rows = []
    try:
        for count in [int(c) for c in args.sources.split(",")]:
            prefixes = make_sources(tmp / f"src{count}", count)
            weights = np.random.default_rng(7).uniform(0.5, 2.0, size=count).tolist()
            sizes = [args.samples, args.samples * 3 // 97, 0]

            def ours(cache_dir, prefixes=prefixes, weights=weights, sizes=sizes):
                clear_memo()
                return build(BuildConfig(data=list(zip(weights, prefixes, strict=True)), split=split,
                                         seq_length=args.seq_length, num_samples=tuple(sizes), cache_dir=cache_dir))

            def megatron(cache_dir, prefixes=prefixes, weights=weights, sizes=sizes):
                config = mgpt.GPTDatasetConfig(
                    random_seed=1234, sequence_length=args.seq_length, blend=(prefixes, weights), split=split,
                    tokenizer=BenchTokenizer(), reset_position_ids=False, reset_attention_mask=False,
                    eod_mask_loss=False, path_to_cache=cache_dir)
                return BlendedMegatronDatasetBuilder(mgpt.GPTDataset, sizes, lambda: True, config).build()

            def warm(fn, cache_dir):
                gc.collect()  # megatron-core's previous datasets (reference cycles) close their files
                start = time.perf_counter()
                result = fn(cache_dir)
                return time.perf_counter() - start, result

            with_megatron = count <= args.megatron_max
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                sides = [timed_in_fresh_dir(f, tmp, before=gc.collect)
                         for f in ([ours, megatron] if with_megatron else [ours])]
                t_cold = best_interleaved(sides, repeat=args.repeat if with_megatron else 1)
                ours_dir, theirs_dir = str(tmp / f"ours{count}"), str(tmp / f"theirs{count}")
                ours(ours_dir)
                t_warm = min(warm(ours, ours_dir)[0] for _ in range(3))

                def max_ids(cache_dir, prefixes=prefixes):
                    clear_memo()
                    return source_metadata(prefixes, cache_dir, max_ids=True)

                t_ids_cold = warm(max_ids, ours_dir)[0]
                t_ids_warm = min(warm(max_ids, ours_dir)[0] for _ in range(3))
                result = ours(ours_dir)
                same = "not run"
                if with_megatron:  # one megatron-core build alive at a time (see the docstring)
                    gc.collect()
                    megatron(theirs_dir)
                    t_warm_theirs = min(warm(megatron, theirs_dir)[0] for _ in range(2))
                    gc.collect()
                    theirs = megatron(theirs_dir)
                    same = "equal" if _same_arrays(result.train, theirs[0]) else "DIFFERENT"
            if with_megatron:
                rows.append((f"{count} sources: cold build", f"{t_cold[0]:.2f} s", f"{t_cold[1]:.2f} s",
                             f"{t_cold[0] / t_cold[1]:.2f}x"))
                rows.append((f"{count} sources: warm start (arrays {same})", f"{t_warm:.2f} s",
                             f"{t_warm_theirs:.2f} s", f"{t_warm / t_warm_theirs:.2f}x"))
            else:
                rows.append((f"{count} sources: cold build (megatron-core: too many open files)", f"{t_cold[0]:.2f} s",
                             "-", "-"))
                rows.append((f"{count} sources: warm start (target <= 1 s)", f"{t_warm:.2f} s", "1 s",
                             f"{t_warm:.2f}x"))
            rows.append((f"{count} sources: preflight id check, first (reads every .bin)", f"{t_ids_cold:.2f} s",
                         "-", "-"))
            rows.append((f"{count} sources: preflight id check, warm (target <= 1 s)", f"{t_ids_warm:.2f} s",
                         "1 s", f"{t_ids_warm:.2f}x"))
            del result  # megatron-core's datasets hold 3 descriptors per source until collected
            if with_megatron:
                del theirs
            gc.collect()
            shutil.rmtree(tmp / f"src{count}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print_table(f"build with many sources (200-2,000 documents each, sparse .bin), {args.samples} train samples "
                f"of {args.seq_length}; baseline megatron-core 0.16.1; 2 shared CPU cores", rows)


def _same_arrays(ours, theirs) -> bool:
    """The train blend's arrays and every member's indices, ours vs megatron-core's."""
    if not (np.array_equal(ours.dataset_index, theirs.dataset_index)
            and np.array_equal(ours.dataset_sample_index, theirs.dataset_sample_index)):
        return False
    return all(
        np.array_equal(m.indices.document_index, t.document_index)
        and np.array_equal(m.indices.sample_index, t.sample_index)
        and np.array_equal(m.indices.shuffle_index, t.shuffle_index)
        for m, t in zip(ours.datasets, theirs.datasets, strict=True)
    )


if __name__ == "__main__":
    main()
