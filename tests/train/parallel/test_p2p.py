"""p2p posting in one process: a fake ``batch_isend_irecv`` stands in for gloo, so the tests
control when a batch is posted. (Exchanges between real ranks: ``test_pp_schedules.py``.)"""

from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed as dist

from tokenloom.train.parallel import p2p
from tokenloom.train.parallel.p2p import P2PComm, Poster

SHAPE = (2, 3)


class FakeWork:
    def wait(self) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


class FakeOp:
    """``dist.P2POp`` without a process group."""

    def __init__(self, op, tensor: torch.Tensor, peer: int, group, tag: int) -> None:
        self.op, self.tensor, self.peer, self.group, self.tag = op, tensor, peer, group, tag


class FakeTransport:
    """Records each posted batch as ``(thread name, [(op, tag), ...])``; receives are filled
    with the batch's number; ``gate`` (when set) holds every posting until released;
    ``fail_on`` makes that batch raise."""

    def __init__(self, gate: threading.Event | None = None, fail_on: int | None = None) -> None:
        self.batches: list = []
        self.gate, self.fail_on = gate, fail_on

    def __call__(self, ops):
        if self.gate is not None:
            assert self.gate.wait(10)
        n = len(self.batches)
        self.batches.append((threading.current_thread().name,
                             [("send" if op.op is dist.isend else "recv", op.tag) for op in ops]))
        if n == self.fail_on:
            raise RuntimeError(f"batch {n} failed")
        for op in ops:
            if op.op is not dist.isend:
                op.tensor.fill_(float(n))
        return [FakeWork() for _ in ops]


@pytest.fixture(autouse=True)
def fake_ops(monkeypatch):
    monkeypatch.setattr(dist, "P2POp", FakeOp)


def comm(poster: Poster | None) -> P2PComm:
    return P2PComm(None, pp_rank=0, pp_size=2, prev_rank=1, next_rank=1, tensor_shape=SHAPE, poster=poster)


def test_background_posts_return_at_once_and_keep_program_order(monkeypatch):
    gate = threading.Event()
    fake = FakeTransport(gate)
    monkeypatch.setattr(dist, "batch_isend_irecv", fake)
    c = comm(Poster())
    x, _ = p2p.post(c, send_next=torch.ones(SHAPE), recv_prev=True)  # held at the gate
    _, dy = p2p.post(c, send_prev=torch.ones(SHAPE), recv_next=True)
    assert fake.batches == [] and len(c.pending_sends) == 2 and not c.pending_sends[0].is_completed()
    gate.set()
    assert dy.wait()[0, 0].item() == 1.0 and x.wait()[0, 0].item() == 0.0  # batches numbered in post order
    assert x.tensor.requires_grad and not dy.tensor.requires_grad
    # an inline post (communicate: posted and waited for at once) goes after everything queued
    fake.gate = None
    p2p.post(c, send_next=torch.ones(SHAPE))
    got, _ = p2p.communicate(c, recv_prev=True)
    assert got[0, 0].item() == 3.0
    p2p.wait_sends(c)
    assert c.pending_sends == []
    threads = [name for name, _ in fake.batches]
    assert threads[:3] == ["tokenloom-p2p-poster"] * 3 and threads[3] == threading.current_thread().name
    assert fake.batches[0][1] == [("recv", p2p.FORWARD_TAG), ("send", p2p.FORWARD_TAG)]
    assert fake.batches[1][1] == [("send", p2p.BACKWARD_TAG), ("recv", p2p.BACKWARD_TAG)]


def test_without_a_poster_every_post_is_inline(monkeypatch):
    fake = FakeTransport()
    monkeypatch.setattr(dist, "batch_isend_irecv", fake)
    c = comm(None)
    x, _ = p2p.post(c, send_next=torch.ones(SHAPE), recv_prev=True)
    assert [name for name, _ in fake.batches] == [threading.current_thread().name]
    assert x.wait()[0, 0].item() == 0.0


def test_a_failed_background_post_is_raised_by_its_waits(monkeypatch):
    monkeypatch.setattr(dist, "batch_isend_irecv", FakeTransport(fail_on=0))
    c = comm(Poster())
    x, _ = p2p.post(c, send_next=torch.ones(SHAPE), recv_prev=True)
    with pytest.raises(RuntimeError, match="batch 0 failed"):
        x.wait()
    p2p.post(c, send_next=torch.ones(SHAPE))  # a later post keeps the failed send pending
    with pytest.raises(RuntimeError, match="batch 0 failed"):
        p2p.wait_sends(c)


def test_poster_runs_calls_in_order_and_drain_waits_for_all():
    poster, seen = Poster(), []
    futures = [poster.submit(seen.append, i) for i in range(50)]
    poster.drain()
    assert seen == list(range(50)) and all(f.done() for f in futures)
    poster.drain()  # nothing queued: returns at once
