"""Tokens/s of our training loop vs a plain single-process eager loop of the same GPT.

    .venv/bin/python bench/train_bench.py [--iters 13] [--skip 3] [--rounds 8] [--d-model 256]

Ours is tokenloom's training loop (``loop.start_run(cfg).steps()``, what ``run`` drives)
on mock data: DataLoader over GPTSamples, lr schedule, grad clipping, metrics JSONL every
10 steps, one checkpoint at the end, no evaluation; Python's automatic GC off with a
collection every 50 steps (``gc_interval``), while the baseline steps run with Python's
default automatic GC, as a plain loop does. The baseline is the
nanoGPT-style loop: batches pre-built in memory, forward, backward, clip, AdamW. Both
use the same model, batch, optimizer groups and precision (fp32 on CPU, bf16 autocast on
GPU). The three loops take turns one optimizer step at a time (ours, baseline, baseline
with fused AdamW, ours, ...), each step timed on its own, and each side reports its median
step over all rounds: on a shared box the load drifts within seconds, and alternating
steps gives all sides the same conditions (alternating whole runs moved the ratio by +-4%
between runs). All three loops train the same model instance, the one our run builds
(each loop has its own optimizer and data): two instances of the same model in one
process differ in step time by 4-5% (measured: six instances, same seed, interleaved;
memory placement, presumably), which separate instances would put into the ratio. Each
round builds a fresh run and model. Target: ratio >= 1.0.
MFU is printed when the device's peak FLOP/s is known (GPUs in the metrics table).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _table import print_table  # noqa: E402

from tokenloom.train.data import DataConfig, MockDataConfig  # noqa: E402
from tokenloom.train.loop import TrainConfig, start_run  # noqa: E402
from tokenloom.train.metrics import peak_flops  # noqa: E402
from tokenloom.train.model import GPT, GPTConfig  # noqa: E402
from tokenloom.train.optim import OptimConfig, build_optimizer  # noqa: E402


def model_config(args) -> GPTConfig:
    return GPTConfig(vocab_size=4096, make_vocab_size_divisible_by=128, seq_len=args.seq_len, n_layers=4,
                     n_heads=4, d_model=args.d_model)


def our_run(args, out: Path):
    """tokenloom's run on mock data (:func:`start_run`): its model is shared with the baselines."""
    cfg = TrainConfig(
        model=model_config(args), data=DataConfig(mock=MockDataConfig(num_sequences=20_000, max_length=1024)),
        optim=OptimConfig(lr=3e-4, min_lr=3e-5, warmup_iters=5), micro_batch_size=args.micro,
        global_batch_size=args.micro, train_iters=args.iters, eval_interval=0, log_interval=10,
        save_interval=None, output_dir=str(out), progress=False, plot=False,
    )
    return start_run(cfg)


def our_steps(run):
    """tokenloom's loop, as a generator of optimizer steps."""
    yield from run.steps()
    run.finish()


def baseline_steps(args, device: torch.device, model: GPT, fused: bool = False):
    """The plain eager loop over ``model`` with its own AdamW, as a generator of optimizer steps."""
    opt = build_optimizer(model, OptimConfig(lr=3e-4, fused=None if fused else False))
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, 4096, (args.iters, args.micro, args.seq_len + 1), generator=g).to(device)
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


def timed_step(steps, device: torch.device, automatic_gc: bool = False) -> float:
    """Seconds for one step. GC state is per process, and ours turns automatic collection off
    for its run (its ``gc_interval``); ``automatic_gc`` gives a baseline step Python's default,
    as the plain loop has on its own."""
    was_enabled = gc.isenabled()
    if automatic_gc:
        gc.enable()
    start = time.perf_counter()
    next(steps)
    if device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    if not was_enabled:
        gc.disable()
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=13, help="steps per loop and round")
    parser.add_argument("--skip", type=int, default=3, help="warm-up steps left out of every round")
    parser.add_argument("--rounds", type=int, default=8, help="rounds, each with a fresh run and model")
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--micro", type=int, default=8)
    args = parser.parse_args()
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    times: dict[str, list[float]] = {"ours": [], "base": [], "fused": []}
    round_ratios: list[float] = []  # per round: base median step / ours median step
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):  # a fresh run (and model) each round
            run = our_run(args, Path(tmp) / f"run{r}")
            runs = {"ours": our_steps(run), "base": baseline_steps(args, device, run.model),
                    "fused": baseline_steps(args, device, run.model, fused=True)}
            this_round: dict[str, list[float]] = {name: [] for name in runs}
            for it in range(args.iters):  # the three loops take turns, one step each
                for name, steps in runs.items():
                    elapsed = timed_step(steps, device, automatic_gc=name != "ours")
                    if it >= args.skip:
                        this_round[name].append(elapsed)
            for name, ts in this_round.items():
                times[name].extend(ts)
            round_ratios.append(statistics.median(this_round["base"]) / statistics.median(this_round["ours"]))
            for steps in runs.values():
                next(steps, None)  # lets our run finish (metrics closed)
    tokens = args.micro * args.seq_len
    tps_ours, tps_base, tps_fused = (tokens / statistics.median(times[k]) for k in ("ours", "base", "fused"))
    model = GPT(model_config(args))
    rows = [("tokens/s (target >= 1.0)", f"{tps_ours:,.0f}", f"{tps_base:,.0f}", f"{tps_ours / tps_base:.3f}x"),
            ("tokens/s, baseline also with fused AdamW (loop overhead only)", f"{tps_ours:,.0f}",
             f"{tps_fused:,.0f}", f"{tps_ours / tps_fused:.3f}x"),
            ("for information: tokens/s ratio per round, min / median / max", "", "",
             " / ".join(f"{v:.3f}" for v in (min(round_ratios), statistics.median(round_ratios), max(round_ratios))))]
    peak = peak_flops(device)
    if peak:
        fpt = model.flops_per_token()
        rows.append(("MFU", f"{fpt * tps_ours / peak:.1%}", f"{fpt * tps_base / peak:.1%}",
                     f"{tps_ours / tps_base:.3f}x"))
    else:
        rows.append(("MFU", "n/a", "n/a", f"no known peak FLOP/s for {device.type}"))
    print_table(f"training loop: tokenloom run() vs plain eager loop, {device.type} ({torch.get_num_threads()} "
                f"threads), GPT {model.num_params() / 1e6:.2f}M params, micro {args.micro} x seq {args.seq_len}, "
                f"median step of {args.rounds} rounds x {args.iters - args.skip} taken in turn (ratio = ours/baseline, higher is better)",
                rows)


if __name__ == "__main__":
    main()
