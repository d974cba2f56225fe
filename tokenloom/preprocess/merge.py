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
"""

from __future__ import annotations

import os
import shutil
import tempfile

from tokenloom import objstore
from tokenloom.errors import TokenloomError
from tokenloom.fsio import os_error_message, remove_dead_temps
from tokenloom.indexed import manifest
from tokenloom.indexed import merge as merge_indexed
from tokenloom.indexed.format import data_path, index_path, normalize_prefix
from tokenloom.preprocess.commit import publish_dataset, uncommit


def merge(output_prefix: str, prefixes: list[str], rerun: str = "rerun the merge") -> dict:
    """``rerun``: what the one-line error of a failed write tells the user to do next."""
    try:
        return _merge(output_prefix, prefixes)
    except OSError as exc:
        raise TokenloomError(f"{os_error_message(exc, output_prefix)}; then {rerun}") from None


def _merge(output_prefix: str, prefixes: list[str]) -> dict:
    if objstore.is_url(output_prefix):
        return _merge_to_store(output_prefix, prefixes)
    prefixes = [normalize_prefix(p) for p in prefixes]
    manifests = [manifest.read(p) for p in prefixes]
    have = [m is not None for m in manifests]
    complete = [m for m in manifests if m is not None]  # all of them where all(have)
    if all(have):
        manifest.merged(output_prefix, complete, {})  # refuses mixed tokenizers before any work
    output = normalize_prefix(output_prefix)
    for final in (data_path(output), index_path(output), manifest.manifest_path(output)):
        remove_dead_temps(final)
    if all(os.path.abspath(p) != os.path.abspath(output) for p in prefixes):  # else merge_indexed refuses
        uncommit(output)
    report = merge_indexed(output_prefix, prefixes)
    if all(have):
        counts = {"documents": report["documents"], "sequences": report["sequences"], "tokens": report["tokens"]}
        manifest.write(report["path_prefix"], manifest.merged(output_prefix, complete, counts))
        report["manifest"] = str(manifest.manifest_path(report["path_prefix"]))
    elif any(have):
        report["manifest"] = "none (not every input has a manifest)"
    return report


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
