"""Blend sources as users write them: ``--data WEIGHT PREFIX ...`` values and blend files.

Both become ``[(weight, prefix), ...]`` lists (a blend file may give one per split); what
the builder does with them is in :mod:`tokenloom.blending.build`.
"""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from tokenloom.errors import TokenloomError


def parse_data_args(values: list[str]) -> list[tuple[float, str]]:
    """``["0.3", "a", "0.7", "b"]`` or ``["a", "b"]`` (equal weights) -> [(w, prefix), ...]."""
    if not values:
        return []
    try:
        float(values[0])
        weighted = True
    except ValueError:
        weighted = False
    if not weighted:
        return [(1.0, v) for v in values]
    if len(values) % 2:
        raise TokenloomError(
            f"--data takes WEIGHT PREFIX pairs; got an odd number of values: {' '.join(values)}"
        )
    pairs = []
    for w, p in zip(values[::2], values[1::2], strict=True):
        try:
            pairs.append((float(w), p))
        except ValueError:
            raise TokenloomError(f"--data: {w!r} is not a weight (expected WEIGHT PREFIX pairs)") from None
    return pairs


def source_names(prefixes: list[str], names: list[str | None] | None = None, where: str = "the blend") -> list[str]:
    """One display name per source (losses per source, plots): ``names[i]`` where given, else the
    prefix's basename, or the whole prefix when another source has the same basename. Refuses
    in one line, naming ``where``, names that do not match the sources one to one or repeat."""
    given = names if names is not None else [None] * len(prefixes)
    if len(given) != len(prefixes):
        raise TokenloomError(f"{where}: {len(given)} names for {len(prefixes)} sources; give one name per source")
    bases = [Path(p).name for p in prefixes]
    out = [n if n is not None else (b if bases.count(b) == 1 else p)
           for n, b, p in zip(given, bases, prefixes, strict=True)]
    repeated = sorted({n for n in out if out.count(n) > 1})
    if repeated:
        raise TokenloomError(f"{where}: the source name(s) {', '.join(map(repr, repeated))} name more than one "
                             "source; give each source its own name")
    return out


def phase_sources(prefixes: list[str], names: list[str | None] | None = None, where: str = "the blend") -> dict[str, str]:
    """Prefix or display name (:func:`source_names`) -> prefix of every source: what a data
    schedule's phase may call a source."""
    shown = source_names(prefixes, names, where)
    return {**dict(zip(shown, prefixes, strict=True)), **{p: p for p in prefixes}}


def resolve_schedule(phases: list[tuple[int, list]], keys: dict[str, str], where: str,
                     listed_in: str, file: str | None = None) -> list[tuple[int, list[tuple[float, str]]]]:
    """A data schedule's phases ``(start_iter, [(weight, source), ...])`` with each source made
    its prefix (``keys``: :func:`phase_sources`), a phase's order kept (it draws the interleave).

    Refuses, in one line naming the phase (``where[k]``), phases whose start iterations do not
    increase from 0, a phase blend that is empty, has a weight that is not > 0, names a source
    twice or one ``listed_in`` does not list, and two phases in a row with the same blend; the
    line starts with ``file`` when the schedule came from one."""
    lead = f"{file}: " if file else ""
    out: list[tuple[int, list[tuple[float, str]]]] = []
    for k, (start, blend) in enumerate(phases):
        at = f"{where}[{k}]"
        if not isinstance(start, int) or isinstance(start, bool):
            raise TokenloomError(f"{lead}{at}.start_iter is {start!r}: give an iteration count")
        if k == 0 and start != 0:
            raise TokenloomError(f"{lead}{at}.start_iter is {start}: the first phase starts at 0")
        if k and not start > out[-1][0]:
            raise TokenloomError(f"{lead}{at}.start_iter {start} does not follow {where}[{k - 1}].start_iter "
                                 f"{out[-1][0]}: phases start at increasing iterations")
        if not blend:
            raise TokenloomError(f"{lead}{at}.blend is empty; give [[weight, source], ...]")
        pairs = []
        for entry in blend:
            if not isinstance(entry, (list, tuple)) or len(entry) != 2:
                raise TokenloomError(f"{lead}{at}.blend: each entry is [weight, source], got {entry!r}")
            weight, source = entry
            number = isinstance(weight, (int, float)) and not isinstance(weight, bool)
            if not (number and weight > 0):
                shown = f"{weight:g}" if number else repr(weight)
                raise TokenloomError(f"{lead}{at}.blend: the weight {shown} of {source} is not > 0; leave a source "
                                     "out of a phase instead")
            if str(source) not in keys:
                raise TokenloomError(f"{lead}{at}.blend: unknown source {source!r}; a phase's sources are {listed_in} "
                                     f"(or their names): {', '.join(sorted(keys))}")
            pairs.append((float(weight), keys[str(source)]))
        if len({p for _, p in pairs}) != len(pairs):
            raise TokenloomError(f"{lead}{at}.blend lists a source twice; give each source once")
        if out and pairs == out[-1][1]:
            raise TokenloomError(f"{lead}{at}.blend is {where}[{k - 1}]'s; one phase: drop {at}")
        out.append((start, pairs))
    return out


def load_blend_file(path: str) -> dict:
    """A YAML or JSON blend file: {"data": [[w, prefix], ...]} or {"train": [...], "valid": [...], ...};
    an entry may also be {weight, prefix, name}: the source's display name (its losses per
    source), returned as "names" beside "data" when any is given. Beside "data" a "schedule"
    (the train config's ``data.schedule``: [{start_iter, blend: [[w, source], ...]}, ...], a
    source named by its prefix or name) is returned as it is, each phase's keys checked."""
    text = Path(path).read_text(encoding="utf-8")
    try:
        doc = json.loads(text)  # JSON first: a YAML parser takes seconds on a blend of 10,000 sources
    except ValueError:
        try:
            doc = yaml.safe_load(text)
        except Exception as exc:  # noqa: BLE001 - yaml's errors have many types
            raise TokenloomError(f"{path}: not valid YAML/JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise TokenloomError(f"{path}: expected a mapping with 'data' or per-split keys")

    names: list[str | None] = []

    def pairs(entries, where):
        out = []
        for e in entries or []:
            if isinstance(e, dict) and "prefix" in e:
                out.append((float(e.get("weight", 1.0)), str(e["prefix"])))
                names.append(None if e.get("name") is None else str(e["name"]))
            elif isinstance(e, (list, tuple)) and len(e) == 2:
                out.append((float(e[0]), str(e[1])))
                names.append(None)
            else:
                raise TokenloomError(f"{path}: {where}: each entry is [weight, prefix] or {{weight, prefix[, name]}}")
        return out

    if "data" in doc:
        unknown = set(doc) - {"data", "schedule"}
        if unknown:
            raise TokenloomError(f"{path}: unknown keys {sorted(unknown)} beside 'data' (known: data, schedule)")
        spec: dict = {"data": pairs(doc["data"], "data")}
        if any(n is not None for n in names):  # display names of the sources (losses per source)
            spec["names"] = names
        if "schedule" in doc:
            spec["schedule"] = schedule(doc["schedule"], path)
        return spec
    if "schedule" in doc:
        raise TokenloomError(f"{path}: a schedule needs 'data' beside it, listing every source its phases draw from")
    unknown = set(doc) - {"train", "valid", "test"}
    if unknown:
        raise TokenloomError(f"{path}: unknown keys {sorted(unknown)} (use 'data' or train/valid/test)")
    return {"data_per_split": {k: pairs(v, k) for k, v in doc.items()}}


def schedule(phases, path: str) -> list[dict]:
    """A blend file's ``schedule``: a list of {start_iter, blend} mappings (their values are
    checked with the train config's ``data.schedule``)."""
    if not isinstance(phases, list):
        raise TokenloomError(f"{path}: schedule is a list of {{start_iter: N, blend: [[w, source], ...]}}")
    for k, phase in enumerate(phases):
        if not isinstance(phase, dict) or set(phase) != {"start_iter", "blend"}:
            raise TokenloomError(f"{path}: schedule[{k}]: each phase is {{start_iter: N, blend: [[w, source], ...]}}, "
                                 f"got {phase!r}")
    return phases
