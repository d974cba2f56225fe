"""Checks a train config can pass before any rank starts, each failing with one line that
names the flag or file and what to type instead.

The launching process runs :func:`check`, so a typo costs a second, not a torchrun start-up and
a traceback per rank. It reads only the config and small files (``.idx`` headers, manifests,
``state.json``; remote ones fetched into the node's cache once), except a manifest-less source's
largest token id (read once per file version, cached) so another tokenizer's ids fail here. What
needs built indices is left to the ranks, which repeat the layout checks (for ``srun`` jobs).
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenloom import objstore
from tokenloom.blending.sources import source_metadata
from tokenloom.blending.split import Split, split_documents, split_matrix
from tokenloom.errors import TokenloomError
from tokenloom.indexed import manifest
from tokenloom.indexed.format import data_path, index_path, read_header
from tokenloom.indexed.manifest import ids_key
from tokenloom.train.checkpoint import commit as checkpoint
from tokenloom.train.config import (
    TrainConfig,
    check_resumable_model,
    check_resumable_optimizer,
    check_resumable_schedule,
    config_to_dict,
)
from tokenloom.train.data import open_tokenizer
from tokenloom.train.dist import resolve_backend


def check(cfg: TrainConfig, world_size: int) -> None:
    """Raise :class:`TokenloomError` for the first problem found (see the module docstring)."""
    check_layout(cfg, world_size)
    resolve_backend(cfg.distributed_backend)
    check_model_split(cfg)
    if cfg.data.blend is not None:
        check_sources(cfg)
    if cfg.resume is not None:
        check_resume(cfg)


def check_layout(cfg: TrainConfig, world_size: int) -> None:
    """tp x pp divides the world; the global batch splits into micro-batches per dp rank."""
    mp = cfg.tp * cfg.pp
    if world_size % mp:
        fits = [n for n in range(mp, 8 * mp + 1, mp)][:4]
        raise TokenloomError(f"--tp {cfg.tp} x --pp {cfg.pp} = {mp} does not divide the {world_size} rank(s) of "
                             f"this launch; use --nproc-per-node {' or '.join(map(str, fits))} or change --tp/--pp")
    dp = world_size // mp
    per_step = cfg.micro_batch_size * dp
    if cfg.global_batch_size % per_step:
        lo = max(per_step, cfg.global_batch_size // per_step * per_step)
        raise TokenloomError(
            f"--global-batch-size {cfg.global_batch_size} is not a multiple of --micro-batch-size "
            f"{cfg.micro_batch_size} x {dp} data-parallel rank(s) = {per_step}; use --global-batch-size {lo} or "
            f"{lo + per_step}")
    num_micro = cfg.global_batch_size // per_step
    if cfg.vpp and cfg.vpp > 1 and num_micro % cfg.pp:
        raise TokenloomError(
            f"the interleaved schedule (--vpp {cfg.vpp}) needs the {num_micro} micro-batches per step "
            f"(--global-batch-size / (--micro-batch-size x dp)) to be a multiple of --pp {cfg.pp}")


def check_model_split(cfg: TrainConfig) -> None:
    """The model's heads, MLP and vocabulary split evenly over tp, its layers over pp and vpp."""
    m, tp = cfg.model, cfg.tp
    problems = []
    if m.n_heads % tp or m.kv_heads % tp:
        problems.append(f"model.n_heads {m.n_heads} and model.n_kv_heads {m.kv_heads} must be divisible by --tp {tp}")
    if m.ffn_size % tp:
        problems.append(f"the MLP size {m.ffn_size} must be divisible by --tp {tp} (model.ffn_hidden_size)")
    if m.num_experts is not None and cfg.cp > 1:
        problems.append(f"mixture-of-experts layers (model.num_experts) with --cp {cfg.cp}: their routing statistics "
                        "under context parallelism are not implemented; use --cp 1")
    if m.padded_vocab_size % tp:
        problems.append(f"the padded vocabulary {m.padded_vocab_size} must be divisible by --tp {tp} "
                        "(raise model.make_vocab_size_divisible_by)")
    try:
        cfg.pipeline_split  # noqa: B018 (validates)
    except TokenloomError as e:
        problems.append(str(e))
    if problems:
        raise TokenloomError("; ".join(problems))


def check_sources(cfg: TrainConfig) -> None:
    """Files present, no evaluated split empty, ``--tokenizer`` matching manifests, ids within the vocabulary."""
    blend = cfg.data.blend
    if blend is None:  # mock data: no files (check calls this for blend data only)
        return
    if not blend.prefixes:
        raise TokenloomError("--data is empty; give WEIGHT PREFIX pairs, e.g. --data 0.7 out/web 0.3 out/code")
    valid = split_matrix(blend.split)[Split.valid]
    tok, unmanifested = None, []
    if cfg.tokenizer:
        tok = open_tokenizer(cfg.tokenizer)
    remote = objstore.stat_many([path for _, prefix in blend.prefixes if objstore.is_url(prefix)
                                 for path in (index_path(prefix), data_path(prefix))])  # denied, unreachable: one line
    for _, prefix in blend.prefixes:
        for path in (index_path(prefix), data_path(prefix)):
            if objstore.is_url(path):
                if remote[path] is None:
                    raise objstore.StoreError(f"--data: {path}: no such object (a PREFIX names PREFIX.bin and "
                                              "PREFIX.idx, as preprocess --output-prefix wrote them)")
            elif not Path(path).is_file():
                raise TokenloomError(f"--data: {path} does not exist (a PREFIX names PREFIX.bin and PREFIX.idx, as "
                                     "preprocess --output-prefix wrote them)")
        num_sequences = read_header(index_path(prefix))[1]
        if cfg.eval_interval and valid is not None and not len(split_documents(valid, num_sequences)):
            raise TokenloomError(f"--split {blend.split} leaves {prefix} ({num_sequences} documents) no validation "
                                 "documents, yet evaluation reads them; give its valid part more weight (e.g. "
                                 "--split 949,50,1) or set --set eval_interval=0")
        if cfg.eval_interval and valid is None:
            raise TokenloomError(f"--split {blend.split} has no validation part, yet evaluation reads it; give it one "
                                 "(e.g. --split 949,50,1) or set --set eval_interval=0")
        saved = manifest.read(prefix)
        if saved is None:
            unmanifested.append(prefix)
        if tok is not None and saved is not None and ids_key(saved["tokenizer"]) != ids_key(tok.fingerprint()):
            raise TokenloomError(
                f"--tokenizer {cfg.tokenizer} is {manifest.tokenizer_name(tok.fingerprint())}, but {prefix} was tokenized "
                f"with {manifest.tokenizer_name(saved['tokenizer'])} (its manifest); pass that tokenizer")
    if unmanifested:
        check_max_ids(cfg, unmanifested)


def check_max_ids(cfg: TrainConfig, prefixes: list[str]) -> None:
    """The largest token id of each source (without a manifest) is below ``model.vocab_size``."""
    vocab = cfg.model.vocab_size
    cache_dir = cfg.data.blend.cache_dir if cfg.data.blend is not None else None
    metas = source_metadata(prefixes, cache_dir, max_ids=True)
    for prefix in prefixes:
        top = metas[prefix].max_id
        if top is not None and top >= vocab:
            model = f"--tokenizer {cfg.tokenizer} ({vocab} ids)" if cfg.tokenizer else f"model.vocab_size {vocab}"
            raise TokenloomError(
                f"--data: {prefix}.bin holds token id {top}, beyond the vocabulary of {model}; it was tokenized "
                "with another tokenizer (it has no manifest to say which): pass that one, or preprocess it again")


def check_resume(cfg: TrainConfig) -> None:
    """A checkpoint to resume has the same model, schedule (unless ``override_opt_param_scheduler``)
    and data (unless ``force_data``; loader settings and names may change, and with a data history
    the blend and schedule too: ``blending/segments.py``)."""
    if cfg.resume is None:  # nothing to resume (check calls this with one only)
        return
    path = checkpoint.resolve(cfg.resume, cfg.ckpt_dir)
    if path is None:
        return
    state = checkpoint.read_state(path)
    saved = state["config"]
    check_resumable_model(path, cfg, saved["model"])
    check_resumable_schedule(path, cfg, saved)
    check_resumable_optimizer(path, cfg, saved)
    if cfg.force_data or saved.get("data") is None:
        return
    # a checkpoint with a data history continues each source exactly under other weights or sources
    free = ("cache_dir", "build_timeout", "names") + (("prefixes",) if "data_history" in state else ())

    def order_defining(data: dict) -> dict:
        out = {k: v for k, v in data.items() if k != "num_workers" and not (k == "schedule" and "data_history" in state)}
        if out.get("blend"):
            out["blend"] = {k: v for k, v in out["blend"].items() if k not in free}
        return out

    old, new = order_defining(saved["data"]), order_defining(config_to_dict(cfg)["data"])
    diff = [f"data.{k} {json.dumps(old.get(k))} -> {json.dumps(new.get(k))}" for k in sorted(set(old) | set(new))
            if old.get(k) != new.get(k)]
    if diff:
        raise TokenloomError(f"{path} was trained on other data ({'; '.join(diff)}), which changes the sample "
                             "order; resume with the same data or pass --set force_data=true")
