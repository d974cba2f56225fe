"""Tokens/s of our training loop vs a plain single-process eager loop of the same GPT.

    .venv/bin/python bench/train_bench.py [--iters 13] [--skip 3] [--rounds 8] [--d-model 256]
        [--n-layers 4] [--n-heads 4] [--vocab 4096] [--sides ours,base,...]

Ours is tokenloom's training loop (``loop.start_run(cfg).steps()``, what ``run`` drives)
on mock data, with the defaults a ``train`` run has: DataLoader over GPTSamples, lr
schedule, grad clipping, metrics JSONL every 10 steps, one checkpoint at the end, no
evaluation, manual GC (``gc_interval``) and, on CPU, glibc malloc keeping freed memory
for the next step (``keep_freed_memory``, tokenloom.train.host_alloc). The baseline is
the nanoGPT-style loop: batches pre-built in memory, forward, backward, clip, AdamW,
with Python's GC defaults. Both use the same model config and seed, batch, optimizer
groups, precision (fp32 on CPU, bf16 autocast on GPU) and, on CPU, the same malloc
setting (``keep_freed_memory``: it is a process setting any loop can make, so giving it
to one side only would measure malloc, not the loop); two more sides run both with
malloc's defaults, for information.

Each loop runs in its own process, as it would in real use (GC and malloc settings are
per process), and the processes take turns one optimizer step at a time (ours,
baseline, baseline with fused AdamW, ours with malloc's defaults, ours, ...), each step
timed on its own: on a shared box the load drifts within seconds, and alternating steps
gives every side the same conditions (alternating whole runs moved the ratio by +-4%
between runs). Each side reports its median step over all rounds; each round starts
fresh processes, because one model instance can be 4-5% faster or slower than another
(measured: six instances of the same model, same seed, interleaved in one process),
and many rounds average that out. Target: ratio >= 1.0.
MFU is printed when the device's peak FLOP/s is known (GPUs in the metrics table). On a
GPU only ``ours`` and ``base`` run by default (two ~1B-parameter models fit one 80 GB
device; ``scripts/gpu-check.sh`` runs that size through ``bench/run_all.py --gpu``).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _table import print_table  # noqa: E402

from tokenloom.train.config import TrainConfig  # noqa: E402
from tokenloom.train.data import DataConfig, MockDataConfig  # noqa: E402
from tokenloom.train.loop import start_run  # noqa: E402
from tokenloom.train.metrics import mfu, peak_flops  # noqa: E402
from tokenloom.train.model import GPT, GPTConfig  # noqa: E402
from tokenloom.train.optim import OptimConfig, build_optimizer  # noqa: E402
from tokenloom.train.runtime import tune_host_memory  # noqa: E402


def model_config(args) -> GPTConfig:
    return GPTConfig(vocab_size=args.vocab, make_vocab_size_divisible_by=128, seq_len=args.seq_len,
                     n_layers=args.n_layers, n_heads=args.n_heads, d_model=args.d_model)


def our_steps(args, out: Path, keep_freed_memory: bool = True):
    """tokenloom's run on mock data, as a generator of optimizer steps."""
    cfg = TrainConfig(
        model=model_config(args), data=DataConfig(mock=MockDataConfig(num_sequences=20_000, max_length=1024)),
        optim=OptimConfig(lr=3e-4, min_lr=3e-5, warmup_iters=5), micro_batch_size=args.micro,
        global_batch_size=args.micro, train_iters=args.iters, eval_interval=0, log_interval=10,
        save_interval=None, output_dir=str(out), progress=False, plot=False, keep_freed_memory=keep_freed_memory,
    )
    run = start_run(cfg)
    yield from run.steps()
    run.finish()


def baseline_steps(args, device: torch.device, fused: bool = False):
    """The plain eager loop, as a generator of optimizer steps."""
    torch.manual_seed(0)
    model = GPT(model_config(args)).to(device)
    opt = build_optimizer(model, OptimConfig(lr=3e-4, fused=None if fused else False))
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, args.vocab, (args.iters, args.micro, args.seq_len + 1), generator=g).to(device)
    bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported()
    autocast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if bf16 else nullcontext
    for it in range(args.iters):
        x, y = data[it, :, :-1], data[it, :, 1:]
        opt.zero_grad()
        with autocast():
            loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        yield it + 1


def _loop_process(name: str, args, out: str, conn) -> None:
    """One loop in its own process: a step per message, answering with the step's seconds."""
    device = _device()
    malloc_default = name.endswith("_malloc_default")
    if name.startswith("ours"):
        steps = our_steps(args, Path(out), keep_freed_memory=not malloc_default)
    else:
        tune_host_memory(not malloc_default, device)
        steps = baseline_steps(args, device, fused=name == "fused")
    while conn.recv():
        start = time.perf_counter()
        next(steps)
        if device.type == "cuda":
            torch.cuda.synchronize()
        conn.send(time.perf_counter() - start)
    next(steps, None)  # lets our run finish (metrics closed)
    conn.send(None)


SIDES = ("ours", "base", "fused", "ours_malloc_default", "base_malloc_default")


def _device() -> torch.device:
    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=13, help="steps per loop and round")
    parser.add_argument("--skip", type=int, default=3, help="warm-up steps left out of every round")
    parser.add_argument("--rounds", type=int, default=8, help="rounds, each with fresh processes")
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--micro", type=int, default=8)
    parser.add_argument("--n-layers", type=int, default=4)
    parser.add_argument("--n-heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--sides", help="comma-separated subset of " + ",".join(SIDES) + " (default: all on CPU, "
                        "ours,base on a GPU)")
    args = parser.parse_args()
    device = _device()
    ctx = mp.get_context("spawn")
    names = tuple(args.sides.split(",")) if args.sides else SIDES if device.type == "cpu" else ("ours", "base")
    if not {"ours", "base"} <= set(names) or not set(names) <= set(SIDES):
        raise SystemExit(f"--sides must include ours and base, from {','.join(SIDES)}")
    times: dict[str, list[float]] = {name: [] for name in names}
    round_ratios: list[float] = []  # per round: base median step / ours median step
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            pipes, procs = {}, []
            for name in names:
                parent, child = ctx.Pipe()
                proc = ctx.Process(target=_loop_process, args=(name, args, str(Path(tmp) / f"{name}{r}"), child))
                proc.start()
                pipes[name] = parent
                procs.append(proc)
            this_round: dict[str, list[float]] = {name: [] for name in names}
            for it in range(args.iters):  # the loops take turns, one step each; the others wait
                for name in names:
                    pipes[name].send(True)
                    elapsed = pipes[name].recv()
                    if it >= args.skip:
                        this_round[name].append(elapsed)
            for name in names:
                pipes[name].send(False)
                pipes[name].recv()
            for proc in procs:
                proc.join(timeout=120)
                if proc.exitcode != 0:
                    raise SystemExit(f"a bench loop process failed (exit code {proc.exitcode})")
            for name, ts in this_round.items():
                times[name].extend(ts)
            round_ratios.append(statistics.median(this_round["base"]) / statistics.median(this_round["ours"]))
    tokens = args.micro * args.seq_len
    tps = {k: tokens / statistics.median(times[k]) for k in names}
    with torch.device("meta"):
        model = GPT(model_config(args))

    def row(what: str, ours: str, base: str) -> tuple[str, str, str, str]:
        return what, f"{tps[ours]:,.0f}", f"{tps[base]:,.0f}", f"{tps[ours] / tps[base]:.3f}x"

    rows = [row("tokens/s (target >= 1.0)", "ours", "base")]
    if "fused" in tps:
        rows.append(row("tokens/s, baseline also with fused AdamW", "ours", "fused"))
    if "ours_malloc_default" in tps and "base_malloc_default" in tps:
        rows.append(row("for information: both with malloc's defaults (no keep_freed_memory)",
                        "ours_malloc_default", "base_malloc_default"))
    rows.append(("for information: tokens/s ratio per round, min / median / max", "", "",
                 " / ".join(f"{v:.3f}" for v in (min(round_ratios), statistics.median(round_ratios),
                                                 max(round_ratios)))))
    peak = peak_flops(device)
    if peak:
        fpt = model.flops_per_token()
        rows.append(("MFU", f"{mfu(fpt, tps['ours'], peak):.1%}", f"{mfu(fpt, tps['base'], peak):.1%}",
                     f"{tps['ours'] / tps['base']:.3f}x"))
    else:
        rows.append(("MFU", "n/a", "n/a", f"no known peak FLOP/s for {device.type}"))
    print_table(f"training loop: tokenloom run() vs plain eager loop, {device.type} ({torch.get_num_threads()} "
                f"threads), GPT {model.num_params() / 1e6:.2f}M params, micro {args.micro} x seq {args.seq_len}, "
                f"one process per loop, median step of {args.rounds} rounds x {args.iters - args.skip} taken in "
                "turn (ratio = ours/baseline, higher is better)",
                rows)


if __name__ == "__main__":
    main()
