"""Tokens/s of our training loop vs a plain single-process eager loop of the same GPT.

    .venv/bin/python bench/train_bench.py [--iters 12] [--rounds 3] [--d-model 256]

Ours is ``tokenloom.train.loop.run`` on mock data (DataLoader over GPTSamples, lr
schedule, grad clipping, metrics JSONL; no evaluation, one checkpoint at the end which
the timing excludes) and reports its own tokens/s per log interval. The baseline is the
nanoGPT-style loop: batches pre-built in memory, forward, backward, clip, AdamW. Both
use the same model, batch, optimizer groups and precision (fp32 on CPU, bf16 autocast on
GPU). Rounds alternate; the best interval of each side is kept. Target: ratio >= 1.0.
MFU is printed when the device's peak FLOP/s is known (GPUs in the metrics table).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _table import print_table  # noqa: E402

from tokenloom.train.data import DataConfig, MockDataConfig  # noqa: E402
from tokenloom.train.loop import TrainConfig, run  # noqa: E402
from tokenloom.train.metrics import peak_flops, read_metrics  # noqa: E402
from tokenloom.train.model import GPT, GPTConfig  # noqa: E402
from tokenloom.train.optim import OptimConfig, build_optimizer  # noqa: E402


def model_config(args) -> GPTConfig:
    return GPTConfig(vocab_size=4096, make_vocab_size_divisible_by=128, seq_len=args.seq_len, n_layers=4,
                     n_heads=4, d_model=args.d_model)


def ours(args, out: Path) -> float:
    """Best tokens/s over the loop's log intervals (the first interval, with warm-up, is skipped)."""
    cfg = TrainConfig(
        model=model_config(args), data=DataConfig(mock=MockDataConfig(num_sequences=20_000, max_length=1024)),
        optim=OptimConfig(lr=3e-4, min_lr=3e-5, warmup_iters=5), micro_batch_size=args.micro,
        global_batch_size=args.micro, train_iters=args.iters, eval_interval=0, log_interval=args.iters // 3,
        save_interval=None, output_dir=str(out), progress=False, plot=False,
    )
    run(cfg)
    return max(r["tokens_per_s"] for r in read_metrics(out / "metrics.jsonl")[1:])


def baseline(args, device: torch.device, fused: bool = False) -> float:
    """Plain eager loop; best tokens/s over the same intervals as ours."""
    model = GPT(model_config(args)).to(device)
    opt = build_optimizer(model, OptimConfig(lr=3e-4, fused=None if fused else False))
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, 4096, (args.iters, args.micro, args.seq_len + 1), generator=g).to(device)
    bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported()
    autocast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if bf16 else nullcontext
    interval, best, start = args.iters // 3, 0.0, time.perf_counter()
    for it in range(args.iters):
        x, y = data[it, :, :-1], data[it, :, 1:]
        opt.zero_grad()
        with autocast():
            loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if (it + 1) % interval == 0:
            if device.type == "cuda":
                torch.cuda.synchronize()
            now = time.perf_counter()
            if it + 1 > interval:  # skip the warm-up interval, as for ours
                best = max(best, interval * args.micro * args.seq_len / (now - start))
            start = now
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=12, help="steps per run (3 log intervals)")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--micro", type=int, default=8)
    args = parser.parse_args()
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    best_ours = best_base = best_fused = 0.0
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            best_ours = max(best_ours, ours(args, Path(tmp) / f"r{r}"))
            best_base = max(best_base, baseline(args, device))
            best_fused = max(best_fused, baseline(args, device, fused=True))
    model = GPT(model_config(args))
    rows = [("tokens/s (target >= 1.0)", f"{best_ours:,.0f}", f"{best_base:,.0f}", f"{best_ours / best_base:.3f}x"),
            ("tokens/s, baseline also with fused AdamW (loop overhead only)", f"{best_ours:,.0f}",
             f"{best_fused:,.0f}", f"{best_ours / best_fused:.3f}x")]
    peak = peak_flops(device)
    if peak:
        fpt = model.flops_per_token()
        rows.append(("MFU", f"{fpt * best_ours / peak:.1%}", f"{fpt * best_base / peak:.1%}",
                     f"{best_ours / best_base:.3f}x"))
    else:
        rows.append(("MFU", "n/a", "n/a", f"no known peak FLOP/s for {device.type}"))
    print_table(f"training loop: tokenloom run() vs plain eager loop, {device.type} ({torch.get_num_threads()} "
                f"threads), GPT {model.num_params() / 1e6:.2f}M params, micro {args.micro} x seq {args.seq_len}, "
                f"best interval of {args.rounds} x {args.iters} steps (ratio = ours/baseline, higher is better)",
                rows)


if __name__ == "__main__":
    main()
