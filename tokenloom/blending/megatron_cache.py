"""Megatron-LM's index cache (spec D): same description text, MD5 key, file names and files.

A cache directory written here is a cache hit for megatron-core 0.16.1 and the other
way round, so a tokenloom run and a Megatron run can share pre-built indices
(``--data-cache-path``). The key is Megatron's: an MD5 of a JSON description holding
the prefix string *as given*, the sample count, split, seed, sequence length, split
string and matrix, and the tokenizer's ``unique_identifiers``. Like Megatron it does
not cover ``add_extra_token``, ``drop_last_partial_validation_sequence``, the surplus
or the data content: rebuilding data under the same prefix reuses stale indices.
tokenloom's own content-keyed cache avoids that; use this one for interop only.

Files: ``<md5>-<Class>-<split>-{description.txt, document_index.npy, sample_index.npy,
shuffle_index.npy}`` for a GPT dataset and ``...-{description.txt, dataset_index.npy,
dataset_sample_index.npy}`` for a blend, flat in one directory. Real-data GPT datasets
default to ``<prefix>/cache/GPTDataset_indices``; blends and mock datasets are cached
only under an explicit directory. Each file is written atomically.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np

from tokenloom.blending.blend import BlendBuilder, BlendConfig
from tokenloom.blending.gpt import GPTDataset, GPTIndices, TokenSource, epoch_plan
from tokenloom.blending.split import Bookend, Split, split_matrix
from tokenloom.errors import TokenloomError
from tokenloom.fsio import atomic_writer

GPT_ARRAYS = ("document_index", "sample_index", "shuffle_index")
BLEND_ARRAYS = ("dataset_index", "dataset_sample_index")


def describe(mapping: dict) -> str:
    """Megatron's description text: ``json.dumps(indent=4)``, no trailing newline."""
    return json.dumps(mapping, indent=4)


def cache_key(description: str) -> str:
    return hashlib.md5(description.encode("utf-8"), usedforsecurity=False).hexdigest()


def file_base(directory: str | os.PathLike, description: str, class_name: str, split: Split) -> Path:
    return Path(directory) / f"{cache_key(description)}-{class_name}-{split.name}"


def _path(base: Path, suffix: str) -> Path:
    return base.with_name(f"{base.name}-{suffix}")


def load(base: Path, names: tuple[str, ...]) -> dict[str, np.ndarray] | None:
    """The arrays as read-only memmaps if every file exists (Megatron's hit rule), else None."""
    paths = [_path(base, "description.txt")] + [_path(base, f"{n}.npy") for n in names]
    if not all(p.is_file() for p in paths):
        return None
    return {n: np.load(_path(base, f"{n}.npy"), mmap_mode="r", allow_pickle=False) for n in names}


def save(base: Path, description: str, arrays: dict[str, np.ndarray]) -> None:
    base.parent.mkdir(parents=True, exist_ok=True)
    for name, array in arrays.items():
        with atomic_writer(_path(base, f"{name}.npy")) as f:
            np.save(f, array, allow_pickle=False)
    with atomic_writer(_path(base, "description.txt"), "w", encoding="utf-8") as f:
        f.write(description)


class MegatronCacheBuilder(BlendBuilder):
    """A :class:`BlendBuilder` that reads and writes Megatron's cache.

    ``tokenizer`` is the tokenizer's ``unique_identifiers`` mapping as Megatron would
    serialise it (e.g. ``{"class": "...HuggingFaceTokenizer", "tokenizer_path": [...]}``).
    ``path_to_cache`` None follows Megatron's defaults (see the module docstring).
    """

    def __init__(
        self,
        config: BlendConfig,
        tokenizer: dict,
        path_to_cache: str | os.PathLike | None = None,
        open_source: Callable[[str | None], TokenSource] | None = None,
        mock: bool = False,
    ) -> None:
        if config.gpt.packing != "concat":
            raise TokenloomError(f"Megatron's cache holds concatenated samples only; packing {config.gpt.packing!r} "
                                 "builds go to tokenloom's cache (--cache-dir)")
        super().__init__(config, **({"open_source": open_source} if open_source else {}))
        self.tokenizer = tokenizer
        self.path_to_cache = path_to_cache
        self.mock = mock
        self.hits = 0
        self.builds = 0
        self._member_mappings: dict[int, dict] = {}

    def _split_fields(self) -> tuple[str | None, list | None]:
        split = "1,1,1" if self.mock else self.config.gpt.split
        return split, (None if split is None else [list(b) if b else None for b in split_matrix(split)])

    def gpt_mapping(self, prefix: str | None, num_samples: int | None, split: Split) -> dict:
        split_string, matrix = self._split_fields()
        return {
            "class": "MockGPTDataset" if self.mock else "GPTDataset",
            "dataset_path": prefix,
            "num_samples": num_samples,
            "index_split": split.name,
            "random_seed": self.config.gpt.seed,
            "sequence_length": self.config.gpt.seq_length,
            "split": split_string,
            "split_matrix": matrix,
            "tokenizer": self.tokenizer,
        }

    def gpt_indices(
        self,
        prefix: str | None,
        source: TokenSource,
        documents: np.ndarray,
        bookend: Bookend,
        num_samples: int | None,
        split: Split,
    ) -> GPTIndices:
        mapping = self.gpt_mapping(prefix, num_samples, split)
        description = describe(mapping)
        directory = self.path_to_cache
        if directory is None and not self.mock and prefix is not None:  # a mock source has no prefix
            directory = os.path.join(prefix, "cache", "GPTDataset_indices")
        base = file_base(directory, description, mapping["class"], split) if directory else None
        found = load(base, GPT_ARRAYS) if base else None
        if found is None:
            indices = super().gpt_indices(prefix, source, documents, bookend, num_samples, split)
            if base:
                save(base, description, {n: getattr(indices, n) for n in GPT_ARRAYS})
            self.builds += 1
        else:
            tokens = int(np.sum(source.sequence_lengths[documents], dtype=np.int64))
            num_epochs, separate, _ = epoch_plan(tokens, num_samples, self.config.gpt)
            indices = GPTIndices(
                **found, num_epochs=num_epochs, separate_final_epoch=separate, tokens_per_epoch=tokens
            )
            self.hits += 1
        self._member_mappings[id(indices)] = mapping
        return indices

    def blend_indices(
        self, datasets: list[GPTDataset], weights: list[float] | list[int], size: int | None, split: Split
    ) -> tuple[np.ndarray, np.ndarray]:
        mapping = {
            "class": "BlendedDataset",
            "datasets": [self._member_mappings[id(ds.indices)] for ds in datasets],
            "split": split.name,
            "weights": weights,
            "size": size,
        }
        description = describe(mapping)
        base = (
            file_base(self.path_to_cache, description, "BlendedDataset", split)
            if self.path_to_cache
            else None
        )
        found = load(base, BLEND_ARRAYS) if base else None
        if found is not None:
            self.hits += 1
            return found["dataset_index"], found["dataset_sample_index"]
        arrays = super().blend_indices(datasets, weights, size, split)
        if base:
            save(base, description, dict(zip(BLEND_ARRAYS, arrays, strict=True)))
        self.builds += 1
        return arrays
