"""Join preprocess outputs (e.g. shards) into one dataset, manifests included.

The ``.bin/.idx`` merge is :func:`tokenloom.indexed.merge`; when every input has a
manifest, the merged manifest lists all inputs in order, sums the counts, and the
merge is refused if the tokenizers differ. Shards merged in index order give the
same bytes as a single run over all inputs.

The output follows the commit order of :mod:`tokenloom.preprocess.commit`: its old
manifest goes first, then ``.bin``, ``.idx`` and the new manifest are published, so a
killed merge leaves an unfinished pair (no manifest) that the rerun replaces, and
temporary files of dead merges into the same output are removed when it starts. A
full disk or another OS error ends in one line naming the path; the merge keeps
nothing (it has no checkpoint: a rerun starts over). Inputs may be object-store prefixes (read
in place); an object-store output is merged in a local temporary folder (it must hold the
output) and uploaded in the same commit order, index and manifest last.

Cleaned outputs (``preprocess --dedup/--filters``): the merged ``OUTPUT.removed.jsonl`` lists the
parts' removals in order (written before the ``.bin``). Shards of a ``--dedup`` run carry their
duplicates and side files (``SHARD.clean/``): the merge is the final pass that decides dedup over
all of them and writes only the kept documents, so ``--num-shards N`` + ``merge`` removes what a
single run removes. A rerun of a killed merge decides again from the same files.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import numpy as np

from tokenloom import objstore
from tokenloom.clean.buckets import decide, removals
from tokenloom.clean.removed import removed_path
from tokenloom.clean.removed import write as write_removed
from tokenloom.errors import TokenloomError
from tokenloom.fsio import atomic_writer, os_error_message, remove_dead_temps
from tokenloom.indexed import manifest
from tokenloom.indexed import merge as merge_indexed
from tokenloom.indexed.format import (
    IndexedDataset,
    IndexedDatasetWriter,
    data_path,
    index_path,
    normalize_prefix,
)
from tokenloom.preprocess.commit import publish_dataset, uncommit


def merge(output_prefix: str, prefixes: list[str], rerun: str = "rerun the merge",
          removed_to: str | None = None) -> dict:
    """``rerun``: what the one-line error of a failed write tells the user to do next; ``removed_to``:
    the prefix whose ``.removed.jsonl`` lists the inputs' removed documents (default: the output's)."""
    try:
        return _merge(output_prefix, prefixes, removed_to)
    except OSError as exc:
        raise TokenloomError(f"{os_error_message(exc, output_prefix)}; then {rerun}") from None


def _merge(output_prefix: str, prefixes: list[str], removed_to: str | None = None) -> dict:
    if objstore.is_url(output_prefix):
        return _merge_to_store(output_prefix, prefixes)
    prefixes = [normalize_prefix(p) for p in prefixes]
    manifests = [manifest.read(p) for p in prefixes]
    have = [m is not None for m in manifests]
    complete = [m for m in manifests if m is not None]  # all of them where all(have)
    if all(have):
        manifest.merged(output_prefix, complete, {})  # refuses mixed tokenizers before any work
    cleans = [m["options"].get("clean") for m in complete] if all(have) else []
    pending = [bool(c and c.get("pending")) for c in cleans]
    if any(pending) and not all(pending):
        raise TokenloomError("cannot merge shards whose dedup is pending with outputs whose is not: merge "
                             "the shards of one --dedup run together first")
    output = normalize_prefix(output_prefix)
    removed_list = removed_path(removed_to or output)
    for final in (data_path(output), index_path(output), manifest.manifest_path(output), removed_list):
        remove_dead_temps(final)
    if all(os.path.abspath(p) != os.path.abspath(output) for p in prefixes):  # else merge_indexed refuses
        uncommit(output)
    if pending and all(pending):
        return _merge_deduplicated(output, prefixes, complete, removed_list)
    if cleans and all(cleans):  # each part's removals are final: list them in order
        with atomic_writer(removed_list) as out:
            for p, c in zip(prefixes, cleans, strict=True):
                with open(Path(p).parent / c["removed_list"], "rb") as f:
                    shutil.copyfileobj(f, out)
    report = merge_indexed(output_prefix, prefixes)
    if all(have):
        counts = {"documents": report["documents"], "sequences": report["sequences"], "tokens": report["tokens"]}
        manifest.write(report["path_prefix"], manifest.merged(output_prefix, complete, counts))
        report["manifest"] = str(manifest.manifest_path(report["path_prefix"]))
    elif any(have):
        report["manifest"] = "none (not every input has a manifest)"
    return report


def _merge_deduplicated(output: str, prefixes: list[str], manifests: list[dict], removed_list: Path) -> dict:
    """The final pass of a sharded ``--dedup`` job: the decision over every shard's side files in
    order (:func:`tokenloom.clean.buckets.decide`), the removed list, then each shard's kept documents.

    The shards must be merged in index order, all with the same settings, so that the decision is
    the single run's; a shard left out would leave its duplicates' twins unseen (refused only when
    its index shows it missing)."""
    if any(os.path.abspath(p) == os.path.abspath(output) for p in prefixes):
        raise TokenloomError(f"merge output {output} is also an input")
    settings = [{k: v for k, v in m["options"]["clean"].items() if k not in ("side_files", "removed_list")}
                for m in manifests]
    if any(s != settings[0] for s in settings):
        raise TokenloomError("cannot merge shards made with different --dedup or --filters settings")
    shards = [m["options"].get("shard") or {} for m in manifests]
    indices = [int(s.get("index", -1)) for s in shards]
    if any(s.get("count") != shards[0].get("count") for s in shards) or indices != sorted(set(indices)):
        raise TokenloomError("the dedup of sharded outputs is decided over all of them: merge the shards of one "
                             "run, each once, in index order (shard 0 first)")
    dirs = [Path(p).parent / m["options"]["clean"]["side_files"] for p, m in zip(prefixes, manifests, strict=True)]
    decision = decide(dirs)
    removed = write_removed(removed_list, removals(dirs, decision, settings[0]["dedup"]),
                            [[i["path"] for i in m["inputs"]] for m in manifests])
    with IndexedDatasetWriter(output, dtype=manifests[0]["output"]["dtype"]) as writer:
        for n, p in enumerate(prefixes):
            writer.add_kept(p, decision.kept(n))
        counts: dict = {"documents": writer.num_documents, "sequences": writer.num_sequences,
                        "tokens": writer.num_tokens}
    done = IndexedDataset(output)
    counts["empty_documents"] = int((np.diff(done.document_indices) == 0).sum())
    done.close()
    counts["removed"] = removed
    merged = manifest.merged(output, manifests, counts)
    merged["options"]["clean"] = {**settings[0], "pending": False, "removed_list": removed_list.name}
    manifest.write(output, merged)
    return {"path_prefix": output, "dtype": manifests[0]["output"]["dtype"], "inputs": len(prefixes),
            "documents": counts["documents"], "sequences": counts["sequences"], "tokens": counts["tokens"],
            "removed": ", ".join(f"{k} {v}" for k, v in removed.items()) or "none",
            "manifest": str(manifest.manifest_path(output))}


def _merge_to_store(output_url: str, prefixes: list[str]) -> dict:
    """Merge into a local staging folder, then upload ``.bin``, ``.idx`` and manifest in commit order
    (:func:`tokenloom.preprocess.commit.publish_dataset`: the old manifest is removed first)."""
    output = normalize_prefix(output_url)
    if any(normalize_prefix(p) == output for p in prefixes):
        raise TokenloomError(f"merge output {output} is also an input")
    objstore.check_output(output)
    staging = tempfile.mkdtemp(prefix="tokenloom-merge-")
    try:
        local = os.path.join(staging, output.rstrip("/").rsplit("/", 1)[-1])
        report = _merge(local, prefixes)
        publish_dataset(output, data_path(local), index_path(local), manifest.manifest_path(local))
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    report["path_prefix"] = output
    if "manifest" in report and objstore.is_url(output) and report["manifest"].startswith(staging):
        report["manifest"] = manifest.manifest_url(output)
    return report
