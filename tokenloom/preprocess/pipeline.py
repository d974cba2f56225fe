"""``tokenloom preprocess``: corpora in, Megatron ``.bin/.idx`` + manifest out.

    reader (main process)  ->  N worker processes  ->  writer (main process)
    cuts inputs into ~1 MiB    parse JSON, validate,    writes chunks in input
    chunks of raw records      batch-tokenize, frame    order, checkpoints

Policy and its costs:

* Ordered and deterministic: chunks are numbered and written in order, and a
  record's tokens depend only on that record, so the bytes are the same for any
  ``--workers`` and equal Megatron's ``preprocess_data.py`` output.
* Bounded memory: at most ``2 x workers`` chunks are in flight (backpressure on
  the reader); index arrays grow by 12 bytes per sequence.
* Resumable: every ``checkpoint_interval`` seconds the partial ``.bin`` files are
  fsynced and a checkpoint (index arrays + input position + counters) is written
  atomically into ``OUTPUT.partial/``. Rerunning the same command continues from
  there; anything written after the checkpoint is truncated away, so the result
  is byte-identical to an uninterrupted run. A different command starts afresh.
* Bad records: by default the first one stops the run with ``file:line: reason``.
  With ``max_bad_fraction`` they go to ``OUTPUT.rejects.jsonl`` and the run fails
  only if their share of records exceeds it. On failure nothing is published
  under a final name (the rejects file is, to explain the failure).
* Input digests (sha256) are computed by a background thread reading the files
  a second time; this costs disk bandwidth, not tokenizer time.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import hashlib
import json
import multiprocessing
import os
import shutil
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from tokenloom.errors import TokenloomError
from tokenloom.fsio import atomic_writer, sha256_tree
from tokenloom.indexed.format import IndexedDatasetWriter, optimal_dtype
from tokenloom.preprocess import manifest
from tokenloom.preprocess.documents import MISSING_KEY
from tokenloom.preprocess.readers import ChunkReader, Input, Position, discover, shard_inputs
from tokenloom.preprocess.worker import (
    EncodedChunk,
    EncodeOptions,
    encode_chunk,
    encode_in_worker,
    init,
    ping,
)

CHECKPOINT_FORMAT = "tokenloom.preprocess-checkpoint/1"


@dataclass(kw_only=True)
class PreprocessConfig:
    inputs: list[str]
    """Input files, globs or HF datasets directories: jsonl, jsonl.gz, jsonl.zst, parquet, txt (repeatable)."""
    output_prefix: str
    """Output prefix: writes PREFIX.bin, PREFIX.idx and PREFIX.manifest.json."""
    tokenizer: str | None = None
    """Tokenizer file or directory (tokenizer.json, vocab.json+merges.txt, vocab.txt, .model, .tiktoken)."""
    tokenizer_type: str | None = None
    """Force the tokenizer kind instead of detecting it from the files (e.g. byte, null, hf, tiktoken)."""
    json_keys: list[str] = field(default_factory=lambda: ["text"])
    """Keys (columns) to tokenize; several keys give one output per key."""
    append_eod: bool = False
    """Append the tokenizer's EOD id to every non-empty document."""
    prepend_bos: bool = False
    """Prepend the tokenizer's BOS id to every non-empty document."""
    workers: int = 0
    """Tokenizer worker processes (0: one per CPU core)."""
    txt_unit: str = "file"
    """What one document is in a .txt input: file, paragraph (blank-line separated) or line."""
    megatron_names: bool = False
    """Name outputs PREFIX_<key>_document like Megatron's preprocess_data.py."""
    num_shards: int | None = None
    """Split the inputs into this many shards (default: $WORLD_SIZE or $SLURM_NTASKS, else 1)."""
    shard_index: int | None = None
    """Which shard this process writes (default: $RANK or $SLURM_PROCID, else 0)."""
    max_bad_fraction: float | None = None
    """Quarantine bad records into PREFIX.rejects.jsonl and fail only above this fraction (default: stop at the first)."""
    chunk_bytes: int = 1 << 20
    """Text bytes per work unit sent to a worker."""
    checkpoint_interval: float = 60.0
    """Seconds between resume checkpoints."""
    check_space: bool = True
    """Refuse to start when the output disk cannot hold the estimated output."""
    progress: bool = True
    """Show a progress bar on stderr."""


@dataclass
class Counts:
    records: int = 0
    documents: int = 0
    bad_records: int = 0
    bytes_in: int = 0
    text_bytes: int = 0
    per_key: dict = field(default_factory=dict)  # key -> {documents, empty_documents, sequences, tokens}


# --------------------------------------------------------------------------- planning


def _env_int(*names: str) -> int | None:
    for name in names:
        value = os.environ.get(name)
        if value not in (None, ""):
            try:
                return int(value)
            except ValueError:
                raise TokenloomError(f"${name}={value!r} is not an integer") from None
    return None


def resolve_shard(cfg: PreprocessConfig) -> tuple[int, int]:
    n = cfg.num_shards if cfg.num_shards is not None else (_env_int("WORLD_SIZE", "SLURM_NTASKS") or 1)
    i = cfg.shard_index if cfg.shard_index is not None else (_env_int("RANK", "SLURM_PROCID") or 0)
    if n < 1:
        raise TokenloomError(f"--num-shards must be >= 1, got {n}")
    return n, i


def run_prefix(cfg: PreprocessConfig, num_shards: int, shard_index: int) -> str:
    """The prefix of this run's own files (rejects, partial state): the output prefix, per shard."""
    if num_shards > 1:
        return f"{cfg.output_prefix}-shard{shard_index:05d}-of-{num_shards:05d}"
    return cfg.output_prefix


def output_prefixes(cfg: PreprocessConfig, num_shards: int, shard_index: int) -> dict[str, str]:
    base = run_prefix(cfg, num_shards, shard_index)
    if cfg.megatron_names:
        return {k: f"{base}_{k}_document" for k in cfg.json_keys}
    if len(cfg.json_keys) == 1:
        return {cfg.json_keys[0]: base}
    return {k: f"{base}_{k}" for k in cfg.json_keys}


def _estimate_output_bytes(inputs: list[Input], itemsize: int, tokens_per_byte: float) -> int:
    expansion = {"jsonl.gz": 4.0, "jsonl.zst": 5.0, "txt.gz": 3.0, "txt.zst": 4.0, "parquet": 3.0}
    text = sum(i.size * expansion.get(i.format, 1.0) for i in inputs)
    return int(text * tokens_per_byte * itemsize * 1.1)


def _check_space(prefix: str, estimate: int) -> None:
    directory = os.path.dirname(os.path.abspath(prefix))
    free = shutil.disk_usage(directory).free
    if estimate > free:
        raise TokenloomError(f"not enough disk space in {directory}: the output is estimated at "
                             f"{estimate / 1e9:.2f} GB but only {free / 1e9:.2f} GB are free "
                             "(free space, or pass --no-space-check)")


def _config_digest(cfg: PreprocessConfig, inputs: list[Input], tokenizer_fp: dict, shard) -> str:
    stats = [(i.path, i.format, i.size, os.stat(i.path).st_mtime_ns) for i in inputs]
    shape = {k: v for k, v in asdict(cfg).items()
             if k not in ("workers", "chunk_bytes", "checkpoint_interval", "check_space", "progress")}
    blob = json.dumps([stats, tokenizer_fp["digest"], shape, shard], sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


# --------------------------------------------------------------------------- checkpoints


class _Checkpoint:
    """One atomic ``checkpoint.npz`` in the partial directory: writer arrays + JSON state."""

    def __init__(self, directory: Path):
        self.dir = directory
        self.path = directory / "checkpoint.npz"

    def save(self, state: dict, writers: dict[str, IndexedDatasetWriter], rejects) -> None:
        arrays = {}
        for n, writer in enumerate(writers.values()):
            for name, arr in writer.checkpoint().items():
                arrays[f"w{n}_{name}"] = arr
        if rejects is not None:
            rejects.flush()
            os.fsync(rejects.fileno())
            state["rejects_bytes"] = rejects.tell()
        arrays["state"] = np.frombuffer(json.dumps(state).encode(), dtype=np.uint8)
        with atomic_writer(self.path) as f:
            np.savez(f, **arrays)

    def load(self) -> tuple[dict, list[dict]] | None:
        if not self.path.exists():
            return None
        try:
            with np.load(self.path, allow_pickle=False) as data:
                state = json.loads(bytes(data["state"]).decode())
                writers = [{name: data[f"w{n}_{name}"] for name in ("lengths", "document_indices", "bin_bytes")}
                           for n in range(len(state["keys"]))]
        except (OSError, ValueError, KeyError) as exc:
            print(f"warning: ignoring unreadable checkpoint {self.path} ({exc})", file=sys.stderr)
            return None
        if state.get("format") != CHECKPOINT_FORMAT:
            return None
        return state, writers


# --------------------------------------------------------------------------- the run


class _Run:
    """State of one preprocess run (kept in one object so ``run`` reads top to bottom)."""

    def __init__(self, cfg: PreprocessConfig, echo):
        from tokenloom.tokenizers import load_tokenizer

        self.cfg, self.echo = cfg, echo
        if not cfg.json_keys:
            raise TokenloomError("--json-keys needs at least one key")
        if cfg.max_bad_fraction is not None and not 0 <= cfg.max_bad_fraction <= 1:
            raise TokenloomError(f"--max-bad-fraction must lie in [0, 1], got {cfg.max_bad_fraction}")
        if cfg.workers < 0:
            raise TokenloomError(f"--workers must be >= 0, got {cfg.workers}")
        all_inputs = discover(cfg.inputs)
        self.num_shards, self.shard_index = resolve_shard(cfg)
        self.inputs = [all_inputs[k] for k in shard_inputs(all_inputs, self.num_shards, self.shard_index)]
        if cfg.tokenizer is None and cfg.tokenizer_type is None:
            raise TokenloomError("--tokenizer PATH (or --tokenizer-type byte|null) is required")
        self.tokenizer = tok = load_tokenizer(cfg.tokenizer, kind=cfg.tokenizer_type)
        if cfg.append_eod and tok.eod is None:
            raise TokenloomError(f"--append-eod: tokenizer {tok!r} has no EOD token")
        if cfg.prepend_bos and tok.bos is None:
            raise TokenloomError(f"--prepend-bos: tokenizer {tok!r} has no BOS token")
        self.fingerprint = tok.fingerprint()
        self.dtype = optimal_dtype(tok.vocab_size)
        self.opts = EncodeOptions(tuple(cfg.json_keys), str(self.dtype), tok.vocab_size, cfg.append_eod,
                                  cfg.prepend_bos, tok.eod, tok.bos)
        self.outputs = output_prefixes(cfg, self.num_shards, self.shard_index)
        base = run_prefix(cfg, self.num_shards, self.shard_index)
        self.partial = Path(f"{base}.partial")
        self.rejects_path = Path(f"{base}.rejects.jsonl")
        self.digest = _config_digest(cfg, self.inputs, self.fingerprint, [self.num_shards, self.shard_index])
        self.workers = cfg.workers or os.cpu_count() or 1
        self.counts = Counts(per_key={k: {"documents": 0, "empty_documents": 0, "sequences": 0, "tokens": 0}
                                      for k in cfg.json_keys})

    # -- setup: fresh or resumed
    def open_outputs(self) -> Position:
        ckpt = _Checkpoint(self.partial)
        loaded = ckpt.load() if self.partial.exists() else None
        if loaded and loaded[0].get("digest") != self.digest:
            self.echo(f"note: {self.partial} belongs to a different command; starting afresh")
            loaded = None
        if self.partial.exists() and loaded is None:
            shutil.rmtree(self.partial)
        self.partial.mkdir(parents=True, exist_ok=True)
        self.checkpoint = ckpt
        tolerant = self.cfg.max_bad_fraction is not None
        self.writers = {}
        if loaded:
            state, arrays = loaded
            for n, (key, prefix) in enumerate(self.outputs.items()):
                self.writers[key] = IndexedDatasetWriter(prefix, dtype=self.dtype, vocab_size=self.tokenizer.vocab_size,
                                                         bin_tmp=self.partial / f"{n}.bin", resume=arrays[n])
            c = state["counts"]
            self.counts = Counts(**{k: c[k] for k in ("records", "documents", "bad_records", "bytes_in",
                                                       "text_bytes")}, per_key=c["per_key"])
            self.rejects = None
            if tolerant:
                self.rejects = open(self.partial / "rejects.jsonl", "r+b")
                self.rejects.truncate(state.get("rejects_bytes", 0))
                self.rejects.seek(state.get("rejects_bytes", 0))
            position = Position.from_json(state["position"])
            self.echo(f"resuming from {self.partial}: {self.counts.records} records done")
            return position
        for n, (key, prefix) in enumerate(self.outputs.items()):
            self.writers[key] = IndexedDatasetWriter(prefix, dtype=self.dtype, vocab_size=self.tokenizer.vocab_size,
                                                     bin_tmp=self.partial / f"{n}.bin")
        self.rejects = open(self.partial / "rejects.jsonl", "wb") if tolerant else None
        if self.cfg.check_space:
            sample = "".join(chr(c) for c in range(32, 127)) * 40
            per_byte = max(0.3, len(self.tokenizer.encode(sample)) / len(sample))
            _check_space(next(iter(self.outputs.values())),
                         _estimate_output_bytes(self.inputs, self.dtype.itemsize, per_byte))
        return Position()

    def save_checkpoint(self, position: Position) -> None:
        state = {"format": CHECKPOINT_FORMAT, "digest": self.digest, "position": position.to_json(),
                 "counts": asdict(self.counts), "keys": list(self.writers)}
        self.checkpoint.save(state, self.writers, self.rejects)

    # -- consuming results in order
    def consume(self, chunk_input: int, result: EncodedChunk) -> None:
        inp = self.inputs[chunk_input]
        if result.bad:
            if self.rejects is None:
                number, reason, _ = result.bad[0]
                unit = "line" if inp.format.startswith(("jsonl", "txt")) else "row"
                hint = "" if reason.startswith(MISSING_KEY) else \
                    f" (bad {unit}; pass --max-bad-fraction F to quarantine bad records instead)"
                raise TokenloomError(f"{inp.path}:{number}: {reason}{hint}")
            for number, reason, snippet in result.bad:
                self.rejects.write((json.dumps({"file": inp.path, "line": number, "reason": reason,
                                                "record": snippet}, ensure_ascii=False) + "\n").encode())
        self.counts.bad_records += len(result.bad)
        self.counts.records += result.documents + len(result.bad)
        self.counts.documents += result.documents
        self.counts.text_bytes += result.text_bytes
        for key, out in result.outputs.items():
            self.writers[key].add_documents(out.tokens, out.sequence_lengths, out.sequences_per_document)
            c = self.counts.per_key[key]
            c["documents"] += len(out.sequences_per_document)
            c["empty_documents"] += out.empty_documents
            c["sequences"] += len(out.sequence_lengths)
            c["tokens"] += int(out.tokens.size)

    # -- publishing
    def publish(self, digests: dict[str, str]) -> None:
        cfg, c = self.cfg, self.counts
        bad_share = c.bad_records / c.records if c.records else 0.0
        if self.rejects is not None:
            self.rejects.close()
            os.replace(self.partial / "rejects.jsonl", self.rejects_path)
            if cfg.max_bad_fraction is not None and bad_share > cfg.max_bad_fraction:
                raise TokenloomError(f"{c.bad_records} of {c.records} records were bad ({bad_share:.2%} > "
                                     f"--max-bad-fraction {cfg.max_bad_fraction:.2%}); see {self.rejects_path}; "
                                     "nothing was written")
        inputs = [{"path": i.path, "format": i.format, "size": i.size, "sha256": digests[i.path]}
                  for i in self.inputs]
        options = {"json_keys": cfg.json_keys, "append_eod": cfg.append_eod, "prepend_bos": cfg.prepend_bos,
                   "txt_unit": cfg.txt_unit, "max_bad_fraction": cfg.max_bad_fraction,
                   "shard": {"index": self.shard_index, "count": self.num_shards}}
        for key, writer in self.writers.items():
            writer.finalize()
            counts = {**self.counts.per_key[key], "bad_records": c.bad_records, "bytes_in": c.bytes_in,
                      "records": c.records}
            manifest.write(self.outputs[key], manifest.build(self.outputs[key], key, str(self.dtype), inputs,
                                                              self.fingerprint, options, counts))
        shutil.rmtree(self.partial, ignore_errors=True)

    def close_files(self) -> None:
        for writer in self.writers.values():
            writer.close()
        if self.rejects is not None and not self.rejects.closed:
            self.rejects.close()

    def abort(self) -> None:
        for writer in self.writers.values():
            writer.abort()
        if self.rejects is not None and not self.rejects.closed:
            self.rejects.close()
        shutil.rmtree(self.partial, ignore_errors=True)


def start_pool(run: _Run) -> cf.ProcessPoolExecutor | None:
    """Worker processes, started before any thread exists in this process.

    On Linux they are forked (no re-import, ~10 ms each instead of ~1 s with spawn) and
    keep the parent's tokenizer, switched to one thread; forking is safe because no thread
    is running yet (the hasher and the progress bar start later) and nothing has been
    encoded here. Spawned workers build their tokenizer from the spec.
    """
    if run.workers <= 1:
        return None
    fork = sys.platform.startswith("linux")
    pool = cf.ProcessPoolExecutor(run.workers, mp_context=multiprocessing.get_context("fork" if fork else "spawn"),
                                  initializer=init, initargs=(run.tokenizer.spec, run.tokenizer if fork else None))
    pool.submit(ping).result()  # launches every process now, before threads start
    return pool


def _results(run: _Run, chunks, pool: cf.ProcessPoolExecutor | None):
    """Yield (chunk, EncodedChunk) in input order; at most 2 x workers chunks in flight."""
    if pool is None:
        from tokenloom.preprocess import worker

        worker.set_tokenizer(run.tokenizer)
        for chunk in chunks:
            yield chunk, encode_chunk(chunk, run.opts)
        return
    inflight: collections.deque = collections.deque()
    try:
        for chunk in chunks:
            inflight.append((chunk, pool.submit(encode_in_worker, chunk, run.opts)))
            if len(inflight) >= 2 * run.workers:
                done, fut = inflight.popleft()
                yield done, fut.result()
        while inflight:
            done, fut = inflight.popleft()
            yield done, fut.result()
    except cf.process.BrokenProcessPool:
        raise TokenloomError("a tokenizer worker process died (out of memory?); rerun the same command "
                             "to resume from the last checkpoint") from None
    finally:
        for _, fut in inflight:
            fut.cancel()


def run(cfg: PreprocessConfig, echo=print) -> dict:
    """Run preprocess; return the summary (also printed as a table)."""
    start = time.perf_counter()
    r = _Run(cfg, echo)
    position = r.open_outputs()
    pool = start_pool(r)
    digests: dict[str, str] = {}
    hasher = threading.Thread(target=lambda: digests.update({i.path: sha256_tree(i.path) for i in r.inputs}),
                              daemon=True)
    hasher.start()
    reader = ChunkReader(r.inputs, cfg.json_keys, cfg.chunk_bytes, txt_unit=cfg.txt_unit)
    total = sum(i.size for i in r.inputs)
    from tqdm import tqdm

    bar = tqdm(total=total, unit="B", unit_scale=True, disable=not cfg.progress, file=sys.stderr,
               desc="preprocess", mininterval=0.5, initial=r.counts.bytes_in)
    last_ckpt = time.monotonic()
    tokens_at_start = sum(c["tokens"] for c in r.counts.per_key.values())
    try:
        for chunk, result in _results(r, reader.chunks(position), pool):
            r.consume(chunk.input, result)
            r.counts.bytes_in += chunk.raw_bytes
            bar.update(chunk.raw_bytes)
            if time.monotonic() - last_ckpt >= cfg.checkpoint_interval:
                r.save_checkpoint(chunk.end)
                last_ckpt = time.monotonic()
            elapsed = max(time.perf_counter() - start, 1e-9)
            tokens = sum(c["tokens"] for c in r.counts.per_key.values()) - tokens_at_start
            bar.set_postfix_str(f"{tokens / elapsed / 1e3:.0f}k tok/s", refresh=False)
        bar.close()
        hasher.join()
        r.publish(digests)
    except TokenloomError:
        r.abort()
        raise
    except BaseException:
        # Crash or Ctrl-C: keep the last checkpoint so the same command resumes.
        r.close_files()
        raise
    finally:
        bar.close()
        if pool is not None:
            pool.shutdown(cancel_futures=True)
    elapsed = time.perf_counter() - start
    summary = _summary(r, elapsed)
    echo(format_summary(summary))
    return summary


def _summary(r: _Run, elapsed: float) -> dict:
    c = r.counts
    tokens = sum(k["tokens"] for k in c.per_key.values())
    return {
        "outputs": {k: r.outputs[k] for k in r.outputs},
        "inputs": len(r.inputs),
        "shard": f"{r.shard_index + 1}/{r.num_shards}",
        "tokenizer": f"{r.tokenizer.kind} (vocab {r.tokenizer.vocab_size}, {r.fingerprint['digest'][:12]})",
        "dtype": str(r.dtype),
        "records": c.records,
        "bad_records": c.bad_records,
        "per_key": c.per_key,
        "tokens": tokens,
        "bytes_in": c.bytes_in,
        "seconds": round(elapsed, 3),
        "tokens_per_second": round(tokens / max(elapsed, 1e-9)),
        "input_mb_per_second": round(c.bytes_in / 1e6 / max(elapsed, 1e-9), 2),
    }


def format_summary(summary: dict) -> str:
    rows = [("output", ", ".join(f"{k}: {v}" for k, v in summary["outputs"].items()))]
    rows += [(k, str(summary[k])) for k in ("inputs", "shard", "tokenizer", "dtype", "records", "bad_records")]
    for key, c in summary["per_key"].items():
        rows.append((f"[{key}] documents", f"{c['documents']} ({c['empty_documents']} empty)"))
        rows.append((f"[{key}] sequences / tokens", f"{c['sequences']} / {c['tokens']}"))
    rows += [("input", f"{summary['bytes_in'] / 1e6:.2f} MB"), ("time", f"{summary['seconds']:.2f} s"),
             ("throughput", f"{summary['tokens_per_second'] / 1e3:.1f}k tokens/s, "
                            f"{summary['input_mb_per_second']:.2f} MB/s")]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
