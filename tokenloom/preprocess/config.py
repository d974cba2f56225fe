"""What a preprocess run is asked to do and where its files go.

:class:`PreprocessConfig` is the options (the CLI reads its flags and their help from it);
``Counts`` are the counters a run keeps (and checkpoints); the rest derives names from the
config: the shard a process runs, its outputs per JSON key, its own files (rejects, the
``.partial`` folder, the local staging folder of an object-store output).
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from tokenloom.clean.keys import METHODS, DedupParams, MinHashParams
from tokenloom.clean.stage import CleanSpec, build_filters
from tokenloom.errors import TokenloomError


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
    """Text bytes per work unit sent to a worker (larger: less per-unit overhead, more memory in flight, four units per worker)."""
    checkpoint_interval: float = 60.0
    """Seconds between resume checkpoints."""
    encoder_memory_mb: int = 128
    """MB a worker's encoder may grow before it is rebuilt (gigatoken caches every distinct word; 0: never rebuild; a rebuilt encoder runs slower until its cache is warm)."""
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
    dedup: str = "none"
    """Drop duplicate documents, keeping the first in input order: none, exact (equal text after Unicode NFC and whitespace collapsing) or minhash (near-duplicates, datatrove's MinHash); every removed document is listed in PREFIX.removed.jsonl."""
    minhash_ngrams: int = 5
    """--dedup minhash: words per shingle (after lowercasing and removing punctuation and accents)."""
    minhash_bands: int = 14
    """--dedup minhash: bands; two documents are near-duplicates when all hashes of one band are equal."""
    minhash_rows: int = 8
    """--dedup minhash: hashes per band."""
    minhash_seed: int = 1
    """--dedup minhash: seed of the hash family (datatrove's default)."""
    filters: list[str] = field(default_factory=list)
    """Quality filters run on every document before dedup, in order (gopher_quality, gopher_repetition, c4, fineweb); removed documents are listed in PREFIX.removed.jsonl."""
    filter_params: list[str] = field(default_factory=list)
    """Change a filter's setting, NAME.FIELD=VALUE (repeatable), e.g. gopher_quality.min_doc_words=30."""


@dataclass
class Counts:
    records: int = 0
    documents: int = 0
    bad_records: int = 0
    bytes_in: int = 0
    text_bytes: int = 0
    per_key: dict = field(default_factory=dict)  # key -> {documents, empty_documents, sequences, tokens}
    removed: dict = field(default_factory=dict)  # reason -> records removed (filters, dedup), known at the end


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


def check_options(cfg: PreprocessConfig) -> None:
    """Refuse option values no run can use (before any work, also in a driver of many runs)."""
    if not cfg.json_keys:
        raise TokenloomError("--json-keys needs at least one key")
    if cfg.max_bad_fraction is not None and not 0 <= cfg.max_bad_fraction <= 1:
        raise TokenloomError(f"--max-bad-fraction must lie in [0, 1], got {cfg.max_bad_fraction}")
    if cfg.workers < 0:
        raise TokenloomError(f"--workers must be >= 0, got {cfg.workers}")
    spec = clean_spec(cfg)
    if spec.filters:
        try:
            build_filters(list(spec.filters), dict(spec.overrides))
        except ValueError as exc:
            raise TokenloomError(f"--filters / --filter-param: {exc}") from None


def clean_spec(cfg: PreprocessConfig) -> CleanSpec:
    """The cleaning a run does (inactive without --dedup and --filters); bad values raise one line."""
    if cfg.dedup not in METHODS:
        raise TokenloomError(f"--dedup {cfg.dedup!r}: expected one of {', '.join(METHODS)}")
    for name in ("minhash_ngrams", "minhash_bands", "minhash_rows"):
        if getattr(cfg, name) < 1:
            raise TokenloomError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(cfg, name)}")
    overrides = []
    for item in cfg.filter_params:
        name, eq, value = item.partition("=")
        if not eq or "." not in name or not name.split(".", 1)[0] or not name.split(".", 1)[1]:
            raise TokenloomError(f"--filter-param {item!r}: expected NAME.FIELD=VALUE")
        if name.split(".", 1)[0] not in cfg.filters:
            raise TokenloomError(f"--filter-param {item!r}: filter {name.split('.', 1)[0]!r} is not in --filters")
        overrides.append((name, value))
    dedup = None
    if cfg.dedup != "none":
        dedup = DedupParams(cfg.dedup, MinHashParams(cfg.minhash_ngrams, cfg.minhash_bands, cfg.minhash_rows,
                                                     cfg.minhash_seed))
    return CleanSpec(tuple(cfg.filters), tuple(overrides), dedup)


def clean_settings(cfg: PreprocessConfig) -> dict | None:
    """What the manifest records of the cleaning (None: none)."""
    spec = clean_spec(cfg)
    if not spec.active:
        return None
    out: dict = {"dedup": cfg.dedup, "filters": list(cfg.filters), "filter_params": dict(spec.overrides)}
    if cfg.dedup == "minhash":
        out["minhash"] = {"ngrams": cfg.minhash_ngrams, "bands": cfg.minhash_bands, "rows": cfg.minhash_rows,
                          "seed": cfg.minhash_seed}
    return out


def staging_path(prefix: str, staging_dir: str | None) -> Path:
    """The local ``.partial`` folder of an object-store output: one folder per output URL."""
    root = Path(staging_dir or tempfile.gettempdir())
    key = hashlib.sha256(prefix.encode()).hexdigest()[:16]
    return root / f"tokenloom-staging-{key}" / f"{prefix.rstrip('/').rsplit('/', 1)[-1]}.partial"
