"""Types of the compiled helpers built from ``csrc/helpers.cpp`` (the ``PYBIND11_MODULE`` block
there is the source of truth; keep the two in step). Arrays are C-contiguous numpy arrays of the
dtype each name says; the builders check dtype and length and raise ``ValueError``."""

import numpy as np
import numpy.typing as npt

ABI_VERSION: int

def build_sample_idx_int32(sizes: npt.NDArray[np.int32], doc_idx: npt.NDArray[np.int32], seq_length: int,
                           num_epochs: int, tokens_per_epoch: int, drop_last: bool = True,
                           add_extra_token: int = 1, exact_ceil: bool = False) -> npt.NDArray[np.int32]: ...
def build_sample_idx_int64(sizes: npt.NDArray[np.int32], doc_idx: npt.NDArray[np.int32], seq_length: int,
                           num_epochs: int, tokens_per_epoch: int, drop_last: bool = True,
                           add_extra_token: int = 1, exact_ceil: bool = False) -> npt.NDArray[np.int64]: ...
def legacy_shuffle_int32(array: npt.NDArray[np.int32], key: npt.NDArray[np.uint32], pos: int) -> int: ...
def legacy_shuffle_uint32(array: npt.NDArray[np.uint32], key: npt.NDArray[np.uint32], pos: int) -> int: ...
def legacy_shuffle_int64(array: npt.NDArray[np.int64], key: npt.NDArray[np.uint32], pos: int) -> int: ...
def build_blending_indices(dataset_index: npt.NDArray[np.int16], dataset_sample_index: npt.NDArray[np.int64],
                           weights: npt.NDArray[np.float64], num_datasets: int, size: int,
                           verbose: bool = False) -> None: ...
def build_exhaustive_blending_indices(dataset_index: npt.NDArray[np.int16],
                                      dataset_sample_index: npt.NDArray[np.int64],
                                      sizes: npt.NDArray[np.int64], num_datasets: int) -> None: ...
