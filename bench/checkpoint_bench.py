"""Checkpoint saves: how long the step loop is blocked and how long a save takes, asynchronous vs
synchronous, ours vs a plain ``torch.save`` of the same state.

    .venv/bin/python bench/checkpoint_bench.py [--sizes 124m,350m] [--rounds 4] [--device cpu|cuda]
        [--dir DIR]

The state is a GPT's parameters and AdamW state (fp32 weights and both moments, one optimizer step
taken on random gradients), on ``--device`` (CUDA when there is one). Three sides save it, each
into a fresh directory under ``--dir`` (removed untimed after each save), taking turns within a
round, the first side moving each round so no side always follows another

(each followed, untimed, by removing its files and ``os.sync``, so every side starts with no
write-back of another's gigabytes in flight):

* ``async``: tokenloom's :class:`~tokenloom.train.async_save.CheckpointSaver` as a ``train`` run
  uses it (``async_save`` on): the **stall** is the time ``save`` blocks the caller (the host
  copy), the **save time** runs until the background write is committed (``wait``);
* ``sync``: the same saver with ``async_save=false``: stall and save time are one;
* ``torch.save``: ``torch.save({"model": ..., "optimizer": ...}, path)`` of the same state
  dicts, what a hand-written loop does (no fsync, no ``COMPLETE`` marker or atomic publish; ours
  fsyncs every file and directory).

The first round is a warm-up left out of the medians (the asynchronous saver allocates and faults
in its host buffers there; its stall is printed on its own row). Target (issue 38, acceptance 1):
the asynchronous stall is <= 10% of the synchronous save's time, a ratio >= 10x below. Bytes
written per rank: this is one rank saving the whole state (the one-process format); the per-shard
format's ranks write their shards, the same bytes in all.

Sizes: ``124m`` (GPT-2 small), ``350m`` (GPT-2 medium), ``1b`` (16 layers x 2048, vocab 50304, the
GPU shape of ``run_all.py``). ``350m`` is the largest of them this 24 GiB, 2-core box holds: a
save needs the parameters and both AdamW moments (12 bytes a parameter) plus the asynchronous
saver's host copy of them (12 more), about 24 GB at 1 B parameters, the whole box before the
page cache that the writes fill, so ``1b`` runs on a GPU machine (``--device cuda``, its
state in GPU memory and the pinned copy in its larger host memory).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _table import print_table  # noqa: E402

from tokenloom.train import checkpoint, ckpt_format, reshard  # noqa: E402
from tokenloom.train.async_save import CheckpointSaver  # noqa: E402
from tokenloom.train.model import GPT, GPTConfig  # noqa: E402
from tokenloom.train.optim import OptimConfig, build_optimizer  # noqa: E402

SIZES = {  # (n_layers, d_model, n_heads, vocab)
    "124m": (12, 768, 12, 50304),
    "350m": (24, 1024, 16, 50304),
    "1b": (16, 2048, 16, 50304),
}
SIDES = ("async", "sync", "torch.save")


def build_state(size: str, device: torch.device) -> tuple[GPT, torch.optim.Optimizer]:
    """A GPT of ``size`` and its AdamW after one step on random gradients (moments filled)."""
    n_layers, d_model, n_heads, vocab = SIZES[size]
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=vocab, make_vocab_size_divisible_by=128, seq_len=1024, n_layers=n_layers,
                          n_heads=n_heads, d_model=d_model), device=device)
    optimizer = build_optimizer([model], OptimConfig(lr=3e-4))
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return model, optimizer


def files_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def one_process_files(model: GPT, optimizer: torch.optim.Optimizer) -> dict:
    """The files a one-process ``train`` run saves: its RNG states and its piece file."""
    return {"rng_rank0.pt": checkpoint.capture_rng(),
            ckpt_format.piece_file(0, 0, 0): ckpt_format.rank_file(reshard.module_params(model, optimizer),
                                                                    ckpt_format.Placement(0, 1, 0, 0, 1))}


def save_once(side: str, savers: dict[str, CheckpointSaver], model: GPT, optimizer: torch.optim.Optimizer,
              directory: Path, iteration: int) -> tuple[float, float, int]:
    """(stall, save time, bytes written) of one save by ``side`` into ``directory``."""
    if side == "torch.save":
        start = time.perf_counter()
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, directory / "state.pt")
        elapsed = time.perf_counter() - start
        return elapsed, elapsed, files_bytes(directory)
    saver = savers[side]
    saver.root = directory
    start = time.perf_counter()
    saver.save(iteration, lambda: one_process_files(model, optimizer), {"bench": side},
               fresh_copies=True)
    stall = time.perf_counter() - start
    saver.wait()
    total = time.perf_counter() - start
    (report,) = saver.take_reports()
    assert report.iteration == iteration
    return stall, total, files_bytes(directory)


def bench_size(size: str, args, device: torch.device) -> list[tuple[str, str, str, str]]:
    model, optimizer = build_state(size, device)
    params = sum(p.numel() for p in model.parameters())
    savers = {side: CheckpointSaver(args.dir, rank=0, world_size=1, keep_last=0, asynchronous=side == "async",
                                    pin_memory=device.type == "cuda", timeout_s=600) for side in ("async", "sync")}
    stalls: dict[str, list[float]] = {s: [] for s in SIDES}
    totals: dict[str, list[float]] = {s: [] for s in SIDES}
    sizes: dict[str, int] = {}
    first_stall = 0.0
    for r in range(args.rounds + 1):
        order = SIDES[r % len(SIDES):] + SIDES[:r % len(SIDES)]
        for side in order:
            directory = Path(tempfile.mkdtemp(dir=args.dir))
            stall, total, written = save_once(side, savers, model, optimizer, directory, r + 1)
            shutil.rmtree(directory)
            os.sync()  # untimed: every side starts without the previous one's dirty pages in write-back
            sizes[side] = written
            if r == 0:
                first_stall = stall if side == "async" else first_stall
                continue
            stalls[side].append(stall)
            totals[side].append(total)
        print(f"{size} round {r}: " + ", ".join(f"{s} stall {stalls[s][-1]:.3f} s / save {totals[s][-1]:.3f} s"
                                                 for s in SIDES if r and stalls[s]), file=sys.stderr, flush=True)
    stall = {s: statistics.median(v) for s, v in stalls.items()}
    total = {s: statistics.median(v) for s, v in totals.items()}
    tag = f"{size} ({params / 1e6:.0f} M params)"
    return [
        (f"{tag}: loop stall (s), async vs sync save", f"{stall['async']:.3f}", f"{total['sync']:.3f}",
         f"{total['sync'] / stall['async']:.1f}x"),
        (f"{tag}: loop stall (s), async vs torch.save", f"{stall['async']:.3f}", f"{total['torch.save']:.3f}",
         f"{total['torch.save'] / stall['async']:.1f}x"),
        (f"{tag}: first async save's stall (s, allocates its buffers) vs sync save", f"{first_stall:.3f}",
         f"{total['sync']:.3f}", f"{total['sync'] / first_stall:.1f}x"),
        (f"{tag}: save time (s), async (background) vs sync", f"{total['async']:.3f}", f"{total['sync']:.3f}",
         f"{total['sync'] / total['async']:.2f}x"),
        (f"{tag}: save time (s), sync vs torch.save", f"{total['sync']:.3f}", f"{total['torch.save']:.3f}",
         f"{total['torch.save'] / total['sync']:.2f}x"),
        (f"{tag}: bytes written per rank (GB), ours vs torch.save", f"{sizes['async'] / 1e9:.3f}",
         f"{sizes['torch.save'] / 1e9:.3f}", f"{sizes['torch.save'] / sizes['async']:.2f}x"),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="124m,350m", help=f"comma-separated, of {', '.join(SIZES)}")
    parser.add_argument("--rounds", type=int, default=4, help="timed rounds after the warm-up round")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dir", default=None, help="where the checkpoints are written (default: a temp dir)")
    args = parser.parse_args()
    sizes = args.sizes.split(",")
    unknown = [s for s in sizes if s not in SIZES]
    if unknown:
        parser.error(f"--sizes: unknown {', '.join(unknown)}; choose from {', '.join(SIZES)}")
    device = torch.device(args.device)
    with tempfile.TemporaryDirectory(dir=args.dir) as parent:
        args.dir = parent
        rows = [row for size in sizes for row in bench_size(size, args, device)]
    print_table(f"checkpoint save on {device.type} ({os.cpu_count()} cores), median of {args.rounds} rounds, "
                "sides alternated; baseline = the synchronous save or a plain torch.save (ratio > 1: the "
                "tokenloom column is faster; target: loop stall >= 10x below the sync save)", rows)


if __name__ == "__main__":
    main()
