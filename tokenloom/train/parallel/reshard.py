"""Per-rank checkpoints of tp x pp x dp runs, loadable into any other layout.

Layout on disk (``CKPT_DIR/iter_NNNNNNN/``, same names, ``COMPLETE`` marker and ``latest``
file as :mod:`tokenloom.train.checkpoint`)::

    state.json              iteration, consumed samples, data fingerprint, config, layout
    shard_tp{t}_pp{p}.pt    written by the dp-rank-0 rank at (t, p): its local parameter
                            shards and AdamW states (step, moments) by one-process name,
                            with each tensor's partition dim and split sizes; with ZeRO-1
                            the same AdamW states, gathered from the dp ranks' shards
                            (:meth:`ZeroAdamW.gathered_param_states`)
    rng_rank{r}.pt          every rank's RNG state (with the tensor-parallel dropout stream at tp > 1)

Loading (:func:`load`, Megatron's "dist checkpointing" idea in its simplest form):
every rank memory-maps the ``shard_*`` files, rebuilds each full tensor *it holds* under
its one-process name (:func:`~tokenloom.train.parallel.layers.unshard` over the saved tp ranks, a
replicated tensor from tp rank 0) and re-splits it for its own ``(tp, pp, vpp)`` layout
and stage. AdamW moments are elementwise, so they are resharded exactly like their
parameters; a ZeRO-1 rank then cuts its dp shard out of them
(:meth:`ZeroAdamW.load_param_states`). So a checkpoint of any layout, ZeRO-1 or not,
loads into any other, and so does a one-process checkpoint (``model.pt`` +
``optimizer.pt`` of :mod:`tokenloom.train.checkpoint`, the format of runs at tp = pp = 1
without ZeRO-1: its optimizer's parameter order is rebuilt from a ``meta`` copy of the
model). The data position is the consumed-samples count, valid at any dp size.

Trade-offs: a rank reads the full tensors of the parameters it holds (host memory of those,
not of the model), where Megatron reads only its slices. dp replicas are identical, so only dp
rank 0 writes parameters; with ZeRO-1 it also gathers the optimizer shards and holds the full
AdamW state of its model-parallel part while saving (as Megatron's ``dp_reshardable``). RNG
states are restored only when the layout is unchanged (dropout streams have no meaning across
layouts). Per-rank ``zero_rank{r}.pt`` optimizer files are not a format this reads: they are refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from tokenloom.errors import TokenloomError
from tokenloom.train import checkpoint
from tokenloom.train.model import GPT
from tokenloom.train.optim import param_groups
from tokenloom.train.parallel.layers import shard, unshard
from tokenloom.train.runtime import collective

if TYPE_CHECKING:
    from tokenloom.train.async_save import CheckpointSaver


def _layout(run) -> dict[str, Any]:
    c = run.cfg
    return {"tp": c.tp, "pp": c.pp, "vpp": c.vpp, "dp": run.state.dp_size, "zero1": c.zero1}


def _named_params(run) -> dict[str, torch.nn.Parameter]:
    out = {}
    for stage in run.chunks:
        for name, p in stage.named_parameters(remove_duplicate=False):
            out[name] = p
    return out


def _split_info(run, name: str, p: torch.nn.Parameter) -> tuple[int | None, list[int] | None]:
    if not getattr(p, "tensor_model_parallel", False):
        return None, None
    for stage in run.chunks:
        try:
            module = stage.get_submodule(name.rsplit(".", 1)[0])
        except AttributeError:
            continue
        return p.partition_dim, getattr(module, "split_sizes", None)  # type: ignore[attr-defined]  # Megatron's tag on the Parameter
    raise TokenloomError(f"no module owns {name}")


def save(run, iteration: int, run_state: dict, saver: CheckpointSaver) -> Path:
    """Collective: save ``iteration``'s checkpoint of ``run`` (a
    :class:`~tokenloom.train.strategy.Strategy`) through ``saver`` (synchronously or in the
    background); ``run_state`` (consumed samples, data fingerprint, config...) goes into
    ``state.json`` with the layout. Returns its directory. Written, committed and failing as
    :func:`tokenloom.train.checkpoint.save_files` says."""
    return saver.save(iteration, lambda: files(run), {**run_state, "layout": _layout(run)}, fresh_copies=True)


def files(run) -> dict[str, Any]:
    """Collective with ZeRO-1 (its optimizer-state gather over dp): this rank's files (name ->
    what ``torch.save`` writes): its RNG states, and on dp rank 0 its shard. The shard's tensors
    are live views (of the parameters, of the gathered states), to be copied before they are
    written (:class:`~tokenloom.train.async_save.HostStaging`)."""
    cfg, st = run.cfg, run.state
    zero_states, zero_index = None, {}
    if cfg.zero1:  # a collective over dp, before any file is written
        zero_states = collective("ZeRO-1 optimizer state gather", run.optimizer.gathered_param_states)
        zero_index = {id(p): i for i, p in enumerate(run.optimizer.params)}
    rng = checkpoint.capture_rng()
    if run.rng_tracker is not None:  # tp > 1: the tensor-parallel dropout stream too
        rng["tp_tracker"] = run.rng_tracker.get_states()
    out: dict[str, Any] = {f"rng_rank{st.rank}.pt": rng}
    if st.dp_rank == 0:
        params, meta, optim = {}, {}, {}
        for pname, p in _named_params(run).items():
            params[pname] = p.detach()
            meta[pname] = _split_info(run, pname, p)
            if cfg.zero1:  # ZeRO-1 holds the trainable parameters only
                found = zero_states[zero_index[id(p)]] if zero_states is not None and id(p) in zero_index else None
            else:
                found = run.optimizer.state.get(p)
            if found:
                optim[pname] = {k: v.detach() for k, v in found.items()}
        out[f"shard_tp{st.tp_rank}_pp{st.pp_rank}.pt"] = {"params": params, "meta": meta, "optim": optim,
                                                          "tp_rank": st.tp_rank}
    return out


def full_tensors(path: Path, names: set[str] | None = None
                 ) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, torch.Tensor]]]:
    """Full parameters and AdamW states by one-process name from a checkpoint's shard files
    (only ``names`` when given). Files are memory-mapped, so a rank reads the bytes of the
    tensors it asks for, not the whole checkpoint."""
    pieces: dict[str, list[tuple[int, torch.Tensor, Any]]] = {}
    opt_pieces: dict[str, dict[str, list[tuple[int, torch.Tensor]]]] = {}
    for f in sorted(path.glob("shard_tp*_pp*.pt")):
        data = torch.load(f, weights_only=True, mmap=True, map_location="cpu")
        t = data["tp_rank"]
        for name, tensor in data["params"].items():
            if names is None or name in names:
                pieces.setdefault(name, []).append((t, tensor, data["meta"][name]))
        for name, st in data["optim"].items():
            if names is None or name in names:
                for k, v in st.items():
                    opt_pieces.setdefault(name, {}).setdefault(k, []).append((t, v))
    params: dict[str, torch.Tensor] = {}
    optim: dict[str, dict[str, Any]] = {}
    for name, items in pieces.items():
        items.sort(key=lambda x: x[0])
        dim, sizes = items[0][2]
        params[name] = items[0][1] if dim is None else unshard([x[1] for x in items], dim, sizes)
        if name in opt_pieces:
            optim[name] = {}
            for k, vs in opt_pieces[name].items():
                vs.sort(key=lambda x: x[0])
                if dim is None or vs[0][1].dim() == 0:
                    optim[name][k] = vs[0][1]
                else:
                    optim[name][k] = unshard([v for _, v in vs], dim, sizes)
    return params, optim


def one_process_tensors(path: Path, run) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, torch.Tensor]]]:
    """:func:`full_tensors` of a one-process checkpoint (``model.pt``, ``optimizer.pt``):
    the optimizer's states are keyed by position in :func:`~tokenloom.train.optim.param_groups`
    order, which a ``meta`` copy of ``run``'s model gives back as names."""
    params = checkpoint.load_tensors(path, "model.pt")
    saved = checkpoint.load_tensors(path, "optimizer.pt")
    model = GPT(run.cfg.model, device="meta")
    order = [p for g in param_groups(model, 0.0) for p in g["params"]]
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    if sum(len(g["params"]) for g in saved["param_groups"]) != len(order):
        raise TokenloomError(f"{path}: the optimizer state has {sum(len(g['params']) for g in saved['param_groups'])} "
                             f"parameters, the configured model {len(order)}; was it trained with another model?")
    optim = {name: state for i, state in saved["state"].items() for name in names[id(order[int(i)])]}
    return params, optim


def model_tensors(path: Path, state: dict) -> dict[str, torch.Tensor]:
    """The full parameters by one-process name of the checkpoint at ``path`` (``state``: its
    ``state.json``) of any layout: the shard files (memory-mapped) or the one-process ``model.pt``."""
    if state.get("layout") is not None:
        return full_tensors(path)[0]
    return checkpoint.load_tensors(path, "model.pt")


@torch.no_grad()
def load(run, path: Path, state: dict) -> None:
    """Load the checkpoint at ``path`` (``state``: its ``state.json``) into ``run``, a
    :class:`~tokenloom.train.strategy.Strategy` of any layout."""
    st = run.state
    saved = state.get("layout")
    if saved is not None and (path / "zero_rank0.pt").exists():
        raise TokenloomError(f"{path} holds ZeRO-1 optimizer state in the per-rank zero_rank*.pt files of an earlier "
                             "tokenloom, which this version does not read; resume it with the version that wrote it")
    same = saved == _layout(run)
    if saved is None:
        params, optim = one_process_tensors(path, run)
    else:
        params, optim = full_tensors(path, set(_named_params(run)))
    load_params(run, params, optim, str(path))
    rng = path / f"rng_rank{st.rank}.pt"
    if same and rng.exists():
        rng_state = torch.load(rng, weights_only=True)
        checkpoint.restore_rng(rng_state)
        if run.rng_tracker is not None and "tp_tracker" in rng_state:
            run.rng_tracker.set_states(rng_state["tp_tracker"])


@torch.no_grad()
def load_params(run, params: Mapping[str, torch.Tensor], optim: Mapping[str, dict[str, torch.Tensor]],
                where: str) -> None:
    """Set ``run``'s parameters (any layout) from full one-process tensors ``params`` by name,
    each rank cutting out the shard it holds; ``optim``: AdamW states by the same names (the
    parameters without one, or all when it is empty, start with fresh moments). ``where`` names
    the source in errors. The parameter part of :func:`load`, also used to start from a
    Hugging Face model (:mod:`tokenloom.train.hf`)."""
    cfg, st = run.cfg, run.state
    zero_index = {id(p): i for i, p in enumerate(run.optimizer.params)} if cfg.zero1 else {}
    zero_states: list[dict[str, torch.Tensor] | None] = [None] * len(zero_index)
    tp_rank, tp = st.tp_rank, st.tp_size
    done = set()
    for name, p in _named_params(run).items():
        if id(p) in done:
            continue
        done.add(id(p))
        if name not in params:
            raise TokenloomError(f"{where} has no tensor {name}; was it trained with another model?")
        dim, sizes = _split_info(run, name, p)

        def local(full: torch.Tensor, dim=dim, sizes=sizes) -> torch.Tensor:
            return full if dim is None or full.dim() == 0 else shard(full, dim, tp_rank, tp, sizes)

        p.copy_(local(params[name]))
        if name not in optim:
            continue
        if cfg.zero1:
            if id(p) in zero_index:  # a trainable parameter (the only ones ZeRO-1 holds)
                zero_states[zero_index[id(p)]] = {k: local(v) for k, v in optim[name].items()}
        else:  # the parameter is the plain AdamW's master copy: a ZeRO-1 master_param is not kept
            run.optimizer.state[p] = {k: local(v).to(p.device).clone() for k, v in optim[name].items()
                                      if k != "master_param"}
    if cfg.zero1:
        run.optimizer.load_param_states(zero_states)
