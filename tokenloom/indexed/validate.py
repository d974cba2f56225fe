"""``verify`` with everything a dataset's manifest knows, no flags needed.

The manifest's vocabulary size, EOD and BOS (when the run added them), dtype and counts become
checks of :func:`tokenloom.indexed.verify`; a user's value wins. Without a manifest only the
structure and the user's values are checked, and the report lists what could not run. Tokens
are checked through counts and the vocabulary/EOD/BOS checks (the manifest digests only inputs).
"""

from __future__ import annotations

import os
import struct

from tokenloom.errors import FormatError
from tokenloom.indexed import format as indexed_format
from tokenloom.indexed import manifest
from tokenloom.indexed.tools import verify as verify_pair


def check_pair(prefix: str, saved: dict | None) -> None:
    """Raise :class:`FormatError` when the ``.idx`` header's counts are not the manifest ``saved``'s,
    naming the file that does not belong (the ``.idx`` if the ``.bin`` has the manifest's size).
    Reads a header and two sizes: cheap enough for every open of a source."""
    counts = (saved or {}).get("counts", {})
    if "sequences" not in counts or "documents" not in counts:
        return
    idx_file, bin_file = indexed_format.index_path(prefix), indexed_format.data_path(prefix)
    dtype, sequences, document_indices = indexed_format.read_header(idx_file)
    if (sequences, document_indices - 1) == (counts["sequences"], counts["documents"]):
        return
    where = manifest.manifest_path(prefix)
    said = (f"{idx_file} holds {sequences} sequences in {document_indices - 1} documents, but {where} records "
            f"{counts['sequences']} in {counts['documents']}")
    bin_size = indexed_format.file_size(bin_file)
    if "tokens" in counts and bin_size == counts["tokens"] * dtype.itemsize != _described(idx_file):
        raise FormatError(f"{said}, whose {counts['tokens']} tokens {bin_file} holds: the .idx is foreign "
                          "(it belongs to another .bin); preprocess again")
    raise FormatError(f"{said}: the files come from different runs (the manifest of another dataset, or an "
                      "edited one?); preprocess again")


def _described(idx_file: str) -> int | None:
    try:
        return indexed_format.described_bin_size(idx_file)
    except (OSError, struct.error):  # a truncated .idx: opening it names that
        return None


def verify_dataset(prefix: str | os.PathLike, vocab_size: int | None = None, eod: int | None = None) -> dict:
    """:func:`tokenloom.indexed.verify` with the manifest's values; ``not_checked`` lists what could not run."""
    prefix = indexed_format.normalize_prefix(prefix)
    data = manifest.read(prefix)
    if data is not None and indexed_format.exists(prefix):
        check_pair(prefix, data)
    sources = {name: f"given by {flag}" for name, flag, value in (("vocab", "--vocab-size", vocab_size),
                                                                     ("eod", "--eod", eod)) if value is not None}
    bos, expected, not_checked = None, None, []
    if data is None:
        missing = f"no {manifest.manifest_path(prefix).name}"
        if vocab_size is None:
            not_checked.append(f"vocab ({missing}; pass --vocab-size)")
        if eod is None:
            not_checked.append(f"eod ({missing}; pass --eod)")
        not_checked.append(f"counts ({missing})")
    else:
        tokenizer, options = data.get("tokenizer", {}), data.get("options", {})
        origin = f"the tokenizer of {manifest.manifest_path(prefix)}: {manifest.tokenizer_name(tokenizer)}"
        if vocab_size is None and tokenizer.get("vocab_size") is not None:
            vocab_size, sources["vocab"] = int(tokenizer["vocab_size"]), origin
        if eod is None and options.get("append_eod") and tokenizer.get("eod") is not None:
            eod, sources["eod"] = int(tokenizer["eod"]), origin
        if options.get("prepend_bos") and tokenizer.get("bos") is not None:
            bos, sources["bos"] = int(tokenizer["bos"]), origin
        counts = data.get("counts", {})
        expected = {key: counts[key] for key in ("sequences", "documents", "tokens") if key in counts}
        if "dtype" in data.get("output", {}):
            expected["dtype"] = data["output"]["dtype"]
        sources["counts"] = f"in {manifest.manifest_path(prefix)}"
    report = verify_pair(prefix, vocab_size=vocab_size, eod=eod, bos=bos, expected=expected, sources=sources)
    report["not_checked"] = not_checked
    return report
