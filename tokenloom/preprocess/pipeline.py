"""``tokenloom preprocess``: corpora in, Megatron ``.bin/.idx`` + manifest out.

    reader (main process)  ->  N worker processes  ->  writer (main process)
    cuts inputs into ~4 MiB    read their range, parse  writes chunks in input
    chunks of raw records      JSON, validate, batch-   order, checkpoints
                               tokenize, frame

Policy and its costs:

* Ordered and deterministic: chunks are numbered and written in order, and a record's tokens
  depend only on that record, so the bytes are the same for any ``--workers`` and equal Megatron's
  ``preprocess_data.py`` output.
* Bounded memory: at most ``IN_FLIGHT x workers`` chunks in flight (backpressure on the reader); index
  arrays grow by 12 bytes per sequence.
* Scaling: for a local jsonl the main process reads no input: it cuts byte ranges (one 64 KB read
  per chunk to find a line end) and only receives and appends each chunk's tokens. Compressed
  inputs are decompressed and split by the main process, which bounds one stream's rate
  (``bench/preprocess_bench.py``; rates in bench/RESULTS.md's notes). Beyond that, shards
  (``--num-shards``, or ``--executor ray``) joined by ``tokenloom merge``.
* Resumable: every ``checkpoint_interval`` seconds the partial ``.bin`` files are fsynced and a
  checkpoint (index arrays, input position, counters) is written atomically into
  ``OUTPUT.partial/``. The same command continues from there, truncating what was written after
  it, so the result is byte-identical to an uninterrupted run; a different command starts afresh.
* Faults: a full disk, too many open files, an I/O or permission error ends the run with one line
  naming the path; what was written after the last checkpoint is cut away and the checkpoint kept.
  A dead worker first checkpoints what was already written; Ctrl-C (exit 130) and a closed stdout
  keep the checkpoint too. Workers die with the main process (see ``worker``).
* Publishing: every output is completed inside ``OUTPUT.partial/``, a ``staged.json`` marker
  records that, then ``.bin``, ``.idx``, manifest are committed (:mod:`tokenloom.preprocess.commit`;
  the manifest is the commit point). A run killed while publishing is finished by the next run of
  the same command without tokenizing again.
* Bad records: the first one stops the run with ``file:line: reason``; with ``max_bad_fraction``
  they go to ``OUTPUT.rejects.jsonl`` and the run fails only above that share, publishing nothing
  under a final name but the rejects file.
* Object storage: ``s3://`` inputs are streamed; an ``s3://`` output is completed in ``--staging-dir``,
  then uploaded ``.bin``, ``.idx``, manifest. Input digests (BLAKE3) come from a child process.
* Cleaning (``--filter``, ``--dedup``; :mod:`tokenloom.clean`) runs in the tokenizing pass; dedup is
  decided over the whole corpus once reading ends, copying the kept tokens (written twice; the plan
  estimates the extra disk); ``merge`` decides over all shards.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import gc
import itertools
import json
import os
import shutil
import signal
import stat
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import IO

import numpy as np
from tqdm import tqdm

from tokenloom import objstore
from tokenloom.clean import removed as removed_list
from tokenloom.clean.buckets import CleanLog, decide, removals, run_files_bytes
from tokenloom.corpus.documents import MISSING_KEY
from tokenloom.corpus.readers import (
    Chunk,
    ChunkReader,
    Input,
    LineNumbers,
    Position,
    discover,
    shard_inputs,
)
from tokenloom.errors import Stopped, TokenloomError
from tokenloom.fsio import atomic_writer, naming, os_error_message, remove_dead_temps
from tokenloom.indexed import manifest
from tokenloom.indexed.format import (
    IndexedDataset,
    IndexedDatasetWriter,
    data_path,
    index_path,
    optimal_dtype,
)
from tokenloom.preprocess import worker
from tokenloom.preprocess.checkpoint import (
    CHECKPOINT_FORMAT,
    STAGED_FORMAT,
    Checkpoint,
    config_digest,
    input_stats,
)
from tokenloom.preprocess.commit import publish_dataset
from tokenloom.preprocess.config import (
    Counts,
    PreprocessConfig,
    check_options,
    clean_settings,
    clean_spec,
    output_prefixes,
    resolve_shard,
    run_prefix,
    staging_path,
)
from tokenloom.preprocess.hashing import InputHasher
from tokenloom.preprocess.pool import OrderedPool, WorkerDied, fork_or_spawn
from tokenloom.preprocess.space import (
    SpaceEstimate,
    check_space,
    estimate_output,
    megabytes,
    sample_chunks,
    stored_bytes,
)
from tokenloom.preprocess.summary import format_summary, summarize
from tokenloom.preprocess.worker import (
    EncodedChunk,
    EncodeOptions,
    encode_chunk,
    encode_in_worker,
    init,
)


def _check_unchanged(inputs: list[Input], stats: list[tuple]) -> None:
    """Refuse, naming it, a local input whose size or mtime differs from ``stats`` (taken before
    reading): its records may mix two versions of the file."""
    for inp, (_, _, size, mtime) in zip(inputs, stats, strict=True):
        if objstore.is_url(inp.path):
            continue  # an object is read at its version (ETag) or fails
        now = os.stat(inp.path)  # a datasets directory: its own mtime (its size is its files')
        if now.st_mtime_ns != mtime or (not stat.S_ISDIR(now.st_mode) and now.st_size != size):
            raise TokenloomError(f"{inp.path}: changed while being read; rerun when it is complete")


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
        from tokenloom.tokenizers import load_tokenizer  # lazy: start-up time (merge loads no tokenizer)

        self.tokenizer = tok = load_tokenizer(cfg.tokenizer, kind=cfg.tokenizer_type)
        if cfg.append_eod and tok.eod is None:
            raise TokenloomError(f"--append-eod: tokenizer {tok!r} has no EOD token")
        if cfg.prepend_bos and tok.bos is None:
            raise TokenloomError(f"--prepend-bos: tokenizer {tok!r} has no BOS token")
        self.fingerprint = tok.fingerprint()
        self.dtype = optimal_dtype(tok.vocab_size)
        spec = clean_spec(cfg)
        self.clean = spec if spec.active else None
        self.opts = EncodeOptions(tuple(cfg.json_keys), str(self.dtype), tok.vocab_size, cfg.append_eod,
                                  cfg.prepend_bos, tok.eod, tok.bos, self.clean)
        # dedup is decided over the whole job: here for one shard, by ``merge`` over the shards' side files
        self.decides = spec.dedup is not None and self.num_shards == 1
        self.pending = spec.dedup is not None and self.num_shards > 1
        self.outputs = output_prefixes(cfg, self.num_shards, self.shard_index)
        base = run_prefix(cfg, self.num_shards, self.shard_index)
        self.remote = objstore.is_url(base)
        self.partial = staging_path(base, cfg.staging_dir) if self.remote else Path(f"{base}.partial")
        self.staged_marker = self.partial / "staged.json"
        self.rejects_path = f"{base}.rejects.jsonl"
        self.removed_path = str(removed_list.removed_path(base))
        self.side_files = Path(f"{base}.clean")  # a pending shard's clean log, published beside its output
        if self.pending and self.remote:
            raise TokenloomError(f"--dedup {cfg.dedup} with --num-shards > 1 keeps side files beside the shards "
                                 "for the merge: give a local or shared --output-prefix, not object storage")
        self.clean_log: CleanLog | None = None
        self.input_stats = input_stats(self.inputs)
        self.digest = config_digest(cfg, self.input_stats, self.fingerprint, [self.num_shards, self.shard_index])
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

    def written(self, n: int, ext: str) -> Path:
        """Where output ``n``'s tokens are written while reading: the staged file, or with a dedup decided
        here, every document's (``n.all.bin``), copied without the duplicates once the decision is made."""
        return self.staged(n, f"all.{ext}" if self.decides else ext)

    def remove_dead_temps(self) -> None:
        """Temporary files of dead runs of these outputs (this run's own are named by its pid)."""
        finals: list[str | Path] = [self.partial / "checkpoint.npz", self.staged_marker]
        if not self.remote:  # an upload leaves no temporary object
            finals += [self.rejects_path, self.removed_path]
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
        ckpt = Checkpoint(self.partial)
        loaded = ckpt.load() if self.partial.exists() else None
        if loaded and loaded[0].get("digest") != self.digest:
            self.echo(f"note: {self.partial} belongs to a different command; starting afresh")
            loaded = None
        if loaded and not all(self.written(n, "bin").exists() for n in range(len(self.outputs))):
            self.echo(f"note: {self.partial} lacks the data of its checkpoint; starting afresh")
            loaded = None
        if self.partial.exists() and loaded is None:
            shutil.rmtree(self.partial)
        try:
            self.partial.mkdir(parents=True, exist_ok=True)
        except OSError as exc:  # a place no rerun can write (/proc/x, a file as a folder): say so
            if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EMFILE, errno.ENFILE):
                raise
            raise TokenloomError(f"cannot create the directory {exc.filename or self.partial} ({exc.strerror}) for "
                                 f"the output {self.cfg.output_prefix}: choose an --output-prefix (or --staging-dir) "
                                 "in a location this user can create and write") from None
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
            if self.clean is not None:
                self.clean_log = CleanLog(self.partial / "clean", list(self.clean.filters), resume=state["clean"])
            self.echo(f"resuming from {self.partial}: {self.counts.records} records done")
            return position
        for n, (key, prefix) in enumerate(self.outputs.items()):
            self.writers[key] = self.writer(n, prefix)
        self.rejects = open(self.partial / "rejects.jsonl", "wb") if tolerant else None
        if self.clean is not None:
            self.clean_log = CleanLog(self.partial / "clean", list(self.clean.filters))
        return Position()

    def writer(self, n: int, prefix: str, resume: dict | None = None) -> IndexedDatasetWriter:
        if self.remote:  # the writer's prefix only places its files: keep them in the staging dir
            prefix = str(self.partial / str(n))
        return IndexedDatasetWriter(prefix, dtype=self.dtype, vocab_size=self.tokenizer.vocab_size,
                                    bin_tmp=self.written(n, "bin"), idx_tmp=self.written(n, "idx"), resume=resume)

    def estimate(self, samples: list[tuple[Input, Chunk]], encoded: list[tuple[Chunk, EncodedChunk]]) -> SpaceEstimate:
        """Extrapolate the output's size from the tokenized ``samples`` (:func:`sample_chunks`)."""
        return estimate_output(self.inputs, [(inp, result, stored_bytes(inp, chunk)) for (inp, _), (chunk, result)
                                             in zip(samples, encoded, strict=True)], self.dtype.itemsize,
                               len(self.outputs))

    def plan(self, estimate: SpaceEstimate, samples: list[tuple[Input, Chunk]],
             encoded: list[tuple[Chunk, EncodedChunk]]) -> SpaceEstimate:
        """Add what cleaning needs on disk besides the output (printed): the run files of the dedup keys
        and, when the dedup is decided here, the copy of the output written before it."""
        if self.clean is None or self.clean.dedup is None:
            return estimate
        raw = sum(stored_bytes(inp, chunk) for (inp, _), (chunk, _) in zip(samples, encoded, strict=True))
        docs = sum(result.documents for _, result in encoded) / max(raw, 1) * sum(i.size for i in self.inputs)
        runs = run_files_bytes(docs, self.clean.dedup.bands)
        copy = estimate.output if self.decides else 0
        self.echo(f"dedup {self.cfg.dedup}: about {megabytes(runs)} of run files"
                  + (f" and {megabytes(copy)} for every document's tokens until the duplicates are known"
                     if copy else " kept beside the shard for the merge") + ", besides the output")
        estimate.extra += runs + copy
        return estimate

    def save_checkpoint(self, position: Position) -> None:
        state = {"format": CHECKPOINT_FORMAT, "digest": self.digest, "position": position.to_json(),
                 "counts": asdict(self.counts), "keys": list(self.writers)}
        if self.clean_log is not None:
            state["clean"] = self.clean_log.checkpoint()
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
        if result.clean is not None and self.clean_log is not None:
            c = result.clean
            self.clean_log.add(chunk_input, c.numbers, c.removed, c.keys, c.has_keys)
            self.counts.records += len(c.removed)
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
        settings = clean_settings(cfg)
        if settings is not None:
            self.stage_clean()
            clean: dict = {**settings, "pending": self.pending, "removed_list": Path(self.removed_path).name}
            if self.pending:
                clean["side_files"] = self.side_files.name
            options["clean"] = clean
        for n, (key, writer) in enumerate(self.writers.items()):
            writer.stage()
            counts = {**self.counts.per_key[key], "bad_records": c.bad_records, "bytes_in": c.bytes_in,
                      "records": c.records}
            if settings is not None:
                counts["removed"] = dict(c.removed)
            manifest.write(self.outputs[key], manifest.build(self.outputs[key], key, str(self.dtype), inputs,
                                                              self.fingerprint, options, counts),
                           path=self.staged(n, "manifest.json"))
        with atomic_writer(self.staged_marker, "w", encoding="utf-8") as f:
            json.dump({"format": STAGED_FORMAT, "digest": self.digest, "counts": asdict(self.counts)}, f)
        for n in range(len(self.outputs)) if self.decides else ():  # every document's copy: done with
            self.written(n, "bin").unlink(missing_ok=True)
            self.written(n, "idx").unlink(missing_ok=True)

    def stage_clean(self) -> None:
        """Complete the clean log; unless the merge decides (a pending shard), decide dedup over it, list the
        removed records, and with dedup copy every output without its duplicates (the bucket pass).

        A run killed in here resumes from the checkpoint saved when reading ended: the decision and the
        copy are made again from the log and the ``all`` files, the same bytes."""
        assert self.clean_log is not None and self.clean is not None
        log = self.clean_log.finish({"dedup": self.cfg.dedup, "inputs": [i.path for i in self.inputs]})
        self.counts.removed = {r: int(k) for r, k in zip(log["reasons"], log["removed_by_filter"], strict=True) if k}
        if self.pending:
            return
        decision = decide([self.partial / "clean"])
        self.counts.removed = removed_list.write(self.partial / "removed.jsonl",
                                                 removals([self.partial / "clean"], decision, self.cfg.dedup),
                                                 [[i.path for i in self.inputs]])
        if not self.decides:
            return
        keep = decision.kept(0)
        self.counts.documents -= decision.duplicates
        for n, (key, prefix) in enumerate(self.outputs.items()):
            self.writers[key].stage()
            every = IndexedDataset(self.partial / f"{n}.all")
            per_doc = np.diff(every.document_indices)[keep]
            every.close()
            final = IndexedDatasetWriter(str(self.partial / str(n)) if self.remote else prefix, dtype=self.dtype,
                                         vocab_size=self.tokenizer.vocab_size, bin_tmp=self.staged(n, "bin"),
                                         idx_tmp=self.staged(n, "idx"))
            final.add_kept(self.partial / f"{n}.all", keep)
            self.writers[key] = final
            self.counts.per_key[key] = {"documents": final.num_documents,
                                        "empty_documents": int((per_doc == 0).sum()),
                                        "sequences": final.num_sequences, "tokens": final.num_tokens}

    def publish(self) -> None:
        """Commit the staged outputs in order (each ``.bin``, ``.idx``, manifest); a rerun may repeat it."""
        if (self.partial / "rejects.jsonl").exists():
            self.move_rejects()
        if (self.partial / "removed.jsonl").exists():
            if self.remote:
                objstore.upload(self.partial / "removed.jsonl", self.removed_path)
                os.unlink(self.partial / "removed.jsonl")
            else:
                os.replace(self.partial / "removed.jsonl", self.removed_path)
        if self.pending and (self.partial / "clean").exists():  # the merge's input: before the manifest
            shutil.rmtree(self.side_files, ignore_errors=True)
            os.replace(self.partial / "clean", self.side_files)
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
        loaded = Checkpoint(self.partial).load() if self.partial.exists() else None
        if loaded is None:
            shutil.rmtree(self.partial, ignore_errors=True)
            return "rerun the same command (no checkpoint was saved yet, so it starts over)"
        state, arrays = loaded
        for n, saved in enumerate(arrays):
            if self.written(n, "bin").exists():
                os.truncate(self.written(n, "bin"), int(saved["bin_bytes"]))
            self.staged(n, "idx").unlink(missing_ok=True)
            self.staged(n, "manifest.json").unlink(missing_ok=True)
        kept = sum(f.stat().st_size for f in self.partial.iterdir() if f.is_file())
        return (f"rerun the same command to resume from the checkpoint in {self.partial} "
                f"({state['counts']['records']} records done, {megabytes(kept)} kept there)")


IN_FLIGHT = 4
"""Chunks in flight per worker (submitted, their results not yet written). A chunk goes to the worker with
the fewest unfinished ones and results are written in order, so the others run ahead of a slow worker (a
chunk of words new to its cache, a core taken by another process) by at most this bound in all before
they wait; at two, the workers waited on each other (and on the main process) a visible share of a
loaded run. Costs up to this many encoded chunks per worker held in the main process (a few MB each)."""


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
                       initargs=(run.tokenizer.spec, run.tokenizer if fork else None, os.getpid(),
                                 run.cfg.encoder_memory_mb))


def _results(run: _Run, chunks, pool: OrderedPool | None):
    """Yield (chunk, EncodedChunk) in input order; at most ``IN_FLIGHT x workers`` chunks in flight.

    Closing the generator early leaves its in-flight tasks with the pool: whoever owns the pool
    closes the generator first, then the pool (which kills workers with tasks outstanding). The
    generator never touches the pool once closed, so the order of clean-up cannot turn a stop
    into a second error, and a stop never waits for chunks nobody will write."""
    if pool is None:
        worker.set_tokenizer(run.tokenizer, run.cfg.encoder_memory_mb)
        for chunk in chunks:
            yield chunk, encode_chunk(chunk, run.opts)
        return
    inflight: collections.deque = collections.deque()
    for chunk in chunks:
        pool.submit(encode_in_worker, chunk, run.opts)
        inflight.append(chunk)
        if len(inflight) >= IN_FLIGHT * run.workers:
            yield inflight.popleft(), pool.result()
    while inflight:
        yield inflight.popleft(), pool.result()


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
    summary = summarize(outputs=r.outputs, inputs=len(r.inputs), shard=(r.shard_index, r.num_shards),
                        tokenizer=r.tokenizer, fingerprint=r.fingerprint, dtype=r.dtype, counts=r.counts,
                        elapsed=elapsed)
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
    cfg, start = r.cfg, time.perf_counter()
    pool, bar, results = None, None, None
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
            check_space(r.partial, r.plan(r.estimate(samples, encoded := [next(results) for _ in samples]), samples,
                                          encoded), staging=r.remote)
        numbering = LineNumbers(position)
        last_ckpt = time.monotonic()
        for chunk, result in results:
            if base := numbering.place(chunk, result.lines):
                result.bad = [(number + base, reason, snippet) for number, reason, snippet in result.bad]
                if result.clean is not None:
                    result.clean.numbers = result.clean.numbers + base
                    result.clean.removed[:, 0] += base
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
        if r.decides:  # the bucket pass comes next: a run killed there resumes here, not from the start
            r.save_checkpoint(done)
        digests = r.hasher.result()
        _check_unchanged(r.inputs, r.input_stats)
        r.stage(digests)
    except WorkerDied:
        # Everything consumed so far is whole in the writers: checkpoint it before stopping.
        with contextlib.suppress(OSError):
            r.save_checkpoint(done)
        raise TokenloomError(f"a tokenizer worker process died (killed, or out of memory?); {r.suspend()}") from None
    except BrokenPipeError:  # stdout, not the output files: the CLI names it
        r.close_files()
        raise
    except OSError as exc:
        raise TokenloomError(f"{os_error_message(exc, r.partial)}; then {r.suspend()}") from None
    except objstore.StoreError as exc:  # the store failed, not the input: keep the checkpoint
        raise TokenloomError(f"{exc}; then {r.suspend()}") from None
    except TokenloomError:
        r.abort()
        raise
    except KeyboardInterrupt:  # Ctrl-C, or SIGTERM through the CLI: as a dead worker, checkpoint what is whole
        with contextlib.suppress(OSError):
            r.save_checkpoint(done)
        raise Stopped(f"interrupted; {r.suspend()}", signal.SIGINT) from None
    except BaseException:
        # A crash, or stdout closed under an echo (the CLI says so): keep the last checkpoint so the same
        # command resumes.
        r.close_files()
        raise
    finally:
        if bar is not None:
            bar.close()
        if results is not None:  # before the pool: the generator's frame holds tasks of the pool
            results.close()
        if pool is not None:
            pool.close()


