"""Process-group setup from the launcher's environment (torchrun, Slurm's srun, our tests).

Reads the standard variables ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``
and ``MASTER_PORT``; where torchrun did not set them and the process is one task of a
Slurm step (``srun -n N python cli.py train ...``, no torchrun), :func:`launch_env` derives
them from ``SLURM_PROCID``, ``SLURM_STEP_NUM_TASKS`` (else ``SLURM_NTASKS``),
``SLURM_LOCALID``, the first host of the step's node list and a port from the job and
step ids (as Lightning and torchtitan's Slurm scripts do). Variables already set win, so
torchrun started by srun (one task per node) keeps torchrun's ranks. The backend
(:func:`resolve_backend`) is the run's ``distributed_backend``, by default NCCL when CUDA is
available and gloo otherwise; gloo with CUDA is :mod:`tokenloom.train.staged_gloo`'s group, the
ranks on their GPUs (several may share one: :func:`cuda_index`). The
``timeout_s`` is the collective timeout: a rank that dies or stalls makes the others
raise after at most this long instead of hanging (gloo usually notices a closed peer
socket much sooner). Keep it short in tests; in production NCCL runs it should cover
the slowest legitimate gap between collectives (checkpoint saves, evals).
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
    """``torch.distributed``'s name of the default group's backend (``nccl``, ``gloo`` or
    :data:`~tokenloom.train.staged_gloo.BACKEND`)."""
    device: torch.device


def first_host(nodelist: str) -> str:
    """The first host of a Slurm host list: ``gpu[07-09,12],cpu1`` -> ``gpu07``.

    Slurm's own expansion (``scontrol show hostnames``) is not on every compute node's
    PATH and runs a process per rank; rank 0 runs on the first host, which is all we need.
    """
    found = re.match(r"[^,\[]*(?:\[[^\]]*\][^,\[]*)*", nodelist.strip())
    item = found.group(0) if found else ""  # the pattern matches the empty string: always found
    return re.sub(r"\[([^\]]*)\]", lambda m: re.split(r"[,-]", m.group(1))[0], item)


def launch_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT`` of this
    process: torchrun's (or anyone's) where set, else derived from an srun step's Slurm
    variables, else a single process (``WORLD_SIZE`` 1)."""
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
    """This rank's GPU among the visible ones: ``LOCAL_RANK`` modulo the visible count. Fewer
    GPUs than local ranks means ranks share them (gloo: several ranks on one GPU), or that the
    launcher already narrowed ``CUDA_VISIBLE_DEVICES`` per task (``srun --gpus-per-task 1``
    leaves each task one device, ``cuda:0``, whatever its local rank)."""
    count = torch.cuda.device_count()
    return local_rank % count if count else local_rank


BACKENDS = ("nccl", "gloo")
"""The values of ``distributed_backend`` (``--distributed-backend``)."""


def resolve_backend(name: str | None) -> str:
    """The backend a run of ``distributed_backend`` ``name`` uses: ``nccl`` or ``gloo`` (None:
    nccl with CUDA, else gloo); one line for a name that is not one, and for nccl without CUDA."""
    if name is None:
        return "nccl" if torch.cuda.is_available() else "gloo"
    if name not in BACKENDS:
        raise TokenloomError(f"--distributed-backend {name!r}: not a backend; use one of {', '.join(BACKENDS)}")
    if name == "nccl" and not torch.cuda.is_available():
        raise TokenloomError("--distributed-backend nccl needs CUDA, but no CUDA device is visible; use gloo")
    return name


def init_from_env(backend: str | None = None, timeout_s: float = 600.0) -> DistInfo:
    """Initialise the default process group from env vars and return :class:`DistInfo`.

    ``backend`` is :func:`resolve_backend`'s. With CUDA the current device is set to
    :func:`cuda_index` first, and gloo is :class:`~tokenloom.train.staged_gloo.StagedGloo`
    (also without CUDA when ``TOKENLOOM_GLOO_STAGE_ALL=1`` forces its staging: the tests' way to
    run that path on a CPU). Idempotent: if a default group already exists it is described,
    not recreated.
    """
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
