"""Point-to-point exchange between pipeline stages (Megatron-core's ``p2p_communication.py`` with
``batch_p2p_comm=True``): a call posts its ``P2POp`` s in one ``batch_isend_irecv`` (:func:`post`),
sends and receives before waiting on either, so neighbours that both send first never deadlock.

* Fixed boundary shapes ``[micro_batch, seq, hidden]``: no handshake (no ``variable_seq_lengths``).
* Peers are global ranks on a ring (the interleaved schedule uses the wrap-around); one tag per
  direction keeps them apart at pp = 2; ranks post in program order, as gloo matches by order.
* Sends are not waited for at the call (a gloo send completes only once the peer receives, which
  would lock neighbours into step); :func:`wait_sends` ends every run. Receives may be waited for
  later (:class:`Incoming`, ``overlap_p2p_comm``), so the round trip runs under compute.
* Gloo posts off the compute thread (:class:`Poster`): a post takes the connection's lock, which
  the transport thread holds while moving a message; a failed post surfaces at the wait.
* Time in p2p calls adds to :attr:`P2PComm.wait_s`, the schedules' bubble measure.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from tokenloom.errors import TokenloomError

FORWARD_TAG = 0
"""Tag of activation messages (sent to the next stage)."""
BACKWARD_TAG = 1
"""Tag of gradient messages (sent to the previous stage)."""


@dataclass
class P2PComm:
    """How this rank talks to its pipeline neighbours (build it with :meth:`from_group`)."""

    group: dist.ProcessGroup | None
    """The pipeline-parallel group (None: the default group)."""
    pp_rank: int
    """This rank's position in the pipeline (0 = first stage)."""
    pp_size: int
    """Number of pipeline ranks."""
    prev_rank: int
    """Global rank of the previous stage on the ring (the last stage for ``pp_rank`` 0)."""
    next_rank: int
    """Global rank of the next stage on the ring (the first stage for the last rank)."""
    tensor_shape: tuple[int, ...]
    """Shape of every boundary tensor, ``(micro_batch, seq, hidden)``."""
    dtype: torch.dtype = torch.float32
    """Boundary dtype (Megatron's ``pipeline_dtype``, the compute dtype); grads cast back on receipt."""
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    """Device of every boundary tensor and receive buffer."""
    wait_s: float = 0.0
    """Seconds spent inside p2p calls (posting + waiting); reset it between measurements."""
    pending_sends: list = field(default_factory=list)
    """Send works not yet known to be complete (see :func:`wait_sends`)."""
    poster: Poster | None = None
    """Thread posting :func:`post`'s batches (None: inline; :meth:`from_group` gives non-NCCL one)."""

    @classmethod
    def from_group(
        cls, pp_group: dist.ProcessGroup | None, tensor_shape: tuple[int, ...], dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> P2PComm:
        """Neighbours from the group's rank list: ring order = group rank order."""
        ranks = dist.get_process_group_ranks(pp_group or dist.group.WORLD)
        me = dist.get_rank(pp_group)
        if me < 0:
            raise TokenloomError("this process is not a member of the given pipeline group")
        size = len(ranks)
        return cls(
            poster=None if "nccl" in str(dist.get_backend(pp_group)) else Poster(),
            group=pp_group,
            pp_rank=me,
            pp_size=size,
            prev_rank=ranks[(me - 1) % size],
            next_rank=ranks[(me + 1) % size],
            tensor_shape=tuple(tensor_shape),
            dtype=dtype,
            device=torch.device(device),
        )

    @property
    def is_first(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last(self) -> bool:
        return self.pp_rank == self.pp_size - 1


class Poster:
    """A daemon thread running calls in order (a thread pool's, joined at exit, hangs on a dead peer)."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._last: Future | None = None

    def submit(self, fn: Callable, *args) -> Future:
        """Run ``fn(*args)`` after everything before; result or exception in the future."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="tokenloom-p2p-poster", daemon=True)
            self._thread.start()
        future: Future = Future()
        self._queue.put((future, fn, args))
        self._last = future
        return future

    def drain(self) -> None:
        """Block until every submitted call ran (exceptions surface at the work's wait)."""
        if self._last is not None:
            self._last.exception()
            self._last = None

    def _run(self) -> None:
        while True:
            future, fn, args = self._queue.get()
            try:
                future.set_result(fn(*args))
            except BaseException as e:  # noqa: BLE001 - handed to whoever waits on the future
                future.set_exception(e)


class _Posted:
    """Work ``index`` of a :class:`Poster`'s batch: waits for the posting, then the work."""

    def __init__(self, batch: Future, index: int) -> None:
        self.batch, self.index = batch, index

    def _work(self):
        return self.batch.result()[self.index]  # gloo: one work per op (NCCL never posts here)

    def wait(self) -> bool:
        return self._work().wait()

    def is_completed(self) -> bool:
        """False while posting, and for a batch whose posting failed (so :func:`wait_sends` raises it)."""
        return self.batch.done() and self.batch.exception() is None and self._work().is_completed()


class Incoming:
    """A posted receive; :meth:`wait` returns ``tensor`` once arrived (time into ``wait_s``).
    Waiting twice is free (a gloo work waited twice would block until its timeout)."""

    def __init__(self, tensor: torch.Tensor, work, comm: P2PComm, activation: bool) -> None:
        self.tensor, self.work, self.comm, self.activation = tensor, work, comm, activation

    def wait(self) -> torch.Tensor:
        """The received tensor; an activation with ``requires_grad=True``."""
        if self.work is not None:
            start = time.perf_counter()
            self.work.wait()
            self.comm.wait_s += time.perf_counter() - start
            self.work = None
            if self.activation:
                self.tensor.requires_grad_(True)
        return self.tensor


def post(
    comm: P2PComm,
    *,
    send_next: torch.Tensor | None = None,
    send_prev: torch.Tensor | None = None,
    recv_prev: bool = False,
    recv_next: bool = False,
    background: bool = True,
) -> tuple[Incoming | None, Incoming | None]:
    """Post one batched exchange without waiting -> receives ``(from_prev, from_next)`` as
    :class:`Incoming`. Sends (activation next, gradient prev) join ``pending_sends``; nothing to do
    touches no network. ``background``: via the poster where there is one, else inline after it.
    """
    from_prev = torch.empty(comm.tensor_shape, dtype=comm.dtype, device=comm.device) if recv_prev else None
    from_next = torch.empty(comm.tensor_shape, dtype=comm.dtype, device=comm.device) if recv_next else None
    ops = []
    if send_prev is not None:
        ops.append(dist.P2POp(dist.isend, _wire(send_prev, comm), comm.prev_rank, comm.group, BACKWARD_TAG))
    if from_prev is not None:
        ops.append(dist.P2POp(dist.irecv, from_prev, comm.prev_rank, comm.group, FORWARD_TAG))
    if send_next is not None:
        ops.append(dist.P2POp(dist.isend, _wire(send_next, comm), comm.next_rank, comm.group, FORWARD_TAG))
    if from_next is not None:
        ops.append(dist.P2POp(dist.irecv, from_next, comm.next_rank, comm.group, BACKWARD_TAG))
    if not ops:
        return None, None
    start = time.perf_counter()
    comm.pending_sends = [w for w in comm.pending_sends if not w.is_completed()]
    works: list[_Posted] | list[dist.Work]
    if background and comm.poster is not None:
        batch = comm.poster.submit(dist.batch_isend_irecv, ops)
        works = [_Posted(batch, i) for i in range(len(ops))]
    else:
        if comm.poster is not None:
            comm.poster.drain()
        works = dist.batch_isend_irecv(ops)
        if len(works) == 1:  # NCCL coalesces the batch into one work
            works = works * len(ops)
    receives = []
    for op, work in zip(ops, works, strict=True):
        if op.op is dist.isend:
            comm.pending_sends.append(work)
        else:
            receives.append(work)
    comm.wait_s += time.perf_counter() - start
    receives.reverse()  # from_prev's receive was posted before from_next's
    return (
        None if from_prev is None else Incoming(from_prev, receives.pop(), comm, activation=True),
        None if from_next is None else Incoming(from_next, receives.pop(), comm, activation=False),
    )


def communicate(
    comm: P2PComm,
    *,
    send_next: torch.Tensor | None = None,
    send_prev: torch.Tensor | None = None,
    recv_prev: bool = False,
    recv_next: bool = False,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """:func:`post` and wait -> ``(from_prev, from_next)``; activations with ``requires_grad``."""
    from_prev, from_next = post(comm, send_next=send_next, send_prev=send_prev, recv_prev=recv_prev,
                                recv_next=recv_next, background=False)
    return (None if from_prev is None else from_prev.wait(), None if from_next is None else from_next.wait())


def wait_sends(comm: P2PComm) -> None:
    """Block until every send through ``comm`` (and its poster's queue) has completed."""
    start = time.perf_counter()
    if comm.poster is not None:
        comm.poster.drain()
    for work in comm.pending_sends:
        work.wait()
    comm.pending_sends = []
    comm.wait_s += time.perf_counter() - start


def _wire(t: torch.Tensor, comm: P2PComm) -> torch.Tensor:
    """What goes on the wire: ``t`` detached, contiguous, in the pipeline dtype."""
    if tuple(t.shape) != comm.tensor_shape or t.device != comm.device:
        raise TokenloomError(
            f"pipeline boundary tensor has shape {tuple(t.shape)} on {t.device}, expected "
            f"{comm.tensor_shape} on {comm.device} (P2PComm.tensor_shape / device)"
        )
    return t.detach().to(comm.dtype).contiguous()


# stage-aware helpers (1F1B): None / no-op where the first or last stage has no peer, like Megatron's


def recv_forward(comm: P2PComm) -> torch.Tensor | None:
    """Activation from the previous stage (None on the first stage)."""
    return None if comm.is_first else communicate(comm, recv_prev=True)[0]


def recv_backward(comm: P2PComm) -> torch.Tensor | None:
    """Gradient of this stage's output from the next stage (None on the last stage)."""
    return None if comm.is_last else communicate(comm, recv_next=True)[1]


def send_forward(output: torch.Tensor, comm: P2PComm) -> None:
    """Activation to the next stage (no-op on the last stage)."""
    if not comm.is_last:
        communicate(comm, send_next=output)


def send_backward(input_grad: torch.Tensor | None, comm: P2PComm) -> None:  # None: the first stage's
    """Gradient of this stage's input to the previous stage (no-op on the first stage)."""
    if not comm.is_first:
        communicate(comm, send_prev=input_grad)


def send_forward_recv_backward(output: torch.Tensor, comm: P2PComm) -> torch.Tensor | None:
    """Send an activation on and receive the gradient for an earlier one, in one batch."""
    return None if comm.is_last else communicate(comm, send_next=output, recv_next=True)[1]


def send_backward_recv_forward(input_grad: torch.Tensor | None, comm: P2PComm) -> torch.Tensor | None:
    """Send a gradient back and receive the next activation, in one batch."""
    return None if comm.is_first else communicate(comm, send_prev=input_grad, recv_prev=True)[0]
