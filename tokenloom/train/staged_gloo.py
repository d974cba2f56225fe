"""gloo for ranks whose tensors live on a GPU: :class:`StagedGloo`, the process group
``--distributed-backend gloo`` builds when the ranks compute on CUDA (several ranks may then share
one GPU: a layout debugged on a workstation).

torch's ``ProcessGroupGloo`` runs only a few collectives on CUDA tensors (:data:`NATIVE_ON_CUDA`).
Every call is forwarded to a plain gloo group; any other call with GPU tensors is staged: inputs
copied into pinned host buffers at the call, gloo runs on those, results copied back when the work
is waited on (an asynchronous call still overlaps gloo's transfer with the caller's work). Two host
copies plus TCP: NCCL is the fast path, this is for layouts on fewer GPUs than ranks.
``stage_all`` (``TOKENLOOM_GLOO_STAGE_ALL=1``) stages CPU tensors too, so tests run the path
without CUDA. A Python ``ProcessGroup`` subclass because torch has no staging gloo mode, and
``torch.distributed`` calls such a subclass directly: no trainer call site changes.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable, Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

BACKEND = "tokenloom_gloo"
"""The name :func:`register` gives the staged backend in ``torch.distributed``."""

NATIVE_ON_CUDA = frozenset({"allreduce", "broadcast", "barrier"})
"""The calls gloo runs on CUDA tensors itself: forwarded unstaged even when on a GPU."""

INPLACE = frozenset({"allreduce", "broadcast"})
"""The calls whose tensors are both their input and their output."""

STAGE_ALL_ENV = "TOKENLOOM_GLOO_STAGE_ALL"
"""Set to 1: every call of the staged backend is staged, CPU tensors too (the tests' switch)."""


STAGED: Counter[str] = Counter()
"""Staged calls of this process by kind (the tests read it)."""


def _flat(obj) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    return [t for item in obj for t in _flat(item)]


class StagedWork(dist.Work):
    """A staged call's work: :meth:`wait` waits for gloo's, then copies the host results back
    (on the waiting thread's current CUDA stream); it holds the host buffers until then."""

    def __init__(self, work: dist.Work, copies: list[tuple[torch.Tensor, torch.Tensor]]):
        super().__init__()
        self._work = work
        self._copies: list[tuple[torch.Tensor, torch.Tensor]] | None = copies

    def wait(self, timeout: timedelta | None = None) -> bool:
        if self._copies is not None:
            self._work.wait() if timeout is None else self._work.wait(timeout)
            for dst, src in self._copies:
                dst.copy_(src)
            self._copies = None
        return True

    def is_completed(self) -> bool:
        return self._copies is None

    def is_success(self) -> bool:
        return self._copies is None


class StagedGloo(dist.ProcessGroup):
    """A gloo process group staging GPU tensors through pinned host memory (torch's group methods)."""

    def __init__(self, store: dist.Store, rank: int, size: int, timeout: timedelta, stage_all: bool = False):
        super().__init__(rank, size)  # type: ignore[call-arg]  # the stub lists only the (store, rank, size) form
        self._gloo = dist.ProcessGroupGloo(store, rank, size, timeout)
        self.stage_all = stage_all
        self._name, self._desc = "", ""

    # a Python group has no C++ backend to keep its name: kept here for FSDP and torch's registry
    def _set_group_name(self, name: str) -> None:
        self._name = name

    @property
    def group_name(self) -> str:  # type: ignore[override]
        return self._name

    def _set_group_desc(self, desc: str) -> None:
        self._desc = desc

    @property
    def group_desc(self) -> str:
        return self._desc

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return BACKEND

    def name(self) -> str:
        return BACKEND

    def _staged(self, kind: str, ins: Sequence[torch.Tensor], outs: Sequence[torch.Tensor]) -> bool:
        on_gpu = any(t.device.type != "cpu" for t in (*ins, *outs))
        return self.stage_all or (on_gpu and kind not in NATIVE_ON_CUDA)

    @staticmethod
    def _host(t: torch.Tensor, copy: bool) -> torch.Tensor:
        buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.device.type == "cuda")
        if copy:
            buf.copy_(t)
        return buf

    def _run(self, kind: str, ins, outs, call: Callable[..., dist.Work]) -> dist.Work:
        """``call(*ins, *outs)`` on gloo, staged where :meth:`_staged` says (an in-place call passes no ``outs``)."""
        flat_in, flat_out = _flat(ins), _flat(outs)
        if not self._staged(kind, flat_in, flat_out):
            return call(*ins, *outs)
        moved: dict[int, torch.Tensor] = {}

        def host(obj, copy):
            if isinstance(obj, torch.Tensor):
                if id(obj) not in moved:
                    moved[id(obj)] = self._host(obj, copy)
                return moved[id(obj)]
            return [host(item, copy) for item in obj]

        STAGED[kind] += 1
        h_in = [host(x, True) for x in ins]  # the device-to-host copies, before gloo starts
        h_out = [host(x, False) for x in outs]
        back = flat_out if outs else (flat_in if kind in INPLACE else [])
        return StagedWork(call(*h_in, *h_out), [(t, moved[id(t)]) for t in back])

    def allreduce(self, tensors, opts=None):
        return self._run("allreduce", [tensors], [], lambda ts: self._gloo.allreduce(ts, opts or dist.AllreduceOptions()))

    def broadcast(self, tensors, opts=None):
        return self._run("broadcast", [tensors], [], lambda ts: self._gloo.broadcast(ts, opts or dist.BroadcastOptions()))

    def barrier(self, opts=None):
        return self._gloo.barrier(opts or dist.BarrierOptions())

    def allgather(self, output_lists, input_list, opts=None):
        return self._run("allgather", [input_list], [output_lists],
                         lambda i, o: self._gloo.allgather(o, i, opts or dist.AllgatherOptions()))

    def all_gather_single(self, output, input, opts=None):
        return self._run("all_gather_single", [input], [output],
                         lambda i, o: self._gloo._allgather_base(o, i, opts or dist.AllgatherOptions()))

    _allgather_base = all_gather_single

    def reduce_scatter_single(self, output, input, opts=None):
        return self._run("reduce_scatter_single", [input], [output],
                         lambda i, o: self._gloo._reduce_scatter_base(o, i, opts or dist.ReduceScatterOptions()))

    _reduce_scatter_base = reduce_scatter_single

    def gather(self, output_lists, input_list, opts=None):
        return self._run("gather", [input_list], [output_lists],
                         lambda i, o: self._gloo.gather(o, i, opts or dist.GatherOptions()))

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        return self._run("all_to_all_single", [input], [output],
                         lambda i, o: self._gloo.alltoall_base(o, i, output_split_sizes, input_split_sizes,
                                                               opts or dist.AllToAllOptions()))

    alltoall_base = all_to_all_single

    def send(self, tensors, dst, tag=0):
        return self._run("send", [tensors], [], lambda ts: self._gloo.send(ts, dst, tag))

    def recv(self, tensors, src, tag=0):
        return self._run("recv", [], [tensors], lambda ts: self._gloo.recv(ts, src, tag))


def blocks_compile_with(tp: int, cp: int, ep: int) -> bool:
    """Whether torch.compile can capture the blocks' collectives of a (tp, cp, ep) layout: not over
    :class:`StagedGloo` (inductor's functional collectives need a C++ backend); blocks then run eager."""
    return not (dist.is_initialized() and dist.get_backend() == BACKEND and max(tp, cp, ep) > 1)


def register(stage_all: bool | None = None) -> None:
    """Make :data:`BACKEND` a ``torch.distributed`` backend (the first call in a process wins);
    its groups stage every call when ``stage_all`` (None: when ``TOKENLOOM_GLOO_STAGE_ALL=1``)."""
    if BACKEND.upper() in dist.Backend._plugins:
        return
    if stage_all is None:
        stage_all = os.environ.get(STAGE_ALL_ENV, "") == "1"

    def create(store, rank, size, timeout):
        return StagedGloo(store, rank, size, timeout, stage_all=stage_all)

    dist.Backend.register_backend(BACKEND, create, devices=["cpu", "cuda"])
