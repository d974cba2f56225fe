"""The checkpoint writers of earlier tokenloom versions, kept only to make fixtures that the
readers of those formats must still load: the one-process ``model.pt`` + ``optimizer.pt``
(rank 0 wrote all) and the per-(tp, pp) ``shard_tp{t}_pp{p}.pt`` files of dp rank 0, with
ZeRO-1's optimizer state gathered into them."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tokenloom.train.checkpoint import commit as checkpoint
from tokenloom.train.checkpoint.async_save import CheckpointSaver
from tokenloom.train.checkpoint.reshard import split_info
from tokenloom.train.runtime import collective


def one_process_files(model: torch.nn.Module, optimizer: torch.optim.Optimizer, rank: int) -> dict[str, Any]:
    """This rank's files of the one-process format: its RNG states, and on rank 0 the model's and
    optimizer's state dicts."""
    files: dict[str, Any] = {f"rng_rank{rank}.pt": checkpoint.capture_rng()}
    if rank == 0:
        files["model.pt"] = model.state_dict()
        files["optimizer.pt"] = optimizer.state_dict()
    return files


def save(root: str | os.PathLike, iteration: int, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
         state: dict, rank: int = 0, barrier: Callable[[], None] = lambda: None,
         keep_last: int = 0, world_size: int = 1) -> Path:
    """A one-process-format checkpoint of ``iteration`` under ``root``, committed as every checkpoint is."""
    return checkpoint.save_files(root, iteration, checkpoint.write_torch_files(one_process_files(model, optimizer, rank)),
                                 state, rank=rank, barrier=barrier, keep_last=keep_last, world_size=world_size)


def shard_files(run) -> dict[str, Any]:
    """Collective with ZeRO-1: this rank's files of the per-shard format (its RNG states, and on
    dp rank 0 its ``shard_tp{t}_pp{p}.pt``), as the earlier ``reshard.files`` wrote them."""
    cfg, st = run.cfg, run.state
    zero_states, zero_index = None, {}
    if cfg.zero1:
        zero_states = collective("ZeRO-1 optimizer state gather", run.optimizer.gathered_param_states)
        zero_index = {id(p): i for i, p in enumerate(run.optimizer.params)}
    rng = checkpoint.capture_rng()
    if run.rng_tracker is not None:
        rng["tp_tracker"] = run.rng_tracker.get_states()
    out: dict[str, Any] = {f"rng_rank{st.rank}.pt": rng}
    if st.dp_rank == 0:
        params, meta, optim = {}, {}, {}
        for stage in run.chunks:
            for pname, p in stage.named_parameters(remove_duplicate=False):
                params[pname] = p.detach().clone()
                meta[pname] = split_info(run, pname, p)
                if cfg.zero1:
                    found = zero_states[zero_index[id(p)]] if zero_states is not None and id(p) in zero_index else None
                else:
                    found = run.optimizer.state.get(p)
                if found:
                    optim[pname] = {k: v.detach().clone() for k, v in found.items()}
        out[f"shard_tp{st.tp_rank}_pp{st.pp_rank}.pt"] = {"params": params, "meta": meta, "optim": optim,
                                                          "tp_rank": st.tp_rank}
    return out


def save_shards(run, root: Path, iteration: int, state: dict) -> Path:
    """Collective: a per-shard-format checkpoint of ``run`` (a Strategy) under ``root``,
    synchronously; ``state`` is its ``state.json`` (with the run's ``layout``, as the earlier
    writer recorded it)."""
    saver = CheckpointSaver(root, rank=run.world.rank, world_size=run.world.size, keep_last=0, asynchronous=False,
                            pin_memory=False, timeout_s=60.0)
    return saver.save(iteration, lambda: shard_files(run), state, fresh_copies=True)
