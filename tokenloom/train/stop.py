"""Stopping a run the way clusters stop it: on SIGTERM or SIGINT every rank finishes the same
step, saves a checkpoint and exits; a second signal stops the process at once (the kernel's default action).

A signal may reach one rank, all, or them a step apart, so ranks act only on a max all-reduce of
their flags, on a gloo CPU group, started after step k and waited for after k+1: no device sync or
wait, at the price of stopping one step later. A single process reads its own flag.
"""

from __future__ import annotations

import signal
import sys
import threading

import torch
import torch.distributed as dist

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopOnSignal:
    """Catches :data:`SIGNALS` in this process (from the main thread only; elsewhere it never
    fires) and tells every rank, step by step, whether to stop (:meth:`agreed`)."""

    def __init__(self, world_size: int) -> None:
        self.signum: int | None = None
        self._pending: tuple[dist.Work, torch.Tensor] | None = None
        self._group = dist.new_group(backend="gloo") if world_size > 1 else None  # collective: every rank
        self._previous = {}
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._handle) for s in SIGNALS}

    def _handle(self, signum: int, frame) -> None:
        self.signum = signum
        for s in SIGNALS:  # the next one takes the kernel's default action: the process ends at once,
            signal.signal(s, signal.SIG_DFL)  # even inside a collective that never returns
        print(f"{signal.Signals(signum).name}: saving a checkpoint at the end of the step (send it again to "
              "stop at once)", file=sys.stderr, flush=True)

    def agreed(self) -> int | None:
        """The signal to stop on, the same on every rank at the same step (None: go on); call after every step."""
        if self._group is None:
            return self.signum
        result = self._wait()
        flag = torch.tensor([self.signum or 0], dtype=torch.int32, device="cpu")  # the gloo group's device
        self._pending = dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group, async_op=True), flag
        return result

    def _wait(self) -> int | None:
        if self._pending is None:
            return None
        work, flag = self._pending
        self._pending = None
        work.wait()
        return int(flag.item()) or None

    def close(self, failed: bool = False) -> None:
        """Restore the signal handlers; finish the all-reduce in flight unless the run ``failed`` (a peer may be gone)."""
        if not failed:
            self._wait()
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}


def resume_command(config_json: str, world_size: int) -> str:
    """The command that continues a run from its last checkpoint (its config as the run saved it)."""
    launch = f" --nproc-per-node {world_size}" if world_size > 1 else ""
    return f"python cli.py train --config {config_json}{launch} --resume auto"
