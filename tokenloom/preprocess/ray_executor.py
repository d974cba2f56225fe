"""``preprocess --executor ray``: one Ray task per input shard, then the merge, in one job.

    driver                          Ray tasks (one per non-empty shard)        driver
    discover inputs, cut them  ->   the same code as ``--num-shards N     ->   merge shards 0..N-1
    into N shards by size           --shard-index i``, into OUTPUT.shards/     into OUTPUT (atomic)

Policy and its costs:

* Same bytes as a single-process run: shards are contiguous runs of inputs
  (:func:`~tokenloom.corpus.readers.shard_inputs`) and are merged in index order,
  which is the single run's document order. The merged manifest lists the shards.
* One task per input file by default (``--num-shards`` sets another count). Small
  tasks balance load and make a retry cheap; each task loads the tokenizer once, which
  costs a second or so per task on a large vocabulary.
* Retries: a task whose worker process dies (killed, out of memory, a lost node) is
  rerun by Ray up to ``ray_retries`` times. The rerun resumes from the shard's last
  checkpoint (the pipeline's own resume). A bad record or another ``TokenloomError``
  is not retried: the job stops with that one line.
* Staging costs disk: the shards live in ``OUTPUT.shards/`` until the merge has
  published ``OUTPUT``, so the job needs room for the output twice. A killed or failed
  job rerun with the same command resumes its shards from there: finished shards are
  kept as they are (a marker records each one's run digest), unfinished ones resume
  from their checkpoints.
* ``--max-bad-fraction`` is judged over the whole job, as in a single run: tasks
  quarantine every bad record and the driver checks the total before merging.
* Every Ray node must see the inputs and ``OUTPUT`` at the same paths (a shared
  filesystem) and have tokenloom installed; a task that wrote where the driver cannot
  read stops the job with one line saying so.
* ``--dedup``: the tasks tokenize every document and keep their dedup side files; the merge is
  the final pass that decides over all shards (:mod:`tokenloom.preprocess.merge`), so the job
  removes what a single run removes and writes ``OUTPUT.removed.jsonl``.
* Ray is imported only here, only for ``--executor ray`` (the ``[ray]`` extra).
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import sys
import time
from dataclasses import replace
from pathlib import Path

from tqdm import tqdm

from tokenloom import objstore
from tokenloom.corpus.readers import discover, shard_inputs
from tokenloom.errors import TokenloomError
from tokenloom.fsio import atomic_writer, os_error_message
from tokenloom.indexed import manifest
from tokenloom.preprocess.config import (
    PreprocessConfig,
    check_options,
    output_prefixes,
    resolve_shard,
    run_prefix,
)
from tokenloom.preprocess.merge import merge
from tokenloom.preprocess.pipeline import run as run_local
from tokenloom.preprocess.summary import format_summary

CONNECT_TIMEOUT = 10.0


def run(cfg: PreprocessConfig, echo=print) -> dict:
    """Run preprocess as Ray tasks and merge them into ``cfg.output_prefix``; return the summary."""
    start = time.perf_counter()
    ray = _import_ray()
    if cfg.shard_index is not None:
        raise TokenloomError("--shard-index does not apply to --executor ray (the job runs every shard)")
    if objstore.is_url(cfg.output_prefix):  # shards are staged and merged on a filesystem every node sees
        raise TokenloomError(f"--output-prefix {cfg.output_prefix}: --executor ray writes to a shared filesystem, "
                             "not object storage; give a local or shared path (s3:// inputs are fine)")
    check_options(cfg)
    if cfg.ray_retries < 0:
        raise TokenloomError(f"--ray-retries must be >= 0, got {cfg.ray_retries}")
    inputs = discover(cfg.inputs)
    num_shards = cfg.num_shards if cfg.num_shards is not None else len(inputs)
    if num_shards < 1:
        raise TokenloomError(f"--num-shards must be >= 1, got {num_shards}")
    shards = [i for i in range(num_shards) if shard_inputs(inputs, num_shards, i)]
    staging = Path(f"{cfg.output_prefix}.shards")
    task_cfg = replace(cfg, output_prefix=str(staging / Path(cfg.output_prefix).name), executor="local",
                       ray_address=None, num_shards=num_shards, progress=False, workers=cfg.workers or 1,
                       max_bad_fraction=None if cfg.max_bad_fraction is None else 1.0)
    _connect(ray, cfg)
    try:
        staging.mkdir(parents=True, exist_ok=True)
        summaries = _run_tasks(ray, cfg, task_cfg, shards, inputs, num_shards, echo)
    except OSError as exc:
        raise TokenloomError(os_error_message(exc, staging)) from None
    finally:
        ray.shutdown()
    _check_visible(task_cfg, shards, num_shards)
    _judge_bad_records(cfg, task_cfg, shards, num_shards, summaries)
    _merge_shards(cfg, task_cfg, shards, num_shards)
    shutil.rmtree(staging, ignore_errors=True)
    summary = _summary(cfg, summaries, len(inputs), len(shards), time.perf_counter() - start)
    if cfg.dedup != "none":  # decided by the merge over every shard: its counts, not the shards'
        for key, prefix in output_prefixes(cfg, 1, 0).items():
            counts = (manifest.read(prefix) or {}).get("counts", {})
            summary["removed"] = counts.get("removed", {})
            summary["per_key"][key] = {k: counts.get(k, 0) for k in ("documents", "empty_documents", "sequences",
                                                                      "tokens")}
        summary["tokens"] = sum(c["tokens"] for c in summary["per_key"].values())
    echo(format_summary(summary))
    return summary


def run_shard(cfg: PreprocessConfig) -> dict:
    """The Ray task: one shard through the single-process pipeline (quiet; the driver reports).

    A shard that a killed or failed job had finished is not tokenized again on the rerun: its
    marker beside the staged outputs records the run's digest and summary."""
    marker = Path(f"{run_prefix(cfg, *resolve_shard(cfg))}.done.json")  # the driver set both
    return run_local(cfg, echo=lambda *a, **k: None, done_marker=marker)


def _import_ray():
    try:
        import ray  # lazy: optional dependency, the [ray] extra
    except ImportError:
        raise TokenloomError("--executor ray needs Ray: pip install 'tokenloom[ray]'") from None
    return ray


def _connect(ray, cfg: PreprocessConfig) -> None:
    """Join ``--ray-address`` (else ``$RAY_ADDRESS``), or start a local Ray for this job.

    A host:port address is probed first: Ray itself keeps retrying an unreachable
    address for minutes before it gives up.
    """
    address = cfg.ray_address or os.environ.get("RAY_ADDRESS") or None
    flag = "--ray-address" if cfg.ray_address else "$RAY_ADDRESS"
    if address and address.startswith("ray://"):
        raise TokenloomError(f"{flag} {address}: Ray Client (ray://) addresses are not supported; run the "
                             "command on a node of the cluster, with its head's HOST:PORT")
    if address and address not in ("auto", "local"):
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit():
            raise TokenloomError(f"{flag} {address!r}: expected HOST:PORT (or auto)")
        try:
            socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT).close()
        except OSError as exc:
            raise TokenloomError(f"{flag} {address}: no Ray cluster answers there "
                                 f"({exc.strerror or exc}); is the cluster up, and the address its head's?"
                                 ) from None
    options = {"logging_level": logging.WARNING, "log_to_driver": False}
    if not address or address == "local":
        options["include_dashboard"] = False
    try:
        ray.init(address=address, **options)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        hint = "" if os.environ.get("RAY_AUTH_MODE") else \
            "; a cluster with token authentication needs RAY_AUTH_MODE=token and its token"
        raise TokenloomError(f"{flag} {address}: cannot join the Ray cluster ({exc}){hint}") from None


def _run_tasks(ray, cfg, task_cfg, shards, inputs, num_shards, echo) -> dict[int, dict]:
    """Submit one task per shard and wait for all, with a progress bar over input bytes."""
    task = ray.remote(run_shard).options(num_cpus=task_cfg.workers, max_retries=cfg.ray_retries,
                                         retry_exceptions=False)
    pending = {task.remote(replace(task_cfg, shard_index=i)): i for i in shards}
    sizes = {i: sum(inputs[k].size for k in shard_inputs(inputs, num_shards, i)) for i in shards}
    echo(f"ray: {len(shards)} tasks on {int(ray.cluster_resources().get('CPU', 0))} CPUs")
    summaries: dict[int, dict] = {}
    bar = tqdm(total=sum(sizes.values()), unit="B", unit_scale=True, disable=not cfg.progress, file=sys.stderr,
               desc="preprocess (ray)", mininterval=0.5)
    try:
        while pending:
            done, _ = ray.wait(list(pending), num_returns=1)
            i = pending.pop(done[0])
            summaries[i] = _result(ray, done[0], i, num_shards, cfg)
            bar.update(sizes[i])
            bar.set_postfix_str(f"{len(summaries)}/{len(shards)} tasks", refresh=False)
    except BaseException:
        for ref in pending:
            ray.cancel(ref, force=True)
        raise
    finally:
        bar.close()
    return summaries


def _result(ray, ref, shard: int, num_shards: int, cfg: PreprocessConfig) -> dict:
    from ray.exceptions import RayError, RayTaskError  # lazy: optional dependency, the [ray] extra

    try:
        return ray.get(ref)
    except RayTaskError as exc:
        if isinstance(exc.cause, TokenloomError):
            raise TokenloomError(str(exc.cause)) from None
        raise  # a bug: keep the task's traceback
    except RayError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise TokenloomError(f"shard {shard + 1}/{num_shards} failed after {cfg.ray_retries} retries ({first}); "
                             "rerun the same command to resume") from None


def _merge_shards(cfg: PreprocessConfig, task_cfg: PreprocessConfig, shards: list[int], num_shards: int) -> None:
    """Each output key's shards, in index order, into its final prefix (published atomically by ``merge``)."""
    for key, final in output_prefixes(cfg, 1, 0).items():
        parts = [output_prefixes(task_cfg, num_shards, i)[key] for i in shards]
        if cfg.max_bad_fraction is not None:  # the tasks ran with the threshold lifted; record the job's
            for part in parts:
                m = manifest.read(part)
                if m is None:  # _check_visible saw it; gone since
                    raise TokenloomError(f"{part}: the shard's manifest is gone; rerun the job")
                m["options"]["max_bad_fraction"] = cfg.max_bad_fraction
                try:
                    manifest.write(part, m)
                except OSError as exc:
                    raise TokenloomError(os_error_message(exc, part)) from None
        merge(final, parts, rerun="rerun the same command (finished shards are kept)", removed_to=cfg.output_prefix)


def _check_visible(task_cfg: PreprocessConfig, shards: list[int], num_shards: int) -> None:
    for i in shards:
        for prefix in output_prefixes(task_cfg, num_shards, i).values():
            if not manifest.manifest_path(prefix).exists():
                raise TokenloomError(f"{prefix}: a Ray task wrote this shard but it is not visible here; "
                                     "--output-prefix must be on a filesystem shared by every Ray node")


def _judge_bad_records(cfg, task_cfg, shards, num_shards, summaries) -> None:
    """``--max-bad-fraction`` over the whole job; the rejects of every shard, in order, in one file."""
    if cfg.max_bad_fraction is None:
        return
    rejects = Path(f"{cfg.output_prefix}.rejects.jsonl")
    try:
        with atomic_writer(rejects) as out:
            for i in shards:
                part = Path(f"{run_prefix(task_cfg, num_shards, i)}.rejects.jsonl")
                if part.exists():
                    with open(part, "rb") as f:
                        shutil.copyfileobj(f, out)
    except OSError as exc:
        raise TokenloomError(os_error_message(exc, rejects)) from None
    bad = sum(s["bad_records"] for s in summaries.values())
    records = sum(s["records"] for s in summaries.values())
    share = bad / records if records else 0.0
    if share > cfg.max_bad_fraction:
        raise TokenloomError(f"{bad} of {records} records were bad ({share:.2%} > --max-bad-fraction "
                             f"{cfg.max_bad_fraction:.2%}); see {rejects}; nothing was written")


def _summary(cfg: PreprocessConfig, summaries: dict[int, dict], num_inputs: int, tasks: int,
             elapsed: float) -> dict:
    parts = [summaries[i] for i in sorted(summaries)]
    per_key = {key: {name: sum(p["per_key"][key][name] for p in parts) for name in parts[0]["per_key"][key]}
               for key in parts[0]["per_key"]}
    tokens = sum(p["tokens"] for p in parts)
    bytes_in = sum(p["bytes_in"] for p in parts)
    return {
        "outputs": output_prefixes(cfg, 1, 0),
        "inputs": num_inputs,
        "shard": f"all ({tasks} Ray tasks)",
        "tokenizer": parts[0]["tokenizer"],
        "dtype": parts[0]["dtype"],
        "records": sum(p["records"] for p in parts),
        "bad_records": sum(p["bad_records"] for p in parts),
        "per_key": per_key,
        "tokens": tokens,
        "bytes_in": bytes_in,
        "seconds": round(elapsed, 3),
        "tokens_per_second": round(tokens / max(elapsed, 1e-9)),
        "input_mb_per_second": round(bytes_in / 1e6 / max(elapsed, 1e-9), 2),
    }
