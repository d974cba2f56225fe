"""The train configuration: :class:`TrainConfig` and its JSON/YAML files.

One dataclass tree (``model``, ``data``, ``optim``) describes a run in every layout; field
docstrings are the ``--help`` texts. ``key.sub=value`` overrides are parsed as YAML. Unknown
keys are errors, all in one message with the nearest field each, so a typo never silently
trains a default.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
import types
import typing
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from tokenloom.config import field_docs
from tokenloom.errors import TokenloomError
from tokenloom.train import data as train_data
from tokenloom.train.data import DataConfig
from tokenloom.train.model.config import ARCH_FEATURES, GPTConfig
from tokenloom.train.model.fp8 import RECIPES as FP8_RECIPES
from tokenloom.train.model.pipeline_split import PipelineSplit
from tokenloom.train.optim.adamw import OptimConfig


@dataclass(kw_only=True)
class TrainConfig:
    """Everything one training run needs; nested sections ``model``, ``data``, ``optim``."""

    model: GPTConfig = field(default_factory=GPTConfig)
    """Model shape (see tokenloom.train.model.config.GPTConfig)."""
    data: DataConfig = field(default_factory=lambda: DataConfig(mock=train_data.MockDataConfig()))
    """Training data: data.mock (synthetic) or data.blend (weighted .bin/.idx prefixes)."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """The optimizer (AdamW or Muon), learning-rate schedule and gradient clipping."""
    micro_batch_size: int = 4
    """Sequences per forward/backward on one rank."""
    global_batch_size: int = 32
    """Sequences per optimizer step over all ranks; accumulation = global / (micro x ranks)."""
    train_iters: int = 1000
    """Optimizer steps of the whole run (the schedule and data size depend on it)."""
    exit_interval: int | None = None
    """Save and stop this process when the iteration is a multiple of this (time-limited jobs)."""
    save_on_signal: bool = True
    """On SIGTERM/SIGINT to any rank, every rank finishes the next step, saves and exits; a second signal
    stops at once. False: a signal ends the job at once, without a checkpoint."""
    eval_interval: int = 100
    """Validation every this many steps (and at the end); 0 disables validation."""
    eval_iters: int = 10
    """Global batches of validation data per evaluation."""
    log_interval: int = 10
    """Write a metrics record every this many steps."""
    log_loss_per_source: bool = False
    """Also log each blend source's token-weighted train loss per interval (no per-step host sync); costs
    a per-token loss, and with fused loss kernels a recompute of the LM head's logits in backward."""
    gc_interval: int = 50
    """Automatic garbage collection is off while training; a young-generation collection runs every
    this many steps (torchtitan's gc_freq, Megatron's --manual-gc). 0 keeps automatic collection."""
    keep_freed_memory: bool = True
    """CPU with glibc: malloc keeps freed activation memory for the next step (faster steps, the peak
    heap stays mapped; see tokenloom.train.host_alloc). Off: malloc's defaults. Ignored with fsdp."""
    save_interval: int | None = 500
    """Checkpoint every this many steps; a checkpoint is always written at the end."""
    keep_last_checkpoints: int = 0
    """Delete older checkpoints beyond this many (0 keeps all)."""
    local_save_interval: int | None = None
    """Also checkpoint every this many steps into local_save_dir (node-local tier, newest two kept);
    a resume takes the newest step every rank holds complete, locally or durably. None: off."""
    local_save_dir: str | None = None
    """Directory of the local tier (with local_save_interval); a checkpoint missing any rank's files is never taken."""
    async_save: bool = True
    """Write checkpoints in a background thread; the loop waits only for the copy to (reused) host
    memory, and a failed write ends the run at the next step. False: the loop waits for the save."""
    output_dir: str = "train-out"
    """Run directory: config.json, metrics.jsonl, loss.png, checkpoints/."""
    checkpoint_dir: str | None = None
    """Where checkpoints go; None means OUTPUT_DIR/checkpoints."""
    resume: str | None = None
    """"auto" (latest complete checkpoint, or start fresh), a checkpoint directory, or None (fresh)."""
    init_from_hf: str | None = None
    """A local transformers GPT-2 or Llama folder to start from (its shape and tokenizer, conflicts refused;
    optimizer fresh at iteration 0); a checkpoint that resume finds wins."""
    force_data: bool = False
    """Resume even if the checkpoint was trained on different data (samples may repeat or be skipped).
    Not needed for a blend's new weights or sources: each source continues after what it served."""
    override_opt_param_scheduler: bool = False
    """Resume with another learning-rate schedule than the checkpoint's, followed from the resume step.
    False: such a resume is refused naming old and new values (Megatron's flag of this name)."""
    force_optimizer: bool = False
    """Resume a checkpoint of another optim.name with fresh optimizer state. False: such a resume is refused."""
    tokenizer: str | None = None
    """Tokenizer path (or "byte"), stored in checkpoints so generate can decode."""
    seed: int = 1234
    """Seed of the python, numpy and torch RNGs (dropout); the init uses model.seed."""
    precision: Literal["auto", "bf16", "fp32"] = "auto"
    """"auto": bf16 autocast on GPUs that support it, fp32 otherwise (always on CPU)."""
    compile: bool | Literal["auto"] = "auto"
    """torch.compile each transformer block (per block, so gradient buckets and pipeline sends still
    overlap; first steps are slow). auto: on for CUDA, off on CPU; true/false force it."""
    fp8: Literal["tensorwise", "rowwise"] | None = None
    """Train the blocks' linears in float8 with torchao ('tokenloom[fp8]'), scaled per tensor or row.
    Needs CUDA compute capability >= 8.9, bf16, the reference ops and tp = 1. None: bf16 matmuls."""
    ddp_bucket_cap_mb: float | None = None
    """Gradient bucket size in MiB of DDP (None: 25 with a 1 MiB first bucket) and of ZeRO-1 (None:
    25), in every layout."""
    distributed_backend: Literal["nccl", "gloo"] | None = None
    """Collective library of a multi-rank run. None: nccl with CUDA, gloo otherwise. gloo with CUDA
    lets ranks share GPUs (debugging a layout; slower, see tokenloom.train.staged_gloo)."""
    dist_timeout_s: float = 600.0
    """Collective timeout: a dead or stalled rank makes the others fail after at most this."""
    hang_timeout_s: float | None = None
    """Seconds without a finished step before a rank's watchdog dumps its stacks and ends it (for torchrun's
    restarts); None: 10 times the slowest iteration, at least 60. Active under ``train --nproc-per-node``
    or when set. See tokenloom.train.faults."""
    metrics_path: str | None = None
    """Metrics JSONL; None means OUTPUT_DIR/metrics.jsonl."""
    tensorboard_dir: str | None = None
    """Also write TensorBoard scalars here ('tokenloom[tensorboard]'; if missing, one line and on)."""
    wandb_project: str | None = None
    """Also log metrics to this W&B project from rank 0 ('tokenloom[wandb]'; if missing, one line and
    on); W&B's own settings (WANDB_MODE, the API key) apply."""
    wandb_exp_name: str | None = None
    """The W&B run's name; None lets W&B choose one."""
    plot: bool = True
    """Write OUTPUT_DIR/loss.png at the end (matplotlib)."""
    progress: bool = True
    """Progress bar on rank 0."""
    peak_flops: float | None = None
    """Peak FLOP/s of one device for MFU; None looks it up (known GPUs only)."""
    tp: int = 1
    """Tensor-parallel size (Megatron's rank order tp-cp-dp-pp)."""
    cp: int = 1
    """Context-parallel size: each rank holds 1/cp of every sequence (load-balanced chunks) and
    attention all-gathers keys and values; seq_len must divide by 2 x cp (x tp with sp)."""
    ep: int = 1
    """Expert-parallel size: ep data-parallel ranks split each MoE layer's experts and exchange tokens
    by all-to-all; divides dp. Composes with tp (sp required), pp and zero1; not with cp or fsdp."""
    pp: int = 1
    """Pipeline-parallel size (1F1B schedule; interleaved with vpp)."""
    vpp: int | None = None
    """Virtual pipeline stages (model chunks) per pipeline rank for the interleaved schedule; None: 1."""
    num_layers_in_first_pipeline_stage: int | None = None
    """Transformer layers on the first pipeline rank (a multiple of vpp), the rest shared evenly. None: even."""
    num_layers_in_last_pipeline_stage: int | None = None
    """Transformer layers on the last pipeline rank (which also runs the LM head and loss). None: even."""
    account_for_embedding_in_pipeline_split: bool = False
    """Count the embedding as one layer when splitting: the first virtual stage holds one layer fewer."""
    account_for_loss_in_pipeline_split: bool = False
    """Count the LM head and loss as one layer when splitting: the last virtual stage holds one layer fewer."""
    sp: bool = False
    """Sequence parallelism (tp > 1): norms and dropout run on a 1/tp slice of the sequence, with
    all-gather + reduce-scatter instead of all-reduce around each tensor-parallel layer pair."""
    zero1: bool = False
    """Shard the AdamW state over data parallel (ZeRO-1; at ep > 1 experts over their expert-dp ranks)."""
    fsdp: bool = False
    """Fully sharded data parallelism (ZeRO-3, torch's fully_shard): parameters, gradients and optimizer
    state (AdamW's moments, Muon's momentum) sharded over dp, each block's parameters gathered around its
    forward and backward. Composes with tp (+ sp) and pp; refuses zero1 and ddp_bucket_cap_mb."""
    overlap_grad_reduce: bool | None = None
    """ZeRO-1: reduce-scatter each gradient bucket during the last micro-batch's backward as soon as
    it is ready; false: all buckets after backward. None: on (DDP always overlaps)."""
    overlap_param_gather: bool | None = None
    """ZeRO-1: the step launches each bucket's parameter all-gather and the next forward waits for it
    just before first use (saves and the end wait for all). false: the step waits. None: on."""

    def __post_init__(self) -> None:
        positive = ("micro_batch_size", "global_batch_size", "train_iters", "log_interval", "eval_iters")
        bad = [f"{k}={getattr(self, k)}" for k in positive if getattr(self, k) < 1]
        if bad:
            raise TokenloomError(f"must be >= 1: {', '.join(bad)}")
        if self.resume is not None and not self.resume:
            raise TokenloomError("resume must be 'auto', a checkpoint path, or None")
        if self.gc_interval < 0:
            raise TokenloomError(f"gc_interval must be >= 0, got {self.gc_interval}")
        if (self.local_save_interval is None) != (self.local_save_dir is None):
            raise TokenloomError("local_save_interval (--local-save-interval) and local_save_dir (--local-save-dir) "
                                 "go together")
        if self.local_save_interval is not None and self.local_save_interval < 1:
            raise TokenloomError(f"local_save_interval must be >= 1, got {self.local_save_interval}")
        if self.hang_timeout_s is not None and self.hang_timeout_s <= 0:
            raise TokenloomError(f"hang_timeout_s (--hang-timeout) must be > 0, got {self.hang_timeout_s}")
        if self.tp < 1 or self.pp < 1 or self.cp < 1:
            raise TokenloomError(f"tp, cp and pp must be >= 1, got tp={self.tp} cp={self.cp} pp={self.pp}")
        if self.ep < 1:
            raise TokenloomError(f"ep must be >= 1, got ep={self.ep}")
        if self.ep > 1:
            if self.model.num_experts is None:
                raise TokenloomError(f"ep={self.ep} splits the experts of mixture-of-experts layers; set "
                                     "model.num_experts (--num-experts) or leave ep at 1")
            if self.model.num_experts % self.ep:
                raise TokenloomError(f"ep={self.ep} must divide model.num_experts={self.model.num_experts}")
            clashes = [f"{k}={getattr(self, k)}" for k, off in (("cp", 1), ("fsdp", False)) if getattr(self, k) != off]
            if clashes:
                raise TokenloomError(f"ep={self.ep} runs with data, tensor (+ sequence) and pipeline parallelism and "
                                     f"zero1 only in this version; {', '.join(clashes)} is not supported with it yet")
        if self.model.num_experts is not None and self.tp > 1 and not self.sp:
            raise TokenloomError(f"model.num_experts={self.model.num_experts} at tp={self.tp} needs sequence "
                                 "parallelism (sp=true, --sequence-parallel), as in Megatron")
        if self.cp > 1:
            step = 2 * self.cp * (self.tp if self.sp else 1)
            if self.model.seq_len % step:
                what = "2 x cp x tp (sequence parallelism splits each rank's part)" if self.sp else "2 x cp"
                raise TokenloomError(f"cp={self.cp}: model.seq_len={self.model.seq_len} must be divisible by "
                                     f"{what} = {step}")
        if self.vpp is not None and (self.vpp < 1 or (self.vpp > 1 and self.pp < 2)):
            raise TokenloomError(f"vpp={self.vpp} needs pp >= 2 (virtual stages split a pipeline); "
                                 "leave vpp unset for pp = 1")
        if self.fp8 not in (None, *FP8_RECIPES):
            raise TokenloomError(f"fp8 must be one of {', '.join(FP8_RECIPES)} (or null), got {self.fp8!r}")
        if self.compile not in (True, False, "auto"):
            raise TokenloomError(f"compile must be true, false or auto, got {self.compile!r}")
        if self.sp and self.tp < 2:
            raise TokenloomError("sp (sequence parallelism) splits tensor-parallel regions and needs tp >= 2")
        if self.optim.name == "muon" and self.zero1 and (self.overlap_grad_reduce is not None
                                                         or self.overlap_param_gather is not None):
            raise TokenloomError("overlap_grad_reduce and overlap_param_gather are ZeRO-1 AdamW's; Muon's zero1 "
                                 "reduces by DDP and broadcasts whole tensors: leave them unset with optim.name muon")

    @property
    def pipeline_split(self) -> PipelineSplit:
        """Which blocks each pipeline rank's chunks hold (:class:`~tokenloom.train.model.pipeline_split.PipelineSplit`)."""
        return PipelineSplit(self.model.n_layers, self.pp, self.vpp or 1, self.num_layers_in_first_pipeline_stage,
                             self.num_layers_in_last_pipeline_stage, self.account_for_embedding_in_pipeline_split,
                             self.account_for_loss_in_pipeline_split)

    @property
    def ckpt_dir(self) -> Path:
        return Path(self.checkpoint_dir or Path(self.output_dir) / "checkpoints")


# --------------------------------------------------------------------------- config files


def config_to_dict(cfg: Any) -> dict:
    """Plain JSON-able dict of a (nested) config dataclass."""
    return json.loads(json.dumps(asdict(cfg)))


def config_from_dict(cls: type, data: dict, where: str = "", source: str = "the config") -> Any:
    """Build dataclass ``cls`` from nested dicts; all unknown keys in one error naming ``source``."""
    unknown = unknown_keys(cls, data, where)
    if unknown:
        raise TokenloomError(f"unknown config key{'s' if len(unknown) > 1 else ''} in {source}: {'; '.join(unknown)}")
    return _build(cls, data, where)


def unknown_keys(cls: type, data: Any, where: str = "") -> list[str]:
    """Every key of ``data`` (nested too) ``cls`` has no field for, with its nearest name or the
    section's known keys; values of the wrong shape are left to :func:`config_from_dict`."""
    if not isinstance(data, dict):
        return []
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    out = []
    for key, value in data.items():
        if key not in names:
            near = difflib.get_close_matches(str(key), names, n=1)
            out.append(f"{where}{key} (did you mean {where}{near[0]}?)" if near else
                       f"{where}{key} (known in {where[:-1] or 'the top level'}: {', '.join(names)})")
        elif (section := _section_class(hints[key])) is not None:
            out += unknown_keys(section, value, f"{where}{key}.")
    return out


def _section_class(hint: Any) -> type | None:
    """The dataclass a field's type names (``X`` or ``X | None``), else None."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        inner = [a for a in typing.get_args(hint) if a is not type(None)]
        hint = inner[0] if len(inner) == 1 else None
    return hint if isinstance(hint, type) and dataclasses.is_dataclass(hint) else None


def _build(cls: type, data: dict, where: str) -> Any:
    if not isinstance(data, dict):
        raise TokenloomError(f"config section {where[:-1] or '(top)'} must be a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = [k for k in data if k not in fields]  # in a list's items (a section's are refused up front)
    missing = [n for n, f in fields.items() if n not in data and f.default is dataclasses.MISSING
               and f.default_factory is dataclasses.MISSING]
    if unknown or missing:
        what = "; ".join([f"unknown key{'s' * (len(unknown) > 1)} {', '.join(map(str, unknown))}"] * bool(unknown)
                         + [f"{', '.join(missing)} missing"] * bool(missing))
        raise TokenloomError(f"config section {where[:-1] or '(top)'}: {what} (its keys: {', '.join(fields)})")
    return cls(**{k: _convert(hints[k], v, f"{where}{k}.") for k, v in data.items()})


def _convert(hint: Any, value: Any, where: str) -> Any:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if value is None:
        return None
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        return _convert(inner[0], value, where) if len(inner) == 1 else value
    if isinstance(hint, type) and dataclasses.is_dataclass(hint) and isinstance(value, dict):
        return _build(hint, value, where)
    if origin in (tuple, list) and isinstance(value, (list, tuple)):
        if origin is list:
            return [_convert(args[0], v, f"{where[:-1]}[{i}].") for i, v in enumerate(value)] if args else list(value)
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
    sources = [str(path)] if path is not None else []
    return config_from_dict(TrainConfig, read_raw(path, overrides),
                            source=" and ".join(sources + ["--set"] * bool(overrides)) or "the config")


SMALL_MODEL = ("model.n_layers=4", "model.d_model=256", "model.n_heads=4", "model.seq_len=256")
"""The model ``train`` builds when no shape is given: GPTConfig's defaults (GPT-2 124M) are far too slow on a CPU."""

SHAPE_KEYS = ("model.n_layers", "model.d_model", "model.n_heads", "model.seq_len", "model.n_kv_heads",
              "model.ffn_hidden_size", "init_from_hf")
"""Any of these in a config, override or flag means the user chose the model's shape."""


def small_model_overrides(path: str | os.PathLike | None, overrides: typing.Sequence[str]) -> list[str]:
    """:data:`SMALL_MODEL` when neither the file nor ``overrides`` gives a :data:`SHAPE_KEYS` key, else
    nothing (for the ``train`` command; :class:`TrainConfig` keeps GPTConfig's defaults)."""
    raw = read_raw(path, overrides)

    def given(key: str) -> bool:
        node: Any = raw
        for part in key.split("."):
            if not isinstance(node, dict) or node.get(part) is None:
                return False
            node = node[part]
        return True

    return [] if any(given(k) for k in SHAPE_KEYS) else list(SMALL_MODEL)


def read_raw(path: str | os.PathLike | None = None, overrides: typing.Sequence[str] = ()) -> dict:
    """The nested dict of a JSON or YAML config file with ``key.sub=value`` overrides applied, unchecked."""
    raw: dict = {}
    if path is not None:
        text = Path(path).read_text()
        if str(path).endswith((".yaml", ".yml")):
            raw = yaml.safe_load(text) or {}
        else:
            raw = json.loads(text)
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep:
            raise TokenloomError(f"override {item!r} must look like key.sub=value")
        node = raw
        *parents, leaf = key.strip().split(".")
        for part in parents:
            if node.get(part) is None:
                node[part] = {}
            node = node[part]
            if not isinstance(node, dict):
                raise TokenloomError(f"override {item!r}: {part} is {node!r}, not a section")
        node[leaf] = yaml.safe_load(value)
    return raw


MODEL_FIELDS_FREE_ON_RESUME = frozenset({"recompute_layers", "dropout", "seed", "init_std", "kernels",
                                         "moe_token_dispatcher_type"})
"""Model settings that may change on resume (they do not change the parameters' meaning)."""


def check_resumable_model(path: str | os.PathLike, cfg: TrainConfig, saved_model: dict) -> None:
    """Refuse, with old and new values, a checkpoint whose ``saved_model`` differs from ``cfg.model``
    in a field that matters; a field it predates had its default (a feature field its arch's) then."""
    defaults = {f.name: f.default for f in dataclasses.fields(cfg.model) if f.default is not dataclasses.MISSING}
    defaults.update(ARCH_FEATURES.get(saved_model.get("arch", "gpt2"), {}))
    defaults["norm_bias"] = saved_model.get("bias", defaults.get("bias"))  # before norm_bias: LayerNorm followed bias
    plain = json.loads(json.dumps(asdict(cfg.model)))
    changed = []
    for k, v in plain.items():
        old = saved_model.get(k, json.loads(json.dumps(defaults.get(k))))
        if k not in MODEL_FIELDS_FREE_ON_RESUME and v != old:
            changed.append(f"model.{k} {json.dumps(old)} -> {json.dumps(v)}")
    if changed:
        raise TokenloomError(f"{path} was trained with a different model ({'; '.join(changed)}); resume with the "
                             "checkpoint's model settings")


SCHEDULE_KEYS = ("train_iters", "optim.lr", "optim.min_lr", "optim.warmup_iters", "optim.lr_decay_iters",
                 "optim.decay_style", "optim.wsd_decay_iters", "optim.wsd_decay_style")
"""Settings that shape each step's learning rate: a resume keeps them unless
``override_opt_param_scheduler``. A key the config has no field for is skipped."""


def check_resumable_optimizer(path: str | os.PathLike, cfg: TrainConfig, saved_config: dict) -> None:
    """Refuse a resume with another ``optim.name`` than the checkpoint's unless ``cfg.force_optimizer``."""
    old = saved_config.get("optim", {}).get("name", "adamw")
    if old != cfg.optim.name and not cfg.force_optimizer:
        raise TokenloomError(f"{path} was trained with optimizer {old}, this run asks for {cfg.optim.name} "
                             f"(--optimizer); resume with --optimizer {old}, or pass --force-optimizer to start the "
                             "optimizer state fresh")


def check_resumable_schedule(path: str | os.PathLike, cfg: TrainConfig, saved_config: dict) -> None:
    """Refuse, naming old and new values, a resume with another :data:`SCHEDULE_KEYS` schedule unless
    ``cfg.override_opt_param_scheduler``; a key the checkpoint predates had its default then."""
    if cfg.override_opt_param_scheduler:
        return
    new, defaults = config_to_dict(cfg), config_to_dict(type(cfg)())
    changed = []
    for key in SCHEDULE_KEYS:
        section, _, name = key.rpartition(".")
        current = new[section] if section else new
        if name not in current:
            continue
        saved = saved_config.get(section, {}) if section else saved_config
        old = saved.get(name, (defaults[section] if section else defaults)[name])
        if old != current[name]:
            changed.append(f"{key} {json.dumps(old)} -> {json.dumps(current[name])}")
    if changed:
        raise TokenloomError(f"{path} was trained with another learning-rate schedule ({'; '.join(changed)}); resume "
                             "with its values, or pass --override-opt_param-scheduler to follow the new schedule "
                             "from the resume step")


@dataclass(frozen=True)
class FieldRow:
    """One field of a config tree as ``config show`` prints it."""

    key: str
    """Dotted path, e.g. ``optim.lr``."""
    value: Any
    """The value in the config shown (JSON-able); None also for the fields of an unset section."""
    default: Any
    """The value a config without this key gets; :data:`REQUIRED` when there is none."""
    doc: str
    """The field's docstring (its ``--help`` text)."""
    unset: bool = False
    """The field is in a section the config leaves unset (its value is None for that reason)."""


REQUIRED = "(required)"
"""The :attr:`FieldRow.default` of a field without a default (a section's required key)."""


def field_rows(cfg: Any, cls: type | None = None, where: str = "") -> list[FieldRow]:
    """Every field of ``cfg`` in declaration order, sections depth first after their own row; an unset
    section's fields too, valued None (``cls`` names the section class then)."""
    cls = cls or type(cfg)
    hints, docs = typing.get_type_hints(cls), field_docs(cls)
    rows = []
    for f in dataclasses.fields(cls):
        value = getattr(cfg, f.name) if cfg is not None else None
        default = (f.default if f.default is not dataclasses.MISSING else
                   f.default_factory() if f.default_factory is not dataclasses.MISSING else REQUIRED)
        section = _section_class(hints[f.name])
        if section is not None:  # the section's own row; its fields follow
            value, default = value and SECTION, default and SECTION
        elif default is not REQUIRED:
            default = json.loads(json.dumps(default))
        rows.append(FieldRow(f"{where}{f.name}", json.loads(json.dumps(value)), default, docs.get(f.name, ""),
                             unset=cfg is None))
        if section is not None:
            rows += field_rows(getattr(cfg, f.name) if cfg is not None else None, section, f"{where}{f.name}.")
    return rows


SECTION = "(section)"
"""The value and default of a section's own row when the section is set."""


def format_rows(rows: typing.Sequence[FieldRow]) -> str:
    """``key = value  (default: D)`` per field, doc indented below; a non-default value is marked ``*``."""
    def show(v: Any) -> str:
        return v if v in (SECTION, REQUIRED) else json.dumps(v)

    out = []
    for r in rows:
        mark = "*" if r.value != r.default and r.default != REQUIRED and not r.unset else " "
        out.append(f"{mark} {r.key} = {show(r.value)}  (default: {show(r.default)})")
        if r.doc:
            out.append(f"      {r.doc}")
    return "\n".join(out)
