"""Pipeline layout policy: which blocks each pipeline rank's chunks hold (:class:`PipelineSplit`,
Megatron's rules) and :func:`pipeline_stage`, the chunk a rank builds; the model only takes indices.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenloom.errors import TokenloomError
from tokenloom.train.model.config import GPTConfig
from tokenloom.train.model.gpt import GPT
from tokenloom.train.parallel.layers import TensorParallel


@dataclass(frozen=True)
class PipelineSplit:
    """Blocks dealt in model order over virtual stages ``(chunk, pp_rank)``, chunk-major: even, or
    ``first`` / ``last`` fixing the end ranks' counts, or ``embedding_as_layer`` / ``loss_as_layer``
    counting those as a block (Megatron's flags), because the end stages' extra work idles the rest."""

    n_layers: int
    pp: int = 1
    vpp: int = 1
    first: int | None = None
    last: int | None = None
    embedding_as_layer: bool = False
    loss_as_layer: bool = False

    def __post_init__(self) -> None:
        self.counts()  # raises on a split that does not work out

    def counts(self) -> list[list[int]]:
        """Blocks per virtual stage ``[chunk][pp_rank]``; raises naming the flag when it does not divide."""
        n, p, v = self.n_layers, self.pp, self.vpp
        uneven = self.first is not None or self.last is not None
        if uneven or self.embedding_as_layer or self.loss_as_layer:
            if p < 2:
                raise TokenloomError("--decoder-first-pipeline-num-layers, --decoder-last-pipeline-num-layers, "
                                     "--account-for-embedding-in-pipeline-split and --account-for-loss-in-pipeline-"
                                     "split split a pipeline: they need --pp >= 2")
            if uneven and (self.embedding_as_layer or self.loss_as_layer):
                raise TokenloomError("--decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers and "
                                     "--account-for-embedding-in-pipeline-split / --account-for-loss-in-pipeline-split "
                                     "do not go together (Megatron's rule): give one or the other")
        if uneven:
            ends = {0: self.first, p - 1: self.last}
            for flag, k in (("--decoder-first-pipeline-num-layers", self.first),
                            ("--decoder-last-pipeline-num-layers", self.last)):
                if k is not None and (k < 1 or k % v):
                    raise TokenloomError(f"{flag} {k} must be >= 1 and a multiple of --vpp {v}")
            middle = [r for r in range(p) if ends.get(r) is None]
            rest = n - (self.first or 0) - (self.last or 0)
            if rest < 0 or (rest == 0 and middle):
                raise TokenloomError(f"the first and last pipeline stages' layers ({self.first or 0} + "
                                     f"{self.last or 0}) leave none of model.n_layers {n} for the "
                                     f"{len(middle)} other stage(s)")
            if (rest and not middle) or (middle and rest % (len(middle) * v)):  # rest > 0 here
                raise TokenloomError(
                    f"model.n_layers {n} minus the first stage's {self.first or 0} and the last's {self.last or 0} leave "
                    f"{rest} for {len(middle)} middle pipeline stage(s): they must split evenly"
                    + (f" into {v} virtual stages each" if v > 1 else ""))
            per_rank = [e if (e := ends.get(r)) is not None else rest // len(middle) for r in range(p)]
            return [[k // v for k in per_rank] for _ in range(v)]
        total = n + self.embedding_as_layer + self.loss_as_layer
        if total % (p * v):
            counted = "".join((" + the embedding" * self.embedding_as_layer, " + the loss" * self.loss_as_layer))
            raise TokenloomError(f"model.n_layers {n}{counted} must be divisible by --pp {p} x --vpp {v}")
        counts = [[total // (p * v)] * p for _ in range(v)]
        counts[0][0] -= self.embedding_as_layer
        counts[-1][-1] -= self.loss_as_layer
        if min(counts[0][0], counts[-1][-1]) < 0:
            raise TokenloomError(f"model.n_layers {n} at --pp {p} x --vpp {v} leaves no layer to give up for the "
                                 "embedding or loss")
        return counts

    def layer_ids(self, pp_rank: int, chunk: int = 0) -> list[int]:
        """Global block indices of ``chunk`` on ``pp_rank`` (4 layers, pp 2 x vpp 2: rank 0 [0], [2])."""
        counts = self.counts()
        flat = [k for row in counts for k in row]
        start = sum(flat[: chunk * self.pp + pp_rank])
        return list(range(start, start + counts[chunk][pp_rank]))

    @property
    def is_even(self) -> bool:
        return self.first is None and self.last is None and not self.embedding_as_layer and not self.loss_as_layer


def pipeline_stage(cfg: GPTConfig, split: PipelineSplit | None = None, pp_rank: int = 0, chunk: int = 0, *,
                   tp: TensorParallel | None = None, device: torch.device | str | None = None) -> GPT:
    """Chunk ``chunk`` of pipeline rank ``pp_rank`` (blocks by ``split``, default one stage);
    the first virtual stage embeds, the last has the head and loss."""
    split = split or PipelineSplit(cfg.n_layers)
    return GPT(cfg, tp=tp, layers=split.layer_ids(pp_rank, chunk), pre=pp_rank == 0 and chunk == 0,
               post=pp_rank == split.pp - 1 and chunk == split.vpp - 1, device=device)
