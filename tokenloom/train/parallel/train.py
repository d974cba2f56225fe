"""Training with tensor, pipeline and data parallelism together: :func:`run_parallel`.

:func:`tokenloom.train.loop.run` dispatches here when ``tp > 1``, ``pp > 1`` or ``zero1``.
One iteration on every rank (Megatron's ``train_step``)::

    lr = lr_at(it)                               same schedule as loop.py (optim.py)
    forward_backward(schedule, chunks, M)        no_pipelining / 1f1b / interleaved;
                                                 M = global / (micro x dp) micro-batches,
                                                 each loss / M (Megatron's scaling)
    allreduce_tied_embedding_grads               over the embedding group (pp > 1)
    dp reduction                                 one flat all-reduce of all grads / dp
                                                 (or ZeRO-1's reduce-scatter in step())
    global grad norm                             sum of squares counted once per unique
                                                 parameter (shards on every tp rank,
                                                 replicated tensors on tp rank 0, tied
                                                 duplicate never), all-reduced over tp x pp
    clip (torch's rule), AdamW step              optim.py's param groups (decay only on
                                                 non-embedding matrices)

Data: every rank of a data-parallel replica reads the same micro-batches with the
loader of :mod:`tokenloom.train.data` (dp rank and size from the :class:`ParallelState`),
so the global sample order equals the one-process run's; only the first and last
pipeline stages keep them (tokens for the first, labels and loss mask for the last;
middle stages get ``None``). Megatron broadcasts the batch from tp rank 0 instead of
reading it tp times: cheaper on disk, one more collective.

With fp32 on CPU the losses and final parameters equal the one-process
:func:`tokenloom.train.loop.run` of the same config within ~1e-5 (tested for eight
layouts, ``tests/train/parallel/test_compose.py``).

Choices and their costs:

* **No overlap**: the dp all-reduce runs after the last backward as one flat buffer
  (Megatron overlaps bucketed reductions with backward); simple and exact, slower at
  scale.
* **ZeRO-1** uses :class:`~tokenloom.train.parallel.zero.ZeroAdamW` with the same two
  groups as optim.py (no decay for biases, norms and embedding tables), so it matches
  the one-process run like every other layout.
* **Evaluation** uses the forward-only schedule on the same first ``eval_iters``
  validation batches as loop.py.
* **Autocast** (bf16 on GPUs) wraps the whole schedule; p2p activations stay fp32 (the
  residual stream is fp32 under autocast).
* Checkpoints are per rank with the layout recorded and can be loaded into another
  layout (:mod:`tokenloom.train.parallel.reshard`).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tokenloom.errors import TokenloomError
from tokenloom.train import data as train_data
from tokenloom.train.metrics import MetricsLogger, StepTimer
from tokenloom.train.model import GPT
from tokenloom.train.optim import lr_at, set_lr, use_fused
from tokenloom.train.parallel.gpt import build_tp_gpt_stage, counts_in_grad_norm, tp_gpt_loss
from tokenloom.train.parallel.p2p import P2PComm
from tokenloom.train.parallel.schedules import allreduce_tied_embedding_grads, forward_backward, get_schedule
from tokenloom.train.parallel.state import ParallelState
from tokenloom.train.parallel.zero import ZeroAdamW


def parallel_param_groups(stages: list[nn.Module], weight_decay: float) -> list[dict]:
    """optim.py's two groups for tp/pp stages: decay matrices that are not embedding tables
    (``is_embedding``: token / position tables and a tied LM head)."""
    decay, no_decay, seen = [], [], set()
    for stage in stages:
        for p in stage.parameters():
            if not p.requires_grad or id(p) in seen:
                continue
            seen.add(id(p))
            (decay if p.dim() >= 2 and not getattr(p, "is_embedding", False) else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


class ParallelRun:
    """One tp x pp x dp run; build it on every rank (collective), then :meth:`train`."""

    def __init__(self, cfg, world=None) -> None:
        from tokenloom.train import loop

        self.cfg = cfg
        self.world = world or loop._join_world(cfg)
        loop.tune_host_memory(cfg, self.world.device)
        if not dist.is_initialized():
            raise TokenloomError("tp/pp/zero1 training needs torch.distributed (launch with torchrun)")
        from datetime import timedelta

        self.state = st = ParallelState.create(cfg.tp, cfg.pp, cfg.vpp, timeout=timedelta(seconds=cfg.dist_timeout_s))
        self.chunks = cfg.vpp or 1
        dp = st.dp_size
        if cfg.global_batch_size % (cfg.micro_batch_size * dp):
            raise TokenloomError(f"global_batch_size={cfg.global_batch_size} is not a multiple of "
                                 f"micro_batch_size x dp = {cfg.micro_batch_size} x {dp}")
        self.num_micro = cfg.global_batch_size // (cfg.micro_batch_size * dp)
        self.schedule = get_schedule(cfg.pp, self.chunks)
        loop._seed_everything(cfg.seed)
        gbs, evals = cfg.global_batch_size, cfg.eval_iters
        sizes = (cfg.train_iters * gbs, evals * gbs if cfg.eval_interval else 0, evals * gbs)
        tok_eod = None
        if cfg.tokenizer:
            tok = loop.open_tokenizer(cfg.tokenizer)
            if tok.vocab_size > cfg.model.vocab_size:
                raise TokenloomError(f"the tokenizer has {tok.vocab_size} ids but model.vocab_size is "
                                     f"{cfg.model.vocab_size}; set model.vocab_size >= {tok.vocab_size}")
            tok_eod = tok.eod
        self.data = train_data.build(cfg.data, seq_len=cfg.model.seq_len, vocab_size=cfg.model.vocab_size,
                                     sizes=sizes, tokenizer_eod=tok_eod)
        full = GPT(cfg.model)
        self.stages = [
            build_tp_gpt_stage(full, st.tp_group, cfg.pp, st.pp_rank, self.chunks, c).to(self.world.device)
            for c in range(self.chunks)
        ]
        del full
        self.params = list({id(p): p for s in self.stages for p in s.parameters() if p.requires_grad}.values())
        o = cfg.optim
        groups = parallel_param_groups(self.stages, o.weight_decay)
        if cfg.zero1:
            if st.tp_rank > 0:  # replicated tensors: counted in the norm on tp rank 0 only
                for p in self.params:
                    if not getattr(p, "tensor_model_parallel", False):
                        p.shared = True
            # one group per parameter keeps the flat buffer in self.params order (the layout
            # ZeRO-1 checkpoints are saved in) while each parameter keeps its group's decay
            decay = {id(p): g["weight_decay"] for g in groups for p in g["params"]}
            self.optimizer: Any = ZeroAdamW(
                [{"params": [p], "weight_decay": decay[id(p)]} for p in self.params], st.dp_group, lr=o.lr,
                betas=(o.beta1, o.beta2), eps=o.eps, max_grad_norm=o.grad_clip or None,
                norm_group=st.model_parallel_group if cfg.tp * cfg.pp > 1 else None,
            )
        else:
            self.optimizer = torch.optim.AdamW(groups, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps,
                                               fused=use_fused(o, [p for g in groups for p in g["params"]]))
        self.comm = None
        if cfg.pp > 1:
            shape = (cfg.micro_batch_size, cfg.model.seq_len, cfg.model.d_model)
            self.comm = P2PComm.from_group(st.pp_group, shape, torch.float32)
        self.autocast = loop._autocast(cfg, self.world.device)
        self.iteration, self.consumed = 0, 0
        self.losses: list[float] = []
        self.norms: list[float] = []
        self.logger_rank = st.layout.rank_of(0, 0, cfg.pp - 1)
        self.resumed_from = None
        if cfg.resume is not None:
            from tokenloom.train.parallel import reshard

            self.resumed_from = reshard.resume(self)

    # ------------------------------------------------------------------ pieces

    @property
    def has_data(self) -> bool:
        return self.state.is_first_stage(ignore_virtual=True) or self.state.is_last_stage(ignore_virtual=True)

    def _loader(self, dataset, consumed: int, total: int):
        cfg = self.cfg
        return train_data.loader(
            dataset, eod=self.data.eod, eod_mask_loss=cfg.data.eod_mask_loss, consumed_samples=consumed,
            micro_batch_size=cfg.micro_batch_size, dp_rank=self.state.dp_rank, dp_size=self.state.dp_size,
            total_samples=total,
        )

    def _global_batches(self, dataset, consumed: int, total: int):
        it = iter(self._loader(dataset, consumed, total)) if self.has_data else None
        while True:
            if it is None:
                yield [None] * self.num_micro
                continue
            yield [train_data.to_device(next(it), self.world.device) for _ in range(self.num_micro)]

    def _loss_fn(self, logits: torch.Tensor, batch: Any) -> torch.Tensor:
        return tp_gpt_loss(logits, batch, self.state.tp_group)

    def _run_schedule(self, batches: list, forward_only: bool = False):
        model = self.stages if self.chunks > 1 else self.stages[0]
        with self.autocast():
            return forward_backward(self.schedule, model, iter(batches), self.num_micro, self._loss_fn,
                                    comm=self.comm, forward_only=forward_only)

    def _dp_mean(self, value: float) -> float:
        t = torch.tensor([value], dtype=torch.float64)
        if self.state.dp_size > 1:
            dist.all_reduce(t, group=self.state.dp_group)
        return float(t) / self.state.dp_size

    def _sync_and_clip(self) -> float:
        """Tied-embedding and dp reductions, global norm, clipping (non-ZeRO path)."""
        st = self.state
        allreduce_tied_embedding_grads(self.stages, st.embedding_group if self.cfg.pp > 1 else None)
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        grads = [p.grad for p in self.params]
        if st.dp_size > 1:
            flat = torch.cat([g.reshape(-1) for g in grads]).div_(st.dp_size)
            dist.all_reduce(flat, group=st.dp_group)
            for g, new in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
                g.copy_(new.view_as(g))
        sq = torch.zeros((), dtype=torch.float64)
        for p in self.params:
            if counts_in_grad_norm(p, st.tp_rank):
                sq += p.grad.double().square().sum()
        if self.cfg.tp * self.cfg.pp > 1:
            dist.all_reduce(sq, group=st.model_parallel_group)
        norm = float(sq.sqrt())
        clip = self.cfg.optim.grad_clip
        coef = min(1.0, (clip if clip > 0 else math.inf) / (norm + 1e-6))
        torch._foreach_mul_(grads, coef)
        return norm

    def train_step(self, batches: list) -> tuple[float | None, float]:
        """One optimizer step; returns (dp-mean loss on last-stage ranks else None, grad norm)."""
        self.optimizer.zero_grad()
        res = self._run_schedule(batches)
        self.last_stats = res.stats
        if self.cfg.zero1:
            allreduce_tied_embedding_grads(self.stages, self.state.embedding_group if self.cfg.pp > 1 else None)
            norm = self.optimizer.step()
            norm = float("nan") if norm is None else norm
        else:
            norm = self._sync_and_clip()
            self.optimizer.step()
        loss = None
        if self.state.is_last_stage(ignore_virtual=True):
            loss = self._dp_mean(float(sum(x.item() for x in res.losses)) / self.num_micro)
        return loss, norm

    @torch.no_grad()
    def evaluate(self) -> float | None:
        """Mean validation loss over the first ``eval_iters`` global batches (last stage)."""
        cfg = self.cfg
        for s in self.stages:
            s.eval()
        gen = self._global_batches(self.data.valid, 0, cfg.eval_iters * cfg.global_batch_size)
        total = 0.0
        for _ in range(cfg.eval_iters):
            res = self._run_schedule(next(gen), forward_only=True)
            total += float(sum(x.item() for x in res.losses)) / self.num_micro
        for s in self.stages:
            s.train()
        if not self.state.is_last_stage(ignore_virtual=True):
            return None
        return self._dp_mean(total / cfg.eval_iters)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Collective over tp: this rank's stages' full tensors by one-process names."""
        out: dict[str, torch.Tensor] = {}
        for s in self.stages:
            out.update(s.full_state_dict())
        return out

    def _broadcast_float(self, value: float | None) -> float | None:
        t = torch.tensor([math.nan if value is None else value], dtype=torch.float64)
        dist.broadcast(t, src=self.logger_rank)
        return None if math.isnan(float(t)) else float(t)

    # ------------------------------------------------------------------ the loop

    def train(self) -> dict:
        from tokenloom.train.loop import ManualGC  # loop.py imports this module lazily, and so here

        with ManualGC(self.cfg.gc_interval) as manual_gc:
            return self._train(manual_gc)

    def _train(self, manual_gc) -> dict:
        from tokenloom.train.loop import config_to_dict, due

        cfg, st = self.cfg, self.state
        metrics = None
        if st.rank == self.logger_rank:
            Path(cfg.output_dir).mkdir(parents=True, exist_ok=True)
            (Path(cfg.output_dir) / "config.json").write_text(json.dumps(config_to_dict(cfg), indent=2))
            path = Path(cfg.metrics_path or Path(cfg.output_dir) / "metrics.jsonl")
            metrics = MetricsLogger(path, tensorboard_dir=cfg.tensorboard_dir,
                                    resume_iteration=self.iteration if self.resumed_from else None)
        total = cfg.train_iters * cfg.global_batch_size
        batches = self._global_batches(self.data.train, self.consumed, total)
        last: dict[str, Any] = {"train_loss": None, "val_loss": None}
        exited = False
        if self.iteration == 0 and cfg.eval_interval and self.data.valid is not None:
            start = self._broadcast_float(self.evaluate())  # the curve's starting point, as loop.py
            if metrics:
                metrics.log({"iter": 0, "val_loss": start})
        loss_sum, since = 0.0, 0
        timer = StepTimer(cfg.global_batch_size * cfg.model.seq_len, self.world.device)
        timer.start()
        while self.iteration < cfg.train_iters:
            lr = lr_at(self.iteration, cfg.optim, cfg.train_iters)
            set_lr(self.optimizer, lr)
            loss, norm = self.train_step(next(batches))
            self.iteration += 1
            self.consumed += cfg.global_batch_size
            if loss is not None:
                self.losses.append(loss)
                loss_sum += loss
            self.norms.append(norm)
            since += 1
            timer.step()
            done = self.iteration == cfg.train_iters
            if self.iteration % cfg.log_interval == 0 or done:
                mean = self._broadcast_float(loss_sum / since if loss is not None else None)
                if mean is None or not math.isfinite(mean):
                    raise TokenloomError(f"training loss is {mean} at iteration {self.iteration}; lower optim.lr")
                timing = timer.interval()
                if metrics:
                    metrics.log({"iter": self.iteration, "train_loss": mean, "lr": lr, "grad_norm": norm, **timing,
                                 "consumed_samples": self.consumed})
                last["train_loss"] = mean
                loss_sum, since = 0.0, 0
            manual_gc.step(self.iteration)
            evaluating, exited, saving = due(cfg, self.iteration, done, self.data.valid is not None)
            if evaluating or saving:
                with timer.paused():
                    if evaluating:
                        last["val_loss"] = self._broadcast_float(self.evaluate())
                        if metrics:
                            metrics.log({"iter": self.iteration, "val_loss": last["val_loss"]})
                    if saving:
                        from tokenloom.train.parallel import reshard

                        last["checkpoint"] = str(reshard.save(self))
            if exited:
                break
        if metrics:
            metrics.close()
        if "checkpoint" not in last and self.resumed_from is not None:
            last["checkpoint"] = str(self.resumed_from)
        return {"iteration": self.iteration, "exited": exited, **last, **timer.summary()}


def run_parallel(cfg) -> dict:
    """Train ``cfg`` (a :class:`tokenloom.train.loop.TrainConfig`) with its ``tp``/``pp``/``vpp``/
    ``zero1`` layout; returns loop.run's summary dict."""
    run = ParallelRun(cfg)
    summary = run.train()
    if run.world.owns_group:
        dist.destroy_process_group()
    return summary
