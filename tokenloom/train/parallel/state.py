"""Rank grid and process groups for tensor (tp), data (dp) and pipeline (pp) parallelism.

Mirrors Megatron-core's ``parallel_state`` with the default order ``tp-dp-pp`` (no
context or expert parallelism): tp is the fastest-varying coordinate and pp the
slowest, so ``rank = tp_rank + tp * (dp_rank + dp * pp_rank)``. Tensor-parallel
peers are therefore adjacent ranks (one node, fastest links) and pipeline peers are
``tp * dp`` ranks apart. Worked example, world 8, tp 2, pp 2 (so dp 2)::

    tp groups      [0, 1] [2, 3] [4, 5] [6, 7]
    dp groups      [0, 2] [1, 3] [4, 6] [5, 7]
    pp groups      [0, 4] [1, 5] [2, 6] [3, 7]
    model parallel [0, 1, 4, 5] [2, 3, 6, 7]      (tp x pp: one model replica)
    embedding      [0, 4] [1, 5] [2, 6] [3, 7]    (first + last rank of each pp group)

Two layers, so that layouts can be checked without processes:

* :class:`ParallelLayout` is pure arithmetic (rank lists, coordinates, validation);
* :class:`ParallelState` is one rank's view with real ``torch.distributed`` groups.
  It is an object, not module globals, so tests (and a future multi-model setup) can
  hold several. Creating it is collective: ``torch.distributed.new_group`` must be
  called by every rank for every group in the same order, so every rank walks all
  groups of every kind and keeps the ones it belongs to (Megatron's rule).

Differences from Megatron: no context/expert/hierarchical groups, no gloo twins of
the dp groups (on CPU everything is gloo already; on NCCL a caller that needs CPU
object gathers must create them), no pipeline split rank (encoder-decoder). The
virtual pipeline rank is mutable state on the object, as in Megatron, and
``is_first_stage`` / ``is_last_stage`` take it into account unless ``ignore_virtual``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from tokenloom.errors import TokenloomError

Groups = list[list[int]]


@dataclass(frozen=True)
class ParallelLayout:
    """How ``world_size`` ranks split into tp x dp x pp (dp is derived). No processes needed."""

    world_size: int
    tp: int = 1
    pp: int = 1
    vpp: int | None = None
    """Virtual pipeline stages (model chunks) per pipeline rank, for the interleaved schedule."""

    def __post_init__(self) -> None:
        for name in ("world_size", "tp", "pp"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise TokenloomError(f"{name} must be a positive integer, got {value!r}")
        model = self.tp * self.pp
        if self.world_size % model:
            raise TokenloomError(
                f"world size {self.world_size} is not divisible by tp * pp = {self.tp} * {self.pp} = {model}; "
                f"each data-parallel replica needs tp * pp ranks, so use a world size that is a multiple "
                f"of {model} or change tp/pp"
            )
        if self.vpp is not None:
            if not isinstance(self.vpp, int) or self.vpp < 1:
                raise TokenloomError(f"virtual pipeline size must be a positive integer, got {self.vpp!r}")
            if self.vpp > 1 and self.pp == 1:
                raise TokenloomError(
                    f"virtual pipeline size {self.vpp} needs pipeline parallelism (pp > 1), got pp = 1"
                )

    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.pp)

    def coords(self, rank: int) -> tuple[int, int, int]:
        """``(tp_rank, dp_rank, pp_rank)`` of a global rank."""
        if not 0 <= rank < self.world_size:
            raise TokenloomError(f"rank {rank} is outside the world of {self.world_size} ranks")
        return rank % self.tp, (rank // self.tp) % self.dp, rank // (self.tp * self.dp)

    def rank_of(self, tp_rank: int, dp_rank: int, pp_rank: int) -> int:
        """Global rank at the given coordinates (inverse of :meth:`coords`)."""
        return tp_rank + self.tp * (dp_rank + self.dp * pp_rank)

    def tp_groups(self) -> Groups:
        """Ranks that share one layer's shards: consecutive blocks of ``tp``."""
        return [list(range(start, start + self.tp)) for start in range(0, self.world_size, self.tp)]

    def dp_groups(self) -> Groups:
        """Ranks that hold the same shard of the model (gradient all-reduce)."""
        return [
            [self.rank_of(t, d, p) for d in range(self.dp)] for p in range(self.pp) for t in range(self.tp)
        ]

    def pp_groups(self) -> Groups:
        """One pipeline: the same (tp, dp) coordinates on every stage, first stage first."""
        return [
            [self.rank_of(t, d, p) for p in range(self.pp)] for d in range(self.dp) for t in range(self.tp)
        ]

    def model_parallel_groups(self) -> Groups:
        """tp x pp ranks that together hold one model replica (same dp rank)."""
        return [
            [self.rank_of(t, d, p) for p in range(self.pp) for t in range(self.tp)] for d in range(self.dp)
        ]

    def embedding_groups(self) -> Groups:
        """First and last rank of each pipeline (one rank when pp = 1): tied-embedding grads."""
        return [[g[0], g[-1]] if len(g) > 1 else [g[0]] for g in self.pp_groups()]

    def all_groups(self) -> dict[str, Groups]:
        """Every kind of group, in the (fixed) order :class:`ParallelState` creates them."""
        return {
            "tp": self.tp_groups(),
            "dp": self.dp_groups(),
            "pp": self.pp_groups(),
            "model_parallel": self.model_parallel_groups(),
            "embedding": self.embedding_groups(),
        }


class ParallelState:
    """This rank's place in a :class:`ParallelLayout`, with its process groups.

    Build it with :meth:`create` after ``torch.distributed.init_process_group``, on all
    ranks at the same time (group creation is collective).
    """

    def __init__(
        self, layout: ParallelLayout, rank: int, groups: dict[str, dist.ProcessGroup | None]
    ) -> None:
        self.layout = layout
        self.rank = rank
        self.tp_rank, self.dp_rank, self.pp_rank = layout.coords(rank)
        self._groups = groups
        self._ranks = {
            kind: next((g for g in kind_groups if rank in g), [])
            for kind, kind_groups in layout.all_groups().items()
        }
        self.vpp_rank: int | None = 0 if layout.vpp is not None else None
        """Current virtual pipeline stage (model chunk); set by the interleaved schedule."""

    @classmethod
    def create(cls, tp: int = 1, pp: int = 1, vpp: int | None = None, **group_kwargs) -> ParallelState:
        """Create every group of the layout (collective over the default group).

        ``group_kwargs`` go to ``torch.distributed.new_group`` (e.g. ``timeout``, ``backend``).
        """
        if not dist.is_initialized():
            raise TokenloomError("ParallelState.create needs torch.distributed to be initialised first")
        layout = ParallelLayout(dist.get_world_size(), tp, pp, vpp)
        rank = dist.get_rank()
        mine: dict[str, dist.ProcessGroup | None] = {}
        for kind, kind_groups in layout.all_groups().items():
            for ranks in kind_groups:  # every rank creates every group, in the same order
                group = dist.new_group(ranks, **group_kwargs)
                if rank in ranks:
                    mine[kind] = group
        return cls(layout, rank, mine)

    @classmethod
    def single_process(cls) -> ParallelState:
        """World of one rank without ``torch.distributed``: every group is None, which the
        mappings and layers treat as a one-rank group (no communication)."""
        return cls(ParallelLayout(1), 0, dict.fromkeys(ParallelLayout(1).all_groups()))

    # ---- sizes and groups

    @property
    def tp_size(self) -> int:
        return self.layout.tp

    @property
    def dp_size(self) -> int:
        return self.layout.dp

    @property
    def pp_size(self) -> int:
        return self.layout.pp

    @property
    def vpp_size(self) -> int | None:
        return self.layout.vpp

    @property
    def tp_group(self) -> dist.ProcessGroup | None:
        return self._groups["tp"]

    @property
    def dp_group(self) -> dist.ProcessGroup | None:
        return self._groups["dp"]

    @property
    def pp_group(self) -> dist.ProcessGroup | None:
        return self._groups["pp"]

    @property
    def model_parallel_group(self) -> dist.ProcessGroup | None:
        return self._groups["model_parallel"]

    @property
    def embedding_group(self) -> dist.ProcessGroup | None:
        """The embedding group; None on a middle pipeline stage (not a member) or single process."""
        return self._groups.get("embedding")

    # ---- global ranks of this rank's groups

    @property
    def tp_ranks(self) -> list[int]:
        return self._ranks["tp"]

    @property
    def dp_ranks(self) -> list[int]:
        return self._ranks["dp"]

    @property
    def pp_ranks(self) -> list[int]:
        return self._ranks["pp"]

    @property
    def model_parallel_ranks(self) -> list[int]:
        return self._ranks["model_parallel"]

    @property
    def embedding_ranks(self) -> list[int]:
        """Global ranks of this rank's embedding group ([] on a middle stage)."""
        return self._ranks["embedding"]

    # ---- pipeline position

    def is_first_stage(self, ignore_virtual: bool = False) -> bool:
        """First pipeline stage (and, unless ``ignore_virtual``, the first model chunk)."""
        if not ignore_virtual and self.vpp_rank not in (None, 0):
            return False
        return self.pp_rank == 0

    def is_last_stage(self, ignore_virtual: bool = False) -> bool:
        """Last pipeline stage (and, unless ``ignore_virtual``, the last model chunk)."""
        if not ignore_virtual and self.vpp_size is not None and self.vpp_rank != self.vpp_size - 1:
            return False
        return self.pp_rank == self.pp_size - 1

    @property
    def next_rank(self) -> int:
        """Global rank of the next pipeline stage (wraps around, as Megatron)."""
        return self.pp_ranks[(self.pp_rank + 1) % self.pp_size]

    @property
    def prev_rank(self) -> int:
        """Global rank of the previous pipeline stage (wraps around, as Megatron)."""
        return self.pp_ranks[(self.pp_rank - 1) % self.pp_size]

    def __repr__(self) -> str:
        return (
            f"ParallelState(rank={self.rank}, tp={self.tp_rank}/{self.tp_size}, "
            f"dp={self.dp_rank}/{self.dp_size}, pp={self.pp_rank}/{self.pp_size}, vpp={self.vpp_size})"
        )
