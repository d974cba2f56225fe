"""Pipeline layout policy: which transformer blocks each pipeline rank's model chunks hold
(:class:`PipelineSplit`, Megatron's rules), and :func:`pipeline_stage`, the model chunk a
rank builds from it. The model itself (:mod:`tokenloom.train.model.gpt`) knows only the block
indices it is given; the rules for choosing them live here.
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
    """Which transformer blocks each pipeline rank's model chunks hold: Megatron's rules.

    The blocks are dealt out in model order over the virtual stages ``(chunk, pp_rank)``,
    chunk-major (chunk 0 of ranks 0..p-1, then chunk 1, ...), each taking the next
    ``counts()[chunk][pp_rank]`` blocks. The counts:

    * even (default): ``n_layers / (p v)`` everywhere;
    * ``first`` / ``last`` (Megatron's ``--decoder-first/last-pipeline-num-layers``): the
      first / last pipeline rank holds that many blocks (``/ v`` per chunk), the other
      ("middle") ranks share the rest evenly;
    * ``embedding_as_layer`` / ``loss_as_layer`` (Megatron's
      ``--account-for-embedding/loss-in-pipeline-split``): the embedding / the head and loss
      count as one block each, ``(n_layers + 1 or 2) / (p v)`` per chunk, and the chunk
      that holds them builds one block fewer (possibly none).

    The trade-off: the last stage also runs the LM head and the loss (``d x V`` per
    token, a few blocks' worth at a 100 k vocabulary), the first the embedding; equal
    blocks leave the other ranks idle by that difference on every micro-batch, and moving
    whole blocks is as fine as the balance gets. Names stay global, so checkpoints load
    under any split.
    """

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
        """Blocks per virtual stage, ``[chunk][pp_rank]``; :class:`TokenloomError` naming the
        setting when the split does not divide (Megatron's checks)."""
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
        """The global block indices of ``chunk`` on ``pp_rank``.

        Example: 4 layers at pp 2 x vpp 2 -> rank 0 holds [0] and [2], rank 1 [1] and [3];
        with ``loss_as_layer`` 5 layers at pp 2 -> rank 0 holds [0, 1, 2], rank 1 [3, 4].
        """
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
