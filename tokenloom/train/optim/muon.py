"""Muon (momentum orthogonalised by Newton–Schulz) for the hidden matrices, AdamW for the rest.

:func:`split_params` decides: every 2-D weight of a transformer block (attention and MLP
projections, the router) and every expert matrix takes Muon; embeddings, an untied LM head,
biases and norms take AdamW (Keller Jordan's and Megatron's split). :class:`Muon` is one
``torch.optim.Optimizer`` over both, so the loop, the schedule (Muon's groups scale ``lr`` by
``muon_lr / lr``) and the checkpoints (``momentum_buffer`` for Muon, AdamW's moments) see one optimizer.

The update is ``torch.optim.Muon``'s (the test oracle; single-device and 2-D only, so not used):
``B = mu B + (1 - mu) g``, Nesterov ``g + mu (B - g)``, five quintic Newton–Schulz steps in
``muon_ns_dtype``, decoupled decay, a step of ``lr x scale`` with scale ``0.2 sqrt(max(A, B))``
(``match_rms_adamw``) or ``sqrt(max(1, A/B))`` (``original``) for an ``A x B`` (out x in) matrix.
Each of Q, K, V of a fused ``qkv`` is its own matrix, and so is each expert's (stored in x out: its
scale uses the transpose's shape; NS is transpose-equivariant, so the update is the same).

Layouts (Newton–Schulz needs each whole matrix):

* dp: tensors are assigned to dp ranks whole, balanced by size (:func:`assign`, largest first onto
  the least-loaded rank); each rank orthogonalises its own and broadcasts the new values over dp
  (megatron-core's layer-wise scheme). Momentum stays replicated. Experts at ep > 1: over the
  expert-data-parallel group.
* zero1 (``shard_state``): the AdamW tensors are assigned too and only each owner keeps (and steps)
  its state: ZeRO-1 by whole tensors. A save first copies every state to every rank
  (:meth:`Muon.replicate_state`), so the files are those of an unsharded run.
* tp (``muon_tp_mode`` duplicated, the default): the shards are all-gathered over tp (fused blocks in
  one-process order), orthogonalised whole on every tp rank, each keeping its shard: the one-process
  update. ``blockwise`` orthogonalises each shard alone (not the one-process update).
* fsdp (``sharded``): parameter, gradient and momentum are ``DTensor`` rows over dp (momentum sharded
  like FSDP's AdamW moments, so checkpoints stay layout-free). Each rank runs the momentum step on its
  rows; one all-to-all brings each matrix's rows to its owner (:func:`assign`), which orthogonalises
  it whole (tp-gathered at tp > 1); a second sends each rank its rows of the update. Two collectives
  per step whatever dp is.
* pp, cp: each stage steps its own parameters.

Newton–Schulz is written here, batched: the matrices of one shape go through torch's op sequence as
one ``bmm``/``baddbmm`` stack (the same results as ``torch.optim.Muon``'s per-matrix ``addmm`` on CPU
in the unit test), fewer and larger kernels than torch's loop (bench/RESULTS.md). The momentum, decay
and update are ``_foreach`` calls over all matrices; at the bench's sizes the matmuls dominate.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tokenloom.errors import TokenloomError
from tokenloom.train.model.blocks import Attention
from tokenloom.train.optim.adamw import OptimConfig, param_groups, use_fused
from tokenloom.train.parallel.fsdp import local
from tokenloom.train.parallel.layers import shard, unshard
from tokenloom.train.parallel.mappings import all_gather_first_dim

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
"""The quintic Newton–Schulz coefficients of Keller Jordan's Muon (torch's defaults)."""

NS_EPS = 1e-7
"""The floor of the Frobenius norm Newton–Schulz divides by (torch's ``eps``)."""


@dataclass
class MatrixParam:
    """One Muon parameter and how it makes matrices."""

    param: nn.Parameter
    parts: list[int] | None = None
    """Rows (full tensor, one-process order) of each matrix a fused weight stacks (q, k, v); None: one."""
    experts: bool = False
    """A 3-D ``[experts, in, out]`` tensor: each leading slice a matrix."""
    tp_dim: int | None = None
    """The dim the tp ranks split this parameter along; None: replicated over tp."""
    split_sizes: list[int] | None = None
    """The fused blocks of the tp-split dim (full sizes), as the tp layers cut them."""
    expert_parallel: bool = False
    """One ep rank's experts: shared over the expert-data-parallel group, not dp."""


def split_params(modules: nn.Module | Iterable[nn.Module], weight_decay: float
                 ) -> tuple[list[MatrixParam], list[dict]]:
    """(the Muon parameters, the AdamW groups of the rest) of ``modules`` (a model or a rank's chunks).
    Muon: the decayed matmul weights of :func:`~.adamw.param_groups` but an untied LM head."""
    modules = [modules] if isinstance(modules, nn.Module) else list(modules)
    decay, no_decay = param_groups(modules, weight_decay)
    heads = {id(head.weight) for mod in modules for m in mod.modules()
             if isinstance(head := getattr(m, "lm_head", None), nn.Module) and isinstance(head.weight, torch.Tensor)}
    qkv = {}
    for mod in modules:
        for m in mod.modules():
            if isinstance(m, Attention):
                tp = getattr(m.tp, "size", 1)
                qkv[id(m.qkv.weight)] = [n * m.head_dim * tp for n in (m.n_heads, m.n_kv_heads, m.n_kv_heads)]
    fused = {id(m.weight): list(getattr(m, "split_sizes")) for mod in modules for m in mod.modules()  # noqa: B009
             if getattr(m, "split_sizes", None) and isinstance(getattr(m, "weight", None), torch.Tensor)}
    muon, adam = [], []
    for p in decay["params"]:
        if id(p) in heads or p.dim() not in (2, 3):
            adam.append(p)
            continue
        tp_dim = p.partition_dim if getattr(p, "tensor_model_parallel", False) else None
        muon.append(MatrixParam(p, parts=qkv.get(id(p)), experts=p.dim() == 3, tp_dim=tp_dim,
                                split_sizes=fused.get(id(p)), expert_parallel=bool(getattr(p, "expert_parallel", False))))
    groups = [{"params": adam, "weight_decay": decay["weight_decay"]},
              {"params": no_decay["params"], "weight_decay": 0.0}]
    return muon, groups


def newton_schulz(x: torch.Tensor, steps: int, dtype: torch.dtype = torch.bfloat16,
                  coefficients: Sequence[float] = NS_COEFFICIENTS, eps: float = NS_EPS) -> torch.Tensor:
    """The orthogonalisation of a matrix, or of each of a ``[n, rows, cols]`` stack at once
    (``torch.optim.Muon``'s op sequence, batched: ``bmm``/``baddbmm`` for ``mm``/``addmm``), in ``dtype``.
    The iterations write into four buffers allocated once per call (the same kernels, the same values)."""
    if x.dim() == 2:
        return newton_schulz(x.unsqueeze(0), steps, dtype, coefficients, eps).squeeze(0)
    a, b, c = coefficients
    y = x.to(dtype)
    tall = x.size(1) > x.size(2)
    if tall:
        y = y.transpose(1, 2)
    y = y / y.flatten(1).norm(dim=1).clamp(min=eps)[:, None, None]
    n, rows, cols = y.shape
    gram, poly = y.new_empty(n, rows, rows), y.new_empty(n, rows, rows)
    out = [y.new_empty(n, rows, cols), y.new_empty(n, rows, cols)] if steps else []
    for i in range(steps):
        torch.bmm(y, y.transpose(1, 2), out=gram)
        torch.baddbmm(gram, gram, gram, beta=b, alpha=c, out=poly)
        y = torch.baddbmm(y, poly, y, beta=a, out=out[i % 2])
    return y.transpose(1, 2) if tall else y


def lr_scale(rows: int, cols: int, mode: str) -> float:
    """The step size factor of an ``rows x cols`` (out x in) matrix: ``match_rms_adamw``
    (Moonshot: ``0.2 sqrt(max)``, AdamW's update RMS) or ``original`` (``sqrt(max(1, rows/cols))``)."""
    if mode == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    return math.sqrt(max(1.0, rows / cols))


def assign(sizes: Sequence[int], ranks: int) -> list[int]:
    """The owner rank of each of ``sizes`` (element counts): largest first onto the least-loaded
    rank, ties to the lower index (the same on every rank)."""
    owner = [0] * len(sizes)
    load = [0] * ranks
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        r = min(range(ranks), key=lambda r: (load[r], r))
        owner[i], load[r] = r, load[r] + sizes[i]
    return owner


class Muon(torch.optim.Optimizer):
    """Muon over ``matrices`` and AdamW (torch's, fused where it can be) over ``adam_groups``.

    ``dp_group`` / ``expert_dp_group``: where updates of dense / expert-parallel matrices are
    shared (None: one rank does all); ``tp_group``: where tp-split matrices are gathered
    (duplicated mode); ``shard_state``: zero1 by whole tensors; ``sharded``: the parameters are
    fsdp's ``DTensor`` shards over ``dp_group`` (the module docstring's layouts)."""

    def __init__(self, matrices: list[MatrixParam], adam_groups: list[dict], cfg: OptimConfig, *,
                 dp_group: dist.ProcessGroup | None = None, expert_dp_group: dist.ProcessGroup | None = None,
                 tp_group: dist.ProcessGroup | None = None, shard_state: bool = False, sharded: bool = False) -> None:
        if sharded and shard_state:
            raise TokenloomError("Muon: fsdp (sharded) shards every state already; zero1 (shard_state) cannot be "
                                 "combined with it")
        self.cfg, self.matrices, self.shard_state, self.sharded = cfg, matrices, shard_state, sharded
        muon_decay = cfg.weight_decay if cfg.muon_weight_decay is None else cfg.muon_weight_decay
        ratio = 1.0 if cfg.muon_lr is None else cfg.muon_lr / cfg.lr
        groups = [{"params": [m.param for m in matrices], "weight_decay": muon_decay, "muon": True,
                   "lr_ratio": ratio}] if matrices else []
        adam_groups = [g for g in adam_groups if g["params"]]
        adam_params = [p for g in adam_groups for p in g["params"]]
        super().__init__([*groups, *[dict(g, muon=False) for g in adam_groups]], {"lr": cfg.lr})
        self.ns_dtype = torch.bfloat16 if cfg.muon_ns_dtype == "bf16" else torch.float32
        self.tp_group = tp_group if cfg.muon_tp_mode == "duplicated" else None
        # (group, its size, this rank's index, [(parameter, its matrix plan or None for AdamW, owner)]):
        # every parameter has one owner in the group that holds its copies; with shard_state the
        # AdamW parameters are assigned too and only owners keep state (ZeRO-1 by whole tensors)
        self.shares = []
        plans = {id(m.param): m for m in matrices}
        for expert in (False, True):
            group = expert_dp_group if expert else dp_group
            mine = [p for p in [m.param for m in matrices] + (adam_params if shard_state else [])
                    if bool(getattr(p, "expert_parallel", False)) == expert]
            size = dist.get_world_size(group) if group is not None else 1
            if not mine:
                continue
            owners = assign([p.numel() for p in mine], size)
            self.shares.append((group, size, dist.get_rank(group) if group is not None else 0,
                                [(p, plans.get(id(p)), o) for p, o in zip(mine, owners, strict=True)]))
        self.owned = {id(p) for _, _, rank, items in self.shares for p, _, o in items if o == rank}
        if not shard_state:
            self.owned |= {id(p) for p in adam_params}
        # the inner AdamW's own groups (this rank's parameters: all, or with shard_state the owned
        # ones); step copies each outer group's lr (set by the schedule) into its inner group
        self.adam_pairs = []
        for outer in self.param_groups:
            held = [p for p in outer["params"] if id(p) in self.owned] if not outer["muon"] else []
            if held:
                self.adam_pairs.append((outer, {"params": held, "weight_decay": outer["weight_decay"]}))
        self.adamw = (torch.optim.AdamW([inner for _, inner in self.adam_pairs], lr=cfg.lr,
                                        betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                                        fused=use_fused(cfg, adam_params)) if self.adam_pairs else None)
        if self.adamw is not None:
            self.adamw.state = self.state  # one state table: checkpoints read and write it per parameter

    def names(self) -> tuple[int, int]:
        """(parameters, elements) that take Muon."""
        return len(self.matrices), sum(m.param.numel() for m in self.matrices)

    @torch.no_grad()
    def step(self, closure=None):  # noqa: D102 (torch's signature)
        if self.adamw is not None:
            for outer, inner in self.adam_pairs:
                inner["lr"] = outer["lr"]
            self.adamw.step()
        muon = [g for g in self.param_groups if g["muon"]]
        group = muon[0] if muon else None
        lr = group["lr"] * group["lr_ratio"] if group is not None else 0.0
        decay = group["weight_decay"] if group is not None else 0.0
        mu = self.cfg.muon_momentum
        # the momentum and Nesterov steps of every matrix this rank steps, as two foreach calls (on
        # the local rows under fsdp, where gradient and momentum are sharded like the parameter)
        held = [m.param for m in self.matrices
                if m.param.grad is not None and not (self.shard_state and id(m.param) not in self.owned)]
        update: dict[int, torch.Tensor] = {}
        if held:
            grads, bufs = [local(p.grad) for p in held], []
            for p in held:
                state = self.state[p]
                buf = state.get("momentum_buffer")
                if buf is None:
                    buf = state["momentum_buffer"] = torch.zeros_like(p.grad)
                bufs.append(local(buf))
            torch._foreach_lerp_(bufs, grads, 1 - mu)
            news = torch._foreach_lerp(grads, bufs, mu) if self.cfg.muon_nesterov else bufs
            update = {id(p): u for p, u in zip(held, news, strict=True)}
        for share_group, size, rank, items in self.shares:
            if self.sharded:
                self._step_sharded(share_group, size, rank, items, update, lr, decay)
                continue
            work = [(plan, update[id(p)]) for p, plan, owner in items
                    if owner == rank and plan is not None and id(p) in update]
            self._apply(work, [plan.param for plan, _ in work], lr, decay)
            for owner in range(size) if size > 1 else ():  # the owners' new values to the other ranks
                held = [p for p, _, o in items if o == owner and p.grad is not None]
                if not held:
                    continue
                flat = (torch.cat([p.detach().reshape(-1) for p in held]) if owner == rank else
                        torch.empty(sum(p.numel() for p in held), dtype=held[0].dtype, device=held[0].device))
                dist.broadcast(flat, src=dist.get_global_rank(share_group, owner), group=share_group)
                if owner != rank:
                    torch._foreach_copy_(held, [piece.view_as(p) for p, piece in
                                                zip(held, flat.split([p.numel() for p in held]), strict=True)])
        return None

    def _apply(self, work: list[tuple[MatrixParam, torch.Tensor]], targets: list[torch.Tensor], lr: float,
               decay: float) -> None:
        """Decay and step ``targets`` (each work's parameter, or its local tensor) by ``work``'s
        orthogonalised updates: the matrices that need no tp cut straight from Newton-Schulz's
        batches into the parameter's pieces (one foreach call), the tp-gathered ones cut back first."""
        if not work:
            return
        torch._foreach_mul_(targets, 1 - lr * decay)
        into: list[torch.Tensor] = []
        steps: list[torch.Tensor] = []
        for (plan, _), target, (gathered, pieces) in zip(work, targets, self._orthogonalised(work, lr), strict=True):
            if gathered:  # tp-gathered: the whole delta, then this rank's shard of it
                target.sub_(self._delta(plan, pieces))
                continue
            into.extend(target.unbind(0) if plan.experts else target.split([x.size(0) for x in pieces], 0))
            steps.extend(pieces)
        if into:
            torch._foreach_sub_(into, steps)

    def _step_sharded(self, group: dist.ProcessGroup | None, size: int, rank: int,
                      items: list[tuple[nn.Parameter, MatrixParam | None, int]],
                      update: dict[int, torch.Tensor], lr: float, decay: float) -> None:
        """fsdp: each matrix's local rows of ``update`` to its owner (one all-to-all over ``group``),
        orthogonalised whole there, each rank's rows of the step back (a second one), every rank
        stepping its own shard."""
        held = [(p, plan, o) for p, plan, o in items if plan is not None and id(p) in update]
        if not held:
            return
        if size == 1:
            work = [(plan, update[id(p)]) for p, plan, _ in held]
            self._apply(work, [local(p) for p, _, _ in held], lr, decay)
            return
        mine = [(p, plan) for p, plan, o in held if o == rank]
        ref = update[id(held[0][0])]

        def rows_of(p: torch.Tensor) -> list[tuple[int, int]]:  # (first row, rows) on each rank: fully_shard's cut
            per = -(-p.shape[0] // size)
            return [(min(r * per, p.shape[0]), max(0, min(per, p.shape[0] - r * per))) for r in range(size)]

        cuts = {id(p): rows_of(p) for p, _ in mine}
        row = {id(p): math.prod(p.shape[1:]) for p, _ in mine}
        sent = [sum(update[id(p)].numel() for p, _, o in held if o == r) for r in range(size)]
        got = [sum(cuts[id(p)][r][1] * row[id(p)] for p, _ in mine) for r in range(size)]
        flat = [update[id(p)].reshape(-1) for r in range(size) for p, _, o in held if o == r]
        send = torch.cat(flat) if flat else ref.new_empty(0)
        recv = ref.new_empty(sum(got))
        dist.all_to_all_single(recv, send, got, sent, group=group)
        parts = [piece.split([cuts[id(p)][r][1] * row[id(p)] for p, _ in mine])
                 for r, piece in enumerate(recv.split(got))]
        work = [(plan, torch.cat([parts[r][i].view(cuts[id(p)][r][1], *p.shape[1:]) for r in range(size)]))
                for i, (p, plan) in enumerate(mine)]
        deltas = [self._delta(plan, pieces) if gathered else (torch.stack(pieces) if plan.experts else torch.cat(pieces))
                  for (plan, _), (gathered, pieces) in zip(work, self._orthogonalised(work, lr), strict=True)]
        back = [d[first:first + n].reshape(-1) for r in range(size)
                for d, (p, _) in zip(deltas, mine, strict=True) for first, n in [cuts[id(p)][r]]]
        send = torch.cat(back) if back else ref.new_empty(0)
        recv = ref.new_empty(sum(sent))
        dist.all_to_all_single(recv, send, sent, got, group=group)
        shards = [local(p) for r in range(size) for p, _, o in held if o == r]
        torch._foreach_mul_(shards, 1 - lr * decay)
        torch._foreach_sub_(shards, [piece.view_as(t) for t, piece in
                                     zip(shards, recv.split([t.numel() for t in shards]), strict=True)])

    @torch.no_grad()
    def replicate_state(self) -> None:
        """``shard_state``: every rank gets every parameter's state from its owner (collective over
        the groups), so a save writes the whole state as without sharding; :meth:`drop_unowned_state`
        after. A no-op without sharding."""
        if not self.shard_state:
            return
        for share_group, size, rank, items in self.shares:
            if share_group is None or size == 1:
                continue
            for owner in range(size):
                src = dist.get_global_rank(share_group, owner)
                held = [p for p, _, o in items if o == owner]
                # each state's (key, shape, dtype, on the host?, the value of a 0-dim one): AdamW's step
                # is a 0-dim host tensor unless fused
                box: list[Any] = [[[(k, tuple(t.shape), t.dtype, t.device.type == "cpu", t.item() if t.dim() == 0 else None)
                         for k, t in sorted(self.state.get(p, {}).items())] for p in held] if owner == rank else None]
                dist.broadcast_object_list(box, src=src, group=share_group, device=held[0].device if held else None)
                for p, entries in zip(held, box[0], strict=True):
                    for key, shape, dtype, on_host, value in entries:
                        if value is not None:
                            if owner != rank:
                                self.state[p][key] = torch.tensor(value, dtype=dtype,
                                                                  device="cpu" if on_host else p.device)
                            continue
                        buf = self.state[p][key] if owner == rank else torch.empty(shape, dtype=dtype, device=p.device)
                        dist.broadcast(buf, src=src, group=share_group)
                        self.state[p][key] = buf

    def drop_unowned_state(self) -> None:
        """``shard_state``: forget the state of the parameters this rank does not own (after a save's
        :meth:`replicate_state`, or a load, which sets every parameter's)."""
        if self.shard_state:
            for p in list(self.state):
                if id(p) not in self.owned:
                    del self.state[p]

    def _orthogonalised(self, work: list[tuple[MatrixParam, torch.Tensor]], lr: float
                        ) -> list[tuple[bool, list[torch.Tensor]]]:
        """For each ``(plan, local update)`` of ``work``: (whether it was tp-gathered, so that its
        pieces make the whole matrix rather than this rank's; its pieces ``lr x scale x NS(update)``:
        q, k, v apart, each expert apart, in the parameter's order). The matrices of one shape and
        scale (q, k, v, the experts, like layers) are orthogonalised as one batch and scaled in place."""
        mode, steps = self.cfg.muon_scale, self.cfg.muon_ns_steps
        gathered: list[bool] = []
        pieces_of: list[list[torch.Tensor]] = []
        jobs: dict[tuple[Any, ...], list[tuple[int, int]]] = {}  # (shape, scale) -> (work, piece)
        for plan, full in work:
            tp = self.tp_group if plan.tp_dim is not None else None
            tp_size = dist.get_world_size(tp) if tp is not None else 1
            if tp_size > 1:
                shards = all_gather_first_dim(full.unsqueeze(0).contiguous(), tp).unbind(0)
                full = unshard(shards, int(plan.tp_dim or 0), plan.split_sizes)
            if plan.experts:  # [in, out] each: the scale of the out x in matrix
                pieces = full.unbind(0)
                scales = [lr_scale(full.size(2), full.size(1), mode)] * len(pieces)
            else:
                rows = plan.parts or [full.size(0)]
                if sum(rows) != full.size(0):  # blockwise at tp > 1: this shard's rows of each part
                    rows = [r * full.size(0) // sum(rows) for r in rows]
                pieces = full.split(rows, dim=0)
                scales = [lr_scale(x.size(0), x.size(1), mode) for x in pieces]
            for j, (x, scale) in enumerate(zip(pieces, scales, strict=True)):
                jobs.setdefault((tuple(x.shape), scale), []).append((len(pieces_of), j))
            gathered.append(tp_size > 1)
            pieces_of.append(list(pieces))
        for (_, scale), idx in jobs.items():
            batch = newton_schulz(torch.stack([pieces_of[i][j] for i, j in idx]), steps, self.ns_dtype).float()
            batch.mul_(lr * scale)
            for (i, j), y in zip(idx, batch.unbind(0), strict=True):
                pieces_of[i][j] = y
        return list(zip(gathered, pieces_of, strict=True))

    def _delta(self, plan: MatrixParam, pieces: list[torch.Tensor]) -> torch.Tensor:
        """A tp-gathered matrix's step from its orthogonalised pieces, cut to this rank's tp shard."""
        delta = (torch.stack(pieces) if plan.experts else torch.cat(pieces, dim=0)).to(plan.param.dtype)
        tp = self.tp_group
        assert tp is not None  # only tp-gathered matrices come here
        return shard(delta, int(plan.tp_dim or 0), dist.get_rank(tp), dist.get_world_size(tp), plan.split_sizes)
