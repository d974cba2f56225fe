"""Join preprocess outputs (e.g. shards) into one dataset, manifests included.

The ``.bin/.idx`` merge is :func:`tokenloom.indexed.merge`; when every input has a
manifest, the merged manifest lists all inputs in order, sums the counts, and the
merge is refused if the tokenizers differ. Shards merged in index order give the
same bytes as a single run over all inputs.
"""

from __future__ import annotations

from tokenloom.indexed import merge as merge_indexed
from tokenloom.indexed.format import normalize_prefix
from tokenloom.preprocess import manifest


def merge(output_prefix: str, prefixes: list[str]) -> dict:
    prefixes = [normalize_prefix(p) for p in prefixes]
    manifests = [manifest.read(p) for p in prefixes]
    have = [m is not None for m in manifests]
    if all(have):
        manifest.merged(output_prefix, manifests, {})  # refuses mixed tokenizers before any work
    report = merge_indexed(output_prefix, prefixes)
    if all(have):
        counts = {"documents": report["documents"], "sequences": report["sequences"], "tokens": report["tokens"]}
        manifest.write(report["path_prefix"], manifest.merged(output_prefix, manifests, counts))
        report["manifest"] = str(manifest.manifest_path(report["path_prefix"]))
    elif any(have):
        report["manifest"] = "none (not every input has a manifest)"
    return report
