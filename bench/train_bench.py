"""Tokens/s of our training loop vs the loops a user would write for the same GPT.

    .venv/bin/python bench/train_bench.py [--iters 13] [--skip 3] [--rounds 8] [--d-model 256]
        [--n-layers 4] [--n-heads 4] [--vocab 4096] [--arch gpt2|llama] [--n-kv-heads N]
        [--sides ours,base,...] [--pairs]

Ours is tokenloom's training loop (``loop.start_run(cfg).steps()``, what ``run`` drives)
on mock data, with the defaults a ``train`` run has: DataLoader over GPTSamples, lr
schedule, grad clipping, metrics JSONL every 10 steps (stopped one step before its end, so no
checkpoint is written), no
evaluation, manual GC (``gc_interval``) and, on CPU, glibc malloc keeping freed memory
for the next step (``keep_freed_memory``, tokenloom.train.host_alloc). The baseline is
the nanoGPT-style loop: batches pre-built in memory, forward, backward, clip, AdamW,
with Python's GC defaults. The sides a GPU user would pick (``compiled``: the nanoGPT-style
loop with whole-model ``torch.compile``, torch's fused AdamW where the device has it, SDPA
attention and batches resident on the device; ``ours_fp8``: our run with ``fp8``
tensorwise) run by default on CUDA, and on request (``--sides``) on CPU. All use the same model config and seed, batch, optimizer
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
MFU (``metrics.mfu``, the one formula for every side: ``flops.flops_per_token``, the device's
peak) is printed when the device's peak FLOP/s is known (GPUs in the metrics table); so are
each side's peak device memory (``max_memory_allocated``) and its first step (compilation,
warm-up, all sides of a group side by side), which the medians leave out. On a GPU of less than
120 GiB the sides run in pairs with ours (``--pairs``, the default there): two ~1B-parameter models
fit one 80 GB device, four do not;
``scripts/gpu-check.sh`` runs the GPT-2 and Llama shapes through ``bench/run_all.py --gpu``.
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
from tokenloom.train.model.config import GPTConfig
from tokenloom.train.model.flops import flops_per_token  # noqa: E402
from tokenloom.train.model.gpt import GPT  # noqa: E402
from tokenloom.train.optim.adamw import OptimConfig, build_optimizer  # noqa: E402
from tokenloom.train.runtime import tune_host_memory  # noqa: E402


def model_config(args) -> GPTConfig:
    """GPT-2 (LayerNorm, GELU, learned positions) or Llama (RMSNorm, SwiGLU, RoPE, GQA with
    ``--n-kv-heads``) of the bench's size, reference ops (what the compiled loop compiles)."""
    return GPTConfig(arch=args.arch, vocab_size=args.vocab, make_vocab_size_divisible_by=128, seq_len=args.seq_len,
                     n_layers=args.n_layers, n_heads=args.n_heads, n_kv_heads=args.n_kv_heads, d_model=args.d_model)


def our_steps(args, out: Path, keep_freed_memory: bool = True, fp8: str | None = None):
    """tokenloom's run on mock data, as a generator of optimizer steps."""
    cfg = TrainConfig(
        model=model_config(args), data=DataConfig(mock=MockDataConfig(num_sequences=20_000, max_length=1024)),
        optim=OptimConfig(lr=3e-4, min_lr=3e-5, warmup_iters=5), micro_batch_size=args.micro,
        global_batch_size=args.micro, train_iters=args.iters + 1, eval_interval=0, log_interval=10,
        save_interval=None, output_dir=str(out), progress=False, plot=False, keep_freed_memory=keep_freed_memory,
        fp8=fp8,
    )
    # One step more than the bench takes, stopped before it: the end-of-run checkpoint (untimed
    # anyway; ~15 GB at 1B parameters) is never written, which keeps the GPU lease for the rows.
    run = start_run(cfg)
    steps = run.steps()
    try:
        for _ in range(args.iters):
            yield next(steps)
    finally:
        steps.close()
        run.finish()


def baseline_steps(args, device: torch.device, fused: bool = False, compiled: bool = False):
    """The plain eager loop, as a generator of optimizer steps; ``compiled``: the nanoGPT-style
    loop GPU users run (model built on the device and ``torch.compile``d whole, fused AdamW)."""
    torch.manual_seed(0)
    if compiled:
        model = GPT(model_config(args), device=device)
        opt = build_optimizer(model, OptimConfig(lr=3e-4))  # torch's fused AdamW where the device has it
        model = torch.compile(model)
    else:
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
        steps = our_steps(args, Path(out), keep_freed_memory=not malloc_default,
                          fp8="tensorwise" if name == "ours_fp8" else None)
    else:
        tune_host_memory(not malloc_default, device)
        steps = baseline_steps(args, device, fused=name == "fused", compiled=name == "compiled")
    while conn.recv():
        start = time.perf_counter()
        next(steps)
        if device.type == "cuda":
            torch.cuda.synchronize()
        conn.send(time.perf_counter() - start)
    next(steps, None)  # lets our run finish (metrics closed)
    conn.send(torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None)


SIDES = ("ours", "base", "fused", "compiled", "ours_fp8", "ours_malloc_default", "base_malloc_default")
CPU_SIDES = ("ours", "base", "fused", "ours_malloc_default", "base_malloc_default")
DESCRIBED = {
    "base": "the eager loop", "fused": "the eager loop with fused AdamW",
    "compiled": "the compiled nanoGPT-style loop (whole-model torch.compile, fused AdamW, SDPA, batches on the device)",
    "ours_fp8": "ours with --fp8 tensorwise",
}


def _gpu_sides(device: torch.device) -> tuple[str, ...]:
    """The default sides on a GPU: ours, the compiled and the eager loop, and ours in fp8 where it runs."""
    from tokenloom.train.model.fp8 import refusal

    fp8 = refusal("tensorwise", device, tp=1, precision="auto", kernels="reference") is None
    return ("ours", "compiled", "base") + (("ours_fp8",) if fp8 else ())


def _pairs_by_default(device: torch.device) -> bool:
    """Pairs on a GPU of less than 120 GiB: four ~1B-parameter runs (~25 GiB each at the GPU
    shapes) fit one H200's 141 GB, not one H100's 80 GB. One group compiles its sides' first
    steps side by side, so the lease pays for one compilation per group, not one per side."""
    return device.type == "cuda" and torch.cuda.get_device_properties(device).total_memory < 120 * 2**30


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
    parser.add_argument("--arch", choices=("gpt2", "llama"), default="gpt2")
    parser.add_argument("--n-kv-heads", type=int, help="key/value heads (GQA, llama); default: --n-heads")
    parser.add_argument("--sides", help="comma-separated subset of " + ",".join(SIDES) + " (default on CPU: "
                        + ",".join(CPU_SIDES) + "; on a GPU: ours,compiled,base and ours_fp8 where fp8 runs)")
    parser.add_argument("--pairs", action=argparse.BooleanOptionalAction, default=None,
                        help="run each side in turn with ours only, two processes at a time (default on a GPU)")
    args = parser.parse_args()
    device = _device()
    ctx = mp.get_context("spawn")
    names = tuple(args.sides.split(",")) if args.sides else CPU_SIDES if device.type == "cpu" else _gpu_sides(device)
    if "ours" not in names or len(names) < 2 or not set(names) <= set(SIDES):
        raise SystemExit(f"--sides must name ours and at least one other, from {','.join(SIDES)}")
    pairs = _pairs_by_default(device) if args.pairs is None else args.pairs
    groups = [("ours", name) for name in names if name != "ours"] if pairs else [names]
    times: dict[str, list[float]] = {name: [] for name in names}
    first: dict[str, list[float]] = {name: [] for name in names}  # each process's first step
    peak: dict[str, int] = {}
    round_ratios: list[float] = []  # per round: base median step / ours median step (their group's)
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for g, group in enumerate(groups):
                pipes, procs = {}, []
                for name in group:
                    parent, child = ctx.Pipe()
                    proc = ctx.Process(target=_loop_process, args=(name, args, str(Path(tmp) / f"{name}{r}_{g}"), child))
                    proc.start()
                    pipes[name] = parent
                    procs.append(proc)
                this_round: dict[str, list[float]] = {name: [] for name in group}
                for name in group:  # the first steps (compilation, warm-up) side by side
                    pipes[name].send(True)
                for name in group:
                    first[name].append(pipes[name].recv())
                for it in range(1, args.iters):  # then the loops take turns, one step each; the others wait
                    for name in group:
                        pipes[name].send(True)
                        elapsed = pipes[name].recv()
                        if it >= args.skip:
                            this_round[name].append(elapsed)
                for name in group:
                    pipes[name].send(False)
                    got = pipes[name].recv()
                    if got is not None:
                        peak[name] = max(peak.get(name, 0), got)
                for proc in procs:
                    proc.join(timeout=120)
                    if proc.exitcode != 0:
                        raise SystemExit(f"a bench loop process failed (exit code {proc.exitcode})")
                for name, ts in this_round.items():
                    times[name].extend(ts)
                if "base" in group:
                    round_ratios.append(statistics.median(this_round["base"]) / statistics.median(this_round["ours"]))
    tokens = args.micro * args.seq_len
    tps = {k: tokens / statistics.median(times[k]) for k in names}
    with torch.device("meta"):
        model = GPT(model_config(args))

    def row(what: str, ours: str, base: str) -> tuple[str, str, str, str]:
        return what, f"{tps[ours]:,.0f}", f"{tps[base]:,.0f}", f"{tps[ours] / tps[base]:.3f}x"

    rows = []
    if "compiled" in tps:
        rows.append(row(f"tokens/s vs {DESCRIBED['compiled']} (target >= 1.05)", "ours", "compiled"))
    if "base" in tps:
        rows.append(row("tokens/s (target >= 1.0)" if "compiled" not in tps else f"tokens/s vs {DESCRIBED['base']}",
                        "ours", "base"))
    if "ours_fp8" in tps:
        rows.append(row("tokens/s, ours --fp8 tensorwise vs ours bf16 (target >= 1.15)", "ours_fp8", "ours"))
    if "fused" in tps:
        rows.append(row("tokens/s, baseline also with fused AdamW", "ours", "fused"))
    if "ours_malloc_default" in tps and "base_malloc_default" in tps:
        rows.append(row("for information: both with malloc's defaults (no keep_freed_memory)",
                        "ours_malloc_default", "base_malloc_default"))
    if round_ratios:
        rows.append(("for information: tokens/s ratio per round (vs the eager loop), min / median / max", "", "",
                     " / ".join(f"{v:.3f}" for v in (min(round_ratios), statistics.median(round_ratios),
                                                     max(round_ratios)))))
    others = [n for n in ("compiled", "base", "ours_fp8") if n in tps]
    device_peak = peak_flops(device)
    if device_peak:
        fpt = flops_per_token(model)
        for other in others:
            rows.append((f"MFU, ours vs {other}", f"{mfu(fpt, tps['ours'], device_peak):.1%}",
                         f"{mfu(fpt, tps[other], device_peak):.1%}", f"{tps['ours'] / tps[other]:.3f}x"))
    else:
        rows.append(("MFU", "n/a", "n/a", f"no known peak FLOP/s for {device.type}"))
    for other in others:
        if "ours" in peak and other in peak:
            rows.append((f"peak device memory (max allocated), ours vs {other}" +
                         (" (target <= 1.05)" if other == "compiled" else ""),
                         f"{peak['ours'] / 2**30:.1f} GiB", f"{peak[other] / 2**30:.1f} GiB",
                         f"{peak['ours'] / peak[other]:.3f}x"))
        ours_first, other_first = statistics.median(first["ours"]), statistics.median(first[other])
        rows.append((f"first step (compilation, warm-up; the group's first steps side by side), ours vs {other}", f"{ours_first:.1f} s",
                     f"{other_first:.1f} s", f"{ours_first / other_first:.3f}x"))
    against = "plain eager loop" if "compiled" not in tps else "compiled and eager loops"
    print_table(f"training loop: tokenloom run() vs {against}, {device.type} ({torch.get_num_threads()} "
                f"threads), {args.arch} {model.num_params() / 1e6:.2f}M params, micro {args.micro} x seq {args.seq_len}, "
                f"one process per loop, median step of {args.rounds} rounds x {args.iters - args.skip} taken in "
                "turn (ratio = ours/baseline, higher is better)",
                rows)


if __name__ == "__main__":
    main()
