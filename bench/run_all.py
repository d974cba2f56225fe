"""Run every ``bench/*_bench.py`` as a subprocess and write ``bench/RESULTS.md``.

    .venv/bin/python bench/run_all.py [--full] [--only NAME ...] [--out bench/RESULTS.md]
    .venv/bin/python bench/run_all.py --gpu      # on a CUDA machine: only the GPU rows

Each script runs in its own process (no shared torch threads, caches or allocator state
between benches) with reduced sizes (``SMALL_ARGS``) so the suite takes ~10 minutes
on 2 cores; ``--full`` uses each script's own defaults (much longer, closer to the
issue targets). Tables are collected through ``BENCH_RESULTS_MD`` (see ``_table.py``),
not by parsing stdout, so a script's progress output cannot corrupt them. A failing or
timed-out script gets its exit status and the tail of its output in RESULTS.md instead
of a table, and the suite goes on. The trade-off of the small sizes: fixed costs
(process start, compile, pool start-up) weigh more, so ratios are pessimistic for
tokenloom where it amortises start-up (preprocess, blend).

The GPU rows (``--gpu``, what ``scripts/gpu-check.sh`` runs) are bf16 runs of ~1B-parameter
GPTs (``GPU_ARGS``: a GPT-2 and a Llama shape): tokens/s, MFU, peak memory and first step of
our loop against the compiled nanoGPT-style loop (and, for the GPT-2 shape, the eager loop
and our fp8 run), then fp8's loss against bf16 after 300 steps (``fp8_bench``), then the
loop's stall and the save time of a ~1B-parameter checkpoint (``checkpoint_bench``). They live
between ``GPU_BEGIN`` and ``GPU_END`` in RESULTS.md; ``--gpu`` rewrites only that block and a
CPU run keeps the block it finds, so neither erases the other.

The notes (``NOTES_BEGIN`` .. ``NOTES_END``, at the end of RESULTS.md) are written by hand:
figures that a docstring's trade-off rests on, measured once (under the bench that
measures them, or where no bench does, with what, where and when). Every run keeps them as
they are, so code and docstrings can point here instead of quoting numbers that rot.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent

# preprocess_bench, blend_bench, packing_bench, train_bench and ddp_bench always run at their
# defaults: their targets are defined at those sizes (>= 10,000 documents; >= 2 M samples over
# several G tokens; 10 M documents packed; models large enough that per-step overheads and timer
# noise do not dominate), and smaller inputs measure start-up costs and noise.
SMALL_ARGS: dict[str, list[str]] = {
    "indexed_bench": ["--documents", "20000", "--reads", "20000"],
    "kernels_bench": ["--steps", "5", "--rounds", "2"],
    "checkpoint_bench": ["--sizes", "124m", "--rounds", "3"],  # 350m: ~4 more minutes
}
TIMEOUT_S = 600  # train_bench: 8 rounds x 4 fresh processes, ~7 min on 2 quiet cores
# GPT-2 shape, ~1.0 B parameters: 16 layers x d_model 2048 (0.81 B) + 50304 x 2048 tied embedding (0.10 B);
# Llama shape: the same layers with 4 KV heads, vocab 32000, seq 4096. One round of pairs with ours
# (train_bench --pairs on a GPU) keeps the bench inside scripts/gpu-check.sh's lease.
_SHAPE = ["--d-model", "2048", "--n-layers", "16", "--n-heads", "16", "--iters", "9", "--skip", "4", "--rounds", "1"]
GPU_ARGS: dict[str, list[list[str]]] = {
    "train_bench": [
        [*_SHAPE, "--vocab", "50304", "--seq-len", "2048", "--micro", "4"],
        [*_SHAPE, "--arch", "llama", "--n-kv-heads", "4", "--vocab", "32000", "--seq-len", "4096", "--micro", "2",
         "--sides", "ours,compiled"],
    ],
    "fp8_bench": [[]],  # its defaults: the GPT-2 shape above, 300 steps, data from TOKENLOOM_BENCH_DATA
    # the ~1 B-parameter state this CPU box cannot hold twice: a warm-up and one timed round of the three sides
    "checkpoint_bench": [["--sizes", "1b", "--rounds", "1"]],
    # experts as one grouped GEMM (Hopper) vs the loop, and the MoE vs its dense twin, bf16 eager
    "moe_bench": [["--speed-only", "--device", "cuda", "--d-model", "1024", "--n-layers", "8", "--seq-len", "2048",
                   "--micro", "4"]],
}
GPU_BEGIN, GPU_END = "<!-- gpu-rows -->", "<!-- /gpu-rows -->"
NOTES_BEGIN, NOTES_END = "## Notes from measurements", "<!-- /notes: hand-written, kept by bench/run_all.py -->"


def kept_notes(old: str) -> str:
    """The hand-written notes block of an old RESULTS.md (heading to end marker), or "" if none."""
    start = old.find(NOTES_BEGIN)
    end = old.find(NOTES_END, start)
    return old[start:end + len(NOTES_END)] if start >= 0 and end >= 0 else ""


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _ram_gib() -> str:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return f"{int(line.split()[1]) / 2**20:.1f} GiB"
    except OSError:
        pass
    return "unknown"


def machine() -> list[str]:
    import torch

    gpu = "none"
    if torch.cuda.is_available():
        gpu = ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    libs = ", ".join(f"{d} {_version(d)}" for d in ("numpy", "tokenizers", "tiktoken", "sentencepiece",
                                                    "megatron-core"))
    return [
        f"- CPU: {_cpu_model()}, {usable} usable cores ({os.cpu_count()} online)",
        f"- RAM: {_ram_gib()}",
        f"- GPU: {gpu}",
        f"- Python {platform.python_version()}, torch {torch.__version__}, {libs}",
        f"- OS: {platform.platform()}",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--full", action="store_true", help="each script's default sizes")
    parser.add_argument("--only", nargs="*", help="bench names (e.g. kernels_bench): rewrite only their sections "
                        "(with --gpu: run only those GPU rows, keep the block's others)")
    parser.add_argument("--out", default=str(BENCH / "RESULTS.md"))
    parser.add_argument("--gpu", action="store_true", help="run only the GPU rows (needs CUDA) and rewrite only them")
    args = parser.parse_args()

    scripts = sorted(BENCH.glob("*_bench.py"))
    if args.gpu:
        import torch

        if not torch.cuda.is_available():
            raise SystemExit("run_all.py --gpu: no CUDA device visible")
        runs = [(BENCH / f"{name}.py", extra) for name, arg_lists in GPU_ARGS.items() for extra in arg_lists
                if not args.only or name in args.only]
    else:
        if args.only:
            scripts = [s for s in scripts if s.stem in args.only]
        runs = [(s, [] if args.full else SMALL_ARGS.get(s.stem, [])) for s in scripts]
    scripts = [s for s, _ in runs]
    started = datetime.datetime.now(datetime.timezone.utc)
    sections: list[str] = []
    for script, extra in runs:
        cmd = [sys.executable, str(script), *extra]
        print(f"== {script.name} {' '.join(extra)}", flush=True)
        with tempfile.NamedTemporaryFile("r", suffix=".md", delete=False) as tables:
            env = dict(os.environ, BENCH_RESULTS_MD=tables.name,
                       PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
            t0 = time.perf_counter()
            try:
                proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True,
                                      timeout=TIMEOUT_S * (3 if args.gpu else 1))
                rc, output = proc.returncode, proc.stdout + proc.stderr
            except subprocess.TimeoutExpired as e:
                rc = "timeout"
                output = "".join(x.decode() if isinstance(x, bytes) else (x or "") for x in (e.stdout, e.stderr))
            elapsed = time.perf_counter() - t0
            body = Path(tables.name).read_text()
        os.unlink(tables.name)
        print(output[-4000:], flush=True)
        when = f", re-run alone on {started:%Y-%m-%d %H:%M} UTC" if args.only else ""
        if args.gpu and args.only:  # the block's header names the machine of its first rows
            when += f" on {machine()[2].removeprefix('- GPU: ')}"
        head = f"## {script.stem}\n\n`python bench/{script.name} {' '.join(extra)}` ({elapsed:.0f} s{when})\n\n"
        if rc != 0 or not body.strip():
            tail = "\n".join(output.strip().splitlines()[-15:])
            body += f"**failed** (exit {rc}); last lines:\n\n```\n{tail}\n```\n\n"
        sections.append(head + body)

    out = Path(args.out)
    old = out.read_text() if out.exists() else ""
    kept_gpu = old[old.index(GPU_BEGIN):old.index(GPU_END) + len(GPU_END)] if GPU_END in old else ""
    if args.gpu and args.only and kept_gpu:  # those benches' sections replaced, the others kept
        head, *olds = kept_gpu.removesuffix(GPU_END).split("\n## ")
        kept = ["## " + o for o in olds if o.split("\n", 1)[0] not in args.only]
        block = "\n".join([head.rstrip(), "", *kept, *sections, GPU_END])
        out.write_text(old.replace(kept_gpu, block).rstrip() + "\n")
        print(f"rewrote the GPU rows of {', '.join(args.only)} in {args.out}")
        return
    if args.gpu:
        block = "\n".join([GPU_BEGIN, f"GPU rows: `bench/run_all.py --gpu` on {started:%Y-%m-%d %H:%M} UTC",
                           "", *machine(), "", *sections, GPU_END])
        text = old.replace(kept_gpu, block) if kept_gpu else old.rstrip() + "\n\n" + block
        out.write_text(text.rstrip() + "\n")
        print(f"wrote the GPU rows of {args.out}")
        return
    if args.only and old:  # replace those sections, keep the others
        text = old
        for section in sections:
            title = section.split("\n", 1)[0] + "\n"
            start = text.find(title, text.find(GPU_END) + 1)  # not a GPU section of the same name
            if start < 0:  # a new section goes before the notes
                notes = kept_notes(text)
                text = text.replace(notes, "").rstrip() + "\n\n" + section + (f"\n\n{notes}" if notes else "")
                continue
            end = text.find("\n## ", start + len(title))
            text = text[:start] + section.rstrip() + "\n\n" + (text[end + 1:] if end >= 0 else "")
        out.write_text(text.rstrip() + "\n")
        print(f"rewrote {', '.join(s.stem for s in scripts)} in {args.out}")
        return
    sizes = "each script's default sizes (--full)" if args.full else "reduced sizes (bench/run_all.py SMALL_ARGS)"
    gpu_block = kept_gpu or f"{GPU_BEGIN}\nGPU rows: not yet run (`bash scripts/gpu-check.sh` on a CUDA machine)\n{GPU_END}"
    text = "\n".join([
        "# Benchmark results",
        "",
        f"Generated by `make bench` (`python bench/run_all.py`) on {started:%Y-%m-%d %H:%M} UTC, {sizes}.",
        "Ratios are tokenloom / baseline; which direction is better is stated in each bench's docstring.",
        "",
        "## Machine",
        "",
        *machine(),
        "",
        gpu_block,
        "",
        *sections,
        kept_notes(old),
    ])
    out.write_text(text.rstrip() + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
