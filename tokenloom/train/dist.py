"""Process-group setup from the launcher's environment (torchrun / our test harness).

Reads the standard variables ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``
and ``MASTER_PORT``. The backend is NCCL when CUDA is available, gloo otherwise. The
``timeout_s`` is the collective timeout: a rank that dies or stalls makes the others
raise after at most this long instead of hanging (gloo usually notices a closed peer
socket much sooner). Keep it short in tests; in production NCCL runs it should cover
the slowest legitimate gap between collectives (checkpoint saves, evals).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from tokenloom.errors import TokenloomError

_REQUIRED = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits in the job."""

    rank: int
    world_size: int
    local_rank: int
    backend: str
    device: torch.device


def init_from_env(backend: str | None = None, timeout_s: float = 600.0) -> DistInfo:
    """Initialise the default process group from env vars and return :class:`DistInfo`.

    ``backend=None`` picks ``"nccl"`` when CUDA is available, else ``"gloo"``. With NCCL
    the current CUDA device is set to ``LOCAL_RANK`` before the group is created.
    Idempotent: if a default group already exists it is described, not recreated.
    """
    if dist.is_initialized():
        return _describe(dist.get_backend())
    missing = [k for k in _REQUIRED if k not in os.environ]
    if missing:
        raise TokenloomError(
            f"distributed launch variables missing: {', '.join(missing)}; "
            "start the job with torchrun (or set RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)"
        )
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        if not torch.cuda.is_available():
            raise TokenloomError("backend 'nccl' needs CUDA, but no CUDA device is visible; use 'gloo'")
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(
        backend=backend,
        init_method="env://",
        rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
        timeout=timedelta(seconds=timeout_s),
    )
    return _describe(backend)


def _describe(backend: str) -> DistInfo:
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")
    return DistInfo(dist.get_rank(), dist.get_world_size(), local_rank, backend, device)
