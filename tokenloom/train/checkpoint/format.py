"""The on-disk tensor format of training checkpoints: one format for every layout, each rank writing what it owns.

Layout (``CKPT_DIR/iter_NNNNNNN/``; the commit files are :mod:`.commit`'s)::

    tp{t}_pp{p}_dp{d}.pt    written by the rank at (tp t, pp p, dp d): its pieces (below)
    rng_rank{r}.pt          every rank's RNG states (the caller's file, not this module's)

A **piece** is an element range of one flattened tp-local tensor (a parameter, or an AdamW state
under its parameter's one-process name), recording local shape, tp rank and size, and how tp
shards make the full tensor (``dim``, fused block ``sizes`` as ``layers.shard`` cuts qkv or SwiGLU).
Writers (:func:`rank_file`): replicated state is laid end to end per (tp, pp) shard and cut into
dp equal byte ranges, dp rank d writing range d (balanced, no collective); ZeRO-1 and FSDP shards
are written by their owners; nobody gathers the model; tied tensors are written once, with aliases.

Loading (:func:`read`) memory-maps the files, touches only the pieces asked for (of overlapping
saving tp ranks), checks coverage and joins by name, so any layout loads into any other; earlier
formats still load (:func:`legacy_shard_tensors`, :func:`one_process_tensors`).

Why not ``torch.distributed.checkpoint``: its unit is a region of the full tensor, while a tp shard
of a fused block and ZeRO-1's ranges across parameters are not regions (re-layout copies every
save); its planner is collective on the training group, against the background writer; its loader
unpickles metadata. Here a file is one weights-only ``torch.save`` of plain dicts and tensors. The
trade-off: readers assemble whole overlapping local tensors, and the file layout follows saving dp.
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
"""name -> (partition dim, fused block sizes) of a reader's tp split; (None, None): whole."""


@dataclass(frozen=True)
class LocalParam:
    """One parameter as this rank holds it: ``tensor`` the local tp shard (a live view: the saver
    copies), ``dim`` / ``sizes`` its tp split (None: replicated), ``aliases`` its other names,
    ``state`` optimizer states replicated over dp, ``own`` pieces this rank owns (ZeRO-1's; FSDP's
    under ``PARAM``): key -> (start in the flattened local tensor, 1-d piece)."""

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
    """This rank's piece file: its byte range of the replicated state and its own pieces. Every dp
    rank of a shard passes the same ``params`` in order; ``data`` are live views (copy first)."""
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
    """(parameters, optimizer states) by one-process name, aliases included (only ``names`` when
    given), as the reader at (``tp_rank``, ``tp_size``) holds them: split by ``split`` (needed at
    ``tp_size`` > 1), else whole. Touches only overlapping saving ranks' pieces; a tensor its
    pieces do not cover is refused, naming it."""
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
    """Tp rank ``rank``'s :func:`~tokenloom.train.parallel.layers.shard` of ``full`` (itself when whole)."""
    if dim is None or full.dim() == 0 or size == 1:
        return full
    return shard(full, dim, rank, size, sizes)


def _tp_shard(path: Path, name: str, state: str, by_rank: dict[int, list[dict[str, Any]]], rank: int,
              size: int) -> torch.Tensor:
    """Reader rank ``rank`` of ``size``'s shard of a tp-split tensor, from the saving ranks it
    overlaps: blocks split evenly on both sides, so saving rank t overlaps exactly when ``t * size
    < (rank + 1) * saved`` and ``(t + 1) * size > rank * saved``; uneven blocks go via the full tensor."""
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
    """:func:`read` for the previous format's ``shard_tp{t}_pp{p}.pt`` files (full local tensors)."""
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
    """The one-process ``model.pt`` + ``optimizer.pt`` as :func:`read` gives them; ``order[i]``: the
    names of optimizer position ``i`` (None: parameters only)."""
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
    """:func:`read` for any format (``state``: its ``state.json``): pieces, earlier shards, or the
    one-process files (``order()`` as :func:`one_process_tensors`; earlier formats read whole, then
    cut to ``tp_rank``'s shard)."""
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
    """The full parameters by one-process name, any layout and format (:func:`read_any`)."""
    return read_any(path, state)[0]
