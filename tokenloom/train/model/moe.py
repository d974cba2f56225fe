"""Mixture-of-experts pieces (megatron-core's ``TopKRouter``, token permutation, grouped experts,
auxiliary losses); the layer itself is :class:`tokenloom.train.model.blocks.MoE`.

* **Router** (:func:`route`): fp32 logits, top-k, softmax over the k (Megatron's default, equal to
  Mixtral's); no token is dropped. **Permutation**: one stable ``argsort`` by expert; results return
  gated through one ``index_add``. **Experts** (:func:`grouped_mm`): one grouped GEMM, no host sync.
* **Expert parallelism**: each ep rank holds ``E / ep`` consecutive experts. ``alltoall``
  (:func:`dispatch`) moves only routed rows after a split-size exchange (host sync); ``allgather``
  (:func:`gather_dispatch`, megatron-core's ``MoEAllGatherTokenDispatcher``) uses fixed-size
  collectives without host sync, more bytes as ep grows; equal up to rounding.
* **Under tp** (sp required) experts are whole per tp rank, each routing its sequence slice: no tp
  collective, for ``tp`` times the expert memory.
* **Auxiliary losses** enter backward through :class:`AttachAuxLoss` (Megatron's
  ``MoEAuxLossAutoScaler``), not the returned loss: stages without the head train their routers,
  and the reported LM loss is unchanged.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tokenloom.train.parallel.mappings import (
    gather_from_sequence_parallel_region,
    reduce_from_region,
    reduce_scatter_to_sequence_parallel_region,
)

BalancingType = Literal["aux_loss", "seq_aux_loss", "none"]


def route(x: torch.Tensor, weight: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x`` [N, d] -> (fp32 router logits [N, E], chosen experts [N, k] int64, gates [N, k]
    fp32 summing to one per token)."""
    with torch.autocast(device_type=x.device.type, enabled=False):
        logits = F.linear(x.float(), weight.float())
    top, experts = logits.topk(k, dim=-1)
    return logits, experts, top.softmax(dim=-1)


def load_balancing_loss(logits: torch.Tensor, experts: torch.Tensor, sequences: int, kind: BalancingType,
                        group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Switch-Transformer balance loss, no coefficient: ``E / (T^2 k) * sum_e P_e c_e`` (1 when
    uniform) over the micro-batch (``aux_loss``) or per sequence, averaged; sums over ``group``."""
    num_experts, k = logits.shape[-1], experts.shape[-1]
    probs = logits.softmax(dim=-1)
    if kind == "aux_loss":
        sequences = 1
    probs = probs.view(sequences, -1, num_experts)
    counts = torch.zeros(sequences, num_experts, device=probs.device, dtype=probs.dtype)
    counts.scatter_add_(1, experts.view(sequences, -1), torch.ones_like(experts, dtype=probs.dtype).view(sequences, -1))
    prob_sums, tokens = probs.sum(dim=1), probs.shape[1]
    if group is not None and dist.get_world_size(group) > 1:
        prob_sums = reduce_from_region(prob_sums, group)
        dist.all_reduce(counts, group=group)
        tokens *= dist.get_world_size(group)
    per_sequence = (prob_sums * counts).sum(dim=-1) * (num_experts / (tokens * tokens * k))
    return per_sequence.mean()


def z_loss(logits: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """ST-MoE router z-loss, no coefficient: mean ``logsumexp(logits)^2`` (summed over ``group``)."""
    total, tokens = logits.logsumexp(dim=-1).square().sum(), logits.shape[0]
    if group is not None and dist.get_world_size(group) > 1:
        total = reduce_from_region(total, group)
        tokens *= dist.get_world_size(group)
    return total / tokens


class AttachAuxLoss(torch.autograd.Function):
    """Identity whose backward gives scalar ``aux`` gradient ``scale``: it joins the objective only."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        ctx.save_for_backward(aux)
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (aux,) = ctx.saved_tensors
        return grad, torch.full_like(aux, ctx.scale), None


class AllToAll(torch.autograd.Function):
    """Differentiable uneven ``all_to_all_single`` of rows; backward is the reverse exchange."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, send: list[int], recv: list[int], group: dist.ProcessGroup) -> torch.Tensor:
        ctx.send, ctx.recv, ctx.group = send, recv, group
        out = x.new_empty(sum(recv), *x.shape[1:])
        dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out = grad.new_empty(sum(ctx.send), *grad.shape[1:])
        dist.all_to_all_single(out, grad.contiguous(), ctx.send, ctx.recv, group=ctx.group)
        return out, None, None, None


def dispatch(rows: torch.Tensor, counts: torch.Tensor, group: dist.ProcessGroup, size: int
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, tuple]:
    """Send expert-sorted ``rows`` to their experts' ranks -> (rows by local expert, their experts,
    counts, the plan). Host sync."""
    local = counts.numel() // size
    send_counts = counts.view(size, local)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts.contiguous(), group=group)
    send, recv = send_counts.sum(1).tolist(), recv_counts.sum(1).tolist()
    received = AllToAll.apply(rows, send, recv, group)
    expert = torch.repeat_interleave(torch.arange(local, device=rows.device).repeat(size), recv_counts.reshape(-1),
                                     output_size=sum(recv))
    order = expert.argsort(stable=True)
    return received[order], expert[order], recv_counts.sum(0), (order, send, recv, group)


def combine(out: torch.Tensor, plan: tuple) -> torch.Tensor:
    """Inverse of :func:`dispatch`: outputs back to their source ranks in send order."""
    order, send, recv, group = plan
    return AllToAll.apply(out[order.argsort()], recv, send, group)


def gather_dispatch(x: torch.Tensor, experts: torch.Tensor, gates: torch.Tensor, group: dist.ProcessGroup,
                    first: int, local: int
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, tuple]:
    """Gather ``x`` and routing over ``group`` -> (rows for experts ``first ..`` in a fixed ``ep N
    min(k, local)``-row buffer, tail unrouted; their local experts; counts; ``valid``; the plan)."""
    k = experts.shape[-1]
    hidden = gather_from_sequence_parallel_region(x, group)
    # one collective for both: expert ids are exact in fp32 (E < 2**24); their grad is dropped
    routing = gather_from_sequence_parallel_region(torch.cat([gates, experts.to(gates.dtype)], dim=-1), group)
    all_gates, key = routing[:, :k], routing[:, k:].detach().long().reshape(-1) - first
    key = torch.where((key >= 0) & (key < local), key, local)  # rows for other ranks' experts sort last
    order = key.argsort(stable=True)[:hidden.shape[0] * min(k, local)]
    expert_of_row, counts = key[order], torch.bincount(key, minlength=local + 1)[:local]
    mine = (expert_of_row < local).unsqueeze(-1)
    return (hidden[order // k], expert_of_row.clamp(max=local - 1), counts, mine,
            (order, mine, all_gates, hidden.shape[0], group))


def gather_combine(out: torch.Tensor, plan: tuple) -> torch.Tensor:
    """Gated rows summed into their tokens, reduce-scattered -> this rank's tokens [N, d]."""
    order, mine, gates, tokens, group = plan
    k = gates.shape[-1]
    scaled = torch.where(mine, out, 0) * gates.reshape(-1)[order].unsqueeze(-1).to(out.dtype)
    summed = out.new_zeros(tokens, out.shape[-1]).index_add_(0, order // k, scaled)
    return reduce_scatter_to_sequence_parallel_region(summed, group)


def permute(x: torch.Tensor, experts: torch.Tensor, num_experts: int
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pairs sorted by expert -> (rows [N k, d], order, each row's expert, counts [E] on device)."""
    flat = experts.reshape(-1)
    order = flat.argsort(stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    return x[order // experts.shape[-1]], order, flat[order], counts


def unpermute(out: torch.Tensor, order: torch.Tensor, gates: torch.Tensor, tokens: int) -> torch.Tensor:
    """Inverse of :func:`permute`: gated rows summed into their tokens -> [tokens, d]."""
    k = gates.shape[-1]
    scaled = out * gates.reshape(-1)[order].unsqueeze(-1).to(out.dtype)
    return out.new_zeros(tokens, out.shape[-1]).index_add_(0, order // k, scaled)


def grouped_mm_usable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` runs here: 16-byte aligned rows; on CUDA bf16 on Hopper or
    newer; under compile bf16 only (its shape function refuses others)."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
    size = torch.empty((), dtype=dtype, device="meta").element_size()
    if (x.shape[-1] * size) % 16 or (weight.shape[-1] * size) % 16:
        return False
    if torch.compiler.is_compiling() and dtype != torch.bfloat16:
        return False
    if x.device.type == "cuda":
        return dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device) >= (9, 0)
    return x.device.type == "cpu"


def grouped_mm(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor, grouped: bool,
               valid: torch.Tensor | None = None) -> torch.Tensor:
    """Expert-sorted rows [n, a] times their expert's ``weight`` [E, a, b]: grouped GEMM or a loop
    (host sync); rows outside ``valid`` get zero outputs and grads (the GEMM leaves them unset)."""
    if valid is not None:
        x = torch.where(valid, x, 0)
    if grouped and grouped_mm_usable(x, weight):
        device = x.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
        offsets = counts.cumsum(0).to(torch.int32)
        out = torch._grouped_mm(x.to(dtype), weight.to(dtype), offs=offsets)
        return out if valid is None else torch.where(valid, out, 0)
    sizes = counts.tolist()
    parts = x.split([*sizes, x.shape[0] - sum(sizes)])  # the last: the rows of no expert
    out = torch.cat([part @ w for part, w in zip(parts, weight, strict=False)])
    return F.pad(out, (0, 0, 0, parts[-1].shape[0]))


def log_fields(table: torch.Tensor, layers: list[int]) -> dict:
    """Log-interval metrics from ``table`` [layers, E + 3] of summed ``MoE.take_stats`` rows
    (``moe_min_expert_share``: ``1 / E`` is perfect balance)."""
    counts, balance, z, forwards = table[:, :-3], table[:, -3], table[:, -2], table[:, -1].clamp(min=1)
    shares = counts / counts.sum(dim=1, keepdim=True).clamp(min=1)
    return {"moe_balance_loss": float((balance / forwards).mean()), "moe_z_loss": float((z / forwards).mean()),
            "moe_min_expert_share": float(shares.min()),
            "moe_tokens_per_expert": {str(i): [int(c) for c in row] for i, row in zip(layers, counts.tolist(),
                                                                                       strict=True)}}
