"""Rank grid and process groups for tensor (tp), context (cp), data (dp) and pipeline (pp) parallelism.

Megatron-core's ``parallel_state`` in its default order ``tp-cp-dp-pp`` (``ep`` carved out of dp):
``rank = tp_rank + tp * (cp_rank + cp * (dp_rank + dp * pp_rank))``, so tp peers are adjacent
(fastest links) and pp peers farthest. World 8, tp 2, pp 2::

    tp groups      [0, 1] [2, 3] [4, 5] [6, 7]
    dp groups      [0, 2] [1, 3] [4, 6] [5, 7]
    pp groups      [0, 4] [1, 5] [2, 6] [3, 7]
    model parallel [0, 1, 4, 5] [2, 3, 6, 7]      (tp x pp: one model replica)
    embedding      [0, 4] [1, 5] [2, 6] [3, 7]    (first + last rank of each pp group)

Gradients reduce over ``dp_cp`` (cp ranks share parameters), data shards over dp alone.
:class:`ParallelLayout` is pure arithmetic; :class:`ParallelState` one rank's real groups, an
object so tests can hold several, created collectively in one order on every rank (Megatron's
rule). Unlike Megatron: no hierarchical groups, expert groups inside dp only, no gloo twins.
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
    cp: int = 1
    """Context-parallel size: ranks that split each sequence."""
    ep: int = 1
    """Expert-parallel size: dp ranks that split each mixture-of-experts layer's experts (divides dp)."""

    def __post_init__(self) -> None:
        for name in ("world_size", "tp", "pp", "cp", "ep"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise TokenloomError(f"{name} must be a positive integer, got {value!r}")
        model = self.tp * self.cp * self.pp
        if self.world_size % model:
            what = f"tp * cp * pp = {self.tp} * {self.cp} * {self.pp}" if self.cp > 1 else \
                f"tp * pp = {self.tp} * {self.pp}"
            raise TokenloomError(
                f"world size {self.world_size} is not divisible by {what} = {model}; "
                f"each data-parallel replica needs {model} ranks, so use a world size that is a multiple "
                f"of {model} or change the sizes"
            )
        if self.dp % self.ep:
            raise TokenloomError(f"expert-parallel size {self.ep} does not divide the data-parallel size {self.dp}; "
                                 "expert parallelism is carved out of data parallelism, so pick an ep that divides it")
        if self.vpp is not None:
            if not isinstance(self.vpp, int) or self.vpp < 1:
                raise TokenloomError(f"virtual pipeline size must be a positive integer, got {self.vpp!r}")
            if self.vpp > 1 and self.pp == 1:
                raise TokenloomError(
                    f"virtual pipeline size {self.vpp} needs pipeline parallelism (pp > 1), got pp = 1"
                )

    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.cp * self.pp)

    def coords(self, rank: int) -> tuple[int, int, int]:
        """``(tp_rank, dp_rank, pp_rank)`` of a global rank (its cp rank: :meth:`cp_rank_of`)."""
        if not 0 <= rank < self.world_size:
            raise TokenloomError(f"rank {rank} is outside the world of {self.world_size} ranks")
        return rank % self.tp, (rank // (self.tp * self.cp)) % self.dp, rank // (self.tp * self.cp * self.dp)

    def cp_rank_of(self, rank: int) -> int:
        """The context-parallel rank of a global rank."""
        return (rank // self.tp) % self.cp

    def rank_of(self, tp_rank: int, dp_rank: int, pp_rank: int, cp_rank: int = 0) -> int:
        """Global rank at the given coordinates (inverse of :meth:`coords` and :meth:`cp_rank_of`)."""
        return tp_rank + self.tp * (cp_rank + self.cp * (dp_rank + self.dp * pp_rank))

    def tp_groups(self) -> Groups:
        """Ranks that share one layer's shards: consecutive blocks of ``tp``."""
        return [list(range(start, start + self.tp)) for start in range(0, self.world_size, self.tp)]

    def cp_groups(self) -> Groups:
        """Ranks that split the same samples' sequences (keys and values exchanged per layer)."""
        return [[self.rank_of(t, d, p, c) for c in range(self.cp)]
                for p in range(self.pp) for d in range(self.dp) for t in range(self.tp)]

    def dp_groups(self) -> Groups:
        """Ranks that hold the same shard of the model and the same part of different samples."""
        return [[self.rank_of(t, d, p, c) for d in range(self.dp)]
                for p in range(self.pp) for c in range(self.cp) for t in range(self.tp)]

    def dp_cp_groups(self) -> Groups:
        """Ranks that hold the same shard of the model (gradient reduction): dp x cp."""
        return [[self.rank_of(t, d, p, c) for d in range(self.dp) for c in range(self.cp)]
                for p in range(self.pp) for t in range(self.tp)]

    def ep_groups(self) -> Groups:
        """``ep`` consecutive dp ranks splitting a layer's experts (ep rank ``dp_rank % ep``)."""
        return [[self.rank_of(t, d + e, p, c) for e in range(self.ep)]
                for p in range(self.pp) for c in range(self.cp) for t in range(self.tp)
                for d in range(0, self.dp, self.ep)]

    def expert_dp_groups(self) -> Groups:
        """dp ranks with the same ep rank (Megatron's data-modulo-expert group): expert grads reduce here."""
        return [[self.rank_of(t, d, p, c) for d in range(e, self.dp, self.ep)]
                for p in range(self.pp) for c in range(self.cp) for t in range(self.tp) for e in range(self.ep)]

    def pp_groups(self) -> Groups:
        """One pipeline: the same (tp, cp, dp) coordinates on every stage, first stage first."""
        return [[self.rank_of(t, d, p, c) for p in range(self.pp)]
                for d in range(self.dp) for c in range(self.cp) for t in range(self.tp)]

    def model_parallel_groups(self) -> Groups:
        """tp x pp ranks that together hold one model replica (same dp and cp rank)."""
        return [[self.rank_of(t, d, p, c) for p in range(self.pp) for t in range(self.tp)]
                for d in range(self.dp) for c in range(self.cp)]

    def embedding_groups(self) -> Groups:
        """First and last rank of each pipeline (one rank when pp = 1): tied-embedding grads."""
        return [[g[0], g[-1]] if len(g) > 1 else [g[0]] for g in self.pp_groups()]

    def all_groups(self) -> dict[str, Groups]:
        """Every kind of group, in the (fixed) order :class:`ParallelState` creates them."""
        groups = {
            "tp": self.tp_groups(),
            "dp": self.dp_groups(),
            "pp": self.pp_groups(),
            "model_parallel": self.model_parallel_groups(),
            "embedding": self.embedding_groups(),
        }
        if self.cp > 1:  # created only when used: a layout without cp creates the groups it always did
            groups.update({"cp": self.cp_groups(), "dp_cp": self.dp_cp_groups()})
        if self.ep > 1:  # likewise
            groups.update({"ep": self.ep_groups(), "expert_dp": self.expert_dp_groups()})
        return groups


class ParallelState:
    """This rank's place in a :class:`ParallelLayout` with its groups; :meth:`create` is collective."""

    def __init__(
        self, layout: ParallelLayout, rank: int, groups: dict[str, dist.ProcessGroup | None]
    ) -> None:
        self.layout = layout
        self.rank = rank
        self.tp_rank, self.dp_rank, self.pp_rank = layout.coords(rank)
        self.cp_rank = layout.cp_rank_of(rank)
        self._groups = groups
        self._ranks = {
            kind: next((g for g in kind_groups if rank in g), [])
            for kind, kind_groups in layout.all_groups().items()
        }
        self.vpp_rank: int | None = 0 if layout.vpp is not None else None
        """Current virtual pipeline stage (model chunk); set by the interleaved schedule."""

    @classmethod
    def create(cls, tp: int = 1, pp: int = 1, vpp: int | None = None, cp: int = 1, ep: int = 1,
               **group_kwargs) -> ParallelState:
        """Create every group (collective); ``group_kwargs`` go to ``dist.new_group``."""
        if not dist.is_initialized():
            raise TokenloomError("ParallelState.create needs torch.distributed to be initialised first")
        layout = ParallelLayout(dist.get_world_size(), tp, pp, vpp, cp, ep)
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
        """One rank without ``torch.distributed``: every group None (no communication)."""
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
    def cp_size(self) -> int:
        return self.layout.cp

    @property
    def cp_group(self) -> dist.ProcessGroup | None:
        """The context-parallel group (None at cp 1: no communication)."""
        return self._groups.get("cp")

    @property
    def dp_cp_group(self) -> dist.ProcessGroup | None:
        """The group gradients are reduced over: dp x cp ranks (the dp group at cp 1)."""
        return self._groups["dp_cp"] if self.layout.cp > 1 else self._groups["dp"]

    @property
    def dp_cp_size(self) -> int:
        return self.layout.dp * self.layout.cp

    @property
    def dp_cp_rank(self) -> int:
        """This rank's index in its :attr:`dp_cp_group` (dp-major, as the group lists them)."""
        return self.dp_rank * self.layout.cp + self.cp_rank

    @property
    def ep_size(self) -> int:
        return self.layout.ep

    @property
    def ep_rank(self) -> int:
        """This rank's index in its :attr:`ep_group` (which experts it holds)."""
        return self.dp_rank % self.layout.ep

    @property
    def ep_group(self) -> dist.ProcessGroup | None:
        """The expert-parallel group (None at ep 1: every rank holds every expert)."""
        return self._groups.get("ep")

    @property
    def expert_dp_group(self) -> dist.ProcessGroup | None:
        """The group expert gradients reduce over (None at ep 1: with the dense ones)."""
        return self._groups.get("expert_dp")

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
            f"ParallelState(rank={self.rank}, tp={self.tp_rank}/{self.tp_size}, cp={self.cp_rank}/{self.cp_size}, "
            f"dp={self.dp_rank}/{self.dp_size}, pp={self.pp_rank}/{self.pp_size}, vpp={self.vpp_size})"
        )
