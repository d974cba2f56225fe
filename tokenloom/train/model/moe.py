"""Mixture-of-experts pieces of the one GPT (megatron-core's ``TopKRouter``, token permutation,
grouped experts and auxiliary losses); the layer itself is :class:`tokenloom.train.model.blocks.MoE`.

Contracts:

* **Router** (:func:`route`): fp32 logits (autocast off), top-k over the logits, then a softmax
  over the k chosen (Megatron's default ``pre_softmax=False``; equal to Mixtral's softmax, top-k and
  renormalise). No token is dropped: every token reaches its k experts whatever their load.
* **Permutation** (:func:`permute`): the ``N x k`` (token, expert) pairs are sorted by expert with
  one stable ``argsort``, so each expert's tokens are one contiguous slice in token order;
  :func:`unpermute` scales each result by its gate and sums it back with one ``index_add``. The
  counts per expert stay on the device.
* **Experts** (:func:`grouped_mm`): ``torch._grouped_mm`` over the sorted tokens (one kernel, no
  host sync) where the device runs it (:func:`grouped_mm_usable`), else a loop over experts, which
  reads the counts on the host (one sync per MoE layer and pass).
* **Expert parallelism** (:func:`dispatch`, :func:`combine`): at ep > 1 each rank of the ep group
  holds ``E / ep`` consecutive experts. The counts go first (one small ``all_to_all_single``), then
  the rows (:class:`AllToAll`, whose backward is the reverse exchange); received rows are sorted by
  local expert (stable: source rank, then token order). The router, the auxiliary losses and the
  statistics stay on the source rank's tokens.
* **The allgather dispatcher** (:func:`gather_dispatch`, :func:`gather_combine`; megatron-core's
  ``MoEAllGatherTokenDispatcher``): every ep rank all-gathers the group's hidden states and routing,
  runs its experts on the rows routed to them (in :func:`dispatch`'s order), sums the gated results
  into their tokens and reduce-scatters the partial sums back. Fixed-size collectives and no host
  sync where the grouped GEMM runs (a buffer of the most rows a rank can be routed, ``ep N min(k, E
  / ep)``, its unused tail masked); more bytes per rank as ep grows. The result equals the
  all-to-all path's up to rounding. Every rank of the group passes the same number of tokens.
* **Experts under tensor parallelism** (sequence parallelism required, as in Megatron): each expert
  is whole on every tp rank (not Megatron's expert tensor parallelism), and each tp rank routes and
  dispatches its own ``1 / tp`` slice of the sequence over its ep group; the expert grads are summed
  over tp like the router's (tag ``sequence_parallel``) before the expert-data-parallel reduction.
  Why: no tp collective of its own and ``1 / tp`` of the tokens per exchange, where split experts
  would gather over tp and run GEMMs ``1 / tp`` as wide; the price is ``tp`` times the expert memory.
  Under pipeline parallelism each stage's experts split over that stage's ep ranks.
* **Auxiliary losses** (:func:`load_balancing_loss`, :func:`z_loss`) are computed over a
  micro-batch's tokens (all-reduced over tp under sequence parallelism, forward only) and enter
  backward through :class:`AttachAuxLoss` (Megatron's ``MoEAuxLossAutoScaler``), not through the
  returned loss, so a stage without the LM head still trains its routers; the reported LM loss is
  unchanged by them and they are logged apart.
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
    """Switch-Transformer balance loss (Megatron's, without its coefficient):
    ``E / (T^2 k) * sum_e P_e c_e`` with ``P_e`` the sum over T tokens of expert e's full-softmax
    probability and ``c_e`` the tokens routed to e. ``aux_loss`` takes T = every token of the
    micro-batch; ``seq_aux_loss`` takes each of the ``sequences`` sequences (rows of ``logits`` are
    sequence-major: ``[sequences, tokens, E]`` flattened) and averages over them. Equals 1 when
    routing and probabilities are uniform. ``group``: the tp group under sequence parallelism
    (each rank's tokens are one slice of every sequence; sums are all-reduced over it)."""
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
    """ST-MoE router z-loss without its coefficient: the mean over tokens of
    ``logsumexp(logits)^2`` (the sum all-reduced over ``group``, as in :func:`load_balancing_loss`)."""
    total, tokens = logits.logsumexp(dim=-1).square().sum(), logits.shape[0]
    if group is not None and dist.get_world_size(group) > 1:
        total = reduce_from_region(total, group)
        tokens *= dist.get_world_size(group)
    return total / tokens


class AttachAuxLoss(torch.autograd.Function):
    """Identity on ``out`` whose backward also sends gradient ``scale`` into ``aux`` (a scalar
    loss): ``aux * scale`` joins the training objective without being added to the returned loss.
    ``scale`` is the factor the LM loss gets before backward (1 / micro-batches)."""

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
    """``dist.all_to_all_single`` of the rows of ``x`` over ``group`` with uneven splits (rows sent to
    each rank, rows received from each), differentiable: backward sends the gradients back by the
    reverse exchange."""

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
    """Send ``rows`` (sorted by global expert, ``counts`` [E] per expert) to the ep ranks holding
    their experts -> (the received rows sorted by local expert, the local expert of each, tokens
    per local expert [E / ep], the plan :func:`combine` needs). Host sync on the split sizes (the exchange needs them)."""
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
    """Inverse of :func:`dispatch`: the experts' outputs back to their source ranks, in the order
    the rows were sent."""
    order, send, recv, group = plan
    return AllToAll.apply(out[order.argsort()], recv, send, group)


def gather_dispatch(x: torch.Tensor, experts: torch.Tensor, gates: torch.Tensor, group: dist.ProcessGroup,
                    first: int, local: int
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, tuple]:
    """The allgather dispatcher's forward half: ``x`` [N, d] with its routing (``experts`` [N, k]
    global ids, ``gates`` [N, k] fp32) gathered from every rank of ``group`` -> (the rows routed to
    experts ``first .. first + local`` sorted by local expert, in a fixed buffer of
    ``ep N min(k, local)`` rows whose tail, past the routed rows, belongs to no expert; the local
    expert of each row (the tail: the last); tokens per local expert [local]; which rows are routed
    ([rows, 1] bool, :func:`grouped_mm`'s ``valid``); the plan :func:`gather_combine` needs).
    Differentiable in ``x`` and ``gates``; no host sync."""
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
    """The allgather dispatcher's return half: each of :func:`gather_dispatch`'s rows' expert
    output (the tail's values ignored) scaled by its gate and summed into its token, the group's
    partial sums reduce-scattered -> this rank's tokens [N, d]."""
    order, mine, gates, tokens, group = plan
    k = gates.shape[-1]
    scaled = torch.where(mine, out, 0) * gates.reshape(-1)[order].unsqueeze(-1).to(out.dtype)
    summed = out.new_zeros(tokens, out.shape[-1]).index_add_(0, order // k, scaled)
    return reduce_scatter_to_sequence_parallel_region(summed, group)


def permute(x: torch.Tensor, experts: torch.Tensor, num_experts: int
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sort the (token, expert) pairs by expert: (tokens' rows in that order [N k, d], the order
    (indices into the flattened ``experts``), the expert of each sorted row, tokens per expert
    [E] int64 on the device)."""
    flat = experts.reshape(-1)
    order = flat.argsort(stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    return x[order // experts.shape[-1]], order, flat[order], counts


def unpermute(out: torch.Tensor, order: torch.Tensor, gates: torch.Tensor, tokens: int) -> torch.Tensor:
    """Inverse of :func:`permute`: each sorted row scaled by its gate and summed into its token
    -> [tokens, d] in ``out``'s dtype."""
    k = gates.shape[-1]
    scaled = out * gates.reshape(-1)[order].unsqueeze(-1).to(out.dtype)
    return out.new_zeros(tokens, out.shape[-1]).index_add_(0, order // k, scaled)


def grouped_mm_usable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` runs ``x`` [n, a] @ ``weight`` [E, a, b] here: the op exists,
    rows are 16-byte aligned, and on CUDA the inputs are bf16 on a Hopper or newer GPU; under
    ``torch.compile`` bf16 only (the op's shape function refuses other dtypes)."""
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
    """Rows of ``x`` [n, a], sorted by expert with ``counts`` [E] per expert, times their expert's
    ``weight`` [E, a, b] -> [n, b]. ``grouped`` and :func:`grouped_mm_usable`: one
    ``torch._grouped_mm`` (inputs in the autocast dtype, as a matmul would be); else a loop over
    experts (host sync on ``counts``). Rows past ``counts.sum()`` belong to no expert; ``valid``
    [n, 1] bool marks the others: the rows it leaves out get zero outputs and zero input gradients
    (the grouped GEMM leaves both unset there). None: every row belongs to an expert."""
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
    """Metrics of a log interval from ``table`` [MoE layers, E + 3] (each row a layer's
    :meth:`~tokenloom.train.model.blocks.MoE.take_stats` summed over the ranks, in ``layers``' order):
    ``moe_balance_loss`` and ``moe_z_loss`` (means over forwards and layers, coefficients not
    applied), ``moe_min_expert_share`` (the smallest fraction of routed tokens any expert of any
    layer got; ``1 / E`` is perfect balance) and ``moe_tokens_per_expert`` (per layer)."""
    counts, balance, z, forwards = table[:, :-3], table[:, -3], table[:, -2], table[:, -1].clamp(min=1)
    shares = counts / counts.sum(dim=1, keepdim=True).clamp(min=1)
    return {"moe_balance_loss": float((balance / forwards).mean()), "moe_z_loss": float((z / forwards).mean()),
            "moe_min_expert_share": float(shares.min()),
            "moe_tokens_per_expert": {str(i): [int(c) for c in row] for i, row in zip(layers, counts.tolist(),
                                                                                       strict=True)}}
