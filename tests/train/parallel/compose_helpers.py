"""Helpers for the tp x pp x dp composition tests (gloo ranks on CPU).

:func:`launch` spawns ``world_size`` ranks (spawn context, ``file://`` init in a temporary
folder, hard deadline), runs the named scenarios in order inside one process group and
returns every rank's results. :func:`reference` is the one-process
:mod:`tokenloom.train.loop` run every layout is compared with (same config, seed, data
and global batch).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import rank_launcher
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from tokenloom.train import loop, staged_gloo
from tokenloom.train.checkpoint import commit as checkpoint
from tokenloom.train.checkpoint import format as ckpt_format
from tokenloom.train.config import TrainConfig
from tokenloom.train.data import DataConfig, MockDataConfig
from tokenloom.train.model.config import GPTConfig
from tokenloom.train.model.gpt import GPT
from tokenloom.train.optim.adamw import OptimConfig
from tokenloom.train.runtime import World, seed_everything

STEPS = 10
"""Steps of every tiny run: warmup (3), clipping, cosine decay, evaluations at 0, STEPS // 2 and STEPS, and
a checkpoint at STEPS // 2 for the resumes: each thing a layout test compares happens inside them. On 2
cores a gloo collective costs about a millisecond of CPU per rank and a tp layout makes four per layer
and micro-batch, so the steps are most of a tp launch's cost (20 steps were twice that)."""

COMPILE_WAIT_S = 300.0
"""The collective timeout test_compose gives its ``compile: true`` runs: a pipeline rank waits on its
peer's first compile of a chunk's blocks (in the compiling process, as the tests' environment sets;
over a minute from a cold cache on a loaded 2-core machine). Other runs wait 60 s; the launch's
deadline bounds a hang."""


def tiny_cfg(out: Path, *, tp: int = 1, pp: int = 1, vpp: int | None = None, zero1: bool = False,
             weight_decay: float = 0.1, dropout: float = 0.0, recompute: bool = False, moe: bool = False,
             dispatcher: str = "alltoall", optim: dict | None = None, **kw: Any) -> TrainConfig:
    """4 layers, d_model 32, seq 16, vocab 64; no biases (see pp_helpers' note on the key
    bias); :data:`STEPS` steps of global batch 8 in micro-batches of 2; clipping (0.5) active in early steps. ``moe``:
    blocks 0 and 2 mixture-of-experts (4 experts 64 wide, top-2, balance and z losses on, tokens
    reaching the experts by ``dispatcher`` at ep > 1). ``optim``: OptimConfig fields over these
    (e.g. ``name="muon"``)."""
    experts = dict(num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=64, moe_layer_freq=2,
                   moe_aux_loss_coeff=0.01, moe_z_loss_coeff=0.001, moe_token_dispatcher_type=dispatcher) if moe else {}
    model = GPTConfig(bias=False, vocab_size=64, make_vocab_size_divisible_by=64, seq_len=16, n_layers=4,
                      n_heads=4, d_model=32, dropout=dropout, recompute_layers=(0, 1, 2, 3) if recompute else (),
                      **experts)
    data = DataConfig(mock=MockDataConfig(num_sequences=400, max_length=40, content="random"))
    # MoE: a lower peak lr, so that no token's top-k sits on a near-tie that rounding could flip
    optim_cfg = OptimConfig(**{**dict(lr=3e-3 if moe else 1e-2, min_lr=1e-3, warmup_iters=3, weight_decay=weight_decay,
                                      grad_clip=0.5), **(optim or {})})
    base = dict(model=model, data=data, optim=optim_cfg, micro_batch_size=2, global_batch_size=8,
                train_iters=STEPS, eval_interval=STEPS // 2, eval_iters=2, log_interval=1, save_interval=None,
                plot=False, progress=False, dist_timeout_s=60.0, output_dir=str(out), tp=tp, pp=pp, vpp=vpp,
                zero1=zero1)
    base.update(kw)
    return TrainConfig(**base)


def read_losses(metrics: Path) -> list[float]:
    return [r["train_loss"] for r in map(json.loads, metrics.read_text().splitlines()) if "train_loss" in r]


def read_norms(metrics: Path) -> list[float]:
    return [r["grad_norm"] for r in map(json.loads, metrics.read_text().splitlines()) if "grad_norm" in r]


def read_moe(metrics: Path) -> list[tuple]:
    """Each train record's mixture-of-experts metrics (balance loss, z-loss, tokens per expert); empty
    for a dense model."""
    return [(r["moe_balance_loss"], r["moe_z_loss"], r["moe_tokens_per_expert"])
            for r in map(json.loads, metrics.read_text().splitlines()) if "moe_balance_loss" in r]


def read_bubbles(metrics: Path) -> list[float | None]:
    """Each train record's measured pipeline bubble (None without a pipeline)."""
    return [r.get("pipeline_bubble") for r in map(json.loads, metrics.read_text().splitlines()) if "train_loss" in r]


def checkpoint_params(path: Path) -> dict[str, torch.Tensor]:
    """Full parameters by one-process name from a checkpoint of any layout."""
    return ckpt_format.read(path)[0]


def reference(out: Path, **kw: Any) -> dict[str, Any]:
    """The one-process run of the loop: per-step losses and grad norms, final parameters.
    On one thread, as the launched ranks run (torch's default, a thread per core, made it
    5x slower on a loaded 2-core box)."""
    cfg = tiny_cfg(out, **kw)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        run = loop.start_run(cfg, World(0, 1, torch.device("cpu"), False))
        summary = run.train()
    finally:
        torch.set_num_threads(threads)
    metrics = Path(out) / "metrics.jsonl"
    return {"losses": read_losses(metrics), "summary": summary, "norms": read_norms(metrics), "moe": read_moe(metrics),
            "params": {n: t.detach().clone() for n, t in run.strategy.chunks[0].state_dict().items()},
            "expert_grads": expert_grads(run.strategy.chunks)}


def expert_grads(chunks: list[GPT]) -> dict[str, tuple[int, torch.Tensor]]:
    """The last step's (clipped) gradients of the experts these chunks hold, by one-process name:
    (the layer's index of the first expert held, the grad of the held experts)."""
    out = {}
    for chunk in chunks:
        for name, p in chunk.named_parameters():
            if ".mlp.experts." in name and p.grad is not None:
                out[name] = (chunk.get_submodule(name.rsplit(".", 1)[0]).first, p.grad.detach().clone())
    return out


# ---------------------------------------------------------------------- scenarios (run on every rank)


def train(rank: int, *, out: str, **kw: Any) -> dict[str, Any]:
    """Train the tiny config in this layout through the one loop (``loop.run``'s
    ``start_run(cfg).train()``); every rank returns its optimizer-state bytes and trainable
    parameter count, rank 0 also the logged losses and grad norms and the final
    checkpoint's full parameters."""
    cfg = tiny_cfg(Path(out), **kw)
    compiled: list[GPT] = []  # the chunks whose blocks compile: true compiled
    compile_blocks = GPT.compile_blocks

    def counted(model: GPT) -> None:
        compiled.append(model)
        compile_blocks(model)

    with mock.patch.object(GPT, "compile_blocks", counted):
        trainer = loop.start_run(cfg)
    summary = trainer.train()
    opt = trainer.strategy.optimizer
    chunks = trainer.strategy.chunks
    sizes = {"state_bytes": trainer.strategy.optimizer_state_bytes(),
             "numel": sum(p.numel() for p in trainer.strategy.params),
             "zero_shard": (opt.shard_size, len(opt.main_shards)) if hasattr(opt, "main_shards") else None,
             "chunks_compiled": (sum(any(c is m for m in compiled) for c in chunks), len(chunks)),
             "expert_grads": expert_grads(chunks)}
    if rank != 0:
        return {"losses": [], "norms": [], "params": {}, "summary": summary, **sizes}
    metrics = Path(out) / "metrics.jsonl"
    return {"losses": read_losses(metrics), "norms": read_norms(metrics), "bubbles": read_bubbles(metrics),
            "moe": read_moe(metrics), "summary": summary, "params": checkpoint_params(Path(summary["checkpoint"])),
            **sizes}


def gathered_state_dict(model) -> dict[str, torch.Tensor]:
    """Collective over the model's tp group: its full tensors under one-process names."""
    out: dict[str, torch.Tensor] = {}
    for name, module in model.named_modules():
        if hasattr(module, "full_state_dict"):  # a tensor-parallel layer
            out.update({f"{name}.{k}": t for k, t in module.full_state_dict().items()})
    for name, t in model.state_dict().items():
        out.setdefault(name, t.detach().clone())
    return out


def forward_tp(rank: int, arch: str = "llama", sp: bool = False, kernels: str = "reference") -> dict[str, Any]:
    """A GPT with biases (llama flavour: RMSNorm, SwiGLU, RoPE, GQA 4 query / 2 kv heads,
    untied) split over the whole world as tp (with sequence parallelism when ``sp``, the
    fused kernels and loss of ``kernels``): initial weights, loss and a norm weight's grad vs
    the one-process model with the reference kernels."""
    from tokenloom.train.parallel.layers import TensorParallel, sync_sequence_parallel_grads

    shape = dict(arch=arch, bias=True, vocab_size=60, make_vocab_size_divisible_by=64, seq_len=16, n_layers=2,
                 n_heads=4, n_kv_heads=2 if arch == "llama" else None, d_model=32, tie_embeddings=arch != "llama")
    model = GPT(GPTConfig(**shape))
    cfg = GPTConfig(**shape, kernels=kernels)
    g = torch.Generator().manual_seed(5)
    x = torch.randint(0, 60, (2, 17), generator=g)
    batch = {"tokens": x[:, :-1], "labels": x[:, 1:], "loss_mask": (x[:, 1:] % 7 != 0).float()}
    ref = model(batch["tokens"], batch["labels"], batch["loss_mask"])
    ref.backward()
    tp = TensorParallel(None if dist.get_world_size() == 1 else dist.group.WORLD, sequence_parallel=sp)
    stage = GPT(cfg, tp=tp)
    full = gathered_state_dict(stage)  # the initial weights, built shard by shard
    loss = stage(batch["tokens"], batch["labels"], batch["loss_mask"])
    loss.backward()
    sync_sequence_parallel_grads(stage, tp.group)
    return {
        "loss_delta": abs(loss.item() - ref.item()),
        "param_delta": max((full[n] - t).abs().max().item() for n, t in model.state_dict().items()),
        "same_names": sorted(full) == sorted(model.state_dict()),
        "norm_grad_delta": (stage.blocks["1"].norm2.weight.grad - model.blocks["1"].norm2.weight.grad).abs().max().item(),
    }


def train_on_meta(rank: int, **kw: Any) -> dict[str, Any]:
    """:func:`train` with the process default device set to ``meta``: any tensor the run
    makes without naming its device is a meta tensor, and the run fails (no data, no
    ``.item()``) or its losses differ from the one-process run's. The final parameters are read
    back once the default device is the host again."""
    torch.set_default_device("meta")
    try:
        result = train(rank, **kw)
    finally:
        torch.set_default_device(None)
    if result["params"]:
        result["params"] = checkpoint_params(Path(result["summary"]["checkpoint"]))
    return result



def on_meta(scenario: str, kw: dict[str, Any]) -> str:
    """``train_on_meta`` for a ``train`` scenario that does not resume, else ``scenario``: resuming
    reads checkpoints with host tensors made without a device, so a resume trains on the host."""
    return "train_on_meta" if scenario == "train" and "resume" not in kw else scenario


class _DropoutMasks(TorchDispatchMode):
    """Records every dropout mask (``aten.bernoulli_`` output) drawn while active."""

    def __init__(self) -> None:
        super().__init__()
        self.masks: list[torch.Tensor] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.bernoulli_.float:
            self.masks.append(out.detach().clone())
        return out


def dropout_masks(rank: int, *, out: str, sp: bool = False) -> list[list[torch.Tensor]]:
    """The dropout masks of one training forward of the tiny GPT at tp = world size, with
    dropout 0.5 and the trainer's seeding (:class:`~tokenloom.train.strategy.Strategy`),
    twice: each time from a freshly built strategy (a rerun)."""
    from tokenloom.train.strategy import Strategy

    runs = []
    for _ in range(2):
        cfg = tiny_cfg(Path(out), tp=dist.get_world_size(), sp=sp, dropout=0.5)
        seed_everything(cfg.seed)
        strategy = Strategy(cfg, World(rank, dist.get_world_size(), torch.device("cpu"), False))
        tokens = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(3))
        with _DropoutMasks() as rec:
            strategy.chunks[0](tokens[:, :-1], tokens[:, 1:])
        runs.append(rec.masks)
    return runs


class _BackwardMark(torch.autograd.Function):
    """Identity whose backward, the first node of a chunk's backward, appends its tag to a log."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, tag: tuple, log: list) -> torch.Tensor:
        ctx.tag, ctx.log = tag, log
        return y.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ctx.log.append(("backward", *ctx.tag))
        return grad, None, None


def dp_reduction_timeline(rank: int, *, out: str, steps: int = 2, **kw: Any) -> dict[str, Any]:
    """Train steps of the tiny config through :meth:`Strategy.train_step` (global batch 16:
    4 micro-batches per dp rank) with every asynchronous all-reduce (a DDP bucket launch)
    and reduce-scatter (a ZeRO-1 bucket launch) logged between the backwards it falls in: each chunk's output is wrapped so its
    backward logs ``("backward", chunk, micro-batch)`` when it starts, and each launch logs
    ``("launch", grad mode on, bytes)`` (autograd runs backward with grad mode off; the
    schedule and the loop around it run with it on), and each wait for a launch ``("wait",)``.
    Returns per step and chunk the launches after each micro-batch's backward began (before
    the next backward), the launches that came after no backward or after the step, per
    step the waits and those before the step's last backward, each chunk's DDP bucket sizes (ZeRO-1: its
    number of buckets) and whether every
    grad is a bucket view of the parameter's dtype (fp32 also under bf16), and the last
    step's order of backwards."""
    from tokenloom.train.strategy import Strategy

    cfg = tiny_cfg(Path(out), global_batch_size=16, **kw)
    seed_everything(cfg.seed)
    strategy = Strategy(cfg, World(rank, dist.get_world_size(), torch.device("cpu"), False))
    log: list[tuple] = []
    forwards = [0] * len(strategy.chunks)

    def marked(c: int, forward):
        def run(*args, **kwargs):
            y = forward(*args, **kwargs)
            k, forwards[c] = forwards[c] % strategy.num_micro, forwards[c] + 1
            return _BackwardMark.apply(y, (c, k), log)
        return run

    for c, chunk in enumerate(strategy.chunks):
        chunk.forward = marked(c, chunk.forward)
    all_reduce = dist.all_reduce

    class LoggedWork:
        def __init__(self, work) -> None:
            self.work = work

        def wait(self, *args):
            log.append(("wait",))
            return self.work.wait(*args)

    def logged_all_reduce(tensor, *args, async_op: bool = False, **kwargs):
        if not async_op:
            return all_reduce(tensor, *args, **kwargs)
        log.append(("launch", torch.is_grad_enabled(), tensor.numel() * tensor.element_size()))
        return LoggedWork(all_reduce(tensor, *args, async_op=True, **kwargs))

    reduce_scatter = dist.reduce_scatter_single  # ZeRO-1's bucket launches

    def logged_reduce_scatter(output, tensor, *args, async_op: bool = False, **kwargs):
        if not async_op:
            return reduce_scatter(output, tensor, *args, **kwargs)
        log.append(("launch", torch.is_grad_enabled(), tensor.numel() * tensor.element_size()))
        return LoggedWork(reduce_scatter(output, tensor, *args, async_op=True, **kwargs))

    g = torch.Generator().manual_seed(rank)
    per_step, waits, stray = [], [], 0
    dist.all_reduce, dist.reduce_scatter_single = logged_all_reduce, logged_reduce_scatter
    try:
        for _ in range(steps):
            x = torch.randint(0, 64, (strategy.num_micro, 2, 17), generator=g)
            batches = [{"tokens": t[:, :-1], "labels": t[:, 1:], "loss_mask": torch.ones(2, 16)} for t in x]
            log.clear()
            strategy.train_step(batches)
            launches = {c: [[] for _ in range(strategy.num_micro)] for c in range(len(strategy.chunks))}
            current = None
            for event in log:
                if event[0] == "backward":
                    current = launches[event[1]][event[2]]
                elif event[0] == "wait":
                    continue
                elif current is None or event[1]:
                    stray += 1
                else:
                    current.append(event[2])
            per_step.append(launches)
            kinds = [e[0] for e in log]
            last_backward = max(i for i, kind in enumerate(kinds) if kind == "backward")
            waits.append((kinds.count("wait"), kinds[:last_backward].count("wait")))
        order = [(e[1], e[2]) for e in log if e[0] == "backward"]
    finally:
        dist.all_reduce, dist.reduce_scatter_single = all_reduce, reduce_scatter
    return {"launches": per_step, "stray_launches": stray, "backward_order": order, "waits": waits,
            "zero_buckets": len(strategy.optimizer.main_shards) if cfg.zero1 else None,
            "bucket_bytes": {c: ddp.bucket_sizes_bytes for c, ddp in enumerate(strategy.ddps)},
            "chunk_numel": {c: sum(p.numel() for p in chunk.parameters()) for c, chunk in enumerate(strategy.chunks)},
            "fp32_bucket_views": all(
                p.grad.dtype == torch.float32 and p.grad._base is not None for p in strategy.params)}


def legacy_save(rank: int, *, out: str, legacy: str, **kw: Any) -> dict[str, str]:
    """Train the tiny config in this layout to its exit (``exit_interval``: its checkpoint in
    today's format), then write the same state in the earlier per-(tp, pp) shard format under
    ``legacy`` (``tests/train/checkpoint/legacy_ckpt.py``). Returns both checkpoints' directories."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "checkpoint"))
    import legacy_ckpt  # lazy: tests/train/checkpoint, its folder, is put on the path just above

    trainer = loop.start_run(tiny_cfg(Path(out), **kw))
    summary = trainer.train()
    trainer.strategy.saver.wait()
    path = Path(summary["checkpoint"])
    state = checkpoint.read_state(path)
    old = legacy_ckpt.save_shards(trainer.strategy, Path(legacy), state["iteration"], state)
    return {"new": str(path), "old": str(old)}


def legacy_load(rank: int, *, out: str, old: str, new: str, **kw: Any) -> dict[str, Any]:
    """Start a run of this layout from the earlier-format checkpoint ``old`` and compare what this
    rank holds, parameters and AdamW states by one-process name, with the same state read from
    ``new`` (today's format): the largest absolute difference, the names held and the number of
    optimizer states compared."""
    s = loop.start_run(tiny_cfg(Path(out), resume=old, **kw)).strategy
    named = {n: p for chunk in s.chunks for n, p in chunk.named_parameters(remove_duplicate=False)}
    params, optim = ckpt_format.read(Path(new), set(named))
    diff, states = 0.0, 0
    for n, p in named.items():
        diff = max(diff, (p.detach() - params[n]).abs().max().item())
        for k, v in s.optimizer.state[p].items():
            diff = max(diff, (v - optim[n][k]).abs().max().item())
            states += 1
    return {"diff": diff, "names": sorted(named), "states": states}


SCENARIOS = {"train": train, "forward_tp": forward_tp, "train_on_meta": train_on_meta,
             "dropout_masks": dropout_masks, "dp_reduction_timeline": dp_reduction_timeline,
             "legacy_save": legacy_save, "legacy_load": legacy_load}


def merged_params(results: list[dict]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for r in results:
        out.update(r["params"])
    return out


def deltas(results: list[dict], ref: dict[str, Any], first: int = 0) -> tuple[int, float, float]:
    """(steps logged, max loss difference, max final-parameter difference) of a layout's
    results against the one-process ``ref`` (:func:`reference`), from its step ``first`` on."""
    losses = logged_losses(results)
    params = merged_params(results)
    assert sorted(params) == sorted(ref["params"])
    dl = max(abs(a - b) for a, b in zip(losses, ref["losses"][first:], strict=True))
    dp = max((params[n] - t).abs().max().item() for n, t in ref["params"].items())
    return len(losses), dl, dp


def assert_matches_one_process(results: list[dict], ref: dict[str, Any], steps: int, tol: float) -> None:
    """A layout's run equals the one-process ``ref`` within ``tol``: every step's loss, the final
    parameters, the final validation loss and every grad norm (relative), with clipping active."""
    n, dl, dp = deltas(results, ref)
    print(f"max loss delta {dl:.2e}, max param delta {dp:.2e}")
    assert n == steps
    assert dl < tol and dp < tol
    summary = results[0]["summary"]
    assert summary["iteration"] == steps
    assert abs(summary["val_loss"] - ref["summary"]["val_loss"]) < tol
    norms = results[0]["norms"]
    assert max(abs(a - b) / b for a, b in zip(norms, ref["norms"], strict=True)) < tol
    assert max(ref["norms"]) > 0.5  # clipping (grad_clip 0.5) was active


PARAM_TOL = 1e-4
"""Final parameters' tolerance where a run's losses and grad norms are held to 1e-5: AdamW divides each
update by its second moment's root, so an element whose gradient is near zero moves by up to lr per step
on a summation-order difference (one element of 4,096 at 1.07e-5 after 20 steps of cp 2 with documents
masked on an Intel Xeon, where an AMD EPYC stayed under 1e-5)."""


def assert_losses_norms_params_match(results: list[dict], ref: dict[str, Any], steps: int, tol: float,
                                     param_tol: float | None = None) -> None:
    """A layout's run equals the one-process ``ref`` within ``tol`` (absolute): every step's loss, the
    grad norms of the first rank that logged them, and the merged final parameters within ``param_tol``
    (default ``tol``; the checks of :func:`assert_matches_one_process` without validation and the
    clipping premise)."""
    losses = logged_losses(results)
    assert len(losses) == steps
    assert max(abs(a - b) for a, b in zip(losses, ref["losses"], strict=True)) < tol, (losses, ref["losses"])
    norms = next(r["norms"] for r in results if r["norms"])
    assert max(abs(a - b) for a, b in zip(norms, ref["norms"], strict=True)) < tol
    params = merged_params(results)
    worst = max(ref["params"], key=lambda k: (params[k] - ref["params"][k]).abs().max().item())
    delta = params[worst] - ref["params"][worst]
    over = int((delta.abs() >= tol).sum())
    assert delta.abs().max().item() < (param_tol or tol), (worst, delta.abs().max().item(), over, delta.numel())


def logged_losses(results: list[dict]) -> list[float]:
    """Losses of a last-stage rank (every last-stage rank holds the dp mean)."""
    return next(r["losses"] for r in results if r["losses"])


# ---------------------------------------------------------------------- launching


LAUNCH_START_S = 90.0
"""Every launch's deadline also holds this for the ranks' start (spawn, torch's import, the process group)."""
SCENARIO_BUDGET_S = 90.0
"""A launch's hang deadline is this per scenario it runs: a scenario (a few steps of a tiny model,
compile's first graphs the slowest) takes a few seconds on the developers' machine, 4 ranks
oversubscribing 2 cores, and up to 20 s in the whole suite on a machine without AVX-512 (about
3x slower), where the budget still leaves three times the need: a launch that passes its
deadline hung rather than ran slow. A module
whose scenarios are heavier (MoE: steps of routed experts) passes its own ``per_scenario_s``."""
REFERENCE_BUDGET_S = 60.0
"""A one-process reference run's share of a module's timeout (a few seconds here)."""
MIN_TIMEOUT_S = 600.0
"""No launching module's timeout is below the suite's default (pyproject's ``timeout``)."""


def launch(scenarios: list[tuple[str, dict]], world_size: int, tmp_path: Path, deadline_s: float | None = None,
           per_scenario_s: float = SCENARIO_BUDGET_S, staged: bool = False):
    """Run ``scenarios`` (name, kwargs) of this module on ``world_size`` ranks; per-rank result lists.
    The hang deadline is sized by the work: the ranks' start plus ``per_scenario_s`` per scenario unless given.
    ``staged``: over :class:`~tokenloom.train.staged_gloo.StagedGloo` staging every call."""
    return rank_launcher.launch(__name__, scenarios, world_size, tmp_path,
                                deadline_s=deadline_s or LAUNCH_START_S + per_scenario_s * len(scenarios), collective_timeout_s=60,
                                staged=staged)


def launches_timeout(scenarios: int, references: int = 1, per_scenario_s: float = SCENARIO_BUDGET_S
                     ) -> pytest.MarkDecorator:
    """The timeout of a module's tests whose module fixtures launch ``scenarios`` scenarios in all and
    run ``references`` one-process references: the first test's setup runs all of them, so its timeout
    covers the sum of their budgets (counting a start per scenario, an upper bound on the launches'
    starts: the timeouts catch hangs, the work sizes them), at least :data:`MIN_TIMEOUT_S`."""
    return pytest.mark.timeout(max(MIN_TIMEOUT_S, REFERENCE_BUDGET_S * references
                                   + (LAUNCH_START_S + per_scenario_s) * scenarios))




def activation_bytes(rank: int, *, out: str, **kw: Any) -> dict[str, Any]:
    """Bytes of the tensors one training step saves for backward on this rank (activation
    memory: parameters left out, each storage counted once), on one micro-batch of random
    tokens (``global_batch_size`` = ``micro_batch_size`` x dp)."""
    cfg = tiny_cfg(Path(out), **kw)
    strategy = loop.start_run(cfg).strategy
    params = {p.untyped_storage().data_ptr() for p in strategy.params}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            saved[ptr] = t.untyped_storage().nbytes()
        return t

    seq, micro = cfg.model.seq_len, cfg.micro_batch_size
    tokens = torch.randint(cfg.model.vocab_size, (micro, seq + 1), generator=torch.Generator().manual_seed(0))
    batch = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "loss_mask": torch.ones(micro, seq)}
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        strategy.train_step([batch] * strategy.num_micro)
    return {"bytes": sum(saved.values())}


SCENARIOS["activation_bytes"] = activation_bytes


def staged_calls(rank: int) -> dict[str, int]:
    """This rank's staged calls so far by kind (:data:`tokenloom.train.staged_gloo.STAGED`)."""
    return dict(staged_gloo.STAGED)


SCENARIOS["staged_calls"] = staged_calls
