"""tokenloom.train.dist's backend choice: the default per machine, the one-line refusals, the GPU
a rank uses when ranks share GPUs, and the flag reaching the config."""

from __future__ import annotations

import pytest
import torch

from tokenloom.errors import TokenloomError
from tokenloom.train import dist as tl_dist
from tokenloom.train.config import load_config
from tokenloom.train.launch import flag_overrides


def test_default_is_nccl_with_cuda_and_gloo_without(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert tl_dist.resolve_backend(None) == "gloo" and tl_dist.resolve_backend("gloo") == "gloo"
    with pytest.raises(TokenloomError, match="^--distributed-backend nccl needs CUDA, but no CUDA device is visible"):
        tl_dist.resolve_backend("nccl")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert tl_dist.resolve_backend(None) == "nccl" and tl_dist.resolve_backend("gloo") == "gloo"


def test_unknown_backend_is_refused_in_one_line():
    with pytest.raises(TokenloomError) as err:
        tl_dist.resolve_backend("mpi")
    assert str(err.value) == "--distributed-backend 'mpi': not a backend; use one of nccl, gloo"


@pytest.mark.parametrize("count,local_rank,index", [(1, 0, 0), (1, 1, 0), (1, 3, 0), (2, 3, 1), (4, 2, 2), (8, 5, 5)])
def test_ranks_beyond_the_visible_gpus_share_them(monkeypatch, count, local_rank, index):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    assert tl_dist.cuda_index(local_rank) == index


def test_flag_reaches_the_config():
    assert load_config(None, flag_overrides(distributed_backend="gloo")).distributed_backend == "gloo"
    assert load_config(None, []).distributed_backend is None
