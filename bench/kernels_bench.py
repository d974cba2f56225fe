"""Fused / compiled kernels vs the eager reference inside the GPT, plus the chunked-CE memory.

    .venv/bin/python bench/kernels_bench.py [--steps 10] [--d-model 128] [--seq-len 256]

Rows:

* training tokens/s (forward + backward + AdamW step, fp32 on CPU, bf16 autocast on GPU)
  of the same GPT (gpt2 and llama flavours) with ``model.kernels`` = the device's best
  mode (``compiled`` on CPU, ``triton`` on CUDA) vs ``reference``. Warm-up steps
  (where torch.compile builds its graphs) are excluded and reported as their own row;
  rounds alternate and the best is kept (the box is shared). Target: ratio >= 1.0.
  On tiny CPU shapes the win is small or negative: the eager ops are already a few
  big vectorised loops, and each compiled op adds a guard check and a call.
* peak memory (RSS high-water growth during forward + backward, fresh subprocess per
  implementation) of the chunked cross entropy vs the full-logits reference at vocab
  50304, 1024 tokens; uses tests/train/kernels/_ce_memory_probe.py.
* MFU with the standard 6N + 12*L*H*Q*T FLOPs per token (``GPT.flops_per_token``)
  against the device's dense bf16 peak: "n/a" without a GPU.
* GPU-only rows (Triton kernels, bf16) are marked "not yet run" when no GPU is present.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _table import print_table  # noqa: E402

from tokenloom.train.metrics import peak_flops  # noqa: E402
from tokenloom.train.model import GPT, GPTConfig  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
PROBE = REPO / "tests" / "train" / "kernels" / "_ce_memory_probe.py"
NO_GPU = "not yet run (no GPU available)"


def _model(args: argparse.Namespace, arch: str, kernels: str, device: torch.device) -> GPT:
    cfg = GPTConfig(arch=arch, vocab_size=args.vocab, seq_len=args.seq_len, n_layers=args.layers,
                    n_heads=args.d_model // 32, d_model=args.d_model, kernels=kernels)
    return GPT(cfg).to(device)


def _steps(model: GPT, opt: torch.optim.Optimizer, batches: list, n: int, autocast) -> float:
    start = time.perf_counter()
    for i in range(n):
        tokens, labels = batches[i % len(batches)]
        with autocast():
            loss = model(tokens, labels)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    if tokens.device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def _train_rows(args: argparse.Namespace, device: torch.device, fast: str) -> tuple[list, float]:
    def autocast():
        return torch.autocast("cuda", torch.bfloat16) if device.type == "cuda" else nullcontext()

    g = torch.Generator().manual_seed(0)
    batches = [(torch.randint(0, args.vocab, (args.micro, args.seq_len), generator=g).to(device),
                torch.randint(0, args.vocab, (args.micro, args.seq_len), generator=g).to(device))
               for _ in range(4)]
    tokens_per_step = args.micro * args.seq_len
    rows, best_fast_tps = [], 0.0
    for arch in ("gpt2", "llama"):
        runs = {}
        for mode in ("reference", fast):
            model = _model(args, arch, mode, device)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
            runs[mode] = (model, opt, _steps(model, opt, batches, args.warmup, autocast))
        best = {m: float("inf") for m in runs}
        for _ in range(args.rounds):
            for mode, (model, opt, _) in runs.items():
                best[mode] = min(best[mode], _steps(model, opt, batches, args.steps, autocast) / args.steps)
        tps = {m: tokens_per_step / t for m, t in best.items()}
        best_fast_tps = max(best_fast_tps, tps[fast]) if arch == "gpt2" else best_fast_tps
        rows.append((f"{arch} train tokens/s ({fast} vs reference)", f"{tps[fast]:,.0f}",
                     f"{tps['reference']:,.0f}", f"{tps[fast] / tps['reference']:.2f}x"))
        rows.append((f"{arch} warm-up {args.warmup} steps (compile)", f"{runs[fast][2]:.1f} s",
                     f"{runs['reference'][2]:.1f} s", f"{runs[fast][2] / runs['reference'][2]:.1f}x"))
    return rows, best_fast_tps


def _ce_memory(mode: str, tokens: int, vocab: int, hidden: int) -> dict:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", PYTHONPATH=str(REPO))
    out = subprocess.run([sys.executable, str(PROBE), mode, str(tokens), str(vocab), str(hidden)],
                         env=env, capture_output=True, text=True, check=True, timeout=600)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per round")
    parser.add_argument("--warmup", type=int, default=3, help="untimed first steps (compile)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--micro", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--ce-tokens", type=int, default=1024)
    parser.add_argument("--ce-vocab", type=int, default=50304)
    parser.add_argument("--ce-hidden", type=int, default=768)
    args = parser.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    fast = "triton" if device.type == "cuda" else "compiled"
    rows, fast_tps = _train_rows(args, device, fast)

    ref = _ce_memory("reference", args.ce_tokens, args.ce_vocab, args.ce_hidden)
    chunked = _ce_memory("chunked", args.ce_tokens, args.ce_vocab, args.ce_hidden)
    rows.append((f"CE peak RSS growth, fwd+bwd, {args.ce_tokens} tok x vocab {args.ce_vocab} (chunked vs full)",
                 f"{chunked['peak_rss_delta'] / 2**20:.0f} MiB", f"{ref['peak_rss_delta'] / 2**20:.0f} MiB",
                 f"{chunked['peak_rss_delta'] / ref['peak_rss_delta']:.2f}x"))
    rows.append(("CE memory held from forward to backward (chunked vs full)",
                 f"{chunked['held_after_forward'] / 2**20:.0f} MiB", f"{ref['held_after_forward'] / 2**20:.0f} MiB",
                 f"{chunked['held_after_forward'] / ref['held_after_forward']:.2f}x"))

    model = _model(args, "gpt2", "reference", torch.device("cpu"))
    fpt = model.flops_per_token()
    peak = peak_flops(device)
    mfu = f"{model.mfu(fast_tps, peak):.1%}" if peak else "n/a (no GPU in this run)"
    rows.append((f"gpt2 FLOPs/token (6N + 12*L*H*Q*T, T={args.seq_len})", f"{fpt / 1e6:.1f} M", "", ""))
    rows.append((f"gpt2 MFU ({fast}, dense bf16 peak)", mfu, "", ""))
    if device.type != "cuda":
        rows.append(("triton kernels train tokens/s (GPU, bf16)", NO_GPU, NO_GPU, ""))
        rows.append(("GPU MFU (bf16)", NO_GPU, "", ""))
    print_table(f"kernels: GPT d_model {args.d_model}, {args.layers} layers, seq {args.seq_len}, micro {args.micro}, "
                f"vocab {args.vocab}, {device.type} ({torch.get_num_threads()} threads); "
                f"CE memory at hidden {args.ce_hidden}", rows)


if __name__ == "__main__":
    main()
