"""Checkpoints of a :class:`~tokenloom.train.strategy.Strategy` of any layout: the adapter between a
run and the on-disk format of :mod:`tokenloom.train.checkpoint.format`.

Saving (:func:`save`, :func:`files`): every rank lists its parameters under one-process names
(:class:`~.format.LocalParam`: local tp shard, split info, optimizer states; ZeRO-1's own pieces
without a gather) and writes its piece file and ``rng_rank{r}.pt`` (with the tp dropout stream);
one process writes the same format; ``state.json`` gets the layout.

Loading (:func:`load`): every rank reads the full tensors it holds, by one-process name, from any
format, and cuts its own ``(tp, pp, vpp)`` shard (:func:`load_params`). AdamW moments are
elementwise, so they reshard like their parameters; ZeRO-1 then cuts its dp shard. The data
position is the consumed-samples count, valid at any dp size.

Trade-offs: a rank holds the full tensors of its parameters in host memory (Megatron reads only its
slices). RNG states are restored only for an unchanged layout (streams mean nothing across
layouts). An earlier tokenloom's ``zero_rank{r}.pt`` optimizer files are refused.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from tokenloom.errors import TokenloomError
from tokenloom.train.checkpoint import commit as checkpoint
from tokenloom.train.checkpoint import format as ckpt_format
from tokenloom.train.model.gpt import GPT
from tokenloom.train.optim.adamw import param_groups
from tokenloom.train.optim.zero import ZeroAdamW
from tokenloom.train.parallel import fsdp

if TYPE_CHECKING:
    from tokenloom.train.checkpoint.async_save import CheckpointSaver


def _layout(run) -> dict[str, Any]:
    c = run.cfg
    layout = {"tp": c.tp, "pp": c.pp, "vpp": c.vpp, "dp": run.state.dp_size, "zero1": c.zero1}
    if c.cp > 1:  # the keys only where they are on: earlier layouts compare equal
        layout["cp"] = c.cp
    if c.fsdp:
        layout["fsdp"] = True
    if c.ep > 1:
        layout["ep"] = c.ep
    return layout


def _named_params(run) -> dict[str, torch.nn.Parameter]:
    out = {}
    for stage in run.chunks:
        for name, p in stage.named_parameters(remove_duplicate=False):
            out[name] = p
    return out


def split_info(run, name: str, p: torch.nn.Parameter) -> tuple[int | None, list[int] | None]:
    """(partition dim, fused split sizes) of parameter ``name`` over tp; (None, None): replicated."""
    if not getattr(p, "tensor_model_parallel", False):
        return None, None
    for stage in run.chunks:
        try:
            module = stage.get_submodule(name.rsplit(".", 1)[0])
        except AttributeError:
            continue
        return p.partition_dim, getattr(module, "split_sizes", None)  # type: ignore[attr-defined]  # Megatron's tag on the Parameter
    raise TokenloomError(f"no module owns {name}")


def expert_rows(run, name: str, p: torch.nn.Parameter) -> int | None:
    """The layer's first expert in an ep rank's share ``name``; None for other parameters."""
    if not getattr(p, "expert_parallel", False):
        return None
    module_name = name.rsplit(".", 1)[0]
    for stage in run.chunks:
        try:
            return stage.get_submodule(module_name).first
        except AttributeError:
            continue
    raise TokenloomError(f"no module owns {name}")


def _gather_experts(run, t: torch.Tensor) -> torch.Tensor:
    """The whole layer's experts from every ep rank's share ``t`` (collective over the ep group)."""
    parts = [torch.empty_like(t) for _ in range(run.cfg.ep)]
    dist.all_gather(parts, t.contiguous(), group=run.state.ep_group)
    return torch.cat(parts)


def _each_once(named: Iterable[tuple[str, torch.nn.Parameter]]) -> list[tuple[str, torch.nn.Parameter, list[str]]]:
    """Each parameter once, under its first name, with its other names (tied weights) as aliases."""
    by_id: dict[int, tuple[str, torch.nn.Parameter, list[str]]] = {}
    for name, p in named:
        if id(p) in by_id:
            by_id[id(p)][2].append(name)
        else:
            by_id[id(p)] = (name, p, [])
    return list(by_id.values())


def save(run, iteration: int, run_state: dict, saver: CheckpointSaver, local: Path | None = None) -> Path:
    """Collective: save ``iteration`` through ``saver``; ``run_state`` goes into ``state.json`` with
    the layout. Returns the directory; commit and failures as :func:`.commit.save_files`."""
    return saver.save(iteration, lambda: files(run), {**run_state, "layout": _layout(run)}, fresh_copies=True,
                      local=local)


def placement(run) -> ckpt_format.Placement:
    """This rank's place for the format; cp ranks count as dp ranks (dp x cp share a shard's files)."""
    st = run.state
    return ckpt_format.Placement(tp_rank=st.tp_rank, tp_size=st.tp_size, pp_rank=st.pp_rank,
                                 dp_rank=st.dp_cp_rank, dp_size=st.dp_cp_size)


def local_params(run) -> list[ckpt_format.LocalParam]:
    """This rank's parameters, each once (tied names as aliases), with split info and optimizer
    states (AdamW's whole, ZeRO-1's step and own pieces), as live views; ep experts are gathered
    whole (collective) so any ep loads them, ZeRO-1's pieces of them shifted, not gathered."""
    zero, sharded = isinstance(run.optimizer, ZeroAdamW), run.fsdp_group is not None
    own = run.optimizer.own_param_states() if zero else []
    zero_index = {id(p): i for i, p in enumerate(run.optimizer.params)} if zero else {}
    out = []
    for name, p, aliases in _each_once(_named_params(run).items()):
        dim, sizes = split_info(run, name, p)
        state: dict[str, torch.Tensor] = {}
        pieces: dict[str, tuple[int, torch.Tensor]] = {}
        if zero:
            if id(p) in zero_index:  # ZeRO-1 holds the trainable parameters only
                step, pieces = own[zero_index[id(p)]]
                if step is not None:
                    state["step"] = step
        elif sharded:  # fsdp: this rank's rows of the parameter and of its moments; the step is replicated
            pieces = {ckpt_format.PARAM: fsdp.own_piece(p, p.detach())}
            for k, v in run.optimizer.state.get(p, {}).items():
                if v.dim() == 0:
                    state[k] = v.detach()
                else:
                    pieces[k] = fsdp.own_piece(p, v.detach())
            out.append(ckpt_format.LocalParam(name, torch.empty(p.shape, device="meta"), dim, sizes, tuple(aliases),
                                              state, pieces))
            continue
        else:
            state = {k: v.detach() for k, v in run.optimizer.state.get(p, {}).items()}
        first = expert_rows(run, name, p)
        if first is not None:
            state = {k: v if v.dim() == 0 else _gather_experts(run, v) for k, v in state.items()}
            # ZeRO-1's pieces of this rank's experts: the same elements of the whole layer's tensor
            shift = first * (p.numel() // p.shape[0] if p.dim() else 0)
            pieces = {k: (start + shift, piece) for k, (start, piece) in pieces.items()}
            out.append(ckpt_format.LocalParam(name, _gather_experts(run, p.detach()), dim, sizes, tuple(aliases),
                                              state, pieces))
            continue
        out.append(ckpt_format.LocalParam(name, p.detach(), dim, sizes, tuple(aliases), state, pieces))
    return out


def files(run) -> dict[str, Any]:
    """This rank's files: RNG states and piece file (live views, copied before writing). No collective."""
    st = run.state
    rng = checkpoint.capture_rng()
    if run.rng_tracker is not None:  # tp > 1: the tensor-parallel dropout stream too
        rng["tp_tracker"] = run.rng_tracker.get_states()
    where = placement(run)
    return {f"rng_rank{st.rank}.pt": rng,
            ckpt_format.piece_file(where.tp_rank, where.pp_rank, where.dp_rank): ckpt_format.rank_file(
                local_params(run), where)}


def optimizer_order(model_cfg) -> list[list[str]]:
    """Names of each one-process optimizer position (``param_groups`` order), from a ``meta`` model."""
    model = GPT(model_cfg, device="meta")
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return [names[id(p)] for g in param_groups(model, 0.0) for p in g["params"]]


@torch.no_grad()
def load(run, path: Path, state: dict) -> None:
    """Load a checkpoint of any layout and format (``state``: its ``state.json``) into ``run``."""
    st = run.state
    saved = state.get("layout")
    if saved is not None and (path / "zero_rank0.pt").exists():
        raise TokenloomError(f"{path} holds ZeRO-1 optimizer state in the per-rank zero_rank*.pt files of an earlier "
                             "tokenloom, which this version does not read; resume it with the version that wrote it")
    # RNG streams continue only where they are this rank's own: same layout, or unsharded one-process
    same = saved == _layout(run) if saved is not None else not (run.staged or run.cfg.zero1 or run.cfg.fsdp)
    named = _named_params(run)
    params, optim = ckpt_format.read_any(path, state, set(named), order=lambda: optimizer_order(run.cfg.model),
                                         split=lambda name: split_info(run, name, named[name]),
                                         tp_rank=st.tp_rank, tp_size=st.tp_size)
    if state.get("config", {}).get("optim", {}).get("name", "adamw") != run.cfg.optim.name:
        optim = {}  # another optimizer's state (a resume with force_optimizer): every parameter starts fresh
    load_params(run, params, optim, str(path), sharded=True)
    rng = path / f"rng_rank{st.rank}.pt"
    if same and rng.exists():
        rng_state = torch.load(rng, weights_only=True)
        checkpoint.restore_rng(rng_state)
        if run.rng_tracker is not None and "tp_tracker" in rng_state:
            run.rng_tracker.set_states(rng_state["tp_tracker"])


@torch.no_grad()
def load_params(run, params: Mapping[str, torch.Tensor], optim: Mapping[str, dict[str, torch.Tensor]],
                where: str, *, sharded: bool = False) -> None:
    """Set ``run``'s parameters from one-process tensors by name: full ones, each rank cutting its
    shard, or (``sharded``) this rank's tp shards already; ``optim`` alike (missing: fresh
    moments). ``where`` names the source in errors. Also starts runs from a HF model (:mod:`.hf`)."""
    st = run.state
    zero = isinstance(run.optimizer, ZeroAdamW)
    zero_index = {id(p): i for i, p in enumerate(run.optimizer.params)} if zero else {}
    zero_states: list[dict[str, torch.Tensor] | None] = [None] * len(zero_index)
    tp_rank, tp = st.tp_rank, st.tp_size
    done = set()
    for name, p in _named_params(run).items():
        if id(p) in done:
            continue
        done.add(id(p))
        if name not in params:
            raise TokenloomError(f"{where} has no tensor {name}; was it trained with another model?")
        dim, sizes = split_info(run, name, p)
        first, rows = expert_rows(run, name, p), p.shape[0] if p.dim() else 0

        def local(full: torch.Tensor, dim=dim, sizes=sizes, first=first, rows=rows) -> torch.Tensor:
            if first is not None and full.dim() > 0:  # this ep rank's experts
                return full[first:first + rows]
            return full if sharded else ckpt_format.tp_part(full, dim, sizes, tp_rank, tp)

        value, held = fsdp.cut(p, local(params[name])), fsdp.local(p)
        if value.shape != held.shape:
            raise TokenloomError(f"{where} holds {name} of shape {list(value.shape)} where this rank's model has "
                                 f"{list(held.shape)}; was it trained with another model?")
        held.copy_(value)
        if name not in optim:
            continue
        if zero:
            if id(p) in zero_index:  # a trainable parameter (the only ones ZeRO-1 holds)
                zero_states[zero_index[id(p)]] = {k: local(v) for k, v in optim[name].items()}
        else:  # the parameter is the plain AdamW's master copy: a ZeRO-1 master_param is not kept
            run.optimizer.state[p] = {k: fsdp.like(p, local(v)) for k, v in optim[name].items()
                                      if k != "master_param"}
    if zero:
        run.optimizer.load_param_states(zero_states)


def module_params(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[ckpt_format.LocalParam]:
    """:func:`local_params` of a plain module and its torch optimizer (one process, no Strategy)."""
    return [ckpt_format.LocalParam(name, p.detach(), aliases=tuple(aliases),
                                   state={k: v.detach() for k, v in optimizer.state.get(p, {}).items()})
            for name, p, aliases in _each_once(model.named_parameters(remove_duplicate=False))]
