"""Parallel layout arithmetic (no processes) and real groups on 4 gloo ranks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from tp_helpers import run_ranks

from tokenloom.errors import TokenloomError
from tokenloom.train.parallel.state import ParallelLayout, ParallelState


def test_world8_tp2_pp2_matches_megatron():
    layout = ParallelLayout(8, tp=2, pp=2)
    assert layout.dp == 2
    assert layout.tp_groups() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout.dp_groups() == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout.pp_groups() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert layout.model_parallel_groups() == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert layout.embedding_groups() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert layout.coords(5) == (1, 0, 1)


@pytest.mark.parametrize("world,tp,pp", [(16, 2, 4), (12, 3, 2), (6, 1, 3), (4, 4, 1), (1, 1, 1)])
def test_every_rank_in_exactly_one_group_of_each_kind(world, tp, pp):
    layout = ParallelLayout(world, tp=tp, pp=pp)
    sizes = {"tp": tp, "dp": layout.dp, "pp": pp, "model_parallel": tp * pp}
    for kind, groups in layout.all_groups().items():
        members = sorted(r for g in groups for r in g)
        if kind == "embedding":
            assert all(
                g == ([p[0], p[-1]] if pp > 1 else [p[0]])
                for g, p in zip(groups, layout.pp_groups(), strict=True)
            )
            continue
        assert members == list(range(world)), kind
        assert {len(g) for g in groups} == {sizes[kind]}, kind
    for rank in range(world):
        assert layout.rank_of(*layout.coords(rank)) == rank
    # tp fastest: tp peers are adjacent; pp slowest: stage s holds ranks [s*tp*dp, (s+1)*tp*dp)
    assert all(g == list(range(g[0], g[0] + tp)) for g in layout.tp_groups())
    assert all(layout.coords(r)[2] == r // (tp * layout.dp) for r in range(world))


def test_pipeline_with_one_stage_embedding_group_is_single_rank():
    assert ParallelLayout(4, tp=2).embedding_groups() == [[0], [1], [2], [3]]


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(world_size=6, tp=4), "world size 6 is not divisible by tp \\* pp = 4 \\* 1 = 4"),
        (dict(world_size=8, tp=2, pp=3), "not divisible by tp \\* pp = 2 \\* 3 = 6"),
        (dict(world_size=4, tp=0), "tp must be a positive integer"),
        (dict(world_size=4, pp=1, vpp=2), "needs pipeline parallelism"),
        (dict(world_size=4, pp=2, vpp=0), "virtual pipeline size must be"),
    ],
)
def test_impossible_layouts_explain_themselves(kwargs, match):
    with pytest.raises(TokenloomError, match=match):
        ParallelLayout(**kwargs)


def test_create_needs_initialised_process_group():
    if dist.is_initialized():
        pytest.skip("a default process group exists in this process")
    with pytest.raises(TokenloomError, match="initialised"):
        ParallelState.create(tp=1)


def test_single_process_state_has_no_groups():
    state = ParallelState.single_process()
    assert (state.tp_size, state.dp_size, state.pp_size) == (1, 1, 1)
    assert state.tp_group is None and state.tp_ranks == [0]
    assert state.is_first_stage() and state.is_last_stage() and state.next_rank == 0


def _state_worker(rank: int, world: int) -> None:
    state = ParallelState.create(tp=2, pp=2)
    layout = ParallelLayout(4, tp=2, pp=2)  # dp 1: tp [0,1] [2,3]; pp [0,2] [1,3]
    assert (state.tp_size, state.dp_size, state.pp_size) == (2, 1, 2)
    assert (state.tp_rank, state.dp_rank, state.pp_rank) == layout.coords(rank)
    assert state.tp_ranks == [rank - rank % 2, rank - rank % 2 + 1]
    assert state.pp_ranks == [rank % 2, rank % 2 + 2]
    assert state.dp_ranks == [rank]
    assert state.model_parallel_ranks == [0, 1, 2, 3]
    assert state.embedding_ranks == state.pp_ranks and state.rank in state.embedding_ranks
    assert state.is_first_stage() == (rank < 2) and state.is_last_stage() == (rank >= 2)
    assert state.next_rank == state.prev_rank == (rank + 2) % 4
    # The groups really contain those ranks: all-reduce of the global rank sums the members.
    for group, ranks in [
        (state.tp_group, state.tp_ranks),
        (state.dp_group, state.dp_ranks),
        (state.pp_group, state.pp_ranks),
        (state.model_parallel_group, state.model_parallel_ranks),
        (state.embedding_group, state.embedding_ranks),
    ]:
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=group)
        assert t.item() == sum(ranks)

    vstate = ParallelState.create(tp=1, pp=2, vpp=2)  # dp 2
    assert vstate.dp_ranks == ([0, 1] if rank < 2 else [2, 3])
    assert vstate.vpp_rank == 0
    first_stage = vstate.pp_rank == 0
    assert vstate.is_first_stage() == first_stage and not vstate.is_last_stage()
    vstate.vpp_rank = 1
    assert not vstate.is_first_stage() and vstate.is_last_stage() == (not first_stage)
    assert vstate.is_first_stage(ignore_virtual=True) == first_stage


@pytest.mark.slow
def test_real_groups_on_4_ranks(tmp_path):
    run_ranks(_state_worker, 4, tmp_path)


def test_expert_groups_are_carved_out_of_dp():
    """ep consecutive dp ranks split the experts; the dp ranks with the same ep rank hold the same
    experts (Megatron's data-modulo-expert-parallel group); no expert groups at ep 1."""
    layout = ParallelLayout(8, tp=2, ep=2)  # dp 4
    assert layout.ep_groups() == [[0, 2], [4, 6], [1, 3], [5, 7]]
    assert layout.expert_dp_groups() == [[0, 4], [2, 6], [1, 5], [3, 7]]
    state = ParallelState(layout, 6, {})
    assert (state.dp_rank, state.ep_rank, state.ep_size) == (3, 1, 2)
    assert "ep" not in ParallelLayout(8, tp=2).all_groups()
    with pytest.raises(TokenloomError, match="expert-parallel size 3 does not divide the data-parallel size 4"):
        ParallelLayout(8, tp=2, ep=3)
