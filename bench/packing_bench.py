"""Best-fit packing (``build --packing best-fit``): build cost at scale, and what it buys in training.

Rows:

* packing 10 M documents whose lengths are drawn (with replacement, seeded) from the shared
  corpora's real documents (the GPT-2 ``megatron-reference`` tinyshakespeare and WikiText-2
  files, pooled), at seq 2048: one epoch's shuffle, best-fit pack and sample shuffle
  (``build_gpt_indices``), each side in a fresh process pinned to one core, against the 30 s
  target (a constant) and against Megatron's concat index of the same documents (sides
  alternated, best of 3);
* the packing's peak memory: the process's peak RSS during the build minus its RSS just
  before, over the bytes of the index arrays it returns - target <= 2x;
* on the shared corpora (tinyshakespeare, WikiText-2 with a document per article, the English
  novels cut into paragraphs; GPT-2 tokens) at seq 1024 and 2048, whole (split 1,0,0) and the
  train split of the default split 969,30,1, from the dumped samples: documents of up to seq + 1
  tokens whole in exactly one sample, the padding share (target <= 1%), the samples over
  ceil(tokens / seq) (target <= 1.01x) and over the fewest samples any packing of the pieces
  uncut can use (Martello and Toth's L2 bound; the refill goes under it by cutting the last
  pieces of long documents again);
* training on real text: the same small GPT trained once on concat samples and once on
  best-fit samples of the byte-tokenized tinyshakespeare (train split, one pass, same seed,
  steps and batch), then both scored on whole held-out documents (the valid split packed
  best-fit: each document alone in its attention span, from position 0, loss inside it);
  train tokens/s of each (best-fit also per trained label, padding and document ends
  excluded), the two runs side by side (one thread each) so that other load reaches both.
  Lower held-out loss is better.

Usage: python bench/packing_bench.py [--documents N] [--seq-length N] [--train-seq N] [--skip-corpora]
       [--skip-train]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _table import print_table  # noqa: E402

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
SHARED = Path(os.environ.get("TOKENLOOM_SHARED_DATA", REPO.parent / "shared" / "data"))
CORPORA = ("tinyshakespeare_gpt2_eod", "wikitext-2_gpt2_eod")


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def child(packing: str, lengths_path: str, seq: int) -> None:
    """One build in this (fresh, one-core) process; prints seconds, memory and index bytes."""
    from tokenloom.blending.gpt import GPTDatasetConfig, build_gpt_indices  # lazy: a fresh process per side
    from tokenloom.blending.split import Split  # lazy: as above

    os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
    lengths = np.load(lengths_path)
    documents = np.arange(len(lengths), dtype=np.int32)
    cfg = GPTDatasetConfig(seq_length=seq, packing=packing)  # type: ignore[arg-type]
    build_gpt_indices(lengths[:1000], documents[:1000], None, Split.train, cfg)  # warm: imports, first calls
    before = rss_bytes()
    start = time.perf_counter()
    idx = build_gpt_indices(lengths, documents, None, Split.train, cfg)
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    index = sum(a.nbytes for a in (idx.document_index, idx.sample_index, idx.shuffle_index))
    print(json.dumps({"seconds": seconds, "extra": max(0, peak - before), "index": index, "samples": len(idx)}))


def build_rows(documents: int, seq: int) -> list[tuple[str, str, str, str]]:
    from tokenloom.indexed import IndexedDataset  # lazy: bench start-up

    pool = np.concatenate([IndexedDataset(str(SHARED / "megatron-reference" / c)).sequence_lengths for c in CORPORA])
    lengths = np.random.default_rng(0).choice(pool, size=documents).astype(np.int32)
    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "lengths.npy")
        np.save(path, lengths)
        env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
        best: dict[str, dict] = {}
        for _ in range(3):
            for side in ("best-fit", "concat"):
                out = subprocess.run([sys.executable, __file__, "--child", side, path, str(seq)], env=env, check=True,
                                     capture_output=True, text=True).stdout
                got = json.loads(out.splitlines()[-1])
                if side not in best or got["seconds"] < best[side]["seconds"]:
                    best[side] = got
    fit, cat = best["best-fit"], best["concat"]
    tokens = int(lengths.sum(dtype=np.int64))
    print(f"{documents} documents, {tokens / 1e6:.1f} M tokens; best-fit {fit['samples']} samples, "
          f"concat {cat['samples']}", flush=True)
    return [
        (f"best-fit pack, {documents / 1e6:g} M documents, one core (target <= 30 s)", f"{fit['seconds']:.2f} s",
         "30 s", f"{fit['seconds'] / 30:.2f}x"),
        ("best-fit vs concat (Megatron's) index of the same documents", f"{fit['seconds']:.2f} s",
         f"{cat['seconds']:.2f} s", f"{fit['seconds'] / cat['seconds']:.2f}x"),
        ("best-fit peak memory over its index arrays (target <= 2x)", f"{fit['extra'] / 2**20:.0f} MiB",
         f"{fit['index'] / 2**20:.0f} MiB", f"{fit['extra'] / fit['index']:.2f}x"),
    ]


def novels_paragraphs(tmp: Path) -> str:
    """The shared English novels cut into paragraphs (blank-line separated), GPT-2 tokens + EOD."""
    import io  # lazy: only this row reads the novels

    import zstandard  # lazy: as above

    path = tmp / "novels_paragraphs.jsonl"
    with open(SHARED / "english-novels" / "english_novels.jsonl.zst", "rb") as raw, \
            open(path, "w", encoding="utf-8") as out:
        for line in io.TextIOWrapper(zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True),
                                     encoding="utf-8"):
            for paragraph in json.loads(line)["text"].split("\n\n"):
                if paragraph.strip():
                    out.write(json.dumps({"text": paragraph}, ensure_ascii=False) + "\n")
    prefix = tmp / "novels_gpt2_eod"
    subprocess.run([sys.executable, str(REPO / "cli.py"), "preprocess", "--input", str(path), "--output-prefix",
                    str(prefix), "--tokenizer", str(SHARED / "tokenizers" / "gpt2"), "--append-eod"], check=True,
                   capture_output=True, env=dict(os.environ, PYTHONPATH=str(REPO)))
    return str(prefix)


def corpus_rows() -> list[tuple[str, str, str, str]]:
    """Acceptance on the shared corpora at seq 1024 and 2048, from the dumped samples: documents
    of up to seq + 1 tokens whole in exactly one sample, padding share, samples over the
    ceil(tokens / seq) that concat gives; and against the fewest samples (and so the least
    padding) any packing of the pieces uncut can reach (``fewest_packed_samples``, the L2 bound),
    which the refill goes under where it cuts last pieces again.
    The whole corpus (split 1,0,0), then the train split of the default split 969,30,1."""
    from collections import Counter  # lazy: only these rows

    from tokenloom.blending.build import BuildConfig, build  # lazy: bench start-up
    from tokenloom.blending.dump import sample_layouts  # lazy: as above
    from tokenloom.blending.gpt import (  # lazy: as above
        GPTDatasetConfig,
        fewest_packed_samples,
        packed_pieces,
    )

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        prefixes = {c.split("_")[0]: str(SHARED / "megatron-reference" / c) for c in CORPORA}
        prefixes["novels (paragraphs)"] = novels_paragraphs(Path(tmp))
        for name, prefix in prefixes.items():
            for seq in (1024, 2048):
                for split in ("1,0,0", "969,30,1"):
                    result = build(BuildConfig(data=[(1.0, prefix)], split=split, seq_length=seq, exhaustive=True,
                                               packing="best-fit"))
                    records = list(sample_layouts(result.train))
                    lengths = result.train.source.sequence_lengths
                    documents = np.asarray(result.train.documents)
                    parts = Counter(d for r in records for _, d, _, _ in r["parts"])
                    whole = Counter(d for r in records for _, d, o, n in r["parts"] if o == 0 and n == lengths[d])
                    fits = [d for d in documents.tolist() if 0 < lengths[d] <= seq + 1]
                    ok = sum(whole[d] == 1 == parts[d] for d in fits)
                    slots = len(records) * (seq + 1)
                    padding = sum(r["padding"] for r in records) / slots
                    bound = math.ceil(int(lengths[documents].sum(dtype=np.int64)) / seq)
                    cfg = GPTDatasetConfig(seq_length=seq, packing="best-fit")
                    fewest = fewest_packed_samples(lengths[documents], cfg)
                    least = 1 - int(packed_pieces(lengths[documents], cfg).sum()) / (fewest * (seq + 1))
                    at = f"{name} seq {seq}" + ("" if split == "1,0,0" else " (train split of 969,30,1)")
                    if split == "1,0,0":
                        rows.append((f"{at}: documents <= seq + 1 whole in one sample", f"{ok}", f"{len(fits)}",
                                     f"{ok / len(fits):.2f}x"))
                    rows += [(f"{at}: padding share (target <= 1%)", f"{100 * padding:.2f}%", "1%",
                              f"{padding / 0.01:.2f}x"),
                             (f"{at}: samples vs ceil(tokens / seq) (target <= 1.01x)", f"{len(records)}",
                              f"{bound}", f"{len(records) / bound:.3f}x"),
                             (f"{at}: samples vs the fewest of any packing of the pieces uncut (its padding share)",
                              f"{len(records)}", f"{fewest} ({100 * least:.2f}%)", f"{len(records) / fewest:.3f}x")]
    return rows


def byte_corpus(tmp: Path) -> str:
    """tinyshakespeare's paragraphs, byte-tokenized with an EOD per document."""
    prefix = tmp / "shakespeare_bytes"
    subprocess.run([sys.executable, str(REPO / "cli.py"), "preprocess", "--input",
                    str(SHARED / "tinyshakespeare" / "tinyshakespeare.jsonl"), "--output-prefix", str(prefix),
                    "--tokenizer-type", "byte", "--append-eod", "--workers", "1"], check=True, capture_output=True,
                   env=dict(os.environ, PYTHONPATH=str(REPO)))
    return str(prefix)


SPLIT, GBS, MICRO = "95,5,0", 16, 16


def heldout_samples(prefix: str, seq: int):
    """The valid split of ``prefix`` packed best-fit, as the loader gives it (whole documents, each
    alone in its attention span, loss inside it)."""
    from tokenloom.blending.blend import Blend, BlendBuilder, BlendConfig  # lazy: only the training rows
    from tokenloom.blending.gpt import GPTDatasetConfig  # lazy: as above
    from tokenloom.blending.loader import GPTSamples, SampleConfig  # lazy: as above
    from tokenloom.blending.split import Split  # lazy: as above

    valid = BlendBuilder(BlendConfig(gpt=GPTDatasetConfig(seq_length=seq, split=SPLIT, packing="best-fit"),
                                     blend=Blend((prefix,)))).build([1, None, 0])[Split.valid]
    return GPTSamples(valid, SampleConfig(inter_document_masking=True, labels_within_documents=True))


def train_child(packing: str, prefix: str, tmp: str, seq: int, steps: int) -> None:
    """Train one side on one thread (the other side runs beside it), score it on the held-out
    documents; prints loss, seconds and the tokens and labels trained."""
    import torch  # lazy: only the training rows need it

    from tokenloom.blending.loader import GPTSamples, SampleConfig  # lazy: as above
    from tokenloom.train import loop  # lazy: as above
    from tokenloom.train.config import TrainConfig  # lazy: as above
    from tokenloom.train.data import BlendDataConfig, DataConfig  # lazy: as above
    from tokenloom.train.model.config import GPTConfig  # lazy: as above
    from tokenloom.train.optim.adamw import OptimConfig  # lazy: as above
    from tokenloom.train.runtime import World  # lazy: as above

    torch.set_num_threads(1)
    data = DataConfig(blend=BlendDataConfig(prefixes=[(1.0, prefix)], split=SPLIT, cache_dir=f"{tmp}/cache-{packing}"),
                      packing=packing)  # type: ignore[arg-type]
    cfg = TrainConfig(model=GPTConfig(vocab_size=257, make_vocab_size_divisible_by=64, seq_len=seq, n_layers=2,
                                      n_heads=4, d_model=64),
                      data=data, optim=OptimConfig(lr=3e-3, min_lr=3e-4, warmup_iters=20), micro_batch_size=MICRO,
                      global_batch_size=GBS, train_iters=steps, eval_interval=0, log_interval=10,
                      output_dir=f"{tmp}/{packing}", progress=False, plot=False)
    run = loop.start_run(cfg, World(0, 1, torch.device("cpu"), False))
    start = time.perf_counter()
    run.train()
    seconds = time.perf_counter() - start
    model = run.strategy.chunks[0].eval()
    evals = heldout_samples(prefix, seq)
    total = count = 0.0
    with torch.no_grad():
        for k in range(0, len(evals), MICRO):
            batch = [evals[i] for i in range(k, min(k + MICRO, len(evals)))]
            t = {key: torch.as_tensor(np.stack([b[key] for b in batch])) for key in batch[0]}
            losses = model(t["tokens"], t["labels"], documents=t["cu_seqlens"], positions=t["position_ids"],
                           token_losses=True)
            total += float((losses * t["loss_mask"]).sum())
            count += float(t["loss_mask"].sum())
    trained = steps * GBS
    within = GPTSamples(run.data.train, SampleConfig(labels_within_documents=True))
    labels = sum(float(within[i]["loss_mask"].sum()) for i in range(trained)) if packing == "best-fit" \
        else trained * seq
    print(json.dumps({"loss": total / count, "seconds": seconds, "tokens": trained * seq, "labels": labels,
                      "heldout": len(evals)}))


def train_rows(seq: int) -> tuple[str, list[tuple[str, str, str, str]]]:
    """Both sides at once, one thread each on the 2 cores, so load from elsewhere reaches both alike."""
    from tokenloom.indexed import IndexedDataset  # lazy: bench start-up

    with tempfile.TemporaryDirectory() as tmp:
        prefix = byte_corpus(Path(tmp))
        tokens = int(np.sum(IndexedDataset(prefix).sequence_lengths, dtype=np.int64))
        steps = tokens * 95 // 100 // (seq * GBS)  # about one pass over the train split
        env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
        procs = {side: subprocess.Popen([sys.executable, __file__, "--train-child", side, prefix, tmp, str(seq),
                                         str(steps)], env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                        text=True)
                 for side in ("concat", "best-fit")}
        results = {}
        for side, proc in procs.items():
            out, _ = proc.communicate()
            if proc.returncode:
                raise SystemExit(f"the {side} training run failed (exit {proc.returncode})")
            results[side] = json.loads(out.splitlines()[-1])
    cat, fit = results["concat"], results["best-fit"]
    cat_tps, fit_tps = cat["tokens"] / cat["seconds"], fit["tokens"] / fit["seconds"]
    title = (f"concat vs best-fit training, byte-level tinyshakespeare (EOD per paragraph), GPT 2 x 64, seq {seq}, "
             f"batch {GBS}, {steps} steps (one pass over the train split), the two runs side by side on one thread "
             f"each; held-out: {fit['heldout']} best-fit samples of whole valid documents (baseline = concat; loss "
             f"lower is better)")
    return title, [
        ("held-out loss on whole documents (nats/token)", f"{fit['loss']:.4f}", f"{cat['loss']:.4f}",
         f"{fit['loss'] / cat['loss']:.3f}x"),
        ("train tokens/s (sample slots)", f"{fit_tps:.0f}", f"{cat_tps:.0f}", f"{fit_tps / cat_tps:.2f}x"),
        ("trained labels/s (best-fit: padding and document ends excluded)", f"{fit['labels'] / fit['seconds']:.0f}",
         f"{cat_tps:.0f}", f"{fit['labels'] / fit['seconds'] / cat_tps:.2f}x"),
    ]


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3], int(sys.argv[4]))
        return
    if len(sys.argv) > 1 and sys.argv[1] == "--train-child":
        train_child(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]), int(sys.argv[6]))
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--documents", type=int, default=10_000_000)
    ap.add_argument("--seq-length", type=int, default=2048)
    ap.add_argument("--train-seq", type=int, default=256)
    ap.add_argument("--skip-train", action="store_true")
    ap.add_argument("--skip-corpora", action="store_true")
    args = ap.parse_args()
    print_table(f"best-fit packing at scale: {args.documents} documents (lengths drawn from the shared corpora), "
                f"seq {args.seq_length}, fresh process per side on one core, best of 3 alternating",
                build_rows(args.documents, args.seq_length))
    if not args.skip_corpora:
        print_table("best-fit packing on the shared corpora (GPT-2, EOD per document; one epoch), checked from "
                    "the dumped samples", corpus_rows())
    if not args.skip_train:
        title, rows = train_rows(args.train_seq)
        print_table(title, rows)


if __name__ == "__main__":
    main()
