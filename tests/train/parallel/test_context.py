"""Context parallelism (``cp``) through the one loop against its one-process run: losses, grad
norms and final parameters of cp2, cp4, cp2 x tp2 (sequence parallel), cp2 x pp2 and cp2 x dp2,
with and without inter-document masking, on a small llama (RoPE, GQA) at seq SEQ (the same
run at seq 4096 passes too, in minutes: see bench/RESULTS.md's notes); each cp4 rank's
activation memory at seq 4096 against one process's; the unit pieces (chunk layout, the
gathered mask, the per-chunk causal attention, the loss scale) without processes.

Two launches (2 and 4 gloo ranks), so the multi-process part is ``slow``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from compose_helpers import (
    PARAM_TOL,
    activation_bytes,
    assert_losses_norms_params_match,
    launch,
    launches_timeout,
    reference,
)
from torch.nn.attention.bias import causal_lower_right

from tokenloom.errors import TokenloomError
from tokenloom.train.kernels.attention import document_mask
from tokenloom.train.model.config import GPTConfig
from tokenloom.train.parallel.context import (
    CausalChunks,
    additive_mask,
    causal_chunks_attention,
    global_order,
    local_index,
    loss_scale,
    take_local,
)
from tokenloom.train.parallel.state import ParallelLayout

TOL = 1e-5
SEQ = 512
STEPS = 6


def small(**kw) -> dict:
    """A 2-layer llama (RoPE, SwiGLU, 4 query heads over 2 kv heads) at seq SEQ, 6 steps."""
    model = GPTConfig(arch="llama", vocab_size=64, make_vocab_size_divisible_by=64, seq_len=SEQ, n_layers=2,
                      n_heads=4, n_kv_heads=2, d_model=32)
    return dict(model=model, train_iters=STEPS, eval_interval=3, eval_iters=1, **kw)


# name -> (world size, overrides)
LAYOUTS = {
    "cp2": (2, dict(cp=2)),
    "cp2_masked": (2, dict(cp=2, masked=True)),
    "cp4": (4, dict(cp=4)),
    "cp4_masked": (4, dict(cp=4, masked=True)),
    "cp2_tp2_sp": (4, dict(cp=2, tp=2, sp=True)),
    "cp2_tp2_sp_masked": (4, dict(cp=2, tp=2, sp=True, masked=True)),
    "cp2_pp2": (4, dict(cp=2, pp=2)),
    "cp2_pp2_masked": (4, dict(cp=2, pp=2, masked=True)),
    "cp2_dp2": (4, dict(cp=2)),
    "cp2_dp2_masked": (4, dict(cp=2, masked=True)),
}
# the launches' layouts and the cp4 memory probe, then the two one-process references (``refs``)
pytestmark = launches_timeout(len(LAYOUTS) + 1, references=2)


def test_each_rank_holds_two_chunks_mirrored_and_the_gather_covers_the_sequence():
    assert local_index(16, 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert local_index(16, 2, 1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    assert sorted(gathered_index(16, 4).tolist()) == list(range(16))
    x = torch.arange(32).view(2, 16)
    assert torch.equal(take_local(x, 4, 3), x[:, [6, 7, 8, 9]])


def gathered_index(seq: int, cp: int) -> torch.Tensor:
    """Positions of the tokens of gather_sequence's output: every rank's local_index, in rank order."""
    return torch.cat([local_index(seq, cp, r) for r in range(cp)])


def dense_relation(seq: int, cp: int, rank: int, cu_seqlens: torch.Tensor | None) -> torch.Tensor:
    """The reference: this rank's queries against every rank's keys in the gathered order, cut from
    the one-process mask of the whole sequence (causal, and within documents with ``cu_seqlens``)."""
    whole = (torch.ones(seq, seq, dtype=torch.bool).tril()[None, None] if cu_seqlens is None
             else document_mask(cu_seqlens, seq))
    return whole[:, :, local_index(seq, cp, rank)][..., gathered_index(seq, cp)]


def test_the_chunk_masks_are_causal_by_global_position_and_within_documents():
    cu = torch.tensor([[0, 5, 16, 16]])  # two documents, padded boundary
    doc = lambda i: int(i >= 5)  # noqa: E731
    for rank in range(2):
        chunks = CausalChunks.of(16, 2, rank, torch.device("cpu"), torch.float32, cu)
        for first, end, mask in zip((rank * 4, (3 - rank) * 4), chunks.ends, chunks.masks, strict=True):
            assert end == first + 4
            expected = torch.tensor([[kk <= qq and doc(kk) == doc(qq) for kk in range(end)]
                                     for qq in range(first, end)])
            assert torch.equal(mask[0, 0] == 0, expected)


def test_the_loss_scale_makes_the_cp_sum_the_sample_mean():
    mask = torch.tensor([[1, 1, 0, 0, 1, 1, 1, 1], [0, 0, 0, 0, 1, 0, 1, 1]]).float()
    losses = torch.rand(2, 8)
    whole = (losses * mask).sum() / mask.sum()
    total = 0.0
    for rank in range(2):
        local_mask, local_losses = take_local(mask, 2, rank), take_local(losses, 2, rank)
        local_mean = (local_losses * local_mask).sum() / local_mask.sum().clamp(min=1.0)
        total += local_mean * loss_scale(mask, local_mask, 2, 8) / 2  # the dp x cp average
    assert torch.allclose(total, whole)


def test_cp_is_refused_where_the_sequence_does_not_split(tmp_path):
    with pytest.raises(TokenloomError, match=r"cp=4: model.seq_len=1004 must be divisible by 2 x cp = 8"):
        _cfg(tmp_path, cp=4, model=GPTConfig(seq_len=1004))
    with pytest.raises(TokenloomError, match=r"divisible by 2 x cp x tp .* = 16"):
        _cfg(tmp_path, cp=2, tp=4, sp=True, model=GPTConfig(seq_len=1004))
    with pytest.raises(TokenloomError, match="tp \\* cp \\* pp = 1 \\* 4 \\* 1 = 4"):
        ParallelLayout(6, cp=4)


def _cfg(tmp_path, **kw):
    from compose_helpers import tiny_cfg

    return tiny_cfg(tmp_path, **kw)


def _kw(tmp, name: str, overrides: dict) -> dict:
    kw = dict(small(**{k: v for k, v in overrides.items() if k != "masked"}), out=str(tmp / name))
    if overrides.get("masked"):
        from tokenloom.train.data import DataConfig, MockDataConfig

        kw["data"] = DataConfig(mock=MockDataConfig(num_sequences=400, max_length=300, content="random"),
                                inter_document_masking=True)
    return kw


# activation memory at seq 4096: a small llama (4 layers x 256, 4 query heads over 2 kv heads)
MEMORY = dict(model=GPTConfig(arch="llama", vocab_size=64, make_vocab_size_divisible_by=64, seq_len=4096, n_layers=4,
                              n_heads=4, n_kv_heads=2, d_model=256), micro_batch_size=1, global_batch_size=1,
              train_iters=1, eval_interval=0)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every layout's results by name; "memory_cp4": the activation bytes of each rank of a
    cp4 step at MEMORY's shape (in the 4-rank launch)."""
    tmp = tmp_path_factory.mktemp("cp")
    out = {}
    for world in (2, 4):
        names = [n for n, (w, _) in LAYOUTS.items() if w == world]
        scenarios = [("train", _kw(tmp, n, LAYOUTS[n][1])) for n in names]
        if world == 4:
            names.append("memory_cp4")
            scenarios.append(("activation_bytes", dict(out=str(tmp / "memory_cp4"), cp=4, **MEMORY)))
        (tmp / f"w{world}").mkdir()
        results = launch(scenarios, world, tmp / f"w{world}")
        for i, name in enumerate(names):
            out[name] = [rank_results[i] for rank_results in results]
    return tmp, out


@pytest.fixture(scope="module")
def refs(runs):
    tmp, _ = runs
    return {masked: reference(tmp / f"ref_{masked}", **{k: v for k, v in _kw(tmp, "x", {"masked": masked}).items()
                                                         if k != "out"})
            for masked in (False, True)}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_one_process(runs, refs, name):
    _, results = runs
    ref = refs[bool(LAYOUTS[name][1].get("masked"))]
    assert_losses_norms_params_match(results[name], ref, STEPS, TOL, PARAM_TOL)


@pytest.mark.slow
def test_activation_memory_per_rank_at_cp4_is_under_035_of_one_rank(runs, tmp_path):
    """The tensors a training step saves for backward (parameters left out): each cp4 rank's
    at most 0.35x the one-process run's, at seq 4096 (its own quarter of every activation,
    the whole sequence's keys and values and the two query chunks' shared masks)."""
    _, results = runs
    one = activation_bytes(0, out=str(tmp_path / "one"), **MEMORY)["bytes"]
    per_rank = [r["bytes"] for r in results["memory_cp4"]]
    assert len(per_rank) == 4 and max(per_rank) <= 0.35 * one, (per_rank, one)


@pytest.mark.parametrize("documents", [False, True], ids=["causal", "documents"])
@pytest.mark.parametrize("cp", [1, 2, 4])
def test_causal_chunks_attention_equals_the_gathered_dense_mask(cp, documents):
    """Each rank's two query chunks, each against the keys up to its end (the shared additive
    masks on CPU; without documents also torch's lower-right CausalBias, what CUDA runs), give the
    output and gradients of its queries against all gathered keys under the dense relation of
    global positions (and documents: two samples with different boundaries), grouped heads
    included."""
    seq, heads, kv_heads, dim = 64, 4, 2, 8
    cu = torch.tensor([[0, 5, 30, 64], [0, 40, 64, 64]]) if documents else None
    gen = torch.Generator().manual_seed(cp)
    for rank in range(cp):
        q, k, v = (torch.randn(2, h, n, dim, generator=gen) for h, n in ((heads, seq // cp), (kv_heads, seq),
                                                                          (kv_heads, seq)))
        chunks = CausalChunks.of(seq, cp, rank, torch.device("cpu"), torch.float32, cu)
        forms: list = ["dense", chunks]
        if not documents:
            forms.append(CausalChunks(cp, chunks.chunk, chunks.ends,
                                      tuple(causal_lower_right(chunks.chunk, e)
                                            for e in chunks.ends)))
        dense = additive_mask(dense_relation(seq, cp, rank, cu), torch.float32)
        results = []
        for form in forms:
            inputs = [t.clone().requires_grad_() for t in (q, k, v)]
            out = (F.scaled_dot_product_attention(*inputs, attn_mask=dense, enable_gqa=True) if form == "dense"
                   else causal_chunks_attention(*inputs, form))
            out.square().sum().backward()
            results.append([out, *(t.grad for t in inputs)])
        for got in results[1:]:
            for a, b in zip(got, results[0], strict=True):
                torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_global_order_undoes_the_gathered_order():
    seq, cp = 24, 3
    gathered = gathered_index(seq, cp).float().view(1, 1, seq, 1)
    assert global_order(gathered, cp, seq // (2 * cp)).flatten().tolist() == list(range(seq))
