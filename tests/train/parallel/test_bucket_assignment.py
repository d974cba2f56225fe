"""Our Python bucket assignment equals torch's C++ ``_compute_bucket_assignment_by_size``."""

from __future__ import annotations

import random
import sys

import pytest
import torch
import torch.distributed as dist

from tokenloom.train.model.config import GPTConfig
from tokenloom.train.model.gpt import GPT
from tokenloom.train.parallel.ddp import FIRST_BUCKET_BYTES, compute_bucket_assignment_by_size

MiB = 1024 * 1024
LIMITS = {
    "first+default": [FIRST_BUCKET_BYTES, 25 * MiB],
    "default-only": [25 * MiB],
    "one-bucket": [sys.maxsize],
    "small-caps": [4096, 65536],
    "three-caps": [1000, 20000, 3000],
    "one-byte": [1],
}


def torch_assignment(tensors, limits, sparse=(), indices=()):
    return dist._compute_bucket_assignment_by_size(list(tensors), list(limits), list(sparse), list(indices))


def gpt_params(tied: bool, arch: str = "gpt2") -> list[torch.Tensor]:
    cfg = GPTConfig(
        arch=arch, vocab_size=500, seq_len=64, n_layers=3, n_heads=4, d_model=64, tie_embeddings=tied
    )
    return list(GPT(cfg).parameters())  # deduplicated: a tied weight appears once


def mixed_dtypes() -> list[torch.Tensor]:
    rng = random.Random(0)
    dtypes = [torch.float32, torch.float64, torch.bfloat16]
    return [torch.empty(rng.choice([1, 7, 300, 5000, 70000]), dtype=rng.choice(dtypes)) for _ in range(40)]


def large_meta() -> list[torch.Tensor]:
    """Sizes from tiny to 40 MiB without allocating: meta tensors (also a second device key)."""
    sizes = [MiB // 4, 3, 10 * MiB, 0, 40 * MiB // 4, 1, MiB // 4, 7 * MiB // 4]
    meta = [torch.empty(n, device="meta") for n in sizes * 4]
    return meta + [torch.empty(100), torch.empty(MiB // 4)] + meta[:3]


def linear_stack() -> list[torch.Tensor]:
    """30 x Linear(512, 512): every weight exactly 1 MiB (the doc's measured case)."""
    return [p for _ in range(30) for p in (torch.empty(512, 512), torch.empty(512))]


MODELS = {
    "gpt2_tied": lambda: gpt_params(True),
    "gpt2_untied": lambda: gpt_params(False),
    "llama_tied": lambda: gpt_params(True, "llama"),
    "mixed_dtypes": mixed_dtypes,
    "large_meta": large_meta,
    "linear_stack": linear_stack,
}


@pytest.mark.parametrize("limits", LIMITS.values(), ids=LIMITS.keys())
@pytest.mark.parametrize("model", MODELS.values(), ids=MODELS.keys())
def test_initial_path_equals_torch(model, limits):
    tensors = model()
    assert compute_bucket_assignment_by_size(tensors, limits) == torch_assignment(tensors, limits)


@pytest.mark.parametrize("model", MODELS.values(), ids=MODELS.keys())
def test_sparse_flags_equal_torch(model):
    tensors = model()
    sparse = [random.Random(i).random() < 0.2 for i in range(len(tensors))]
    limits = LIMITS["first+default"]
    assert compute_bucket_assignment_by_size(tensors, limits, sparse) == torch_assignment(
        tensors, limits, sparse
    )


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("model", ["gpt2_tied", "llama_tied", "linear_stack"])
def test_rebuild_path_equals_torch(model, seed):
    """Tensors given in a 'ready order' with tensor_indices: no sorting, same result."""
    tensors = MODELS[model]()
    order = list(reversed(range(len(tensors))))
    random.Random(seed).shuffle(order[: len(order) // 2])  # partly reversed, partly shuffled
    ordered = [tensors[i] for i in order]
    for limits in ([FIRST_BUCKET_BYTES, 25 * MiB], [4096, 65536]):
        ours = compute_bucket_assignment_by_size(ordered, limits, (), order)
        assert ours == torch_assignment(ordered, limits, (), order)


def test_rebuild_path_mixed_dtypes_same_buckets():
    """With several dtypes torch emits leftover buckets in unordered_map order: compare as sets."""
    tensors = mixed_dtypes()
    order = list(reversed(range(len(tensors))))
    ordered = [tensors[i] for i in order]
    ours = compute_bucket_assignment_by_size(ordered, [4096, 65536], (), order)
    theirs = torch_assignment(ordered, [4096, 65536], (), order)
    as_set = lambda r: sorted(zip(map(tuple, r[0]), r[1], strict=True))  # noqa: E731
    assert as_set(ours) == as_set(theirs)


def test_documented_examples():
    """The worked examples from the training-stack doc, verbatim."""
    sizes_mib = [0.38, 0.76, 11.4, 19.1, 0.004]
    tensors = [torch.empty(int(s * MiB) // 4, device="meta") for s in sizes_mib]
    assert compute_bucket_assignment_by_size(tensors, [MiB, 25 * MiB]) == (
        [[0, 1], [2, 3], [4]],
        [MiB, 25 * MiB, 25 * MiB],
    )
    exact = [
        torch.empty(MiB // 4, device="meta"),
        torch.empty(10, device="meta"),
        torch.empty(10, device="meta"),
    ]
    assert compute_bucket_assignment_by_size(exact, [MiB, 25 * MiB])[0] == [[0], [1, 2]]


def test_sparse_tensor_rejected():
    with pytest.raises(ValueError, match="sparse"):
        compute_bucket_assignment_by_size([torch.eye(3).to_sparse()], [MiB])


def test_a_bucket_does_not_end_inside_a_unit():
    """With ``units``, a bucket that reached its limit inside a unit (a compiled block, whose
    grads all arrive at once) takes the rest of that unit; tensors without a unit (-1) and
    unit boundaries close as torch does; a unit of another dtype does not hold a bucket open."""
    t = [torch.empty(MiB // 4, device="meta") for _ in range(6)]  # 1 MiB each
    limits = [2 * MiB]
    assert compute_bucket_assignment_by_size(t, limits)[0] == [[0, 1], [2, 3], [4, 5]]
    assert compute_bucket_assignment_by_size(t, limits, units=[0, 0, 0, 1, 1, 1])[0] == [[0, 1, 2], [3, 4, 5]]
    assert compute_bucket_assignment_by_size(t, limits, units=[-1, -1, 5, 5, 5, -1])[0] == [[0, 1], [2, 3, 4], [5]]
    # unit ids only group neighbours of one key: 0 and 1 differ, so the boundary closes as usual
    assert compute_bucket_assignment_by_size(t, limits, units=[0, 1, 0, 1, 0, 1])[0] == [[0, 1], [2, 3], [4, 5]]
    # rebuild path: indices in ready order, units given in that order too
    order = [5, 4, 3, 2, 1, 0]
    assert compute_bucket_assignment_by_size(t, limits, (), order, [2, 2, 2, -1, -1, -1])[0] == [
        [5, 4, 3], [2, 1], [0]]
    # another dtype in between: the unit's next tensor of the same key decides
    mixed = [t[0], t[1], torch.empty(4, dtype=torch.float64, device="meta"), t[2]]
    assert compute_bucket_assignment_by_size(mixed, limits, units=[0, 0, 0, 0])[0] == [[0, 1, 3], [2]]
    with pytest.raises(ValueError, match="units"):
        compute_bucket_assignment_by_size(t, limits, units=[0])


def test_without_units_the_assignment_is_torchs():
    """``units`` all -1 changes nothing (the torch-equality tests above run without it)."""
    tensors = gpt_params(True)
    for limits in LIMITS.values():
        assert compute_bucket_assignment_by_size(tensors, limits, units=[-1] * len(tensors)) == \
            compute_bucket_assignment_by_size(tensors, limits)
