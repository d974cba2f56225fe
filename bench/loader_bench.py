"""Loading from object storage: samples/s at seq 2048 from local files and from S3 with latency,
and the share of a CPU training step spent waiting for data.

One source of ``--tokens`` random uint16 tokens below 4096 (documents of 1-4,000 tokens) is written locally and
uploaded to moto's S3 server on 127.0.0.1 (the dev extra), reached through a proxy that adds
``--latency`` seconds to every request (``tests/tl_testing.py``'s FaultProxy, dropping nothing).
Both copies are built into one index cache: the S3 build loads the local build's entries (same
content keys). Rows:

* samples/s at seq 2048 through a ``DataLoader`` (``--workers`` processes, batches of 8) over the
  same shuffled train samples, local vs S3 with the default block cache and read-ahead; each
  pass starts new workers, so every S3 pass fetches its blocks again (a cold cache per worker:
  a pass of ``--samples`` pays that start once, as a run pays it once per worker).
  Alternating passes, best of ``--rounds`` - target: S3 >= 0.5x local;
* data wait per step as a share of the step, S3 vs local: a tiny GPT (``--d-model``, 2 layers, vocab 4096)
  trains on CPU from the S3 loader; the wait is the time ``next(batch)`` blocks - target <= 5%.

Honest limits: the source fits in the default cache (256 MiB per worker); a shuffled sample order
over a ``.bin`` much larger than the cache pays one block transfer per miss (see
``tokenloom.objstore.RangedReader``). The proxy and moto run in this process, on the same cores.

Usage: python bench/loader_bench.py [--tokens N] [--samples N] [--latency S] [--workers N]
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(BENCH.parent / "tests"))
from _table import print_table  # noqa: E402
from tl_testing import FaultProxy, S3Server  # noqa: E402

from tokenloom.blending.build import BuildConfig, build  # noqa: E402
from tokenloom.blending.loader import GPTSamples, SampleConfig  # noqa: E402
from tokenloom.indexed import IndexedDatasetWriter  # noqa: E402
from tokenloom.train.model.config import GPTConfig  # noqa: E402
from tokenloom.train.model.gpt import GPT  # noqa: E402

SEQ = 2048
BATCH = 8
STEP_BATCH = 2
VOCAB = 4096


def write_source(prefix: Path, tokens: int, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 4000, size=tokens // 2000 + 1)
    lengths = lengths[np.cumsum(lengths) <= tokens]
    with IndexedDatasetWriter(prefix, dtype=np.uint16) as writer:
        writer.add_documents(rng.integers(1, VOCAB, int(lengths.sum()), dtype=np.uint16), lengths,
                             np.ones(len(lengths), dtype=np.int64))


def loader(samples: GPTSamples, workers: int, batch: int = BATCH) -> DataLoader:
    return DataLoader(samples, batch_size=batch, num_workers=workers, prefetch_factor=4 if workers else None)


def samples_per_s(samples: GPTSamples, workers: int) -> float:
    start = time.perf_counter()
    n = sum(len(batch["tokens"]) for batch in loader(samples, workers))
    return n / (time.perf_counter() - start)


def step_wait(samples: GPTSamples, workers: int, steps: int, d_model: int) -> tuple[float, float]:
    """(data wait / step time, mean step seconds) over ``steps`` steps after one warm-up step."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=VOCAB, seq_len=SEQ, n_layers=2, n_heads=2, d_model=d_model))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    it = iter(loader(samples, workers, STEP_BATCH))
    wait = total = 0.0
    for i in range(steps + 1):
        t0 = time.perf_counter()
        batch = next(it)
        t1 = time.perf_counter()
        loss = model(batch["tokens"], batch["labels"])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        t2 = time.perf_counter()
        if i:  # the first step also starts the workers
            wait, total = wait + t1 - t0, total + t2 - t0
    return wait / total, total / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, default=16_000_000, help="tokens in the source (uint16)")
    parser.add_argument("--samples", type=int, default=12000, help="train samples read per pass")
    parser.add_argument("--latency", type=float, default=0.02, help="seconds the proxy adds per request")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6, help="training steps for the data-wait row")
    parser.add_argument("--d-model", type=int, default=64)
    args = parser.parse_args()
    torch.set_num_threads(max(1, (os.cpu_count() or 2) - args.workers))
    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # moto's server logs every request

    with tempfile.TemporaryDirectory() as tmp:
        os.environ["TOKENLOOM_CACHE"] = f"{tmp}/node-cache"
        write_source(Path(tmp) / "web", args.tokens)
        server = S3Server()
        proxy = FaultProxy(server.endpoint, latency=args.latency)
        os.environ.update({k: v for k, v in server.env(proxy.endpoint).items() if k.startswith("AWS_")})
        fs = server.fs()
        fs.mkdir("bench")
        for suffix in (".bin", ".idx"):
            fs.put_file(f"{tmp}/web{suffix}", f"bench/web{suffix}")

        def samples(prefix: str) -> GPTSamples:
            result = build(BuildConfig(data=[(1.0, prefix)], split="100,0,0", seq_length=SEQ,
                                       num_samples=(args.samples, 0, 0), cache_dir=f"{tmp}/index-cache"))
            return GPTSamples(result.train, SampleConfig(eod=0))

        local, remote = samples(f"{tmp}/web"), samples("s3://bench/web")
        assert np.array_equal(local[len(local) // 2]["tokens"], remote[len(remote) // 2]["tokens"])
        best_local = best_remote = 0.0
        for _ in range(args.rounds):
            best_local = max(best_local, samples_per_s(local, args.workers))
            best_remote = max(best_remote, samples_per_s(remote, args.workers))
        share_remote, step_s = step_wait(remote, args.workers, args.steps, args.d_model)
        share_local, _ = step_wait(local, args.workers, args.steps, args.d_model)
        requests = proxy.requests
        proxy.close()
        server.close()

    mib = args.tokens * 2 / (1 << 20)
    print_table(
        f"loader: one source of {mib:.0f} MiB (uint16), {args.samples} samples of {SEQ} per pass, "
        f"{args.workers} DataLoader workers, batches of {BATCH}; S3 = moto on 127.0.0.1 behind a proxy adding "
        f"{args.latency * 1000:.0f} ms per request, default block cache and read-ahead; best of {args.rounds} "
        f"alternating passes; 2 shared CPU cores, noisy (tokenloom = S3, baseline = local)",
        [("samples/s at seq 2048, S3 vs local (target >= 0.5x)", f"{best_remote:,.0f}", f"{best_local:,.0f}",
          f"{best_remote / best_local:.3f}x"),
         (f"data wait per CPU training step (GPT d_model {args.d_model}, 2 layers, vocab {VOCAB}, micro {STEP_BATCH} x {SEQ}; "
          f"step {step_s:.2f} s), share of the step, S3 vs local (target <= 5%)",
          f"{share_remote:.1%}", f"{share_local:.1%}", ""),
         ("for information: requests through the proxy (every worker of every pass fetches its blocks)",
          f"{requests}", "", "")])


if __name__ == "__main__":
    main()
