"""Where one optimizer step of our ``train`` spends its time: torch.profiler over a few steps.

    .venv/bin/python bench/profile_step.py [--steps 3] [--warmup 4] [train_bench's shape flags]

Runs tokenloom's loop (``loop.start_run``, what ``cli.py train`` drives) with the defaults a
``train`` run has on this device, on mock data at ``bench/train_bench.py``'s shape flags,
steps ``--warmup`` times (compilation, allocator warm-up), then profiles ``--steps`` steps and
prints: the operators and kernels by device time (CPU time where there is no GPU), and every
host synchronisation the steps made (``cudaStreamSynchronize``, ``cudaDeviceSynchronize``,
device-to-host copies, ``aten::item`` / ``_local_scalar_dense``) with its count, so a sync
inside a step shows up by name. A diagnostic, not a bench: it prints no ratio and writes no
RESULTS.md row (``scripts/gpu-check.sh`` keeps its output in ``gpu-check-profile.txt``).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_bench import model_config  # noqa: E402

from tokenloom.train.config import TrainConfig  # noqa: E402
from tokenloom.train.data import DataConfig, MockDataConfig  # noqa: E402
from tokenloom.train.loop import start_run  # noqa: E402
from tokenloom.train.optim.adamw import OptimConfig  # noqa: E402

SYNC_NAMES = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "Memcpy DtoH",
              "aten::item", "aten::_local_scalar_dense", "aten::nonzero")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--rows", type=int, default=30, help="rows of the operator table")
    for flag, default in (("--d-model", 2048), ("--seq-len", 2048), ("--micro", 4), ("--n-layers", 16),
                          ("--n-heads", 16), ("--vocab", 50304)):
        parser.add_argument(flag, type=int, default=default)
    parser.add_argument("--arch", choices=("gpt2", "llama"), default="gpt2")
    parser.add_argument("--n-kv-heads", type=int)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        cfg = TrainConfig(model=model_config(args), data=DataConfig(mock=MockDataConfig(num_sequences=20_000)),
                          optim=OptimConfig(lr=3e-4, warmup_iters=2), micro_batch_size=args.micro,
                          global_batch_size=args.micro, train_iters=args.warmup + args.steps + 1, eval_interval=0,
                          log_interval=10, save_interval=None, output_dir=tmp, progress=False, plot=False)
        run = start_run(cfg)
        steps = run.steps()
        for _ in range(args.warmup):
            next(steps)
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.synchronize()
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=activities) as prof:
            for _ in range(args.steps):
                next(steps)
            if cuda:
                torch.cuda.synchronize()
        steps.close()
        run.finish()
    events = prof.key_averages()
    sort = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    print(f"== {args.steps} steps of ours, {args.arch} {args.n_layers} x {args.d_model}, micro {args.micro} x "
          f"seq {args.seq_len}: operators and kernels by {sort}")
    print(events.table(sort_by=sort, row_limit=args.rows))
    print(f"== host synchronisations in {args.steps} steps (count per step)")
    for e in events:
        if any(name in e.key for name in SYNC_NAMES):
            print(f"{e.key:<60} {e.count / args.steps:8.1f}")


if __name__ == "__main__":
    main()
