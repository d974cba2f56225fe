"""The start-up summary rank 0 prints before the first step, and the warnings for defaults
a user is likely to regret.

It says what a Megatron user checks first: model shape and size, layout, data plan, batch
arithmetic, schedule, evaluation cost and outputs, from the config and the built datasets (no
second pass over the data).
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenloom.train import staged_gloo
from tokenloom.train.config import TrainConfig
from tokenloom.train.kernels import choose_compile, resolve_mode
from tokenloom.train.model.config import ARCH_FEATURES, GPTConfig
from tokenloom.train.model.gpt import GPT
from tokenloom.train.optim.adamw import OptimConfig
from tokenloom.train.optim.muon import split_params
from tokenloom.train.runtime import bf16_over_fp32_speed, cpu_bf16_native


@dataclass(frozen=True)
class RunFacts:
    """What the summary needs beyond the config (known once the run is set up)."""

    world_size: int
    dp: int
    accumulation: int
    device: str
    precision: str
    parameters: int
    train_samples: int
    data_plan: str
    resumed_at: int = 0


def _count(n: float) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.1f}{unit}"
    return str(int(n))


def _uneven(cfg: TrainConfig) -> str:
    """", layers per pipeline rank 3/1" for an uneven split (with vpp: each rank's chunks, 1+1/2+1)."""
    split = cfg.pipeline_split
    if split.is_even:
        return ""
    counts = split.counts()
    per_rank = ["+".join(str(row[r]) for row in counts) for r in range(cfg.pp)]
    return f", layers per pipeline rank {'/'.join(per_rank)}"


def startup_summary(cfg: TrainConfig, facts: RunFacts) -> str:
    """The summary text (several lines, each starting with its topic)."""
    m, o = cfg.model, cfg.optim
    meta = GPT(m, device="meta")
    split = ", ".join(f"{name} {_count(n)}" for name, n in meta.param_split().items())
    if m.num_experts is not None:
        split += f"; {_count(meta.num_active_params())} active per token"
    tokens_per_step = cfg.global_batch_size * m.seq_len
    decay = o.lr_decay_iters or cfg.train_iters
    evals, interval, start = 0, cfg.eval_interval, facts.resumed_at
    if interval and cfg.train_iters > start:  # as loop.due: every interval, at the end, and before step 1
        evals = cfg.train_iters // interval - start // interval
        evals += (cfg.train_iters % interval != 0) + (start == 0)
    lines = [
        f"model     {m.arch}: {m.n_layers} layers x {m.d_model} wide, {m.n_heads} heads ({m.kv_heads} kv), "
        f"vocab {m.vocab_size} (padded {m.padded_vocab_size}), seq {m.seq_len}; "
        f"{_count(facts.parameters)} parameters ({split})",
        f"          {features(m)}",
        f"speed     {choices(cfg, facts.device)}",
        f"layout    {facts.world_size} rank(s) on {facts.device}: dp {facts.dp} x tp {cfg.tp}"
        f"{f' x cp {cfg.cp}' if cfg.cp > 1 else ''} x pp {cfg.pp}"
        f"{f' (vpp {cfg.vpp})' if cfg.vpp else ''}{', sequence parallel' if cfg.sp else ''}"
        f"{f', context parallel: {cfg.model.seq_len // cfg.cp} tokens of each sequence per rank' if cfg.cp > 1 else ''}"
        f"{f', expert parallel: ep {cfg.ep}, {(m.num_experts or 0) // cfg.ep} of {m.num_experts} experts per rank' if cfg.ep > 1 else ''}"
        f"{' (whole on each tp rank)' if cfg.ep > 1 and cfg.tp > 1 else ''}"
        f"{f', tokens by {DISPATCHERS[m.moe_token_dispatcher_type]}' if cfg.ep > 1 else ''}"
        f"{_uneven(cfg)}{', ZeRO-1' if cfg.zero1 else ''}{', FSDP' if cfg.fsdp else ''}; {facts.precision}",
        "data      " + facts.data_plan.replace("\n", "\n          "),
        f"batch     global {cfg.global_batch_size} = micro {cfg.micro_batch_size} x dp {facts.dp} x accumulation "
        f"{facts.accumulation}; {_count(tokens_per_step)} tokens/step, {cfg.train_iters} steps = "
        f"{_count(tokens_per_step * cfg.train_iters)} tokens",
        f"schedule  lr {o.lr:g}, linear warmup {o.warmup_iters} steps, {_decay(o, decay)}; "
        f"weight decay {o.weight_decay:g}, grad clip {o.grad_clip:g}",
        f"optimizer {_optimizer(meta, o)}",
        (f"eval      {cfg.eval_iters} global batches ({cfg.eval_iters * cfg.global_batch_size} samples) "
         f"every {cfg.eval_interval} steps, at the end{' and before the first step' if facts.resumed_at == 0 else ''}"
         f": {evals} evaluations" if cfg.eval_interval else "eval      off (eval_interval 0)"),
        f"outputs   {cfg.output_dir} (config.json, metrics.jsonl{', loss.png' if cfg.plot else ''}); checkpoints in "
        f"{cfg.ckpt_dir} " + (f"every {cfg.save_interval} steps and " if cfg.save_interval else "") + "at the end",
    ]
    if facts.resumed_at:
        lines.append(f"resume    from iteration {facts.resumed_at}")
    return "\n".join(lines + [f"warning: {w}" for w in regrets(cfg, facts)])


def _optimizer(meta: GPT, o: OptimConfig) -> str:
    """Which parameters take which optimizer, with their counts (:func:`~tokenloom.train.optim.muon.split_params`)."""
    if o.name == "adamw":
        return f"AdamW for every parameter (betas {o.beta1:g}, {o.beta2:g}, eps {o.eps:g})"
    matrices, groups = split_params(meta, o.weight_decay)
    names = {id(p): n for n, p in meta.named_parameters()}
    kinds = sorted({names[id(m.param)].rsplit(".", 1)[0].split(".", 2)[-1] for m in matrices})
    adam = [p for g in groups for p in g["params"]]
    adam_kinds = sorted({names[id(p)].split(".")[0] if not names[id(p)].startswith("blocks.") else
                         names[id(p)].split(".", 2)[-1] for p in adam})
    count = sum(len(m.parts or [1]) if not m.experts else m.param.shape[0] for m in matrices)
    return (f"Muon for {len(matrices)} tensors ({count} matrices, {_count(sum(m.param.numel() for m in matrices))} "
            f"parameters: {', '.join(kinds)}; lr {o.muon_lr or o.lr:g}, momentum {o.muon_momentum:g}"
            f"{' nesterov' if o.muon_nesterov else ''}, {o.muon_ns_steps} Newton-Schulz steps in {o.muon_ns_dtype}, "
            f"{o.muon_scale} scaling); AdamW for {len(adam)} tensors ({_count(sum(p.numel() for p in adam))} "
            f"parameters: {', '.join(adam_kinds)})")


def _decay(o: OptimConfig, decay: int) -> str:
    """The schedule after warmup in words (:func:`tokenloom.train.optim.schedule.lr_at`)."""
    if o.decay_style == "constant":
        return "then constant"
    if o.decay_style == "WSD":
        return (f"WSD: constant to step {decay - (o.wsd_decay_iters or 0)}, then {o.wsd_decay_style} to "
                f"{o.min_lr:g} at step {decay}")
    if o.decay_style == "inverse-square-root":
        return f"inverse-square-root (not below {o.min_lr:g}), {o.min_lr:g} from step {decay}"
    return f"{o.decay_style} to {o.min_lr:g} at step {decay}"


DISPATCHERS = {"alltoall": "all-to-all", "allgather": "all-gather"}
"""How the layout line names each ``model.moe_token_dispatcher_type`` (shown at ep > 1 only)."""

STYLES = {"gpt2": "GPT-2", "llama": "Llama"}
"""The name of the model each arch preset's features describe."""


def features(m: GPTConfig) -> str:
    """The model's features in words, led by the preset style they match (whatever ``arch`` says) or ``custom``."""
    style = next((f"{STYLES[name]}-style" for name, preset in ARCH_FEATURES.items()
                  if all(getattr(m, k) == v for k, v in preset.items())), f"custom ({m.arch} preset changed)")
    norm = "RMSNorm" if m.norm == "rmsnorm" else "LayerNorm"
    mlp = f"{'SwiGLU' if m.mlp == 'swiglu' else 'GELU'} MLP {m.ffn_size} wide"
    positions = f"RoPE (base {m.rope_theta:g})" if m.positions == "rope" else "learned positions"
    biases = "biases" if m.use_bias else "no biases"
    if m.norm == "layernorm" and bool(m.norm_bias) != m.use_bias:
        biases = "LayerNorm biases only" if m.norm_bias else "linear biases only"
    if m.num_experts is not None:
        moe_blocks = sum(m.is_moe_layer(i) for i in range(m.n_layers))
        mlp += (f" ({moe_blocks} of {m.n_layers} blocks mixture-of-experts: {m.num_experts} experts {m.moe_ffn_size} "
                f"wide, top-{m.moe_router_topk})")
    return f"{style}: {norm}, {mlp}, {positions}, {biases}, {'tied' if m.tie_embeddings else 'untied'} embeddings"


def choices(cfg: TrainConfig, device_type: str) -> str:
    """The kernel set and block compilation the run chooses on ``device_type``, and why (as the strategy resolves them)."""
    compile_on, why_compile = choose_compile(cfg.compile, device_type, staged_gloo.blocks_compile_with(cfg.tp, cfg.cp,
                                                                                                      cfg.ep))
    mode = cfg.model.kernels
    try:
        chosen, why = resolve_mode(mode, device_type)
    except ValueError as e:  # building the model raises the same; the summary still says it
        chosen, why = mode, str(e)
    why_kernels = f"model.kernels {mode}" + (f": {why}" if why != "forced" else "")
    why_blocks = f"compile {str(cfg.compile).lower()}" + (f": {why_compile}" if why_compile != "set" else "")
    fp8 = f"; fp8 {cfg.fp8} scaling (torchao float8 block linears)" if cfg.fp8 else ""
    return f"kernels {chosen} ({why_kernels}); blocks {'compiled' if compile_on else 'eager'} ({why_blocks}){fp8}"


def regrets(cfg: TrainConfig, facts: RunFacts) -> list[str]:
    """Defaults and settings that are legal but probably not what the user meant."""
    out = []
    if cfg.data.mock is not None:
        out.append("training on synthetic mock data; give --data WEIGHT PREFIX ... (or data.blend) for real data")
    tokens = facts.train_samples * cfg.model.seq_len
    if facts.parameters > tokens:
        out.append(f"the model has {_count(facts.parameters)} parameters but the run trains on {_count(tokens)} "
                   "tokens; a smaller model (model.n_layers / model.d_model) or more steps fit better")
    if cfg.log_loss_per_source and (cfg.data.blend is None or len(cfg.data.blend.prefixes) < 2):
        out.append("log_loss_per_source is ignored: the data has one source, whose loss is train_loss; give a "
                   "blend of two or more sources")
    if facts.device == "cpu" and facts.precision == "bfloat16" and not cpu_bf16_native():
        out.append(f"bf16 is emulated on this CPU (no AVX512-BF16 or AMX): its matmuls ran at "
                   f"{bf16_over_fp32_speed():.2f}x fp32's speed here; --set precision=fp32 (without --bf16) trains "
                   "faster on it")
    if cfg.optim.warmup_iters >= cfg.train_iters:
        out.append(f"warmup ({cfg.optim.warmup_iters} steps) is not shorter than the run ({cfg.train_iters} steps): "
                   "the learning rate never reaches its peak; lower optim.warmup_iters")
    return out


DATA_WAIT_WARN = 0.05
"""Share of the training time spent waiting for data above which the run ends with a warning."""


def data_wait_warning(share: float | None, num_workers: int) -> str | None:
    """The end-of-run warning when the data wait ``share`` exceeds :data:`DATA_WAIT_WARN`, else None."""
    if share is None or share <= DATA_WAIT_WARN:
        return None
    return (f"the steps waited for data {share:.1%} of the training time (data_wait_share in metrics.jsonl); "
            f"more loader processes (data.num_workers, now {num_workers}) or faster storage would help")
