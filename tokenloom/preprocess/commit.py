"""The commit point of a dataset: ``PREFIX.bin``, then ``PREFIX.idx``, then ``PREFIX.manifest.json``.

A dataset written by tokenloom is *finished* when its manifest exists. Publishing
renames three complete, fsynced files into place in that order, fsyncing the
directory after each rename, so the manifest appears last; before the first rename
the previous manifest (if any) is removed, so an old manifest never describes new
files. A ``.bin``/``.idx`` pair without its manifest is therefore an unfinished
publish, and the next run of the same output replaces it.

Publishing is restartable: the caller stages the files (preprocess: inside
``PREFIX.partial/``) and records that staging is complete before calling
:func:`publish_dataset`. Each rename is skipped when its staged file is gone (an
earlier, killed publish made it), so calling it again after a kill at any step ends
with the same files.

On object storage (``s3://`` prefixes) the same order holds with uploads in place
of renames: the old manifest object is deleted, then the staged ``.bin``, ``.idx``
and manifest are uploaded one after another, each staged file removed once its
object is complete. A PUT or multipart upload is atomic per object, so a failed
upload leaves no object under its key, an ``.idx`` object appears only after its
``.bin`` object is complete, and the manifest object only after both. A rerun
uploads what is still staged. Unlike a rename, an upload costs the transfer time
of the object.

Trade-off: readers (``build``, ``train``) still accept pairs without a manifest,
because Megatron-made datasets have none; only the stages that own an output
(``preprocess``, ``merge``) treat such a pair as unfinished.
"""

from __future__ import annotations

import contextlib
import os

from tokenloom import objstore
from tokenloom.fsio import fsync_dir
from tokenloom.indexed.format import data_path, index_path
from tokenloom.indexed.manifest import manifest_path, manifest_url


def uncommit(prefix: str | os.PathLike) -> None:
    """Remove ``prefix``'s manifest: what is under its other final names is no longer finished."""
    if objstore.is_url(prefix):
        objstore.remove(manifest_url(os.fspath(prefix)))
        return
    with contextlib.suppress(FileNotFoundError):
        os.unlink(manifest_path(prefix))
        fsync_dir(manifest_path(prefix))


def publish_dataset(prefix: str | os.PathLike, staged_bin: str | os.PathLike, staged_idx: str | os.PathLike,
                    staged_manifest: str | os.PathLike) -> None:
    """Move a staged dataset onto its final names in commit order; idempotent after a kill."""
    if os.path.exists(staged_bin) or os.path.exists(staged_idx):
        uncommit(prefix)
    remote = objstore.is_url(prefix)
    for staged, final in ((staged_bin, data_path(prefix)), (staged_idx, index_path(prefix)),
                          (staged_manifest, manifest_url(os.fspath(prefix)) if remote else manifest_path(prefix))):
        if not os.path.exists(staged):
            continue
        if remote:
            objstore.upload(staged, str(final))  # a str already: data_path and manifest_url give one
            os.unlink(staged)
        else:
            os.replace(staged, final)
            fsync_dir(final)
