"""Step time of our DDP vs torch.nn.parallel.DistributedDataParallel: 2 gloo ranks, same GPT.

    .venv/bin/python bench/ddp_bench.py [--steps 10] [--repeat 8] [--d-model 128] [--layers 4] [--compile]

With ``--compile`` both sides are compiled as their users would: ours block by block
(``GPT.compile_blocks``, what ``compile: true`` does), torch's as ``torch.compile(DDP(model))``,
whose DDPOptimizer splits the graph at bucket boundaries so its buckets still overlap.
Issue 16's setting: ``--d-model 768 --layers 8 --micro 1`` (58 M parameters, 9 buckets).

Each rank runs forward + backward + AdamW step on the same model and batches, once
wrapped in ours (as the trainer wraps it: the blocks' weight-gradient GEMMs write into
its buckets, eager or compiled, ``tokenloom.train.parallel.wgrad``) and once in torch's (default settings: 25 MiB
buckets), with and without
4-micro-batch accumulation (``no_sync``); a third side, torch's with
``gradient_as_bucket_view=True`` (its opt-in mode whose grads are bucket views, like ours),
is timed the same way and reported for information. Every side gets the trainer's settings: the
optimizer's default ``zero_grad()`` (``set_to_none=True``; torch DDP's faster mode, ~2-3%
over ``set_to_none=False`` at issue 16's size) and, on the process, glibc tuned to keep
freed memory (``keep_freed_memory``, what ``cli.py train`` does on CPU; ``--malloc-defaults``
leaves glibc alone). The wrappers alternate step by step, the order rotated each round
(ours, torch, torch with bucket views; torch, torch with bucket views, ours; ...) so that
no side always follows the same one, each step timed on its own (barrier before, slowest rank's time), and
each side reports its median step: on a shared box the load drifts within seconds, and
step-level alternation gives both sides the same conditions where round-level alternation
did not (best-of-rounds ratios moved by +-5% between runs). Issue 16's target: ours <= 1.0x
torch's, eager and with both sides compiled.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as TorchDDP

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _table import print_table  # noqa: E402

from tokenloom.train.dist import init_from_env  # noqa: E402
from tokenloom.train.host_alloc import keep_freed_memory  # noqa: E402
from tokenloom.train.model.config import GPTConfig
from tokenloom.train.model.gpt import GPT  # noqa: E402
from tokenloom.train.parallel.ddp import DistributedDataParallel  # noqa: E402


def make(args, wrapper: str):
    cfg = GPTConfig(vocab_size=2048, make_vocab_size_divisible_by=128, seq_len=args.seq_len, n_layers=args.layers,
                    n_heads=4, d_model=args.d_model)
    model = GPT(cfg)
    if wrapper == "ours":  # as the trainer wraps it: compiled blocks are grad units (no bucket ends inside one)
        if args.compile:
            model.compile_blocks()
        ddp = DistributedDataParallel(model, grad_units=model.blocks.values() if args.compile else ())
    else:  # torch's default, and its gradient_as_bucket_view=True (no copy back after the all-reduce)
        ddp = TorchDDP(model, gradient_as_bucket_view=wrapper == "torch_view")
        if args.compile:
            ddp = torch.compile(ddp)
    return model, ddp, torch.optim.AdamW(model.parameters(), lr=1e-4)


SIDES = ("ours", "torch", "torch_view")
"""Alternated step by step; ``torch_view`` is torch DDP with ``gradient_as_bucket_view=True``
(grads as views of its buckets, as ours always are), reported for information."""


def no_sync(ddp):
    return (ddp._orig_mod if hasattr(ddp, "_orig_mod") else ddp).no_sync()


def steps(model, ddp, opt, batches, accum: int) -> None:
    for x, y in batches:
        opt.zero_grad()
        for m in range(accum):
            if m < accum - 1:
                with no_sync(ddp):
                    (ddp(x, y) / accum).backward()
            else:
                (ddp(x, y) / accum).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()


def worker(rank: int, args, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(args.threads)
    if not args.malloc_defaults:
        keep_freed_memory()
    init_from_env(timeout_s=120)
    g = torch.Generator().manual_seed(rank)
    data = torch.randint(0, 2048, (args.steps, args.micro, args.seq_len + 1), generator=g)
    batches = [(d[:, :-1], d[:, 1:]) for d in data]
    rows = []
    for accum in args.accum:
        built = {w: make(args, w) for w in SIDES}
        for w in built:
            steps(*built[w], batches[:2], accum)  # warm-up (bucket rebuild, allocator)
        times: dict[str, list[float]] = {w: [] for w in SIDES}
        for k in range(args.repeat * args.steps):
            for w in SIDES[k % len(SIDES):] + SIDES[:k % len(SIDES)]:  # rotated: no side always runs first
                dist.barrier()
                start = time.perf_counter()
                steps(*built[w], batches[k % len(batches) : k % len(batches) + 1], accum)
                elapsed = torch.tensor(time.perf_counter() - start)
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
                times[w].append(elapsed.item())
        median = {w: statistics.median(t) for w, t in times.items()}
        tokens = 2 * args.micro * accum * args.seq_len
        rows.append((f"step time, accum {accum} (ms)", f"{median['ours'] * 1e3:.1f}", f"{median['torch'] * 1e3:.1f}",
                     f"{median['ours'] / median['torch']:.3f}x"))
        rows.append((f"tokens/s, accum {accum}", f"{tokens / median['ours']:,.0f}", f"{tokens / median['torch']:,.0f}",
                     f"{median['torch'] / median['ours']:.3f}x"))
        rows.append((f"for information: vs torch DDP with gradient_as_bucket_view, accum {accum} (ms)",
                     f"{median['ours'] * 1e3:.1f}", f"{median['torch_view'] * 1e3:.1f}",
                     f"{median['ours'] / median['torch_view']:.3f}x"))
    if rank == 0:
        params = sum(p.numel() for p in built["ours"][0].parameters())
        setup = (", both compiled" if args.compile else "") + (", glibc malloc untuned" if args.malloc_defaults else "")
        print_table(f"DDP: tokenloom vs torch DDP, 2 gloo ranks x {args.threads} thread(s), GPT {params / 1e6:.2f}M "
                    f"params in {len(built['ours'][1].bucket_indices)} buckets{setup}, micro {args.micro} x seq "
                    f"{args.seq_len}, median of {args.repeat * args.steps} alternating steps "
                    "(time ratio = ours/torch, lower is better)", rows)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeat", type=int, default=8)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--compile", action="store_true", help="compile both sides (see the module docstring)")
    parser.add_argument("--accum", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4],
                        help="micro-batches per step, comma-separated (default 1,4)")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--micro", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--malloc-defaults", action="store_true",
                        help="leave glibc malloc untuned (the trainer tunes it on CPU; see tokenloom.train.host_alloc)")
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(args, port), nprocs=2, join=True)


if __name__ == "__main__":
    main()
