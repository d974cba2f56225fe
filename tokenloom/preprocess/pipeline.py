"""``tokenloom preprocess``: corpora in, Megatron ``.bin/.idx`` + manifest out.

    reader (main process)  ->  N worker processes  ->  writer (main process)
    cuts inputs into ~4 MiB    read their range, parse  writes chunks in input
    chunks of raw records      JSON, validate, batch-   order, checkpoints
                               tokenize, frame

Policy and its costs:

* Ordered and deterministic: chunks are numbered and written in order, and a
  record's tokens depend only on that record, so the bytes are the same for any
  ``--workers`` and equal Megatron's ``preprocess_data.py`` output.
* Bounded memory: at most ``2 x workers`` chunks are in flight (backpressure on
  the reader); index arrays grow by 12 bytes per sequence.
* Scaling: for a local jsonl the main process reads no input: it cuts byte ranges
  (one 64 KB read per chunk to find a line end) and the workers read and parse them.
  What stays in the main process is receiving each chunk's tokens (one pickle over a
  pipe) and appending them to the ``.bin``, so one main process keeps up with several
  workers at gigatoken's speed. Compressed inputs are decompressed and split into lines
  by the main process, which bounds one stream's rate (``bench/preprocess_bench.py``
  measures the throughput; the per-process rates are in bench/RESULTS.md's notes).
  Beyond that, a node runs several shards (``--num-shards``, one main process each,
  or ``--executor ray``), joined by ``tokenloom merge`` with in-kernel copies. Input
  digests are computed by a child process (BLAKE3, several threads per file) on the
  cores that start-up leaves idle.
* Resumable: every ``checkpoint_interval`` seconds the partial ``.bin`` files are
  fsynced and a checkpoint (index arrays + input position + counters) is written
  atomically into ``OUTPUT.partial/``. Rerunning the same command continues from
  there; anything written after the checkpoint is truncated away, so the result
  is byte-identical to an uninterrupted run. A different command starts afresh.
* Faults: a full disk, too many open files, an I/O or permission error ends the run
  with one line naming the path and what to do; everything written after the last
  checkpoint is cut away (it may be what filled the disk) and the checkpoint is kept,
  so rerunning the same command resumes. A dead worker process (killed, out of
  memory) first checkpoints everything already written, then stops the same way.
  Workers die with the main process (see ``worker``).
* Publishing: every output is completed inside ``OUTPUT.partial/`` (``.bin``,
  ``.idx``, manifest), a ``staged.json`` marker records that, and then each output is
  committed ``.bin``, ``.idx``, manifest (:mod:`tokenloom.preprocess.commit`): the
  manifest is the commit point. A run killed while publishing is finished by the
  next run of the same command without tokenizing again; temporary files of dead
  runs of the same output are removed when it starts.
* Bad records: by default the first one stops the run with ``file:line: reason``.
  With ``max_bad_fraction`` they go to ``OUTPUT.rejects.jsonl`` and the run fails
  only if their share of records exceeds it. On failure nothing is published
  under a final name (the rejects file is, to explain the failure).
* Object storage: inputs and the output prefix may be ``s3://`` URLs
  (:mod:`tokenloom.objstore`). Inputs are streamed. An object-store output is
  completed in a local staging directory (``--staging-dir``, default the system temp
  dir, one folder per output URL), which holds the ``.partial`` state above, so
  resume works the same; then it is uploaded ``.bin``, ``.idx``, manifest. Costs: the
  staging disk must hold the whole output, and the upload starts only when
  tokenizing ends.
* Input digests (BLAKE3) are computed by a child process started before the tokenizer
  loads, reading the files a second time (:mod:`tokenloom.preprocess.hashing`).
"""

from __future__ import annotations

import collections
import contextlib
import gc
import hashlib
import itertools
import json
import os
import shutil
import stat
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO

import numpy as np

from tokenloom import objstore
from tokenloom.errors import TokenloomError
from tokenloom.fsio import atomic_writer, naming, os_error_message, remove_dead_temps
from tokenloom.indexed.format import IndexedDatasetWriter, data_path, index_path, optimal_dtype
from tokenloom.preprocess import manifest
from tokenloom.preprocess.commit import publish_dataset
from tokenloom.preprocess.documents import MISSING_KEY
from tokenloom.preprocess.hashing import InputHasher
from tokenloom.preprocess.pool import OrderedPool, WorkerDied, fork_or_spawn
from tokenloom.preprocess.readers import (
    Chunk,
    ChunkReader,
    Input,
    LineNumbers,
    Position,
    discover,
    shard_inputs,
    text_expansion,
)
from tokenloom.preprocess.worker import (
    EncodedChunk,
    EncodeOptions,
    encode_chunk,
    encode_in_worker,
    init,
)

CHECKPOINT_FORMAT = "tokenloom.preprocess-checkpoint/1"
STAGED_FORMAT = "tokenloom.preprocess-staged/1"


@dataclass(kw_only=True)
class PreprocessConfig:
    inputs: list[str]
    """Input files, globs or HF datasets directories: jsonl, jsonl.gz, jsonl.zst, parquet, txt; files and globs may be s3:// URLs (repeatable)."""
    output_prefix: str
    """Output prefix: writes PREFIX.bin, PREFIX.idx and PREFIX.manifest.json (a local path or s3://bucket/key)."""
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
    """Tokenizer worker processes (0: one per CPU core; with --executor ray: per task, 0 meaning 1)."""
    txt_unit: str = "file"
    """What one document is in a .txt input: file, paragraph (blank-line separated) or line."""
    megatron_names: bool = False
    """Name outputs PREFIX_<key>_document like Megatron's preprocess_data.py."""
    num_shards: int | None = None
    """Split the inputs into this many shards (default: $WORLD_SIZE or $SLURM_NTASKS, else 1; with --executor ray: one per input)."""
    shard_index: int | None = None
    """Which shard this process writes (default: $RANK or $SLURM_PROCID, else 0)."""
    max_bad_fraction: float | None = None
    """Quarantine bad records into PREFIX.rejects.jsonl and fail only above this fraction (default: stop at the first)."""
    # 4 MiB: gigatoken builds an awkward array per call, a visible part of a small chunk's encode;
    # 8 MiB is slower (the last chunks leave a worker idle longer); see bench/RESULTS.md, notes
    chunk_bytes: int = 4 << 20
    """Text bytes per work unit sent to a worker (larger: less per-unit overhead, more memory in flight, two units per worker)."""
    checkpoint_interval: float = 60.0
    """Seconds between resume checkpoints."""
    check_space: bool = True
    """Check that the output disk can hold the estimated output before starting."""
    progress: bool = True
    """Show a progress bar on stderr."""
    executor: str = "local"
    """Where the job runs: local (processes on this machine) or ray (one task per shard on a Ray cluster, merged into one output; the [ray] extra)."""
    ray_address: str | None = None
    """Ray cluster for --executor ray, HOST:PORT (default: $RAY_ADDRESS, else a local Ray started for the job)."""
    ray_retries: int = 3
    """With --executor ray: times a task whose worker process died (killed, out of memory, lost node) is rerun."""
    staging_dir: str | None = None
    """Local directory where an s3:// output is completed (and resumed) before upload; it must hold the whole output (default: the system temp dir)."""


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


SAMPLE_INPUTS = 8
SAMPLE_BYTES = 1 << 20


@dataclass
class SpaceEstimate:
    """Output size extrapolated from tokenizing a sample: bytes of ``.bin`` and of ``.idx`` files."""

    bin_bytes: int
    idx_bytes: int

    @property
    def output(self) -> int:
        return self.bin_bytes + self.idx_bytes

    @property
    def peak(self) -> int:
        """What the run holds at most: the output plus the checkpoint's copy of the index."""
        return self.bin_bytes + 2 * self.idx_bytes


def sample_chunks(inputs: list[Input], keys: list[str], txt_unit: str) -> list[tuple[Input, Chunk]]:
    """The first chunk of up to ``SAMPLE_INPUTS`` inputs spread over the list (~``SAMPLE_BYTES`` of text)."""
    if not inputs:
        return []
    picks = sorted({round(x) for x in np.linspace(0, len(inputs) - 1, min(SAMPLE_INPUTS, len(inputs)))})
    samples = []
    for k in picks:
        chunks = ChunkReader([inputs[k]], keys, max(1 << 16, SAMPLE_BYTES // len(picks)), txt_unit=txt_unit).chunks()
        first = next(chunks, None)
        chunks.close()
        if first is not None and first.raw_bytes:
            samples.append((inputs[k], first))
    return samples


def estimate_output(inputs: list[Input], samples: list[tuple[Input, EncodedChunk, float]], itemsize: int,
                    num_keys: int) -> SpaceEstimate:
    """Extrapolate sampled (input, encoded chunk, raw bytes read) to every input, per input format.

    Costs one tokenized chunk per sampled input (~1 MiB of text in all). The sample is
    the start of each file, so a corpus whose documents change character along a file is
    estimated from its beginning (on the shared corpora it lands close; see bench/RESULTS.md).
    """
    by_format: dict[str, np.ndarray] = {}
    for inp, result, raw in samples:
        if raw <= 0:  # nothing decodable in the sample (a corrupt input, reported when it is read)
            continue
        tokens = sum(int(o.tokens.size) for o in result.outputs.values())
        index = sum(12 * len(o.sequence_lengths) + 8 * len(o.sequences_per_document) for o in result.outputs.values())
        by_format[inp.format] = by_format.get(inp.format, np.zeros(3)) + (tokens * itemsize, index, raw)
    total = sum(by_format.values(), np.zeros(3)) if by_format else np.array([0.0, 0.0, 1.0])
    bin_bytes, idx_bytes = 0.0, float((34 + 8) * num_keys)
    for inp in inputs:
        b, i, raw = by_format.get(inp.format, total)
        bin_bytes += inp.size * b / raw
        idx_bytes += inp.size * i / raw
    return SpaceEstimate(int(bin_bytes), int(idx_bytes))


def _stored_bytes(inp: Input, chunk: Chunk) -> float:
    """The input bytes a chunk's records take on disk (compressed inputs: their text over the expansion)."""
    if not inp.compressed:
        return chunk.raw_bytes
    text = sum(map(len, chunk.lines)) + sum(len(v) for values in chunk.columns.values() for v in values)
    return text / max(text_expansion(inp), 1e-9)


def _check_space(partial: Path, estimate: SpaceEstimate, staging: bool = False) -> None:
    """Refuse to start when the disk of ``partial`` cannot hold the run (an object-store output is
    completed in a local ``staging`` folder first: that disk must hold it all)."""
    directory = os.path.dirname(os.path.abspath(partial))
    free = shutil.disk_usage(directory).free
    if estimate.peak > free:
        where = "the local staging folder of the object-store output " if staging else ""
        elsewhere = "put it elsewhere with --staging-dir, " if staging else ""
        raise TokenloomError(f"not enough disk space in {where}{directory}: the output is estimated at "
                             f"{_megabytes(estimate.output)} ({_megabytes(estimate.peak)} while running) but only "
                             f"{_megabytes(free)} are free (free space, {elsewhere}or pass --no-space-check)")


def _megabytes(n: int) -> str:
    return f"{n / 1e6:,.1f} MB"


def _input_stats(inputs: list[Input]) -> list[tuple]:
    """(path, format, size, version) per input: an object's ETag, a local file's mtime."""
    return [(i.path, i.format, i.size, i.version if objstore.is_url(i.path) else os.stat(i.path).st_mtime_ns)
            for i in inputs]


def _check_unchanged(inputs: list[Input], stats: list[tuple]) -> None:
    """Refuse, naming it, a local input whose size or mtime differs from ``stats`` (taken before
    reading): its records may mix two versions of the file."""
    for inp, (_, _, size, mtime) in zip(inputs, stats, strict=True):
        if objstore.is_url(inp.path):
            continue  # an object is read at its version (ETag) or fails
        now = os.stat(inp.path)  # a datasets directory: its own mtime (its size is its files')
        if now.st_mtime_ns != mtime or (not stat.S_ISDIR(now.st_mode) and now.st_size != size):
            raise TokenloomError(f"{inp.path}: changed while being read; rerun when it is complete")


def _config_digest(cfg: PreprocessConfig, stats: list[tuple], tokenizer_fp: dict, shard) -> str:
    shape = {k: v for k, v in asdict(cfg).items()
             if k not in ("workers", "chunk_bytes", "checkpoint_interval", "check_space", "progress",
                          "executor", "ray_address", "ray_retries", "staging_dir")}
    blob = json.dumps([stats, tokenizer_fp["digest"], shape, shard], sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


def check_options(cfg: PreprocessConfig) -> None:
    """Refuse option values no run can use (before any work, also in a driver of many runs)."""
    if not cfg.json_keys:
        raise TokenloomError("--json-keys needs at least one key")
    if cfg.max_bad_fraction is not None and not 0 <= cfg.max_bad_fraction <= 1:
        raise TokenloomError(f"--max-bad-fraction must lie in [0, 1], got {cfg.max_bad_fraction}")
    if cfg.workers < 0:
        raise TokenloomError(f"--workers must be >= 0, got {cfg.workers}")


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
            np.savez(f, **arrays)  # type: ignore[arg-type]  # numpy's stub lets a ** dict reach allow_pickle

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
        self.cfg, self.echo = cfg, echo
        check_options(cfg)
        if objstore.is_url(cfg.output_prefix):  # before any work
            objstore.check_output(cfg.output_prefix)
        all_inputs = discover(cfg.inputs)
        self.num_shards, self.shard_index = resolve_shard(cfg)
        self.inputs = [all_inputs[k] for k in shard_inputs(all_inputs, self.num_shards, self.shard_index)]
        if cfg.tokenizer is None and cfg.tokenizer_type is None:
            raise TokenloomError("--tokenizer PATH (or --tokenizer-type byte|null) is required")
        self.hasher = InputHasher([i.path for i in self.inputs])  # before the tokenizer: see hashing
        try:
            self._setup(cfg)
        except BaseException:
            self.hasher.close()
            raise

    def _setup(self, cfg: PreprocessConfig) -> None:
        from tokenloom.tokenizers import load_tokenizer

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
        self.remote = objstore.is_url(base)
        self.partial = staging_path(base, cfg.staging_dir) if self.remote else Path(f"{base}.partial")
        self.staged_marker = self.partial / "staged.json"
        self.rejects_path = f"{base}.rejects.jsonl"
        self.input_stats = _input_stats(self.inputs)
        self.digest = _config_digest(cfg, self.input_stats, self.fingerprint, [self.num_shards, self.shard_index])
        self.workers = cfg.workers or os.cpu_count() or 1
        self.counts = Counts(per_key={k: {"documents": 0, "empty_documents": 0, "sequences": 0, "tokens": 0}
                                      for k in cfg.json_keys})
        self.writers: dict[str, IndexedDatasetWriter] = {}
        self.rejects: IO[bytes] | None = None

    def finished(self, marker: Path) -> dict | None:
        """The summary ``marker`` records for this run, if it finished and its outputs are published."""
        try:
            done = json.loads(marker.read_text())
        except (OSError, ValueError):
            return None
        if not isinstance(done, dict) or done.get("digest") != self.digest:
            return None
        if not all(manifest.manifest_path(prefix).exists() for prefix in self.outputs.values()):
            return None
        return done.get("summary")

    # -- setup: fresh, resumed, or an interrupted publish
    def staged(self, n: int, ext: str) -> Path:
        """Where output ``n``'s ``ext`` file (bin, idx, manifest.json) is completed before publishing."""
        return self.partial / f"{n}.{ext}"

    def remove_dead_temps(self) -> None:
        """Temporary files of dead runs of these outputs (this run's own are named by its pid)."""
        finals: list[str | Path] = [self.partial / "checkpoint.npz", self.staged_marker]
        if not self.remote:  # an upload leaves no temporary object
            finals.append(self.rejects_path)
            for prefix in self.outputs.values():
                finals += [data_path(prefix), index_path(prefix), manifest.manifest_path(prefix)]
        for final in finals:
            for path in remove_dead_temps(final):
                self.echo(f"note: removed {path}, left by a killed run")

    def load_staged(self) -> bool:
        """True when an earlier run of this command staged everything and was killed while publishing."""
        try:
            state = json.loads(self.staged_marker.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return False
        if state.get("format") != STAGED_FORMAT or state.get("digest") != self.digest:
            return False
        self.counts = Counts(**state["counts"])
        self.echo(f"resuming from {self.partial}: every output is complete; publishing it")
        return True

    def open_outputs(self) -> Position:
        ckpt = _Checkpoint(self.partial)
        loaded = ckpt.load() if self.partial.exists() else None
        if loaded and loaded[0].get("digest") != self.digest:
            self.echo(f"note: {self.partial} belongs to a different command; starting afresh")
            loaded = None
        if loaded and not all(self.staged(n, "bin").exists() for n in range(len(self.outputs))):
            self.echo(f"note: {self.partial} lacks the data of its checkpoint; starting afresh")
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
                self.writers[key] = self.writer(n, prefix, arrays[n])
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
            self.writers[key] = self.writer(n, prefix)
        self.rejects = open(self.partial / "rejects.jsonl", "wb") if tolerant else None
        return Position()

    def writer(self, n: int, prefix: str, resume: dict | None = None) -> IndexedDatasetWriter:
        if self.remote:  # the writer's prefix only places its files: keep them in the staging dir
            prefix = str(self.partial / str(n))
        return IndexedDatasetWriter(prefix, dtype=self.dtype, vocab_size=self.tokenizer.vocab_size,
                                    bin_tmp=self.staged(n, "bin"), idx_tmp=self.staged(n, "idx"), resume=resume)

    def estimate(self, samples: list[tuple[Input, Chunk]], encoded: list[tuple[Chunk, EncodedChunk]]) -> SpaceEstimate:
        """Extrapolate the output's size from the tokenized ``samples`` (:func:`sample_chunks`)."""
        return estimate_output(self.inputs, [(inp, result, _stored_bytes(inp, chunk)) for (inp, _), (chunk, result)
                                             in zip(samples, encoded, strict=True)], self.dtype.itemsize,
                               len(self.outputs))

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
            with naming(self.partial / "rejects.jsonl"):
                for number, reason, snippet in result.bad:
                    self.rejects.write((json.dumps({"file": inp.path, "line": number, "reason": reason,
                                                    "record": snippet}, ensure_ascii=False) + "\n").encode())
        self.counts.bad_records += len(result.bad)
        self.counts.records += result.documents + len(result.bad)
        self.counts.documents += result.documents
        self.counts.text_bytes += result.text_bytes
        for key, out in result.outputs.items():
            self.writers[key].add_documents(out.tokens, out.sequence_lengths, out.sequences_per_document,
                                            out.max_id)
            c = self.counts.per_key[key]
            c["documents"] += len(out.sequences_per_document)
            c["empty_documents"] += out.empty_documents
            c["sequences"] += len(out.sequence_lengths)
            c["tokens"] += int(out.tokens.size)

    # -- publishing
    def stage(self, digests: dict[str, str]) -> None:
        """Complete every output inside ``PREFIX.partial/``, then mark it ready to publish."""
        cfg, c = self.cfg, self.counts
        bad_share = c.bad_records / c.records if c.records else 0.0
        if self.rejects is not None:
            self.rejects.close()
            if cfg.max_bad_fraction is not None and bad_share > cfg.max_bad_fraction:
                self.move_rejects()
                raise TokenloomError(f"{c.bad_records} of {c.records} records were bad ({bad_share:.2%} > "
                                     f"--max-bad-fraction {cfg.max_bad_fraction:.2%}); see {self.rejects_path}; "
                                     "nothing was written")
        inputs = [{"path": i.path, "format": i.format, "size": i.size, "blake3": digests[i.path]}
                  for i in self.inputs]
        options = {"json_keys": cfg.json_keys, "append_eod": cfg.append_eod, "prepend_bos": cfg.prepend_bos,
                   "txt_unit": cfg.txt_unit, "max_bad_fraction": cfg.max_bad_fraction,
                   "shard": {"index": self.shard_index, "count": self.num_shards}}
        for n, (key, writer) in enumerate(self.writers.items()):
            writer.stage()
            counts = {**self.counts.per_key[key], "bad_records": c.bad_records, "bytes_in": c.bytes_in,
                      "records": c.records}
            manifest.write(self.outputs[key], manifest.build(self.outputs[key], key, str(self.dtype), inputs,
                                                              self.fingerprint, options, counts),
                           path=self.staged(n, "manifest.json"))
        with atomic_writer(self.staged_marker, "w", encoding="utf-8") as f:
            json.dump({"format": STAGED_FORMAT, "digest": self.digest, "counts": asdict(self.counts)}, f)

    def publish(self) -> None:
        """Commit the staged outputs in order (each ``.bin``, ``.idx``, manifest); a rerun may repeat it."""
        if (self.partial / "rejects.jsonl").exists():
            self.move_rejects()
        for n, prefix in enumerate(self.outputs.values()):
            publish_dataset(prefix, self.staged(n, "bin"), self.staged(n, "idx"), self.staged(n, "manifest.json"))
        self.checkpoint_path.unlink(missing_ok=True)  # first, so a half-removed folder never resumes
        self.remove_partial()

    def move_rejects(self) -> None:
        """Put the staged rejects file under its final name (uploaded for an object-store output)."""
        if self.remote:
            objstore.upload(self.partial / "rejects.jsonl", self.rejects_path)
            os.unlink(self.partial / "rejects.jsonl")
        else:
            os.replace(self.partial / "rejects.jsonl", self.rejects_path)

    @property
    def checkpoint_path(self) -> Path:
        return self.partial / "checkpoint.npz"

    def close_files(self) -> None:
        """Close without publishing; bytes a full disk refuses are dropped (a resume cuts them anyway)."""
        for writer in self.writers.values():
            writer.close()
        if self.rejects is not None and not self.rejects.closed:
            with contextlib.suppress(OSError):
                self.rejects.close()

    def abort(self) -> None:
        for writer in self.writers.values():
            writer.abort()
        self.close_files()
        self.remove_partial()

    def remove_partial(self) -> None:
        shutil.rmtree(self.partial, ignore_errors=True)
        if self.remote:  # the staging folder of this output URL, if nothing else is in it
            with contextlib.suppress(OSError):
                self.partial.parent.rmdir()

    def suspend(self) -> str:
        """Keep what a rerun resumes from, drop the rest; return what the rerun will do.

        Data written after the last checkpoint is cut away: it cannot be resumed from
        and may be what filled the disk. Staged index and manifest files go too.
        """
        self.close_files()
        loaded = _Checkpoint(self.partial).load() if self.partial.exists() else None
        if loaded is None:
            shutil.rmtree(self.partial, ignore_errors=True)
            return "rerun the same command (no checkpoint was saved yet, so it starts over)"
        state, arrays = loaded
        for n, saved in enumerate(arrays):
            if self.staged(n, "bin").exists():
                os.truncate(self.staged(n, "bin"), int(saved["bin_bytes"]))
            self.staged(n, "idx").unlink(missing_ok=True)
            self.staged(n, "manifest.json").unlink(missing_ok=True)
        kept = sum(f.stat().st_size for f in self.partial.iterdir() if f.is_file())
        return (f"rerun the same command to resume from the checkpoint in {self.partial} "
                f"({state['counts']['records']} records done, {_megabytes(kept)} kept there)")


def start_pool(run: _Run) -> OrderedPool | None:
    """Worker processes, started before any thread exists in this process.

    On Linux they are forked and keep the parent's tokenizer, switched to one thread;
    forking is safe because no thread of ours that holds a lock is running (the input hasher
    is a process of its own) and nothing has been encoded here. With ``s3://`` inputs fsspec's I/O
    thread already runs: the workers never use it, and fsspec resets its loop and locks
    in a forked child. Spawned workers build their tokenizer
    from the spec.
    """
    if run.workers <= 1:
        return None
    context = fork_or_spawn()
    fork = context.get_start_method() == "fork"
    if fork:  # what start-up built (modules, the tokenizer) is never scanned by a collection again,
        gc.freeze()  # here or in the workers, whose copy-on-write pages a scan would copy (Python's advice)
    return OrderedPool(run.workers, context, initializer=init,
                       initargs=(run.tokenizer.spec, run.tokenizer if fork else None, os.getpid()))


def _results(run: _Run, chunks, pool: OrderedPool | None):
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
            pool.submit(encode_in_worker, chunk, run.opts)
            inflight.append(chunk)
            if len(inflight) >= 2 * run.workers:
                yield inflight.popleft(), pool.result()
        while inflight:
            yield inflight.popleft(), pool.result()
    except GeneratorExit:  # the caller stopped early: take the results it left, keeping the pool in order
        for _ in inflight:
            pool.result()
        raise


def run(cfg: PreprocessConfig, echo=print, done_marker: Path | None = None) -> dict:
    """Run preprocess; return the summary (also printed as a table).

    ``done_marker``: a file recording that this very run (same inputs, tokenizer, options and
    shard: the resume digest) finished; when it says so and the outputs are published, the run
    returns the recorded summary without tokenizing again (a rerun of a job of many runs,
    ``--executor ray``, redoes only what did not finish). Written after publishing.
    """
    start = time.perf_counter()
    r = _Run(cfg, echo)
    try:
        if done_marker is not None and (finished := r.finished(done_marker)) is not None:
            return finished
        try:
            r.remove_dead_temps()
        except OSError as exc:
            raise TokenloomError(os_error_message(exc, r.partial)) from None
        if not r.load_staged():
            _tokenize(r)
    finally:
        r.hasher.close()
    try:
        r.publish()
    except (OSError, objstore.StoreError) as exc:
        what = exc if isinstance(exc, objstore.StoreError) else os_error_message(exc, r.partial)
        raise TokenloomError(f"{what}; then rerun the same command to finish publishing from {r.partial}") from None
    elapsed = time.perf_counter() - start
    summary = _summary(r, elapsed)
    if done_marker is not None:
        try:
            with atomic_writer(done_marker) as f:
                f.write(json.dumps({"digest": r.digest, "summary": summary}).encode())
        except OSError as exc:
            raise TokenloomError(os_error_message(exc, done_marker)) from None
    echo(format_summary(summary))
    return summary


def _tokenize(r: _Run) -> None:
    """Read, encode and write every input, then stage the outputs (see the module docstring for faults)."""
    from tqdm import tqdm

    cfg, start = r.cfg, time.perf_counter()
    pool, bar = None, None
    try:
        done = position = r.open_outputs()
        fresh = r.counts.records == 0 and position == Position()
        bar = tqdm(total=sum(i.size for i in r.inputs), unit="B", unit_scale=True, disable=not cfg.progress,
                   file=sys.stderr, desc="preprocess", mininterval=0.5, initial=r.counts.bytes_in)
        tokens_at_start = sum(c["tokens"] for c in r.counts.per_key.values())
        pool = start_pool(r)
        samples = sample_chunks(r.inputs, cfg.json_keys, cfg.txt_unit) if fresh and cfg.check_space else []
        reader = ChunkReader(r.inputs, cfg.json_keys, cfg.chunk_bytes, txt_unit=cfg.txt_unit)
        results = _results(r, itertools.chain((chunk for _, chunk in samples), reader.chunks(position)), pool)
        if samples:  # their results come first; the pool works on the first chunks meanwhile, nothing is written
            _check_space(r.partial, r.estimate(samples, [next(results) for _ in samples]), staging=r.remote)
        numbering = LineNumbers(position)
        last_ckpt = time.monotonic()
        for chunk, result in results:
            if base := numbering.place(chunk, result.lines):
                result.bad = [(number + base, reason, snippet) for number, reason, snippet in result.bad]
            r.consume(chunk.input, result)
            done = chunk.end
            r.counts.bytes_in += chunk.raw_bytes
            bar.update(chunk.raw_bytes)
            if time.monotonic() - last_ckpt >= cfg.checkpoint_interval:
                r.save_checkpoint(done)
                last_ckpt = time.monotonic()
            elapsed = max(time.perf_counter() - start, 1e-9)
            tokens = sum(c["tokens"] for c in r.counts.per_key.values()) - tokens_at_start
            bar.set_postfix_str(f"{tokens / elapsed / 1e3:.0f}k tok/s", refresh=False)
        bar.close()
        digests = r.hasher.result()
        _check_unchanged(r.inputs, r.input_stats)
        r.stage(digests)
    except WorkerDied:
        # Everything consumed so far is whole in the writers: checkpoint it before stopping.
        with contextlib.suppress(OSError):
            r.save_checkpoint(done)
        raise TokenloomError(f"a tokenizer worker process died (killed, or out of memory?); {r.suspend()}") from None
    except OSError as exc:
        raise TokenloomError(f"{os_error_message(exc, r.partial)}; then {r.suspend()}") from None
    except objstore.StoreError as exc:  # the store failed, not the input: keep the checkpoint
        raise TokenloomError(f"{exc}; then {r.suspend()}") from None
    except TokenloomError:
        r.abort()
        raise
    except BaseException:
        # Crash or Ctrl-C: keep the last checkpoint so the same command resumes.
        r.close_files()
        raise
    finally:
        if bar is not None:
            bar.close()
        if pool is not None:
            pool.close()


def staging_path(prefix: str, staging_dir: str | None) -> Path:
    """The local ``.partial`` folder of an object-store output: one folder per output URL."""
    root = Path(staging_dir or tempfile.gettempdir())
    key = hashlib.sha256(prefix.encode()).hexdigest()[:16]
    return root / f"tokenloom-staging-{key}" / f"{prefix.rstrip('/').rsplit('/', 1)[-1]}.partial"


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
