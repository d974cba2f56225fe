"""The training loop: ``run(TrainConfig)``, also runnable as ``python -m tokenloom.train.loop --config F``.

One iteration::

    lr = lr_at(it)                         pure function of the iteration (optim.py)
    for each of the accum micro-batches:   accum = global_batch / (micro_batch x dp_size)
        forward (bf16 autocast on GPU)     inside ddp.no_sync() except the last one
        (loss / accum).backward()          the last backward all-reduces (our DDP)
    clip grad norm, AdamW step             identical on every rank

Choices and their costs:

* **Where it runs**: under torchrun / Slurm (``RANK``/``WORLD_SIZE``/``MASTER_*`` in the
  environment) it joins that job (:func:`tokenloom.train.dist.init_from_env`) and wraps
  the model in our :class:`~tokenloom.train.ddp.DistributedDataParallel` when the world
  has more than one rank; with no environment it runs in this process. Every rank is a
  data-parallel rank (no tensor/pipeline parallelism here).
* **Exact resume**: everything that decides the next step is in the checkpoint or a
  pure function of it: parameters, AdamW state, the iteration (learning rate), the
  consumed-samples count (data order), and each rank's RNG states. On CPU in fp32 a run
  stopped and resumed in a fresh process reproduces the losses and final parameters of
  an uninterrupted run bit for bit (tested). GPU runs are reproducible only as far as
  their kernels are deterministic.
* **Host syncs**: losses are summed on the device and read (and all-reduced across
  ranks, for logging only) every ``log_interval`` steps, so the logged ``train_loss`` is the
  mean over the interval; the grad norm is that of the last step.
* **Evaluation** runs the unwrapped model under ``no_grad`` on the same first
  ``eval_iters`` validation batches every time, before the first step, every ``eval_interval``
  steps and at the end.
* **Failures**: a dead or stalled rank surfaces as a :class:`TokenloomError` from the
  next collective (at most the ``dist_timeout_s`` later); ``main`` prints it as one line
  and exits non-zero without tearing down the process group (which could block).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import os
import random
import sys
import types
import typing
from collections.abc import Iterator
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
import torch.distributed as dist

from tokenloom.errors import TokenloomError
from tokenloom.train import checkpoint
from tokenloom.train import data as train_data
from tokenloom.train.data import DataConfig
from tokenloom.train.metrics import MetricsLogger, StepTimer, peak_flops, plot_loss
from tokenloom.train.model import GPT, GPTConfig
from tokenloom.train.optim import OptimConfig, build_optimizer, lr_at, set_lr


@dataclass(kw_only=True)
class TrainConfig:
    """Everything one training run needs; nested sections ``model``, ``data``, ``optim``."""

    model: GPTConfig = field(default_factory=GPTConfig)
    """Model shape (see tokenloom.train.model.GPTConfig)."""
    data: DataConfig = field(default_factory=lambda: DataConfig(mock=train_data.MockDataConfig()))
    """Training data: data.mock (synthetic) or data.blend (weighted .bin/.idx prefixes)."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """AdamW, learning-rate schedule and gradient clipping."""
    micro_batch_size: int = 4
    """Sequences per forward/backward on one rank."""
    global_batch_size: int = 32
    """Sequences per optimizer step over all ranks; accumulation = global / (micro x ranks)."""
    train_iters: int = 1000
    """Optimizer steps of the whole run (the schedule and data size depend on it)."""
    exit_interval: int | None = None
    """Save and stop this process when the iteration is a multiple of this (time-limited jobs)."""
    eval_interval: int = 100
    """Validation every this many steps (and at the end); 0 disables validation."""
    eval_iters: int = 10
    """Global batches of validation data per evaluation."""
    log_interval: int = 10
    """Write a metrics record every this many steps."""
    gc_interval: int = 50
    """Python's automatic garbage collection is off while training and a young-generation
    collection runs every this many steps (torchtitan's gc_freq, Megatron's --manual-gc);
    0 keeps automatic collection."""
    keep_freed_memory: bool = True
    """On CPU with glibc: malloc keeps freed activation memory for the next step instead of
    unmapping it and faulting it in again (CPU steps 5-10% faster, peak RSS ~5% higher, measured;
    the process keeps its peak heap). See tokenloom.train.host_alloc. Off: malloc's defaults."""
    save_interval: int | None = 500
    """Checkpoint every this many steps; a checkpoint is always written at the end."""
    keep_last_checkpoints: int = 0
    """Delete older checkpoints beyond this many (0 keeps all)."""
    output_dir: str = "train-out"
    """Run directory: config.json, metrics.jsonl, loss.png, checkpoints/."""
    checkpoint_dir: str | None = None
    """Where checkpoints go; None means OUTPUT_DIR/checkpoints."""
    resume: str | None = None
    """"auto" (latest complete checkpoint, or start fresh), a checkpoint directory, or None (fresh)."""
    force_data: bool = False
    """Resume even if the checkpoint was trained on different data (the sample order changes)."""
    tokenizer: str | None = None
    """Tokenizer path (or "byte"), stored in checkpoints so generate can decode."""
    seed: int = 1234
    """Seed of the python, numpy and torch RNGs (dropout); the init uses model.seed."""
    precision: Literal["auto", "bf16", "fp32"] = "auto"
    """"auto": bf16 autocast on GPUs that support it, fp32 otherwise (always on CPU)."""
    compile: bool = False
    """torch.compile the model (first steps are slow while it compiles)."""
    ddp_bucket_cap_mb: float | None = None
    """DDP gradient bucket size in MiB; None means 25 with a 1 MiB first bucket."""
    dist_timeout_s: float = 600.0
    """Collective timeout: a dead or stalled rank makes the others fail after at most this."""
    metrics_path: str | None = None
    """Metrics JSONL; None means OUTPUT_DIR/metrics.jsonl."""
    tensorboard_dir: str | None = None
    """Also write TensorBoard scalars here (needs the tensorboard package)."""
    plot: bool = True
    """Write OUTPUT_DIR/loss.png at the end (matplotlib)."""
    progress: bool = True
    """Progress bar on rank 0."""
    peak_flops: float | None = None
    """Peak FLOP/s of one device for MFU; None looks it up (known GPUs only)."""
    tp: int = 1
    """Tensor-parallel size (Megatron layout tp-dp-pp); > 1 trains with tokenloom.train.parallel."""
    pp: int = 1
    """Pipeline-parallel size (1F1B schedule, interleaved with vpp); > 1 uses tokenloom.train.parallel."""
    vpp: int | None = None
    """Virtual pipeline stages (model chunks) per pipeline rank for the interleaved schedule; None: 1."""
    zero1: bool = False
    """Shard AdamW state over data parallel (ZeRO-1, one weight-decay group); uses tokenloom.train.parallel."""

    def __post_init__(self) -> None:
        positive = ("micro_batch_size", "global_batch_size", "train_iters", "log_interval", "eval_iters")
        bad = [f"{k}={getattr(self, k)}" for k in positive if getattr(self, k) < 1]
        if bad:
            raise TokenloomError(f"must be >= 1: {', '.join(bad)}")
        if self.resume is not None and not self.resume:
            raise TokenloomError("resume must be 'auto', a checkpoint path, or None")
        if self.gc_interval < 0:
            raise TokenloomError(f"gc_interval must be >= 0, got {self.gc_interval}")

    @property
    def ckpt_dir(self) -> Path:
        return Path(self.checkpoint_dir or Path(self.output_dir) / "checkpoints")


# --------------------------------------------------------------------------- config files


def config_to_dict(cfg: Any) -> dict:
    """Plain JSON-able dict of a (nested) config dataclass."""
    return json.loads(json.dumps(asdict(cfg)))


def config_from_dict(cls: type, data: dict, where: str = "") -> Any:
    """Build dataclass ``cls`` from nested dicts (as read from JSON/YAML); unknown keys are errors."""
    if not isinstance(data, dict):
        raise TokenloomError(f"config section {where or '(top)'} must be a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(data) - set(names))
    if unknown:
        raise TokenloomError(f"unknown config key(s) {[where + k for k in unknown]}; known in "
                             f"{where or 'the top level'}: {', '.join(names)}")
    return cls(**{k: _convert(hints[k], v, f"{where}{k}.") for k, v in data.items()})


def _convert(hint: Any, value: Any, where: str) -> Any:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if value is None:
        return None
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        return _convert(inner[0], value, where) if len(inner) == 1 else value
    if dataclasses.is_dataclass(hint) and isinstance(value, dict):
        return config_from_dict(hint, value, where)
    if origin in (tuple, list) and isinstance(value, (list, tuple)):
        if origin is list:
            return [_convert(args[0], v, where) for v in value] if args else list(value)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_convert(args[0], v, where) for v in value)
        return tuple(_convert(a, v, where) for a, v in zip(args, value, strict=True)) if args else tuple(value)
    if hint is float and isinstance(value, (int, str)) and not isinstance(value, bool):
        try:
            return float(value)  # YAML reads 6e-4 (no dot) as a string
        except ValueError:
            raise TokenloomError(f"{where[:-1]}: expected a number, got {value!r}") from None
    return value


def load_config(path: str | os.PathLike | None = None, overrides: typing.Sequence[str] = ()) -> TrainConfig:
    """Read a JSON or YAML train config and apply ``key.sub=value`` overrides (values parsed as YAML)."""
    raw: dict = {}
    if path is not None:
        text = Path(path).read_text()
        if str(path).endswith((".yaml", ".yml")):
            import yaml

            raw = yaml.safe_load(text) or {}
        else:
            raw = json.loads(text)
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep:
            raise TokenloomError(f"override {item!r} must look like key.sub=value")
        import yaml

        node = raw
        *parents, leaf = key.strip().split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = yaml.safe_load(value)
    return config_from_dict(TrainConfig, raw)


def open_tokenizer(name: str):
    """``load_tokenizer`` for a path, or for a file-less kind name such as ``"byte"``."""
    from tokenloom.tokenizers import load_tokenizer
    from tokenloom.tokenizers.load import FILELESS

    return load_tokenizer(kind=name) if name in FILELESS else load_tokenizer(name)


# --------------------------------------------------------------------------- the run


@dataclass
class _World:
    rank: int
    size: int
    device: torch.device
    owns_group: bool  # we created the process group (and destroy it at the end)


def _join_world(cfg: TrainConfig) -> _World:
    from tokenloom.train.dist import init_from_env

    if int(os.environ.get("WORLD_SIZE", "1")) > 1 or dist.is_initialized():
        owns = not dist.is_initialized()
        info = init_from_env(timeout_s=cfg.dist_timeout_s)
        return _World(info.rank, info.world_size, info.device, owns)
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    return _World(0, 1, device, False)


def _collective(what: str, fn, *args, **kwargs):
    """Run a collective, turning a peer failure into a one-line TokenloomError."""
    try:
        return fn(*args, **kwargs)
    except TokenloomError:
        raise
    except Exception as e:
        raise TokenloomError(f"rank {dist.get_rank()}: {what} failed ({type(e).__name__}: "
                             f"{str(e).splitlines()[0] if str(e) else ''}); another rank has probably "
                             "died or stalled past the collective timeout") from e


def _mean_across(value: torch.Tensor, world: _World, what: str) -> float:
    if world.size > 1:
        value = value.clone()
        _collective(what, dist.all_reduce, value)
        value /= world.size
    return float(value)


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _autocast(cfg: TrainConfig, device: torch.device):
    bf16 = cfg.precision == "bf16" or (
        cfg.precision == "auto" and device.type == "cuda" and torch.cuda.is_bf16_supported()
    )
    return (lambda: torch.autocast(device.type, dtype=torch.bfloat16)) if bf16 else nullcontext


def train_step(net, ddp, optimizer, batches: list[dict], *, autocast, grad_clip: float,
               params: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """One optimizer step over ``batches`` (the micro-batches of this rank).

    Returns (mean micro-batch loss, total grad norm before clipping), both on the device.
    """
    optimizer.zero_grad(set_to_none=ddp is None)  # keep DDP's bucket views
    model = ddp if ddp is not None else net
    total = torch.zeros((), device=params[0].device)
    for m, batch in enumerate(batches):
        last = m == len(batches) - 1
        with (ddp.no_sync() if ddp is not None and not last else nullcontext()):
            with autocast():
                loss = model(batch["tokens"], batch["labels"], batch["loss_mask"])
            (loss / len(batches)).backward()
        total += loss.detach()
    norm = torch.nn.utils.clip_grad_norm_(params, grad_clip if grad_clip > 0 else math.inf)
    optimizer.step()
    return total / len(batches), norm


@torch.no_grad()
def evaluate(net, dataset, cfg: TrainConfig, world: _World, eod: int, autocast) -> float:
    """Mean loss over the first ``eval_iters`` global batches of ``dataset``."""
    net.eval()
    micro = cfg.micro_batch_size
    batches = train_data.loader(dataset, eod=eod, eod_mask_loss=cfg.data.eod_mask_loss, consumed_samples=0,
                                micro_batch_size=micro, dp_rank=world.rank, dp_size=world.size,
                                total_samples=cfg.eval_iters * cfg.global_batch_size)
    total, count = torch.zeros((), device=world.device), 0
    for batch in batches:
        batch = train_data.to_device(batch, world.device)
        with autocast():
            total += net(batch["tokens"], batch["labels"], batch["loss_mask"]).float()
        count += 1
    net.train()
    if count == 0:
        raise TokenloomError(f"the validation split has fewer than {cfg.global_batch_size} samples; "
                             "set eval_interval=0 or give it more data")
    return _mean_across(total / count, world, "validation loss all-reduce")


def due(cfg: TrainConfig, iteration: int, done: bool, has_valid: bool) -> tuple[bool, bool, bool]:
    """(evaluate, exit, save) after ``iteration`` steps, by ``cfg``'s intervals (``done``: the
    last step). Both loops, this one and the tp/pp/ZeRO one, ask here."""
    evaluating = bool(cfg.eval_interval) and has_valid and (iteration % cfg.eval_interval == 0 or done)
    exiting = bool(cfg.exit_interval) and iteration % cfg.exit_interval == 0 and not done
    saving = done or exiting or bool(cfg.save_interval and iteration % cfg.save_interval == 0)
    return evaluating, exiting, saving


def tune_host_memory(cfg: TrainConfig, device: torch.device) -> None:
    """:func:`~tokenloom.train.host_alloc.keep_freed_memory` when ``cfg.keep_freed_memory`` and
    the run computes on the CPU (on a GPU, host allocations are few and small)."""
    if cfg.keep_freed_memory and device.type == "cpu":
        from tokenloom.train.host_alloc import keep_freed_memory

        keep_freed_memory()


class ManualGC:
    """``with ManualGC(n) as g: ... g.step(iteration)``: Python's automatic garbage collection
    off inside, a young-generation collection every ``n`` steps (n = 0: left automatic).

    Automatic GC walks every tracked object whenever allocations pile up, and the data
    pipeline allocates many small objects per step: measured at 1.5-2% of a CPU training
    step. Collecting at fixed steps costs less and happens on every rank at the same step,
    so no rank stalls the others at random (torchtitan's gc_freq, Megatron's --manual-gc).
    """

    def __init__(self, interval: int) -> None:
        self.interval = interval

    def __enter__(self) -> ManualGC:
        self._was_enabled = gc.isenabled()
        if self.interval:
            gc.collect()
            gc.disable()
        return self

    def step(self, iteration: int) -> None:
        if self.interval and iteration % self.interval == 0:
            gc.collect(1)

    def __exit__(self, *exc) -> None:
        if self.interval and self._was_enabled:
            gc.enable()


def run(cfg: TrainConfig) -> dict:
    """Train as configured; returns ``{"iteration", "train_loss", "val_loss", "checkpoint", "exited"}``."""
    if cfg.tp > 1 or cfg.pp > 1 or cfg.zero1:
        from tokenloom.train.parallel.train import run_parallel

        return run_parallel(cfg)
    r = start_run(cfg)
    summary = r.train()
    if r.world.owns_group:
        dist.destroy_process_group()
    return summary


def start_run(cfg: TrainConfig) -> _Run:
    """A data-parallel run (tp = pp = 1, no ZeRO-1) set up in this process, not yet stepped:
    ``for it in r.steps(): ...`` then ``r.finish()``; ``run`` does ``start_run(cfg).train()``
    (``bench/train_bench.py`` steps it in turn with a baseline loop)."""
    if cfg.tp > 1 or cfg.pp > 1 or cfg.zero1:
        raise TokenloomError("start_run covers tp = pp = 1 without ZeRO-1; use run()")
    return _Run(cfg, _join_world(cfg))


_MODEL_FIELDS_FREE_ON_RESUME = {"recompute_layers", "dropout", "seed", "init_std", "kernels"}
"""Model settings that may change on resume (they do not change the parameters' meaning)."""


class _Run:
    """State of one run; ``train()`` is the loop. Split out only to keep functions short."""

    def __init__(self, cfg: TrainConfig, world: _World) -> None:
        self.cfg, self.world = cfg, world
        tune_host_memory(cfg, world.device)
        dp = world.size
        if cfg.global_batch_size % (cfg.micro_batch_size * dp):
            raise TokenloomError(f"global_batch_size={cfg.global_batch_size} is not a multiple of "
                                 f"micro_batch_size x ranks = {cfg.micro_batch_size} x {dp}")
        self.accum = cfg.global_batch_size // (cfg.micro_batch_size * dp)
        _seed_everything(cfg.seed)
        tok_eod = self._check_tokenizer()
        gbs, evals = cfg.global_batch_size, cfg.eval_iters
        sizes = (cfg.train_iters * gbs, evals * gbs if cfg.eval_interval else 0, evals * gbs)
        self.data = train_data.build(cfg.data, seq_len=cfg.model.seq_len, vocab_size=cfg.model.vocab_size,
                                     sizes=sizes, tokenizer_eod=tok_eod)
        self.model = GPT(cfg.model).to(world.device)
        self.optimizer = build_optimizer(self.model, cfg.optim)
        self.iteration, self.consumed = 0, 0
        self.resumed_from = self._resume()
        self.net = torch.compile(self.model) if cfg.compile else self.model
        self.ddp = None
        if dp > 1:
            from tokenloom.train.ddp import DistributedDataParallel

            self.ddp = _collective("DDP setup", DistributedDataParallel, self.net,
                                   bucket_cap_mb=cfg.ddp_bucket_cap_mb)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.autocast = _autocast(cfg, world.device)
        peak = cfg.peak_flops or peak_flops(world.device)
        self.peak_total = peak * dp if peak else None
        self.flops_per_token = self.model.flops_per_token()
        self.metrics = None
        if world.rank == 0:
            Path(cfg.output_dir).mkdir(parents=True, exist_ok=True)
            (Path(cfg.output_dir) / "config.json").write_text(json.dumps(config_to_dict(cfg), indent=2))
            self.metrics = MetricsLogger(self.metrics_path, tensorboard_dir=cfg.tensorboard_dir,
                                         resume_iteration=self.iteration if self.resumed_from else None)

    @property
    def metrics_path(self) -> Path:
        return Path(self.cfg.metrics_path or Path(self.cfg.output_dir) / "metrics.jsonl")

    def _check_tokenizer(self) -> int | None:
        if not self.cfg.tokenizer:
            return None
        tok = open_tokenizer(self.cfg.tokenizer)
        if tok.vocab_size > self.cfg.model.vocab_size:
            raise TokenloomError(f"the tokenizer has {tok.vocab_size} ids but model.vocab_size is "
                                 f"{self.cfg.model.vocab_size}; set model.vocab_size >= {tok.vocab_size}")
        return tok.eod

    def _resume(self) -> Path | None:
        if self.cfg.resume is None:
            return None
        path = checkpoint.resolve(self.cfg.resume, self.cfg.ckpt_dir)
        if path is None:
            return None
        saved_model = checkpoint.read_state(path)["config"]["model"]
        # A field a checkpoint predates (saved without it) had its default value then.
        defaults = {f.name: f.default for f in dataclasses.fields(self.cfg.model)
                    if f.default is not dataclasses.MISSING}
        changed = sorted(k for k, v in asdict(self.cfg.model).items()
                         if k not in _MODEL_FIELDS_FREE_ON_RESUME
                         and json.loads(json.dumps(v)) != saved_model.get(k, json.loads(json.dumps(defaults.get(k)))))
        if changed:
            raise TokenloomError(f"{path} was trained with a different model ({', '.join(changed)} differ); "
                                 "resume with the checkpoint's model settings")
        state = checkpoint.load(path, model=self.model, optimizer=self.optimizer, rank=self.world.rank,
                                device=self.world.device)
        from tokenloom.blending.loader import check_fingerprint

        check_fingerprint(state.get("data_fingerprint"), self.data.fingerprint, self.cfg.force_data)
        self.iteration, self.consumed = int(state["iteration"]), int(state["consumed_samples"])
        if self.world.rank == 0:
            print(f"resumed from {path} at iteration {self.iteration} ({self.consumed} samples consumed)",
                  file=sys.stderr)
        return path

    def _save(self) -> Path:
        cfg, world = self.cfg, self.world
        state = {
            "consumed_samples": self.consumed,
            "data_fingerprint": self.data.fingerprint,
            "data_description": self.data.description,
            "world_size": world.size,
            "config": config_to_dict(cfg),
        }
        barrier = (lambda: _collective("checkpoint barrier", dist.barrier)) if world.size > 1 else (lambda: None)
        return checkpoint.save(cfg.ckpt_dir, self.iteration, model=self.model, optimizer=self.optimizer,
                               state=state, rank=world.rank, barrier=barrier, keep_last=cfg.keep_last_checkpoints)

    def _batches(self):
        cfg = self.cfg
        loader = train_data.loader(
            self.data.train, eod=self.data.eod, eod_mask_loss=cfg.data.eod_mask_loss,
            consumed_samples=self.consumed, micro_batch_size=cfg.micro_batch_size, dp_rank=self.world.rank,
            dp_size=self.world.size, num_workers=cfg.data.num_workers,
            pin_memory=self.world.device.type == "cuda", total_samples=cfg.train_iters * cfg.global_batch_size,
        )
        it = iter(loader)
        while True:
            yield [train_data.to_device(next(it), self.world.device) for _ in range(self.accum)]

    def train(self) -> dict:
        """The whole loop: :meth:`steps` to the end, then :meth:`finish`."""
        for _ in self.steps():
            pass
        return self.finish()

    def steps(self) -> Iterator[int]:
        """The loop, one optimizer step at a time: yields the iteration number after each step
        (with its logging, evaluation and checkpoint). ``train`` drains it; a benchmark can
        interleave it step by step with a baseline. Call :meth:`finish` afterwards."""
        with ManualGC(self.cfg.gc_interval) as self._gc:
            yield from self._loop()

    def _loop(self) -> Iterator[int]:
        cfg, world = self.cfg, self.world
        from tqdm import tqdm

        self._bar = bar = tqdm(total=cfg.train_iters, initial=self.iteration,
                               disable=world.rank != 0 or not cfg.progress, dynamic_ncols=True, unit="it")
        loss_sum, since = torch.zeros((), device=world.device), 0
        self._timer = timer = StepTimer(cfg.global_batch_size * cfg.model.seq_len, world.device)
        self._last: dict = {"train_loss": None, "val_loss": None}
        self._exited = False
        last = self._last
        batches = self._batches() if self.iteration < cfg.train_iters else iter(())
        if self.iteration == 0 and cfg.eval_interval and self.data.valid is not None:
            # The starting point of the validation curve (eval mode: no RNG is consumed).
            start = evaluate(self.net, self.data.valid, cfg, world, self.data.eod, self.autocast)
            if self.metrics:
                self.metrics.log({"iter": 0, "val_loss": start})
        timer.start()
        while self.iteration < cfg.train_iters:
            lr = lr_at(self.iteration, cfg.optim, cfg.train_iters)
            set_lr(self.optimizer, lr)
            loss, norm = train_step(self.net, self.ddp, self.optimizer, next(batches), autocast=self.autocast,
                                    grad_clip=cfg.optim.grad_clip, params=self.params)
            self.iteration += 1
            self.consumed += cfg.global_batch_size
            loss_sum += loss
            since += 1
            timer.step()
            bar.update(1)
            done = self.iteration == cfg.train_iters
            if self.iteration % cfg.log_interval == 0 or done:
                last["train_loss"] = self._log_train(loss_sum / since, norm, lr, bar)
                loss_sum.zero_()
                since = 0
            self._gc.step(self.iteration)
            evaluating, self._exited, saving = due(cfg, self.iteration, done, self.data.valid is not None)
            if evaluating or saving:
                with timer.paused():
                    if evaluating:
                        last["val_loss"] = evaluate(self.net, self.data.valid, cfg, world, self.data.eod,
                                                    self.autocast)
                        if self.metrics:
                            self.metrics.log({"iter": self.iteration, "val_loss": last["val_loss"]})
                    if saving:
                        last["checkpoint"] = str(self._save())
            yield self.iteration
            if self._exited:
                break

    def finish(self) -> dict:
        """Close the progress bar and metrics, draw the loss plot; the run's summary."""
        cfg, last = self.cfg, self._last
        self._bar.close()
        if "checkpoint" not in last and self.resumed_from is not None:
            last["checkpoint"] = str(self.resumed_from)  # resumed a finished run: nothing new to save
        if self.metrics:
            self.metrics.close()
            if cfg.plot and not self._exited:
                plot_loss(self.metrics_path, Path(cfg.output_dir) / "loss.png")
        return {"iteration": self.iteration, "exited": self._exited, **last, **self._timer.summary()}

    def _log_train(self, mean_loss: torch.Tensor, norm: torch.Tensor, lr: float, bar) -> float:
        loss = _mean_across(mean_loss, self.world, "loss all-reduce")
        if not math.isfinite(loss):
            raise TokenloomError(f"training loss is {loss} at iteration {self.iteration}; lower optim.lr or "
                                 "check the data")
        timing = self._timer.interval()
        mfu = self.flops_per_token * timing["tokens_per_s"] / self.peak_total if self.peak_total else None
        if self.metrics:
            self.metrics.log({"iter": self.iteration, "train_loss": loss, "lr": lr, "grad_norm": float(norm),
                              **timing, "consumed_samples": self.consumed, "mfu": mfu})
        bar.set_postfix(loss=f"{loss:.4f}", lr=f"{lr:.2e}", tok_s=f"{timing['tokens_per_s']:,.0f}")
        return loss


# --------------------------------------------------------------------------- entry point


def main(argv: typing.Sequence[str] | None = None) -> int:
    """``python -m tokenloom.train.loop --config FILE [--set key=value ...]`` (what torchrun starts)."""
    parser = argparse.ArgumentParser(prog="python -m tokenloom.train.loop", description=__doc__.splitlines()[0])
    parser.add_argument("--config", help="train config file (.json, .yaml, .yml)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config value, e.g. --set optim.lr=3e-4 (repeatable)")
    args = parser.parse_args(argv)
    try:
        summary = run(load_config(args.config, args.overrides))
    except TokenloomError as e:
        prefix = f"rank {dist.get_rank()}: " if dist.is_initialized() else ""
        message = str(e) if str(e).startswith("rank ") else prefix + str(e)
        print(f"error: {' '.join(message.split())}", file=sys.stderr, flush=True)
        if dist.is_initialized():
            sys.stdout.flush()
            os._exit(e.exit_code)  # a dead peer can make process-group teardown block
        return e.exit_code
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
