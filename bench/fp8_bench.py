"""Does ``--fp8`` train as well as bf16? Loss of our run in float8 against bf16 on real text.

    .venv/bin/python bench/fp8_bench.py --data PREFIX --tokenizer DIR [--iters 300]
        [--d-model 2048] [--n-layers 16] [--n-heads 16] [--seq-len 2048] [--micro 4] [--recipe tensorwise]

Two runs of tokenloom's loop (``loop.start_run(cfg).steps()``, what ``cli.py train`` drives) with
the same config, seed and data, one with ``fp8`` (torchao's float8 linears), one without (bf16
autocast), each in its own process. The row compares their mean training loss over the last
three logged intervals (30 steps) after ``--iters`` steps: the target is a difference within 2%.
Loss needs real text: random tokens converge to log(vocab) whatever the precision. ``--data`` (or
``TOKENLOOM_BENCH_DATA``) names a tokenized ``PREFIX.bin/.idx`` and ``--tokenizer`` (or
``TOKENLOOM_BENCH_TOKENIZER``) its tokenizer; without data, or where fp8 is refused (no CUDA GPU
of compute capability >= 8.9, no torchao), the bench prints why in its table and exits 0.

Trade-off: the two runs share the GPU at the same time, which halves the lease the row costs
(the row is about loss, not speed); their tokens/s are printed for information only, each slowed
by the other. Speed is ``train_bench``'s fp8 row, measured with the GPU to itself. Each run stops
one step before its configured end, so no end-of-run checkpoint is written.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _table import print_table  # noqa: E402

from tokenloom.train.config import TrainConfig  # noqa: E402
from tokenloom.train.data import BlendDataConfig, DataConfig  # noqa: E402
from tokenloom.train.loop import start_run  # noqa: E402
from tokenloom.train.metrics import read_metrics  # noqa: E402
from tokenloom.train.model.config import GPTConfig  # noqa: E402
from tokenloom.train.model.fp8 import refusal  # noqa: E402
from tokenloom.train.optim.adamw import OptimConfig  # noqa: E402

LAST_RECORDS = 3  # logged intervals averaged at the end


def _config(args, out: Path, fp8: str | None) -> TrainConfig:
    model = GPTConfig(vocab_size=args.vocab, seq_len=args.seq_len, n_layers=args.n_layers, n_heads=args.n_heads,
                      d_model=args.d_model)
    data = DataConfig(blend=BlendDataConfig(prefixes=[(1.0, args.data)], split="100,0,0",
                                            cache_dir=str(out / "cache")))
    return TrainConfig(model=model, data=data, tokenizer=args.tokenizer,
                       optim=OptimConfig(lr=3e-4, min_lr=3e-5, warmup_iters=min(30, args.iters // 10)),
                       micro_batch_size=args.micro, global_batch_size=args.micro, train_iters=args.iters + 1,
                       eval_interval=0, log_interval=10, save_interval=None, output_dir=str(out), progress=False,
                       plot=False, fp8=fp8)


def _run(args, out: str, fp8: str | None) -> None:
    run = start_run(_config(args, Path(out), fp8))
    steps = run.steps()
    for _ in range(args.iters):
        next(steps)
    steps.close()
    run.finish()


def _summary(out: Path) -> tuple[float, float, int]:
    """(mean loss of the last logged intervals, mean tokens/s after the first interval, last iter)."""
    train = [r for r in read_metrics(out / "metrics.jsonl") if "train_loss" in r]
    return (statistics.fmean(r["train_loss"] for r in train[-LAST_RECORDS:]),
            statistics.fmean(r["tokens_per_s"] for r in train[1:] or train), train[-1]["iter"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default=os.environ.get("TOKENLOOM_BENCH_DATA"), help="tokenized PREFIX (.bin/.idx)")
    parser.add_argument("--tokenizer", default=os.environ.get("TOKENLOOM_BENCH_TOKENIZER"))
    parser.add_argument("--iters", type=int, default=300)
    parser.add_argument("--d-model", type=int, default=2048)
    parser.add_argument("--n-layers", type=int, default=16)
    parser.add_argument("--n-heads", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=50304, help="model.vocab_size when no --tokenizer sizes it")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--micro", type=int, default=4)
    parser.add_argument("--recipe", choices=("tensorwise", "rowwise"), default="tensorwise")
    args = parser.parse_args()
    title = (f"fp8 ({args.recipe}) vs bf16: training loss after {args.iters} steps, GPT {args.n_layers} x "
             f"{args.d_model}, micro {args.micro} x seq {args.seq_len}, the two runs side by side on one GPU")
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    why = refusal(args.recipe, device, tp=1, precision="auto", kernels="reference")
    if why is None and not args.data:
        why = "no data: give --data PREFIX and --tokenizer DIR (or TOKENLOOM_BENCH_DATA / TOKENLOOM_BENCH_TOKENIZER)"
    if why is not None:
        print_table(title, [("not run", "", "", why)])
        return
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        outs = {name: Path(tmp) / name for name in ("bf16", "fp8")}
        procs = [ctx.Process(target=_run, args=(args, str(outs[name]), args.recipe if name == "fp8" else None))
                 for name in outs]
        for proc in procs:
            proc.start()
        for proc in procs:
            proc.join()
            if proc.exitcode != 0:
                raise SystemExit(f"an fp8 bench run failed (exit code {proc.exitcode})")
        (bf16_loss, bf16_tps, it), (fp8_loss, fp8_tps, _) = _summary(outs["bf16"]), _summary(outs["fp8"])
    diff = (fp8_loss - bf16_loss) / bf16_loss
    print_table(title, [
        (f"mean training loss, steps {it - 10 * LAST_RECORDS + 1}-{it} (target: within 2%)", f"{fp8_loss:.4f}",
         f"{bf16_loss:.4f}", f"{diff:+.2%}"),
        ("for information: tokens/s, each run slowed by the other", f"{fp8_tps:,.0f}", f"{bf16_tps:,.0f}",
         f"{fp8_tps / bf16_tps:.3f}x"),
    ])


if __name__ == "__main__":
    main()
