"""The on-disk tensor format of training checkpoints: one format for every layout, each rank writing what it owns.

Layout of a checkpoint (``CKPT_DIR/iter_NNNNNNN/``; ``state.json``, ``COMPLETE``, ``latest``
and the atomic commit are :mod:`tokenloom.train.checkpoint.commit`'s)::

    tp{t}_pp{p}_dp{d}.pt    written by the rank at (tp t, pp p, dp d): its pieces (below)
    rng_rank{r}.pt          every rank's RNG states (the caller's file, not this module's)

A **piece** is a contiguous element range ``[start, start + numel)`` of one flattened tensor as a
tp rank holds it (its *local* tensor): a parameter, or one of its AdamW states under the
parameter's one-process name. Each piece records the local shape, the tp rank and size, and how
the tp ranks' local tensors make the full one (``dim``: None when replicated over tp; ``sizes``:
the fused blocks, as :func:`~tokenloom.train.parallel.layers.shard` cuts a fused qkv or SwiGLU
weight). Who writes what (:func:`rank_file`):

* **replicated state** (parameters, optimizer states without ZeRO-1) is written once per model
  replica: the (tp, pp) shard's tensors are laid end to end in bytes and cut into dp equal ranges
  at element boundaries, dp rank d writing range d (deterministic, balanced, no collective);
* **ZeRO-1's optimizer shards** are written by their owner, as the ranges of its flat buffer that
  fall in each parameter; **FSDP's shards** (each rank's dim-0 rows) by the rank holding them, the
  parameter's own pieces under ``own``;
* nobody gathers the model; a tensor tied under several names is written once, with aliases.

Loading (:func:`read`): every file is memory-mapped (``torch.load(weights_only=True, mmap=True)``)
and only the pieces asked for are touched; each local tensor is assembled from its pieces (its
coverage checked) and the tp ranks' local tensors joined by one-process name. The caller cuts the
shard its own layout holds, so a checkpoint of any layout loads into any other; a reader holding a
tp shard assembles only the saving tp ranks that overlap it. Earlier formats still load
(:func:`model_tensors`, :func:`legacy_shard_tensors`, :func:`one_process_tensors`).

Why not ``torch.distributed.checkpoint`` (DCP): its unit is a region of the full tensor, while a
tp rank's shard of a fused block (qkv, SwiGLU) is not one region, and ZeRO-1's pieces are ranges of
the flattened local shard spanning parameters: both would need re-layout copies on every save.
DCP's planner is collective on the training group, which the background writer would have to
serialise against, and its loader unpickles its metadata. Here a rank's file is one ``torch.save``
of plain dicts and tensors (weights-only, identical whichever thread writes it). The trade-offs: a
loading rank assembles whole local tensors of the saving tp ranks it overlaps, a ZeRO-1 reader the
whole local optimizer state before keeping its range, and the layout per file follows the saving dp.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tokenloom.errors import TokenloomError
from tokenloom.train.parallel.layers import shard, unshard

FORMAT = 1
"""The ``format`` field of every piece file."""

PIECES = "tp*_pp*_dp*.pt"
LEGACY_SHARDS = "shard_tp*_pp*.pt"
PARAM = ""
"""The ``state`` field of a parameter's own pieces (an optimizer state's is its key)."""


Split = Callable[[str], tuple[int | None, Sequence[int] | None]]
"""How a reader splits a tensor over tp, by one-process name: (partition dim, fused block
sizes), or (None, None) when it holds the tensor whole."""


@dataclass(frozen=True)
class LocalParam:
    """One parameter as this rank holds it, for :func:`rank_file`.

    ``tensor`` is the local tp shard (a live view is fine: the file's tensors are copied by the
    saver before they are written); ``dim`` / ``sizes`` say how the tp shards make the full
    tensor (None: replicated over tp). ``aliases``: other one-process names of the same tensor.
    ``state``: optimizer states replicated over dp (plain AdamW's, or ZeRO-1's scalar step), in
    the parameter's local shape or 0-dim. ``own``: the pieces this rank owns (ZeRO-1's, or
    FSDP's, whose parameter pieces come under the key ``PARAM``), key -> (start element in the
    flattened local tensor, 1-d piece)."""

    name: str
    tensor: torch.Tensor
    dim: int | None = None
    sizes: Sequence[int] | None = None
    aliases: tuple[str, ...] = ()
    state: Mapping[str, torch.Tensor] = field(default_factory=dict)
    own: Mapping[str, tuple[int, torch.Tensor]] = field(default_factory=dict)


@dataclass(frozen=True)
class Placement:
    """Where a rank sits: its tp, pp and dp ranks and the tp and dp sizes."""

    tp_rank: int
    tp_size: int
    pp_rank: int
    dp_rank: int
    dp_size: int


def piece_file(tp_rank: int, pp_rank: int, dp_rank: int) -> str:
    """The name of the piece file of the rank at (tp, pp, dp)."""
    return f"tp{tp_rank}_pp{pp_rank}_dp{dp_rank}.pt"


def _record(p: LocalParam, state: str, local: torch.Tensor, start: int, data: torch.Tensor,
            where: Placement) -> dict[str, Any]:
    return {"name": p.name, "state": state, "start": int(start), "shape": list(local.shape),
            "dim": p.dim, "sizes": list(p.sizes) if p.sizes else None, "tp_rank": where.tp_rank,
            "tp_size": where.tp_size, "data": data}


def rank_file(params: Sequence[LocalParam], where: Placement) -> dict[str, Any]:
    """This rank's piece file (what ``torch.save`` writes under :func:`piece_file`): its byte
    range of the replicated state and its own ZeRO-1 pieces (module docstring). Every dp rank of
    a (tp, pp) shard must pass the same ``params`` in the same order; ``data`` tensors are views
    of the live ones (copy them before writing)."""
    replicated: list[tuple[LocalParam, str, torch.Tensor]] = []
    for p in params:
        if PARAM not in p.own:  # a parameter sharded over dp (fsdp) is written by its owners
            replicated.append((p, PARAM, p.tensor))
        replicated += [(p, key, v) for key, v in p.state.items()]
    total = sum(t.numel() * t.element_size() for _, _, t in replicated)
    lo, hi = where.dp_rank * total // where.dp_size, (where.dp_rank + 1) * total // where.dp_size
    records, at = [], 0
    for p, key, t in replicated:
        size = t.element_size()
        first = min(max(-(-(lo - at) // size), 0), t.numel())
        last = min(max(-(-(hi - at) // size), 0), t.numel())
        if last > first:
            records.append(_record(p, key, t, first, t.detach().reshape(-1)[first:last], where))
        at += t.numel() * size
    for p in params:
        for key, (start, piece) in p.own.items():
            records.append(_record(p, key, p.tensor, start, piece.detach().reshape(-1), where))
    aliases = {alias: p.name for p in params for alias in p.aliases}
    return {"format": FORMAT, "aliases": aliases, "records": records}


def has_pieces(path: Path) -> bool:
    """Whether the checkpoint at ``path`` is in this format."""
    return any(path.glob(PIECES))


def read(path: Path, names: set[str] | None = None, *, tp_rank: int = 0, tp_size: int = 1,
         split: Split | None = None) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, torch.Tensor]]]:
    """Parameters and optimizer states by one-process name (aliases included) from the piece
    files at ``path``, as the reader at (``tp_rank``, ``tp_size``) holds them: ``split(name)``
    says how the reader splits a tensor over tp (partition dim and fused block sizes, or (None,
    None): replicated; needed when ``tp_size`` > 1), and a split one comes back as that rank's
    shard (:func:`~tokenloom.train.parallel.layers.shard` of the full one), any other whole.
    Only ``names`` when given. Of the memory-mapped files, only the pieces of the saving tp
    ranks whose shards overlap the reader's are touched (one saving rank's for a tensor saved
    replicated). A tensor whose pieces do not cover it is refused, naming it."""
    if tp_size > 1 and split is None:
        raise ValueError("read: tp_size > 1 needs split")
    files = [torch.load(f, weights_only=True, mmap=True, map_location="cpu") for f in sorted(path.glob(PIECES))]
    aliases: dict[str, str] = {}
    for data in files:
        if data.get("format") != FORMAT:
            raise TokenloomError(f"{path}: piece format {data.get('format')} is not {FORMAT}; resume it with the "
                                 "version that wrote it")
        aliases.update(data["aliases"])
    reader_name = None if names is None else {aliases.get(n, n): n for n in names}  # written name -> asked
    parts: dict[tuple[str, str], dict[int, list[dict[str, Any]]]] = {}
    for data in files:
        for r in data["records"]:
            if reader_name is None or r["name"] in reader_name:
                parts.setdefault((r["name"], r["state"]), {}).setdefault(r["tp_rank"], []).append(r)
    params: dict[str, torch.Tensor] = {}
    optim: dict[str, dict[str, torch.Tensor]] = {}
    for (name, state), by_rank in parts.items():
        first = by_rank[min(by_rank)][0]
        dim, sizes = (None, None)
        if tp_size > 1 and first["shape"] and split is not None:
            dim, sizes = split(name if reader_name is None else reader_name[name])
        if first["dim"] is None or not first["shape"]:  # saved replicated over tp: one saving rank's copy
            tensor = _assemble(path, name, state, by_rank[min(by_rank)])
            tensor = tp_part(tensor, dim, sizes, tp_rank, tp_size)
        elif dim is None:  # read whole
            tensor = _tp_shard(path, name, state, by_rank, 0, 1)
        elif dim == first["dim"] and list(sizes or []) == list(first["sizes"] or []):
            tensor = _tp_shard(path, name, state, by_rank, tp_rank, tp_size)
        else:  # split another way than it was saved
            tensor = tp_part(_tp_shard(path, name, state, by_rank, 0, 1), dim, sizes, tp_rank, tp_size)
        if state == PARAM:
            params[name] = tensor
        else:
            optim.setdefault(name, {})[state] = tensor
    for alias, name in aliases.items():
        if name in params and (names is None or alias in names):
            params[alias] = params[name]
            if name in optim:
                optim[alias] = optim[name]
    return params, optim


def tp_part(full: torch.Tensor, dim: int | None, sizes: Sequence[int] | None, rank: int, size: int) -> torch.Tensor:
    """Tp rank ``rank`` of ``size``'s part of the full tensor ``full`` split on ``dim`` in fused
    blocks ``sizes`` (:func:`~tokenloom.train.parallel.layers.shard`); ``full`` itself when it is
    held whole (``dim`` None, a 0-dim state, or one tp rank)."""
    if dim is None or full.dim() == 0 or size == 1:
        return full
    return shard(full, dim, rank, size, sizes)


def _tp_shard(path: Path, name: str, state: str, by_rank: dict[int, list[dict[str, Any]]], rank: int,
              size: int) -> torch.Tensor:
    """Reader tp rank ``rank`` of ``size``'s shard of a tensor saved split over tp, from the
    pieces (``by_rank``: by saving tp rank) of only the saving ranks it overlaps. Each fused
    block (``sizes``, or the whole dim) is split evenly over the saving ranks and over the
    reader's, so saving rank t's rows of a block overlap the reader's exactly when
    ``t * size < (rank + 1) * saved`` and ``(t + 1) * size > rank * saved``, whatever the
    block. A block that one of the two sizes does not divide goes through the full tensor."""
    first = by_rank[min(by_rank)][0]
    saved, dim, local_shape = first["tp_size"], first["dim"], first["shape"]
    blocks = list(first["sizes"] or [local_shape[dim] * saved])
    uneven = any(b % saved or b % size for b in blocks)
    needed = list(range(saved)) if uneven else \
        [t for t in range(saved) if t * size < (rank + 1) * saved and (t + 1) * size > rank * saved]
    missing = [t for t in needed if t not in by_rank]
    if missing:
        raise TokenloomError(f"{path}: {name} {state or 'parameter'} lacks tp ranks {missing} of {saved}")
    locals_ = {t: _assemble(path, name, state, by_rank[t]) for t in needed}
    if uneven:
        return tp_part(unshard([locals_[t] for t in needed], dim, first["sizes"]), dim, first["sizes"], rank, size)
    if saved == size:
        return locals_[rank]
    out, offset = [], 0  # offset: where the block starts in a saving rank's local tensor
    for b in blocks:
        mine, theirs = b // size, b // saved
        lo, hi = rank * mine, (rank + 1) * mine
        for t in needed:
            start, end = max(lo, t * theirs), min(hi, (t + 1) * theirs)
            if end > start:
                out.append(locals_[t].narrow(dim, offset + start - t * theirs, end - start))
        offset += theirs
    return torch.cat(out, dim).contiguous()


def _assemble(path: Path, name: str, state: str, records: list[dict[str, Any]]) -> torch.Tensor:
    """One tp rank's local tensor from its pieces."""
    shape = records[0]["shape"]
    flat = torch.empty(int(torch.Size(shape).numel()), dtype=records[0]["data"].dtype, device="cpu")
    covered = 0
    for r in records:
        flat[r["start"]:r["start"] + r["data"].numel()].copy_(r["data"])
        covered += r["data"].numel()
    if covered != flat.numel():
        raise TokenloomError(f"{path}: the pieces of {name} {state or 'parameter'} cover {covered} of its "
                             f"{flat.numel()} elements; is a piece file missing?")
    return flat.view(shape)


# --------------------------------------------------------------------------- earlier formats


def legacy_shard_tensors(path: Path, names: set[str] | None = None
                         ) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, torch.Tensor]]]:
    """:func:`read` for the per-(tp, pp) ``shard_tp{t}_pp{p}.pt`` files of dp rank 0 (the format
    before this one: full local tensors with their split info, ZeRO-1 state gathered into them)."""
    pieces: dict[str, list[tuple[int, torch.Tensor, Any]]] = {}
    opt_pieces: dict[str, dict[str, list[tuple[int, torch.Tensor]]]] = {}
    for f in sorted(path.glob(LEGACY_SHARDS)):
        data = torch.load(f, weights_only=True, mmap=True, map_location="cpu")
        t = data["tp_rank"]
        for name, tensor in data["params"].items():
            if names is None or name in names:
                pieces.setdefault(name, []).append((t, tensor, data["meta"][name]))
        for name, st in data["optim"].items():
            if names is None or name in names:
                for k, v in st.items():
                    opt_pieces.setdefault(name, {}).setdefault(k, []).append((t, v))
    params: dict[str, torch.Tensor] = {}
    optim: dict[str, dict[str, Any]] = {}
    for name, items in pieces.items():
        items.sort(key=lambda x: x[0])
        dim, sizes = items[0][2]
        params[name] = items[0][1] if dim is None else unshard([x[1] for x in items], dim, sizes)
        if name in opt_pieces:
            optim[name] = {}
            for k, vs in opt_pieces[name].items():
                vs.sort(key=lambda x: x[0])
                if dim is None or vs[0][1].dim() == 0:
                    optim[name][k] = vs[0][1]
                else:
                    optim[name][k] = unshard([v for _, v in vs], dim, sizes)
    return params, optim


def one_process_tensors(path: Path, order: Sequence[Sequence[str]] | None
                        ) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, torch.Tensor]]]:
    """The one-process ``model.pt`` + ``optimizer.pt`` as :func:`read` gives them. The saved
    optimizer keys its states by position; ``order[i]`` are the one-process names of position
    ``i`` (the model's optimizer parameter order), which the caller derives from the model.
    ``order`` None: the parameters alone (``optimizer.pt`` is not read)."""
    params = torch.load(path / "model.pt", map_location="cpu", weights_only=True)
    if order is None:
        return params, {}
    saved = torch.load(path / "optimizer.pt", map_location="cpu", weights_only=True)
    count = sum(len(g["params"]) for g in saved["param_groups"])
    if count != len(order):
        raise TokenloomError(f"{path}: the optimizer state has {count} parameters, the configured model "
                             f"{len(order)}; was it trained with another model?")
    optim = {name: state for i, state in saved["state"].items() for name in order[int(i)]}
    return params, optim


def read_any(path: Path, state: dict, names: set[str] | None = None,
             order: Callable[[], Sequence[Sequence[str]]] | None = None, *,
             split: Split | None = None, tp_rank: int = 0, tp_size: int = 1
             ) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, torch.Tensor]]]:
    """:func:`read` of the checkpoint at ``path`` (``state``: its ``state.json``) in whichever
    format it was written: piece files, the earlier shard files (both memory-mapped, only
    ``names`` when given), or the one-process ``model.pt`` + ``optimizer.pt`` (every name;
    ``order()`` gives its optimizer's parameter order, :func:`one_process_tensors`; without it
    the optimizer states are not read). ``tp_size`` > 1: tensors split over tp come back as
    the shard of ``tp_rank`` by ``split``, as :func:`read` gives them (the earlier formats are
    read whole, then cut)."""
    if has_pieces(path):
        return read(path, names, tp_rank=tp_rank, tp_size=tp_size, split=split)
    if state.get("layout") is not None:
        params, optim = legacy_shard_tensors(path, names)
    else:
        params, optim = one_process_tensors(path, None if order is None else order())
    if tp_size == 1:
        return params, optim
    if split is None:
        raise ValueError("read_any: tp_size > 1 needs split")

    def cut(name: str, full: torch.Tensor) -> torch.Tensor:
        return tp_part(full, *split(name), tp_rank, tp_size)

    return ({n: cut(n, t) for n, t in params.items() if names is None or n in names},
            {n: {k: cut(n, v) for k, v in st.items()} for n, st in optim.items() if names is None or n in names})


def model_tensors(path: Path, state: dict) -> dict[str, torch.Tensor]:
    """The full parameters by one-process name of the checkpoint at ``path`` (``state``: its
    ``state.json``) of any layout and format (:func:`read_any`)."""
    return read_any(path, state)[0]
