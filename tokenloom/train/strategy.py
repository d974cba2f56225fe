"""What differs per parallel layout, behind one small object the training loop calls.

The loop (:mod:`tokenloom.train.loop`) is the same for every layout; a :class:`Strategy`,
built on every rank from ``(tp, pp, vpp, sp, zero1, fsdp)`` and the world size (dp = world /
(tp x pp), Megatron's rank order tp-dp-pp), decides:

======================  ===================================  =======================================
piece                   data parallel only (tp = pp = 1)     tensor / pipeline parallel
======================  ===================================  =======================================
model chunks            the whole :class:`GPT`               this rank's chunk(s) of the same GPT
how a step runs         ``no_pipelining`` (accumulation)     ``1f1b``, or ``interleaved`` with vpp
gradient finalisation   bucketed DDP (ZeRO-1: bucketed       the same over dp, one per chunk, waited
                        reduce-scatter) during backward      for after the schedule; then sp grads
                                                             summed over tp, tied embedding over pp
norm groups (clipping)  none                                 the model-parallel group
optimizer               fused AdamW, or ZeRO-1               the same two
checkpoint I/O          every rank writes its pieces (:mod:`~tokenloom.train.checkpoint.format`)
======================  ===================================  =======================================

``fsdp`` replaces DDP or ZeRO-1 in any of these (sums and clipping norm then on local shards). At
``ep`` > 1 the experts' grads stay out of DDP's buckets and are summed over the expert-data-parallel
group after them (with ZeRO-1, in buckets of their own).

Invariants:

* ``compile`` compiles every chunk's blocks in every layout; a block's backward is one autograd
  node, so buckets are cut at block boundaries only (``grad_units``) and still launch in backward.
* Gradients are fp32 in every layout (fp32 parameters, bf16 autocast), so buckets reduce in fp32
  (Megatron's ``grad_reduce_in_fp32``) at twice bf16's traffic.
* Every tensor it makes names the run's device and every collective gets device tensors (NCCL
  needs that); a test runs every layout with the default device set to ``meta``.
* No host sync per step: losses stay device tensors, reduced over dp and sent from the last stage
  only when the loop logs (:meth:`Strategy.loss_for_log`, :meth:`Strategy.sums_for_log`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tokenloom.errors import TokenloomError
from tokenloom.train import data as train_data
from tokenloom.train import staged_gloo
from tokenloom.train.checkpoint import reshard
from tokenloom.train.checkpoint.async_save import CheckpointSaver
from tokenloom.train.config import TrainConfig
from tokenloom.train.kernels import choose_compile
from tokenloom.train.model import fp8, moe
from tokenloom.train.model.flops import flops_per_token
from tokenloom.train.model.gpt import GPT, masked_mean
from tokenloom.train.model.pipeline_split import pipeline_stage
from tokenloom.train.optim.adamw import (
    build_optimizer,
    clip_coefficient,
    global_grad_norm,
    param_groups,
    use_fused,
)
from tokenloom.train.optim.muon import Muon, split_params
from tokenloom.train.optim.zero import ZeroAdamW
from tokenloom.train.parallel import fsdp
from tokenloom.train.parallel.context import loss_scale, take_local
from tokenloom.train.parallel.ddp import DEFAULT_BUCKET_CAP_MB, DistributedDataParallel
from tokenloom.train.parallel.layers import TensorParallel, is_sequence_parallel, sync_sequence_parallel_grads
from tokenloom.train.parallel.mappings import all_reduce_in_place
from tokenloom.train.parallel.p2p import P2PComm
from tokenloom.train.parallel.random import RNGStatesTracker, get_rng_tracker, model_parallel_manual_seed
from tokenloom.train.parallel.schedules import (
    NoSync,
    PipelineStats,
    allreduce_tied_embedding_grads,
    forward_backward,
    get_schedule,
    is_tied_embedding,
    pipeline_bubble_fraction,
)
from tokenloom.train.parallel.state import ParallelState
from tokenloom.train.runtime import World, autocast_for, collective, compute_dtype
from tokenloom.train.source_loss import SourceLosses


def parallel_state(cfg: TrainConfig, world: World) -> ParallelState:
    """This rank's place in the ``tp x dp x pp`` grid (collective when the world has more ranks)."""
    mp = cfg.tp * cfg.cp * cfg.pp
    if world.size % mp:
        what = f"tp x cp x pp = {cfg.tp} x {cfg.cp} x {cfg.pp}" if cfg.cp > 1 else f"tp x pp = {cfg.tp} x {cfg.pp}"
        raise TokenloomError(f"{what} = {mp} does not divide the {world.size} ranks of this launch; launch a "
                             f"multiple of {mp} ranks (--nproc-per-node) or change the sizes")
    if world.size == 1:
        return ParallelState.single_process()
    if (world.size // mp) % cfg.ep:
        raise TokenloomError(f"ep={cfg.ep} does not divide the {world.size // mp} data-parallel ranks of this launch; "
                             "launch a multiple of ep ranks (--nproc-per-node) or change ep")
    return collective("parallel group setup", ParallelState.create, cfg.tp, cfg.pp, cfg.vpp, cfg.cp, cfg.ep,
                      timeout=timedelta(seconds=cfg.dist_timeout_s))


def counts_in_grad_norm(param: nn.Parameter, tp_rank: int) -> bool:
    """Megatron's rule, once per model replica: shards on every tp rank, replicated tensors on tp
    rank 0, the tied duplicate never."""
    if getattr(param, "shared", False):
        return False
    return bool(getattr(param, "tensor_model_parallel", False)) or tp_rank == 0


def is_expert(param: nn.Parameter) -> bool:
    """Whether ``param`` is one rank's share of an expert-parallel layer's experts."""
    return bool(getattr(param, "expert_parallel", False))


def refuse_unsupported(cfg: TrainConfig) -> None:
    """Refuse, naming the field, a setting this layout would otherwise ignore."""
    if cfg.fsdp:
        clashes = [("zero1", cfg.zero1, "fsdp shards the optimizer state already (and the parameters and gradients)"),
                   ("ddp_bucket_cap_mb", cfg.ddp_bucket_cap_mb is not None,
                    "fsdp gathers and reduce-scatters per transformer block, not in buckets"),
                   ("overlap_grad_reduce", cfg.overlap_grad_reduce is not None,
                    "fsdp always reduce-scatters during backward"),
                   ("overlap_param_gather", cfg.overlap_param_gather is not None,
                    "fsdp always gathers each block's parameters during the forward"),
                   ("fp8", cfg.fp8 is not None, "fsdp is not combined with torchao's float8 linears here")]
        for field, given, reason in clashes:
            if given:
                raise TokenloomError(f"{field} cannot be combined with fsdp: {reason}; leave it unset")
    if cfg.overlap_grad_reduce is not None and not cfg.zero1:
        raise TokenloomError("overlap_grad_reduce applies to zero1 (DDP always overlaps); leave it unset or set "
                             "zero1=true")
    if cfg.overlap_param_gather is not None and not cfg.zero1:
        raise TokenloomError("overlap_param_gather applies to zero1 (without it every rank steps its full "
                             "parameters, nothing is gathered); leave it unset or set zero1=true")


class Strategy:
    """One layout's model chunks, optimizer, step, gradient finalisation and checkpoint I/O; build it
    on every rank at once (it creates process groups and broadcasts the initial parameters)."""

    def __init__(self, cfg: TrainConfig, world: World) -> None:
        self.cfg, self.world, self.device = cfg, world, world.device
        self.state = st = parallel_state(cfg, world)
        self.dp_size, self.dp_rank = st.dp_size, st.dp_rank
        if cfg.global_batch_size % (cfg.micro_batch_size * self.dp_size):
            raise TokenloomError(f"global_batch_size={cfg.global_batch_size} is not a multiple of "
                                 f"micro_batch_size x data-parallel ranks = {cfg.micro_batch_size} x {self.dp_size}")
        self.num_micro = cfg.global_batch_size // (cfg.micro_batch_size * self.dp_size)
        self.num_chunks = cfg.vpp or 1
        self.schedule = get_schedule(cfg.pp, self.num_chunks)
        self.staged = cfg.tp > 1 or cfg.pp > 1
        refuse_unsupported(cfg)
        self.autocast = autocast_for(cfg.precision, self.device)
        capturable = staged_gloo.blocks_compile_with(cfg.tp, cfg.cp, cfg.ep)
        if cfg.compile is True and not capturable:
            raise TokenloomError("compile=true with --distributed-backend gloo on CUDA and tp, cp or ep > 1: "
                                 "torch.compile cannot capture the blocks' collectives over gloo's staged group; "
                                 "use compile=auto (eager blocks) or nccl")
        self.compile = choose_compile(cfg.compile, self.device.type, capturable)[0]
        self.rng_tracker = self._seed_tp_dropout()
        self.chunks = self._build_chunks()
        if cfg.fp8:
            self._convert_to_fp8()
        for chunk in self.chunks:  # MoE auxiliary losses weigh as the loss does (divided by micro-batches)
            chunk.set_aux_loss_scale(1.0 / self.num_micro)
        self.fsdp_group = self._shard_fully() if cfg.fsdp else None
        self.zero_adamw = cfg.zero1 and cfg.optim.name == "adamw"
        """ZeRO-1 by :class:`ZeroAdamW` (Muon's zero1 shards by whole tensors in :class:`Muon`, over DDP)."""
        self.params = list({id(p): p for c in self.chunks for p in c.parameters() if p.requires_grad}.values())
        self.optimizer = self._build_optimizer()
        self.saver = CheckpointSaver(cfg.ckpt_dir, rank=world.rank, world_size=world.size,
                                     keep_last=cfg.keep_last_checkpoints, asynchronous=cfg.async_save,
                                     pin_memory=self.device.type == "cuda", timeout_s=cfg.dist_timeout_s)
        """Checkpoint writes: the loop polls it and waits for it at the end."""
        self.comm = None
        self.train_time = PipelineStats()  # this rank's schedule time over the train steps since bubble_for_log
        if cfg.pp > 1:
            seq = cfg.model.seq_len // cfg.cp  # this rank's tokens of each sequence
            shape = (cfg.micro_batch_size, seq, cfg.model.d_model)
            if cfg.sp:  # stages exchange their slice of the sequence, sequence first
                shape = (seq // cfg.tp, cfg.micro_batch_size, cfg.model.d_model)
            self.comm = P2PComm.from_group(st.pp_group, shape, compute_dtype(cfg.precision, self.device),
                                           self.device)
        if self.compile and self.fsdp_group is None:
            for chunk in self.chunks:
                chunk.compile_blocks()
        self.ddps = self._wrap_ddp() if st.dp_cp_size > 1 and not (self.zero_adamw or cfg.fsdp) else []
        # the loss of the last stage reaches every rank from here (tp 0, dp 0, last pp rank)
        self.loss_src = st.layout.rank_of(0, 0, cfg.pp - 1)
        self._per_source: SourceLosses | None = None  # where the running global batch's last stage adds

    # ------------------------------------------------------------------ building

    def _seed_tp_dropout(self) -> RNGStatesTracker | None:
        """At tp > 1, Megatron's seeding: default generator equal over tp, tracker stream per tp rank; else None."""
        if self.cfg.tp == 1:
            return None
        tracker = get_rng_tracker(self.device)
        return model_parallel_manual_seed(self.cfg.seed + 100 * self.state.pp_rank, self.state.tp_rank, tracker)

    def _build_chunks(self) -> list[GPT]:
        """This rank's model chunk(s), built on ``meta`` and materialised with the one-process initial values."""
        cfg, st = self.cfg, self.state
        tp = TensorParallel(st.tp_group if cfg.tp > 1 else None, cfg.sp)
        split = cfg.pipeline_split
        chunks = [pipeline_stage(cfg.model, split, st.pp_rank, c, tp=tp, device=self.device)
                  for c in range(self.num_chunks)]
        if cfg.cp > 1:
            assert st.cp_group is not None  # a cp > 1 layout has its groups
            for chunk in chunks:
                chunk.context_parallel(st.cp_group, cfg.cp, st.cp_rank)
        if cfg.ep > 1:
            assert st.ep_group is not None  # an ep > 1 layout has its groups
            for chunk in chunks:
                chunk.expert_parallel(st.ep_group, cfg.ep, st.ep_rank)
        return chunks

    def _convert_to_fp8(self) -> None:
        """``fp8``: the block linears become float8 linears before anything compiles or holds them."""
        recipe = self.cfg.fp8
        assert recipe is not None  # called only for an fp8 run
        ops = self.chunks[0].ops
        why = fp8.refusal(recipe, self.device, tp=self.cfg.tp, precision=self.cfg.precision,
                          kernels="reference" if ops is None else ops.mode)
        if why:
            raise TokenloomError(why)
        fp8.convert(self.chunks, recipe)

    def _shard_fully(self) -> dist.ProcessGroup | None:
        """``fsdp``: compile the blocks, then shard every chunk over the dp (x cp) group; returns the
        group, None (nothing sharded) for one process without ``torch.distributed``."""
        group = self.state.dp_cp_group
        if group is None and dist.is_initialized():
            group = dist.group.WORLD
        if group is None:
            return None
        if self.compile:
            for chunk in self.chunks:
                chunk.compile_blocks()
        collective("FSDP setup", fsdp.shard_fully, self.chunks, [list(c.blocks.values()) for c in self.chunks],
                   group, self.device)
        return group

    def _wrap_ddp(self) -> list[DistributedDataParallel]:
        """One bucketed DDP per chunk over the dp group, launched in its last micro-batch backward; in tp/pp
        layouts waited for after the schedule, buffers not re-broadcast (mid-pipeline collectives stall it)."""
        return [collective("DDP setup", DistributedDataParallel, chunk, process_group=self.state.dp_cp_group,
                           params_and_buffers_to_ignore=[n for n, p in chunk.named_parameters() if is_expert(p)],
                           bucket_cap_mb=self.cfg.ddp_bucket_cap_mb, broadcast_buffers=not self.staged,
                           finish_in_backward=not self.staged, grad_units=self._compiled_units(chunk))
                for chunk in self.chunks]

    def _compiled_units(self, chunk: GPT) -> list[nn.Module]:
        """The modules of ``chunk`` compiled in place, whose grads arrive together (no bucket ends inside one)."""
        return list(chunk.blocks.values()) if self.compile else []

    def _build_optimizer(self):
        cfg, st, o = self.cfg, self.state, self.cfg.optim
        if o.name == "muon":
            # zero1: DDP's all-reduced grads, each rank stepping and keeping the state of the whole
            # tensors it owns, broadcasting their new values (megatron-core's layer-wise optimizer);
            # fsdp: the owner of a matrix gathers its sharded update over dp (its fsdp group) and
            # sends each rank its rows of the step
            matrices, groups = split_params(self.chunks, o.weight_decay)
            return Muon(matrices, groups, o, dp_group=st.dp_cp_group if st.dp_cp_size > 1 else None,
                        expert_dp_group=st.expert_dp_group if cfg.ep > 1 else None,
                        tp_group=st.tp_group if cfg.tp > 1 else None, shard_state=cfg.zero1,
                        sharded=self.fsdp_group is not None)
        if not cfg.zero1:
            return build_optimizer(self.chunks, o)
        groups = param_groups(self.chunks, o.weight_decay)
        # one group per parameter keeps ZeRO's flat buffer (its checkpoint layout) in self.params order
        decay = {id(p): g["weight_decay"] for g in groups for p in g["params"]}
        # pp > 1: the tied embedding copies in a bucket of their own, cut alike on first and last stage
        cap = DEFAULT_BUCKET_CAP_MB if cfg.ddp_bucket_cap_mb is None else cfg.ddp_bucket_cap_mb
        return ZeroAdamW([{"params": [p], "weight_decay": decay[id(p)]} for p in self.params], st.dp_cp_group,
                         lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, max_grad_norm=o.grad_clip,
                         norm_group=st.model_parallel_group if self.staged else None,
                         counts_in_norm=self._counts_in_norm,
                         bucket_bytes=int(cap * 2**20),
                         overlap_grad_reduce=cfg.overlap_grad_reduce is not False,
                         overlap_param_gather=cfg.overlap_param_gather is not False,
                         modules=self.chunks,
                         grad_units=[m for c in self.chunks for m in self._compiled_units(c)],
                         own_bucket=is_tied_embedding if cfg.pp > 1 else None,
                         fused=use_fused(o, self.params),
                         # ep > 1: the experts in buckets of their own over the ranks holding them
                         is_expert=is_expert if cfg.ep > 1 else None, expert_dp_group=st.expert_dp_group)

    def _counts_in_norm(self, p: nn.Parameter) -> bool:
        return counts_in_grad_norm(p, self.state.tp_rank)

    # ------------------------------------------------------------------ data

    @property
    def has_data(self) -> bool:
        """Whether this rank reads batches: first and last stages, every stage under document masking."""
        st = self.state
        return (st.is_first_stage(ignore_virtual=True) or st.is_last_stage(ignore_virtual=True)
                or self.cfg.data.masks_documents)

    @property
    def computes_loss(self) -> bool:
        return self.state.is_last_stage(ignore_virtual=True)

    def global_batches(self, dataset, *, eod: int | None, consumed: int, total: int,
                       workers: int = 0, sources: bool = False) -> Iterator[list]:
        """This rank's micro-batches of each global batch on the device (None where unread); ``sources``:
        each carries ``source``. Assembled under an explicit CPU device, ignoring a default device."""
        if not self.has_data:
            while True:
                yield [None] * self.num_micro
        cfg = self.cfg
        loader = train_data.loader(
            dataset, eod=eod, eod_mask_loss=cfg.data.eod_mask_loss, consumed_samples=consumed,
            micro_batch_size=cfg.micro_batch_size, dp_rank=self.dp_rank, dp_size=self.dp_size,
            num_workers=workers, pin_memory=self.device.type == "cuda", total_samples=total,
            inter_document_masking=cfg.data.masks_documents, vocab_size=cfg.model.vocab_size,
            source_ids=sources, packed=cfg.data.packing == "best-fit",
        )
        host = torch.device("cpu")
        with host:
            it = iter(loader)
        while True:
            with host:
                host_batches = [next(it) for _ in range(self.num_micro)]
            yield [train_data.to_device(b, self.device) for b in host_batches]

    # ------------------------------------------------------------------ steps

    def _forward_step(self, module: nn.Module, hidden: torch.Tensor | None, batch: Any, last: bool) -> torch.Tensor:
        """One chunk on one micro-batch: the loss from the last stage (per-source sums added), else its activation."""
        docs = {}
        if batch is not None and "cu_seqlens" in batch:  # a middle stage without masking reads no batch
            docs = {"documents": batch["cu_seqlens"], "positions": batch["position_ids"]}
        scale: torch.Tensor | float = 1.0
        if self.cfg.cp > 1 and batch is not None:  # this rank's tokens of each sequence; the loss scaled
            full_mask, batch = batch["loss_mask"], self._local_tokens(batch)
            if "positions" in docs:
                docs["positions"] = batch["position_ids"]
            if last:
                scale = loss_scale(full_mask, batch["loss_mask"], self.cfg.cp, self.cfg.model.seq_len)
        per_source = self._per_source if last or not self.staged else None
        if per_source is not None:
            docs["token_losses"] = True
        if not self.staged:
            out = module(batch["tokens"], batch["labels"], batch["loss_mask"], **docs)
        else:
            tokens = batch["tokens"] if hidden is None else None
            if not last:
                return module(tokens, hidden=hidden, **docs)
            out = module(tokens, batch["labels"], batch["loss_mask"], hidden=hidden, **docs)
        if per_source is None:
            return out * scale
        per_source.add(out, batch["loss_mask"], batch["source"])  # this rank's tokens: summed over dp x cp
        return masked_mean(out.reshape(-1), batch["loss_mask"]) * scale

    def _local_tokens(self, batch: dict) -> dict:
        """A micro-batch's per-token tensors cut to this context-parallel rank's tokens."""
        cp, rank = self.cfg.cp, self.state.cp_rank
        return {k: take_local(v, cp, rank) if k in ("tokens", "labels", "loss_mask", "position_ids") and v is not None
                else v for k, v in batch.items()}

    def _run(self, modules: Sequence[nn.Module], batches: list, forward_only: bool,
             no_sync: NoSync | list[NoSync] | None = None, per_source: SourceLosses | None = None) -> torch.Tensor:
        """Run one global batch; the sum of its micro-batch losses (zero off the last stage)."""
        model = modules if self.num_chunks > 1 else modules[0]
        self._per_source = per_source
        try:
            with self.autocast():
                res = forward_backward(self.schedule, model, iter(batches), self.num_micro, self._forward_step,
                                       comm=self.comm, forward_only=forward_only, no_sync=no_sync)
        finally:
            self._per_source = None
        self.last_stats = res.stats
        total = torch.zeros((), device=self.device)
        for loss in res.losses:
            total += loss.detach().float()
        return total

    def train_step(self, batches: list, per_source: SourceLosses | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step: (mean micro-batch loss or zero, grad norm before clipping), device tensors."""
        self.optimizer.zero_grad()  # set_to_none: DDP and ZeRO-1 copy each first grad into their buffers
        if self.ddps:
            total = self._run(self.ddps, batches, False, no_sync=[ddp.no_sync for ddp in self.ddps],
                              per_source=per_source)
        else:
            overlap = self.zero_adamw and self.optimizer.overlap  # launches its buckets from the last backward
            total = self._run(self.chunks, batches, False, no_sync=self.optimizer.no_sync if overlap else None,
                              per_source=per_source)
        self.train_time += self.last_stats
        norm = self._finish_grads_and_step()
        return total / self.num_micro, norm

    def _finish_grads_and_step(self) -> torch.Tensor:
        """After the schedule: the dp averages, then the sp, tied-embedding and expert sums (linear: after
        the average only rounding changes), clipping and the step."""
        cfg, st = self.cfg, self.state
        if self.fsdp_group is not None:
            return self._finish_sharded_grads_and_step()
        if self.zero_adamw:  # the sums on the reduced shard: each rank sums only the pieces it steps
            self.optimizer.finish_grad_sync()
            if cfg.sp:
                self.optimizer.all_reduce_grads([p for p in self.params if is_sequence_parallel(p)], st.tp_group)
            if cfg.pp > 1:
                self.optimizer.all_reduce_grads([p for p in self.params if is_tied_embedding(p)], st.embedding_group)
            self.saver.before_update()  # a save in flight may still be copying the state
            return self.optimizer.step()
        for ddp in self.ddps:  # tp/pp: wait for the buckets launched in each chunk's last backward
            ddp.finish_grad_sync()
        if cfg.sp:
            for chunk in self.chunks:
                sync_sequence_parallel_grads(chunk, st.tp_group)
        allreduce_tied_embedding_grads(self.chunks, st.embedding_group if cfg.pp > 1 else None)
        experts = self._reduce_expert_grads()
        grads = [p.grad for p in self.params if p.grad is not None]
        counted = [p.grad for p in self.params if p.grad is not None and self._counts_in_norm(p) and not is_expert(p)]
        groups = [st.model_parallel_group] if self.staged else []
        norm = global_grad_norm(counted, groups, device=self.device)
        if cfg.ep > 1:  # expert squares summed over ep, then the stages, on every rank (collectives)
            groups = [st.ep_group] + ([st.pp_group] if cfg.pp > 1 else [])
            expert_norm = global_grad_norm(experts, groups, device=self.device)
            norm = (norm.double().square() + expert_norm.double().square()).sqrt().float()
        return self._clipped_step(grads, norm)

    def _clipped_step(self, grads: list[torch.Tensor], norm: torch.Tensor) -> torch.Tensor:
        """Clip ``grads`` to the global ``norm``, wait for a save's copy, step; returns ``norm``."""
        coefficient = clip_coefficient(norm, self.cfg.optim.grad_clip)
        if self.optimizer.defaults.get("fused"):
            # fused AdamW divides by grad_scale in its kernel: clipping costs no pass of its own
            self.optimizer.grad_scale = coefficient.reciprocal()
        else:
            torch._foreach_mul_(grads, coefficient)
        self.saver.before_update()  # a save in flight may still be copying the state
        self.optimizer.step()
        return norm

    def _reduce_expert_grads(self) -> list[torch.Tensor]:
        """The expert grads (outside DDP's buckets) made the one-process gradient and returned: each
        holds its ep peers' sum after the all-to-all, so sum over the expert-dp group, divide by dp."""
        grads = [p.grad for p in self.params if is_expert(p) and p.grad is not None]
        if grads:
            all_reduce_in_place(grads, self.state.expert_dp_group)
            torch._foreach_div_(grads, self.state.dp_size)
        return grads

    def _finish_sharded_grads_and_step(self) -> torch.Tensor:
        """``fsdp``: the grads are dp-averaged shards already; the sp and tied-embedding sums run on
        the local shards (cut alike), the norm over dp and the model-parallel group, then the step."""
        cfg, st = self.cfg, self.state
        if cfg.sp:
            all_reduce_in_place([fsdp.local(p.grad) for p in self.params
                                 if is_sequence_parallel(p) and p.grad is not None], st.tp_group)
        if cfg.pp > 1:
            tied = []
            for p in self.params:
                if is_tied_embedding(p):
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)
                    tied.append(fsdp.local(p.grad))
            all_reduce_in_place(tied, st.embedding_group)
        grads = [fsdp.local(p.grad) for p in self.params if p.grad is not None]
        counted = [fsdp.local(p.grad) for p in self.params if p.grad is not None and self._counts_in_norm(p)]
        groups = [self.fsdp_group] + ([st.model_parallel_group] if self.staged else [])
        return self._clipped_step(grads, global_grad_norm(counted, groups, device=self.device))

    @torch.no_grad()
    def eval_loss_sum(self, batches: list, per_source: SourceLosses | None = None) -> torch.Tensor:
        """Sum of the micro-batch losses of one global batch, forward only (eval mode)."""
        modules = self.chunks
        for m in modules:
            m.eval()
        try:
            return self._run(modules, batches, True, per_source=per_source)
        finally:
            for m in modules:
                m.train()

    def loss_for_log(self, value: torch.Tensor, what: str) -> float:
        """The dp (x cp) mean of a last-stage loss, on every rank (collective)."""
        return float(self._to_every_rank(value, what, mean=True))

    def sums_for_log(self, value: torch.Tensor, what: str) -> torch.Tensor:
        """The dp (x cp) sum of a last-stage tensor, on every rank's host (collective, same shape everywhere)."""
        return self._to_every_rank(value, what, mean=False).cpu()

    def _to_every_rank(self, value: torch.Tensor, what: str, mean: bool) -> torch.Tensor:
        st = self.state
        value = value.detach().clone()
        if st.dp_cp_size > 1 and self.computes_loss:
            collective(what, dist.all_reduce, value, group=st.dp_cp_group)
            if mean:
                value /= st.dp_cp_size
        if self.cfg.pp > 1:
            collective(what, dist.broadcast, value, src=self.loss_src)
        return value

    def moe_for_log(self) -> dict:
        """The MoE metrics since the last call, on every rank (empty when dense); collective over the world."""
        model = self.cfg.model
        if model.num_experts is None:
            return {}
        layers = [i for i in range(model.n_layers) if model.is_moe_layer(i)]
        table = torch.zeros(len(layers), model.num_experts + 3, dtype=torch.float64, device=self.device)
        for chunk in self.chunks:
            for i, layer in chunk.moe_layers().items():
                table[layers.index(i)] = layer.take_stats()
        if self.world.size > 1:
            collective("MoE statistics", dist.all_reduce, table)
        return moe.log_fields(table, layers)

    def bubble_for_log(self) -> float | None:
        """The pipeline-wide bubble of the train steps since the last call, on every rank (None at
        pp = 1); collective over the pipeline group, so asked once per log interval."""
        stats, self.train_time = self.train_time, PipelineStats()
        if self.cfg.pp == 1:
            return None
        return collective("pipeline bubble", pipeline_bubble_fraction, stats, self.state.pp_group)

    # ------------------------------------------------------------------ checkpoints

    def finish_param_sync(self) -> None:
        """Wait for ZeRO-1's pending parameter all-gathers, or reshard FSDP's gathered parameters:
        before parameters are read or written outside a forward. A no-op for other layouts."""
        if self.zero_adamw:
            self.optimizer.finish_param_sync()
        if self.fsdp_group is not None:  # the chunks' own parameters stay gathered after a forward
            fsdp.reshard(self.chunks)

    def save(self, iteration: int, state: dict, local: Path | None = None) -> Path:
        """Collective: save ``iteration``'s checkpoint through :attr:`saver`, after the previous write (raising its failure)."""
        self.finish_param_sync()
        if not isinstance(self.optimizer, Muon):
            return reshard.save(self, iteration, state, self.saver, local)
        self.optimizer.replicate_state()  # zero1: each owner's state to every rank, written as unsharded
        try:
            return reshard.save(self, iteration, state, self.saver, local)
        finally:
            self.optimizer.drop_unowned_state()

    def load(self, path: Path, saved: dict) -> None:
        """Load the checkpoint at ``path`` (``saved``: its state.json), of any layout or format, into this rank."""
        self.finish_param_sync()  # a gather still in flight would overwrite the loaded parameters
        reshard.load(self, path, saved)
        if isinstance(self.optimizer, Muon):  # zero1: every parameter's state was loaded; keep the owned
            self.optimizer.drop_unowned_state()

    # ------------------------------------------------------------------ model facts

    def optimizer_state_bytes(self) -> int:
        """Bytes of optimizer state on this rank (ZeRO-1: its shard); zero before the first step."""
        if self.zero_adamw:
            return self.optimizer.state_bytes()
        return sum(fsdp.local(t).numel() * t.element_size() for state in self.optimizer.state.values()
                   for t in state.values() if isinstance(t, torch.Tensor))

    def model_size(self) -> tuple[int, int]:
        """(parameters, training FLOPs per token) of the whole model, counted on a ``meta`` copy."""
        model = GPT(self.cfg.model, device="meta")
        return model.num_params(), flops_per_token(model)
