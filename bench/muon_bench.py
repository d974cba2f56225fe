"""Muon against AdamW: steps (and wall time) to the same validation loss, and the optimizer step's share.

    .venv/bin/python bench/muon_bench.py [--steps 300] [--d-model 64] [--n-layers 2] [--seq-len 64]
        [--micro 64] [--lrs 3e-3,1e-2,3e-2,1e-1] [--text-mb 1.5] [--device cpu] [--ns-dtype bf16|fp32]

Quality (issue 51, acceptance 4): the same Llama-style model, data and schedule (warmup, cosine to
lr/10) train ``--steps`` steps through the one loop (``loop.start_run``) on the shared English novels
(the first ``--text-mb`` MB, cut into ~4 KB documents at line boundaries, byte tokens, preprocessed
with ``cli.py preprocess``), once per learning rate of ``--lrs`` for each optimizer, validation every
``--eval-every`` steps. Each optimizer's best lr is the one with the lowest final validation loss; the
table gives the steps and the training wall time each needs at its best lr to reach AdamW's best final
validation loss (Muon's first evaluation at or below it; target: Muon <= 0.8x AdamW's steps), and both
final losses. Wall time to the target is the steps times the run's mean step time.

Speed: the optimizer step's share of a training step (forward, backward, clip, step) of the Muon
model at dp 1, eager, steps in turn, median of ``--speed-iters`` (target <= 10% on CPU), with AdamW's
share beside it. Newton-Schulz costs per matrix, not per token, so the share falls as the batch grows:
the default micro-batch of 64 (4,096 tokens a step, far below a real run's) is where the target is read;
``--micro 16`` (1,024 tokens) shows it where the forward and backward are too small to hide it. Newton-
Schulz runs in the config's dtype (``optim.muon_ns_dtype``, bf16 as torch.optim.Muon's) unless
``--ns-dtype``. GPU rows (a GPT-2 124M shape; the optimizer step at 1B) are ``--device cuda``'s.
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import zstandard

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _table import print_table  # noqa: E402

from tokenloom.train.config import TrainConfig  # noqa: E402
from tokenloom.train.data import BlendDataConfig, DataConfig  # noqa: E402
from tokenloom.train.loop import start_run  # noqa: E402
from tokenloom.train.metrics import read_metrics  # noqa: E402
from tokenloom.train.model.config import GPTConfig  # noqa: E402
from tokenloom.train.model.gpt import GPT  # noqa: E402
from tokenloom.train.optim.adamw import OptimConfig, build_optimizer  # noqa: E402
from tokenloom.train.optim.muon import Muon, split_params  # noqa: E402
from tokenloom.train.runtime import World  # noqa: E402

NOVELS = Path("/work/shared/data/english-novels/english_novels.jsonl.zst")
ROOT = Path(__file__).resolve().parents[1]


def novels_prefix(out: Path, megabytes: float) -> Path:
    """The first ``megabytes`` MB of the novels as ~4 KB documents, byte-tokenized into ``out/novels``."""
    budget, docs = int(megabytes * 2**20), []
    with NOVELS.open("rb") as raw, zstandard.ZstdDecompressor().stream_reader(raw) as reader:
        for line in io.TextIOWrapper(reader, encoding="utf-8"):
            text, piece = json.loads(line)["text"], []
            for row in text.splitlines(keepends=True):
                piece.append(row)
                if sum(map(len, piece)) >= 4096:
                    docs.append("".join(piece))
                    budget -= len(docs[-1])
                    piece = []
                if budget <= 0:
                    break
            if budget <= 0:
                break
    src = out / "novels.jsonl"
    src.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    prefix = out / "novels"
    subprocess.run([sys.executable, str(ROOT / "cli.py"), "preprocess", "--input", str(src), "--output-prefix",
                    str(prefix), "--tokenizer-type", "byte", "--append-eod", "--workers", "1"], check=True,
                   capture_output=True)
    return prefix


def model_config(args) -> GPTConfig:
    return GPTConfig(arch="llama", vocab_size=512, make_vocab_size_divisible_by=64, seq_len=args.seq_len,
                     n_layers=args.n_layers, n_heads=4, d_model=args.d_model)


def train(args, prefix: Path, out: Path, name: str, lr: float) -> dict:
    """One run; its validation losses by step and its mean step time."""
    cfg = TrainConfig(model=model_config(args),
                      data=DataConfig(blend=BlendDataConfig(prefixes=[(1.0, str(prefix))], split="949,50,1",
                                                            cache_dir=str(out / "cache"))),
                      optim=OptimConfig(name=name, lr=lr, min_lr=lr / 10, warmup_iters=args.steps // 20,
                                        **ns_dtype(args)),
                      micro_batch_size=args.micro, global_batch_size=args.micro, train_iters=args.steps,
                      eval_interval=args.eval_every, eval_iters=8, log_interval=args.eval_every, save_interval=None,
                      output_dir=str(out / f"{name}_{lr:g}"), progress=False, plot=False, seed=1)
    start = time.perf_counter()
    summary = start_run(cfg, World(0, 1, torch.device(args.device), False)).train()
    wall = time.perf_counter() - start
    vals = [(r["iter"], r["val_loss"]) for r in read_metrics(Path(cfg.output_dir) / "metrics.jsonl")
            if r.get("val_loss") is not None]
    tokens = args.micro * args.seq_len
    return {"val": vals, "final": summary["val_loss"], "step_s": tokens / summary["tokens_per_s"], "wall": wall}


def ns_dtype(args) -> dict:
    """Newton-Schulz's dtype: the config's default (bf16, as ``torch.optim.Muon``'s) unless ``--ns-dtype``."""
    return {"muon_ns_dtype": args.ns_dtype} if args.ns_dtype else {}


def steps_to(vals: list[tuple[int, float]], target: float) -> int | None:
    return next((it for it, v in vals if it > 0 and v <= target), None)


def step_share(args, name: str) -> tuple[float, float]:
    """(median optimizer-step seconds, median whole-step seconds) at dp 1, eager, steps in turn."""
    torch.manual_seed(0)
    device = torch.device(args.device)
    model = GPT(model_config(args), device=device)
    cfg = OptimConfig(name=name, **ns_dtype(args))
    opt = Muon(*split_params(model, cfg.weight_decay), cfg) if name == "muon" else build_optimizer(model, cfg)
    tokens = torch.randint(0, 256, (args.speed_micro or args.micro, args.seq_len + 1), device=device)
    steps, wholes = [], []
    for i in range(args.speed_iters + 1):
        t0 = time.perf_counter()
        loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t1 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t2 = time.perf_counter()
        if i:  # the first warms up
            steps.append(t2 - t1)
            wholes.append(t2 - t0)
    return statistics.median(steps), statistics.median(wholes)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--eval-every", type=int, default=25)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--n-layers", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--micro", type=int, default=64)
    p.add_argument("--lrs", default="3e-3,1e-2,3e-2,1e-1")
    p.add_argument("--text-mb", type=float, default=1.5)
    p.add_argument("--speed-iters", type=int, default=10)
    p.add_argument("--device", default="cpu")
    p.add_argument("--speed-micro", type=int, default=None, help="micro-batch of the speed rows (default: --micro)")
    p.add_argument("--speed-only", action="store_true")
    p.add_argument("--ns-dtype", choices=("bf16", "fp32"), default=None,
                   help="Muon's Newton-Schulz dtype (default: the config's, optim.muon_ns_dtype)")
    p.add_argument("--threads", type=int, default=None, help="torch threads of every run (default: torch's)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    lrs = [float(x) for x in args.lrs.split(",")]
    shape = (f"{args.n_layers} layers x {args.d_model}, seq {args.seq_len}, micro {args.micro}, byte tokens, "
             f"{torch.get_num_threads()} torch threads, Newton-Schulz in {args.ns_dtype or OptimConfig().muon_ns_dtype}")
    if not args.speed_only:
        quality(args, lrs, shape)
    micro = args.speed_micro or args.micro
    speed_shape = shape.replace(f"micro {args.micro}", f"micro {micro}")
    ms, mw = step_share(args, "muon")
    as_, aw = step_share(args, "adamw")
    print_table(f"optimizer step's share of a training step at dp 1, {args.device}, {speed_shape} (median of "
                f"{args.speed_iters}; tokenloom = Muon, baseline = AdamW)",
                [("optimizer step / training step (Muon target <= 10%)", f"{100 * ms / mw:.1f}%",
                  f"{100 * as_ / aw:.1f}%", f"{(ms / mw) / (as_ / aw):.3f}x"),
                 ("optimizer step", f"{ms * 1e3:.2f} ms", f"{as_ * 1e3:.2f} ms", f"{ms / as_:.3f}x")])


def quality(args, lrs: list[float], shape: str) -> None:
    """The steps-to-loss table (the lr sweep of both optimizers)."""
    with tempfile.TemporaryDirectory() as tmp:
        prefix = novels_prefix(Path(tmp), args.text_mb)
        runs = {}
        for lr in lrs:  # the two optimizers alternate at each lr
            for name in ("adamw", "muon"):
                runs[name, lr] = train(args, prefix, Path(tmp), name, lr)
    best = {name: min((r for (n, _), r in runs.items() if n == name), key=lambda r: r["final"])
            for name in ("adamw", "muon")}
    best_lr = {name: next(lr for (n, lr), r in runs.items() if r is best[name]) for name in best}
    target = best["adamw"]["final"]
    s_m, s_a = steps_to(best["muon"]["val"], target), steps_to(best["adamw"]["val"], target)
    sweep = "; ".join(f"{n} lr {lr:g}: {r['final']:.4f}" for (n, lr), r in runs.items())
    rows = [(f"final validation loss at the best lr (muon {best_lr['muon']:g}, adamw {best_lr['adamw']:g})",
             f"{best['muon']['final']:.4f}", f"{target:.4f}", f"{best['muon']['final'] / target:.3f}x"),
            ("steps to AdamW's final validation loss (target <= 0.8x)", str(s_m), str(s_a),
             f"{s_m / s_a:.3f}x" if s_m and s_a else "not reached"),
            ("training wall time to it (steps x mean step time)",
             f"{s_m * best['muon']['step_s']:.1f} s" if s_m else "-", f"{s_a * best['adamw']['step_s']:.1f} s",
             f"{s_m * best['muon']['step_s'] / (s_a * best['adamw']['step_s']):.3f}x" if s_m and s_a else "-"),
            ("mean step time (evaluation aside)", f"{best['muon']['step_s'] * 1e3:.1f} ms",
             f"{best['adamw']['step_s'] * 1e3:.1f} ms", f"{best['muon']['step_s'] / best['adamw']['step_s']:.3f}x")]
    print_table(f"Muon vs AdamW, {args.steps} steps on the English novels ({args.text_mb:g} MB), {shape}, "
                f"{args.device}; sweep: {sweep} (tokenloom = Muon, baseline = AdamW; lower is better)", rows)


if __name__ == "__main__":
    main()
