"""Checkpoint saves: how long the step loop is blocked and how long a save takes, asynchronous vs
synchronous, ours vs a plain ``torch.save`` of the same state.

    .venv/bin/python bench/checkpoint_bench.py [--sizes 124m,350m] [--rounds 4] [--device cpu|cuda]
        [--step-tokens 256] [--dir DIR]

The state is a GPT's parameters and AdamW state (fp32 weights and both moments, one optimizer step
taken on random gradients), on ``--device`` (CUDA when there is one). Each side saves it into a
fresh directory under ``--dir`` and then runs one training step (forward and backward of
``--step-tokens`` tokens, then the optimizer step), as the loop does after a save; the sides take
turns within a round, the first side moving each round so no side always follows another (each
followed, untimed, by removing its files and ``os.sync``, so every side starts with no write-back
of another's gigabytes in flight):

* ``async``: tokenloom's :class:`~tokenloom.train.checkpoint.async_save.CheckpointSaver` as a ``train`` run
  uses it (``async_save`` on): save, then the step, whose optimizer update waits for the
  background copy (``before_update``, as ``Strategy`` calls it); the write goes on behind;
* ``sync``: the same saver with ``async_save=false``;
* ``torch.save``: ``torch.save({"model": ..., "optimizer": ...}, path)`` of the same state
  dicts, what a hand-written loop does (no fsync, no ``COMPLETE`` marker or atomic publish; ours
  fsyncs every file and directory);
* ``none``: the training step alone.

The time the **loop is blocked** is the saver's own stall (its report): the whole synchronous
save, or the asynchronous save's capture plus the optimizer step's wait for the background copy.
The **save + next step** rows show what the blocked time leaves out: the background copy's and
write's competition with the step for cores and memory bandwidth (on a busy 2-core box, noise of
its own). The **save time** is the synchronous save's whole time, and the asynchronous one's
background copy, write and commit. Medians over the rounds; the first round is a warm-up left out
of them (the asynchronous saver allocates and faults in its host buffers there; its block is a row
of its own). Target (issue 38, acceptance 1): the asynchronous block is <= 10% of the synchronous
save's, a ratio >= 10x.
Bytes written per rank: this is one rank saving the whole state (the one-process format); the
per-shard format's ranks write their shards, the same bytes in all.

Sizes: ``124m`` (GPT-2 small), ``350m`` (GPT-2 medium), ``1b`` (16 layers x 2048, vocab 50304, the
GPU shape of ``run_all.py``). ``350m`` is the largest of them this 24 GiB, 2-core box holds: a
save needs the parameters, gradients and both AdamW moments (16 bytes a parameter) plus the
asynchronous saver's host copy of the saved part (12 more), about 28 GB at 1 B parameters, more
than the box, so ``1b`` runs on a GPU machine (``--device cuda``, its state in GPU memory and the
pinned copy in its larger host memory).
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

from tokenloom.train.checkpoint import commit as checkpoint  # noqa: E402
from tokenloom.train.checkpoint import format as ckpt_format
from tokenloom.train.checkpoint import reshard
from tokenloom.train.checkpoint.async_save import CheckpointSaver  # noqa: E402
from tokenloom.train.model.config import GPTConfig
from tokenloom.train.model.gpt import GPT  # noqa: E402
from tokenloom.train.optim.adamw import OptimConfig, build_optimizer  # noqa: E402

SIZES = {  # (n_layers, d_model, n_heads, vocab)
    "124m": (12, 768, 12, 50304),
    "350m": (24, 1024, 16, 50304),
    "1b": (16, 2048, 16, 50304),
}
SIDES = ("async", "sync", "torch.save", "none")


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


def train_step(model: GPT, optimizer: torch.optim.Optimizer, tokens: torch.Tensor,
               saver: CheckpointSaver | None) -> None:
    """One training step as the loop runs it: forward and backward, then the optimizer step,
    which waits for a save in flight to hold its copy (``saver.before_update``, as
    ``Strategy`` calls it)."""
    loss = model(tokens[:, :-1], tokens[:, 1:])
    loss.backward()
    if saver is not None:
        saver.before_update()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if tokens.is_cuda:
        torch.cuda.synchronize()


def save_once(side: str, savers: dict[str, CheckpointSaver], model: GPT, optimizer: torch.optim.Optimizer,
              directory: Path, iteration: int, tokens: torch.Tensor) -> tuple[float, float, float, int]:
    """(wall time of the save and the training step after it, time the loop was blocked by the
    save, the save's own time, bytes written) of one save by ``side`` into ``directory``;
    ``none`` is the training step alone."""
    if side == "none":
        start = time.perf_counter()
        train_step(model, optimizer, tokens, None)
        return time.perf_counter() - start, 0.0, 0.0, 0
    if side == "torch.save":
        start = time.perf_counter()
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, directory / "state.pt")
        saved = time.perf_counter() - start
        train_step(model, optimizer, tokens, None)
        return time.perf_counter() - start, saved, saved, files_bytes(directory)
    saver = savers[side]
    saver.root = directory
    start = time.perf_counter()
    saver.save(iteration, lambda: one_process_files(model, optimizer), {"bench": side},
               fresh_copies=True)
    train_step(model, optimizer, tokens, saver)
    loop = time.perf_counter() - start
    saver.wait()
    (report,) = saver.take_reports()
    assert report.iteration == iteration
    # blocked: the report's stall (synchronous: the whole save; asynchronous: the capture and the
    # optimizer step's wait for the copy); the save's own time: synchronous, the stall;
    # asynchronous, its background copy, write and commit
    return loop, report.stall_s, report.stall_s if side == "sync" else report.write_s, files_bytes(directory)


def bench_size(size: str, args, device: torch.device) -> list[tuple[str, str, str, str]]:
    model, optimizer = build_state(size, device)
    params = sum(p.numel() for p in model.parameters())
    vocab = model.cfg.vocab_size
    tokens = torch.randint(vocab, (1, args.step_tokens + 1), generator=torch.Generator().manual_seed(0)).to(device)
    savers = {side: CheckpointSaver(args.dir, rank=0, world_size=1, keep_last=0, asynchronous=side == "async",
                                    pin_memory=device.type == "cuda", timeout_s=600) for side in ("async", "sync")}
    loops: dict[str, list[float]] = {s: [] for s in SIDES}
    blocked: dict[str, list[float]] = {s: [] for s in SIDES}
    totals: dict[str, list[float]] = {s: [] for s in SIDES}
    sizes: dict[str, int] = {}
    first_blocked = 0.0
    for r in range(args.rounds + 1):
        order = SIDES[r % len(SIDES):] + SIDES[:r % len(SIDES)]
        for side in order:
            directory = Path(tempfile.mkdtemp(dir=args.dir))
            loop, stall, total, written = save_once(side, savers, model, optimizer, directory, r + 1, tokens)
            shutil.rmtree(directory)
            os.sync()  # untimed: every side starts without the previous one's dirty pages in write-back
            sizes[side] = written
            if r == 0:
                first_blocked = stall if side == "async" else first_blocked
                continue
            loops[side].append(loop)
            blocked[side].append(stall)
            totals[side].append(total)
        print(f"{size} round {r}: " + ", ".join(
            f"{s} loop {loops[s][-1]:.3f} s / blocked {blocked[s][-1]:.3f} s / save {totals[s][-1]:.3f} s"
            for s in SIDES if r and loops[s]), file=sys.stderr, flush=True)
    med = {s: {k: statistics.median(v[s]) for k, v in (("loop", loops), ("blocked", blocked), ("total", totals))}
           for s in SIDES}
    step, a, y, t = med["none"]["loop"], med["async"], med["sync"], med["torch.save"]
    tag = f"{size} ({params / 1e6:.0f} M params)"

    def ratio(ours: float, base: float, digits: int = 1) -> str:
        return f"{base / ours:.{digits}f}x" if ours > 0 else "inf"

    return [
        (f"{tag}: loop blocked (s), async (capture + wait for the copy) vs sync save", f"{a['blocked']:.3f}",
         f"{y['blocked']:.3f}", ratio(a["blocked"], y["blocked"])),
        (f"{tag}: loop blocked (s), async vs torch.save", f"{a['blocked']:.3f}", f"{t['blocked']:.3f}",
         ratio(a["blocked"], t["blocked"])),
        (f"{tag}: first async save's block (s, allocates its buffers) vs sync save", f"{first_blocked:.3f}",
         f"{y['blocked']:.3f}", ratio(first_blocked, y["blocked"])),
        (f"{tag}: save + next step (s), async vs that step alone ({args.step_tokens} tokens)", f"{a['loop']:.3f}",
         f"{step:.3f}", ratio(a["loop"], step, 2)),
        (f"{tag}: save + next step (s), async vs sync", f"{a['loop']:.3f}", f"{y['loop']:.3f}",
         ratio(a["loop"], y["loop"], 2)),
        (f"{tag}: save time (s), async (background) vs sync", f"{a['total']:.3f}", f"{y['total']:.3f}",
         ratio(a["total"], y["total"], 2)),
        (f"{tag}: save time (s), sync vs torch.save", f"{y['total']:.3f}", f"{t['total']:.3f}",
         ratio(y["total"], t["total"], 2)),
        (f"{tag}: bytes written per rank (GB), ours vs torch.save", f"{sizes['async'] / 1e9:.3f}",
         f"{sizes['torch.save'] / 1e9:.3f}", ratio(sizes["async"], sizes["torch.save"], 2)),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="124m,350m", help=f"comma-separated, of {', '.join(SIZES)}")
    parser.add_argument("--rounds", type=int, default=4, help="timed rounds after the warm-up round")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--step-tokens", type=int, default=256,
                        help="tokens of the training step that follows each save (one sequence)")
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
                "tokenloom column is faster; target: async loop block >= 10x below the sync save's)", rows)


if __name__ == "__main__":
    main()
