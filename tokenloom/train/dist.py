"""Process-group setup from the launcher's environment (torchrun, Slurm's srun, our tests).

Reads ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``; in a Slurm
step without torchrun :func:`launch_env` derives them from Slurm's variables (as Lightning and
torchtitan do), set variables winning. The backend is :func:`resolve_backend`'s; gloo with CUDA
is :mod:`tokenloom.train.staged_gloo`'s group. ``timeout_s`` bounds how long a dead or stalled
rank leaves the others hanging: short in tests, longer than any legitimate gap (saves, evals).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from tokenloom.errors import TokenloomError
from tokenloom.train import staged_gloo

_REQUIRED = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits in the job."""

    rank: int
    world_size: int
    local_rank: int
    backend: str
    """The default group's backend name (``nccl``, ``gloo`` or the staged one)."""
    device: torch.device


def first_host(nodelist: str) -> str:
    """The first host of a Slurm host list, ``gpu[07-09,12],cpu1`` -> ``gpu07`` (no ``scontrol`` needed)."""
    found = re.match(r"[^,\[]*(?:\[[^\]]*\][^,\[]*)*", nodelist.strip())
    item = found.group(0) if found else ""  # the pattern matches the empty string: always found
    return re.sub(r"\[([^\]]*)\]", lambda m: re.split(r"[,-]", m.group(1))[0], item)


def launch_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's launch variables: as set, else from an srun step's Slurm variables, else one process."""
    env = os.environ if environ is None else environ
    out = {k: env[k] for k in (*_REQUIRED, "LOCAL_RANK") if k in env}
    tasks = env.get("SLURM_STEP_NUM_TASKS") or env.get("SLURM_NTASKS")
    if "RANK" not in env and "SLURM_PROCID" in env and tasks and int(tasks) > 1:
        nodes = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
        master = env.get("MASTER_ADDR") or (first_host(nodes) if nodes else "")
        if not master:  # (an empty MASTER_ADDR without a node list crashed in first_host)
            raise TokenloomError("a Slurm task without a node list (SLURM_STEP_NODELIST); set MASTER_ADDR "
                                 "to rank 0's host")
        step = int(env.get("SLURM_STEP_ID", "0")) if env.get("SLURM_STEP_ID", "0").isdigit() else 0
        out = {"RANK": env["SLURM_PROCID"], "WORLD_SIZE": tasks, "LOCAL_RANK": env.get("SLURM_LOCALID", "0"),
               "MASTER_ADDR": master,
               "MASTER_PORT": env.get("MASTER_PORT") or str(15000 + (int(env.get("SLURM_JOB_ID", "0")) + step) % 20000)}
    out.setdefault("WORLD_SIZE", "1")
    out.setdefault("RANK", "0")
    out.setdefault("LOCAL_RANK", "0")
    return out


def cuda_index(local_rank: int) -> int:
    """This rank's GPU: ``LOCAL_RANK`` modulo the visible count (shared GPUs, or one per task)."""
    count = torch.cuda.device_count()
    return local_rank % count if count else local_rank


BACKENDS = ("nccl", "gloo")
"""The values of ``distributed_backend`` (``--distributed-backend``)."""


def resolve_backend(name: str | None) -> str:
    """``nccl`` or ``gloo`` for ``distributed_backend`` ``name`` (None: nccl with CUDA); refuses nccl without CUDA."""
    if name is None:
        return "nccl" if torch.cuda.is_available() else "gloo"
    if name not in BACKENDS:
        raise TokenloomError(f"--distributed-backend {name!r}: not a backend; use one of {', '.join(BACKENDS)}")
    if name == "nccl" and not torch.cuda.is_available():
        raise TokenloomError("--distributed-backend nccl needs CUDA, but no CUDA device is visible; use gloo")
    return name


def init_from_env(backend: str | None = None, timeout_s: float = 600.0) -> DistInfo:
    """Initialise the default process group from env vars (gloo staged with CUDA or forced staging) and
    return :class:`DistInfo`; idempotent: an existing default group is described, not recreated."""
    if dist.is_initialized():
        return _describe(dist.get_backend())
    backend = resolve_backend(backend)
    env = launch_env()
    os.environ.update(env)  # env:// reads them (no-op under torchrun; srun's derived values)
    missing = [k for k in _REQUIRED if k not in env]
    if missing:
        raise TokenloomError(
            f"distributed launch variables missing: {', '.join(missing)}; "
            "start the job with torchrun (or set RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)"
        )
    if torch.cuda.is_available():
        torch.cuda.set_device(cuda_index(int(env["LOCAL_RANK"])))
    if backend == "gloo" and (torch.cuda.is_available() or os.environ.get(staged_gloo.STAGE_ALL_ENV) == "1"):
        staged_gloo.register()
        backend = staged_gloo.BACKEND
    dist.init_process_group(
        backend=backend,
        init_method="env://",  # torchrun's agent store is reused only through env://
        rank=int(env["RANK"]),
        world_size=int(env["WORLD_SIZE"]),
        timeout=timedelta(seconds=timeout_s),
    )
    return _describe(backend)


def _describe(backend: str) -> DistInfo:
    local_rank = int(launch_env()["LOCAL_RANK"])
    on_gpu = backend != "gloo" and torch.cuda.is_available()  # plain gloo: a CPU run
    device = torch.device("cuda", cuda_index(local_rank)) if on_gpu else torch.device("cpu")
    return DistInfo(dist.get_rank(), dist.get_world_size(), local_rank, backend, device)
