"""Document-isolated attention: SDPA with the ``causal & same document`` mask equals each
document attended on its own (``attention_reference`` on slices), values and gradients."""

from __future__ import annotations

import pytest
import torch

from tokenloom.train.kernels.attention import attention_reference, attention_sdpa, document_ids, document_mask

SEQ = 10


def cu(*starts: int) -> list[int]:
    return [*starts, *[SEQ] * (SEQ + 1 - len(starts))]


def test_document_ids_and_mask_by_hand():
    cu_seqlens = torch.tensor([cu(0, 3, 7, SEQ), cu(0, SEQ)], dtype=torch.int32)
    assert document_ids(cu_seqlens, SEQ).tolist() == [[0, 0, 0, 1, 1, 1, 1, 2, 2, 2], [0] * SEQ]
    mask = document_mask(cu_seqlens, SEQ)
    assert mask.shape == (2, 1, SEQ, SEQ)
    assert mask[0, 0, 4].tolist() == [False, False, False, True, True, False, False, False, False, False]
    assert mask[1, 0].equal(torch.ones(SEQ, SEQ, dtype=torch.bool).tril())


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_sdpa_with_documents_equals_each_document_alone(kv_heads):
    torch.manual_seed(0)
    cu_seqlens = torch.tensor([cu(0, 3, 7, SEQ), cu(0, 1, 2, 9, SEQ), cu(0, SEQ)], dtype=torch.int32)
    q = torch.randn(3, 4, SEQ, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(3, kv_heads, SEQ, 8, dtype=torch.float64, requires_grad=True)
    v = torch.randn(3, kv_heads, SEQ, 8, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(3, 4, SEQ, 8, dtype=torch.float64)
    got = attention_sdpa(q, k, v, documents=cu_seqlens)
    grads = torch.autograd.grad(got, (q, k, v), dy)
    want = attention_reference(q, k, v, documents=cu_seqlens)
    want_grads = torch.autograd.grad(want, (q, k, v), dy)
    torch.testing.assert_close(got, want)
    for a, b in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(a, b)
    # one document per sample is plain causal attention
    whole = torch.tensor([cu(0, SEQ)] * 3, dtype=torch.int32)
    torch.testing.assert_close(attention_sdpa(q, k, v, documents=whole), attention_sdpa(q, k, v))


def test_flex_is_used_only_where_it_runs():
    """Flex needs CUDA, no dropout and heads of at least 16 (its lowering raised at 8 on an
    H100); everywhere else the dense mask is built."""
    from tokenloom.train.kernels.attention import FLEX_MIN_HEAD_DIM, flex_usable

    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert FLEX_MIN_HEAD_DIM == 16
    assert flex_usable(cuda, 0.0, 16) and flex_usable(cuda, 0.0, 128)
    assert not flex_usable(cuda, 0.0, 8) and not flex_usable(cuda, 0.1, 64) and not flex_usable(cpu, 0.0, 64)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("seq,head_dim", [(256, 64), (200, 64), (200, 8)])
def test_flex_path_on_cuda_equals_the_dense_mask(seq, head_dim):
    """The compiled flex kernel with the document BlockMask against SDPA with the dense mask,
    values and gradients, and under no_grad (evaluation runs the forward-only kernel); heads
    narrower than flex's least take the dense mask on CUDA too."""
    torch.manual_seed(0)
    cu_seqlens = random_cu_seqlens(3, seq, torch.Generator().manual_seed(seq)).cuda()
    q, k, v = (torch.randn(3, 4, seq, head_dim, device="cuda", requires_grad=True) for _ in range(3))
    got = attention_sdpa(q, k, v, documents=cu_seqlens)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=document_mask(cu_seqlens, seq))
    torch.testing.assert_close(got, want, rtol=2e-3, atol=2e-3)
    dy = torch.randn_like(want)
    for a, b in zip(torch.autograd.grad(got, (q, k, v), dy), torch.autograd.grad(want, (q, k, v), dy), strict=True):
        torch.testing.assert_close(a, b, rtol=2e-3, atol=2e-3)
    with torch.no_grad():
        torch.testing.assert_close(attention_sdpa(q, k, v, documents=cu_seqlens), want, rtol=2e-3, atol=2e-3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_compiled_blocks_with_documents_on_cuda_equal_eager():
    """``compile: true`` with document masking (each block compiled, the mask built once per
    forward outside them) equals the eager model, in training and under no_grad (evaluation;
    the mask built inside the compiled blocks made an illegal memory access there)."""
    from tokenloom.train.model.config import GPTConfig
    from tokenloom.train.model.gpt import GPT

    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=256, make_vocab_size_divisible_by=128, seq_len=256, n_layers=2, n_heads=4, d_model=128)
    eager = GPT(cfg).cuda()
    compiled = GPT(cfg).cuda()
    compiled.load_state_dict(eager.state_dict())
    compiled.compile_blocks()
    cu_seqlens = random_cu_seqlens(4, 256, torch.Generator().manual_seed(2)).cuda()
    tokens = torch.randint(0, 256, (4, 256), device="cuda")
    positions = torch.arange(256, device="cuda") - cu_seqlens[:, :-1].gather(
        1, document_ids(cu_seqlens, 256).clamp(max=cu_seqlens.shape[1] - 2)).to(torch.int64)
    for model in (eager, compiled):
        model.eval()
    with torch.no_grad():
        want = eager(tokens, tokens, documents=cu_seqlens, positions=positions)
        got = compiled(tokens, tokens, documents=cu_seqlens, positions=positions)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    for model in (eager, compiled):
        model.train()
    losses = [model(tokens, tokens, documents=cu_seqlens, positions=positions) for model in (eager, compiled)]
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-4, atol=1e-4)
    for loss in losses:
        loss.backward()
    for (name, a), b in zip(eager.named_parameters(), compiled.parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-3, atol=1e-4, msg=name)


def random_cu_seqlens(batch: int, seq: int, gen: torch.Generator) -> torch.Tensor:
    """Rows of document starts: one whole-sequence document, tile-aligned cuts (128), one-token
    documents and random cuts; padded with ``seq`` to [batch, seq + 1]."""
    rows = [[0], [0, 128, 129] if seq > 129 else [0, 1], [0, *range(1, seq, 37)]]
    while len(rows) < batch:
        rows.append([0, *sorted(torch.randperm(seq - 1, generator=gen)[: int(torch.randint(1, 9, (1,), generator=gen))]
                                .add(1).tolist())])
    return torch.tensor([r + [seq] * (seq + 1 - len(r)) for r in rows[:batch]], dtype=torch.int32)


def elementwise(block_mask, seq: int) -> torch.Tensor:
    """[batch, seq, seq] booleans a BlockMask allows: full tiles all, partial tiles by its rule."""
    tiles = block_mask.to_dense()[:, 0]  # partial or full, [batch, tiles, tiles]
    full = torch.zeros_like(tiles)
    counts, indices = block_mask.full_kv_num_blocks[:, 0], block_mask.full_kv_indices[:, 0]
    for b in range(tiles.shape[0]):
        for i in range(tiles.shape[1]):
            full[b, i, indices[b, i, : counts[b, i]].long()] = 1
    edge = block_mask.BLOCK_SIZE[0]
    q, k = torch.arange(seq)[:, None], torch.arange(seq)[None, :]
    out = torch.zeros(tiles.shape[0], seq, seq, dtype=torch.bool)
    for b in range(tiles.shape[0]):
        tile = tiles[b][q // edge, k // edge].bool()
        ruled = block_mask.mask_mod(torch.tensor(b), torch.tensor(0), q, k)
        out[b] = tile & (full[b][q // edge, k // edge].bool() | ruled)
    return out


@pytest.mark.parametrize("seq", [256, 200, 384, 130, 64])
def test_document_block_mask_allows_exactly_the_dense_mask(seq):
    from torch.nn.attention.flex_attention import create_block_mask

    from tokenloom.train.kernels.attention import document_block_mask

    cu_seqlens = random_cu_seqlens(5, seq, torch.Generator().manual_seed(seq))
    mask = document_block_mask(cu_seqlens, seq)
    assert elementwise(mask, seq).equal(document_mask(cu_seqlens, seq)[:, 0])
    docs = document_ids(cu_seqlens, seq)
    library = create_block_mask(lambda b, h, q, k: (q >= k) & (docs[b, q] == docs[b, k]), len(cu_seqlens), None,
                                seq, seq, device="cpu")
    assert mask.to_dense().equal(library.to_dense())  # the same tiles are visited
    if seq % 128 == 0:  # and the same are full (a tile cut by the end is never full here)
        assert mask.full_kv_num_blocks.equal(library.full_kv_num_blocks)
    assert mask.shape == library.shape


def test_attention_with_the_block_mask_equals_the_dense_mask():
    """The flex path's mask on flex attention (uncompiled, forward only: flex has no CPU
    backward) equals SDPA with the dense mask; ``attention_sdpa`` takes the prepared dense
    mask and cu_seqlens alike."""
    from torch.nn.attention.flex_attention import flex_attention

    from tokenloom.train.kernels.attention import document_attention_mask

    torch.manual_seed(0)
    seq = 200
    cu_seqlens = random_cu_seqlens(3, seq, torch.Generator().manual_seed(1))
    q, k, v = (torch.randn(3, 2, seq, 16) for _ in range(3))
    dense = document_attention_mask(cu_seqlens, seq, flex=False)
    assert dense.dtype == torch.bool
    want = attention_sdpa(q, k, v, documents=dense)
    torch.testing.assert_close(attention_sdpa(q, k, v, documents=cu_seqlens), want)
    got = flex_attention(q, k, v, block_mask=document_attention_mask(cu_seqlens, seq, flex=True))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_compiled_block_takes_the_block_mask_in_one_graph():
    """A transformer block compiled as ``compile: true`` does, given the forward's BlockMask,
    is one graph with flex captured inside it, and equals the eager block with the dense mask
    (forward only: flex has no CPU backward). Torch 2.11 on CUDA split the block at a nested
    compiled flex call, which ``attention_sdpa`` no longer makes inside compiled code; this
    torch does not split there, so the check guards against breaks of any other cause.
    It runs on CUDA where there is one, the only device the trainer runs flex on: torch
    2.11's CPU inductor cannot lower flex when q, k and v are views of one buffer (seen on
    the H100 machine), 2.13's can."""
    from tokenloom.train.kernels.attention import document_attention_mask
    from tokenloom.train.model.config import GPTConfig
    from tokenloom.train.model.gpt import GPT

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=128, make_vocab_size_divisible_by=128, seq_len=256, n_layers=1, n_heads=2, d_model=32)
    block = next(iter(GPT(cfg).eval().blocks.values())).to(device)
    cu_seqlens = random_cu_seqlens(2, 256, torch.Generator().manual_seed(3)).to(device)
    x = torch.randn(2, 256, 32, device=device)
    with torch.no_grad():
        explained = torch._dynamo.explain(block)(x, None, document_attention_mask(cu_seqlens, 256, flex=True))
        assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
        torch._dynamo.reset()
        got = torch.compile(block)(x, None, document_attention_mask(cu_seqlens, 256, flex=True))
        want = block(x, None, document_attention_mask(cu_seqlens, 256, flex=False))
    tol = 2e-3 if device.type == "cuda" else 1e-4  # SDPA's CUDA kernels sum in another order
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


def test_both_masks_are_made_on_the_device_of_cu_seqlens():
    """With the default device set to meta, every tensor of both masks is still on
    ``cu_seqlens``' device (none is made without naming it)."""
    from tokenloom.train.kernels.attention import document_attention_mask

    cu_seqlens = random_cu_seqlens(2, 200, torch.Generator().manual_seed(4))
    with torch.device("meta"):
        dense = document_attention_mask(cu_seqlens, 200, flex=False)
        block = document_attention_mask(cu_seqlens, 200, flex=True)
    tensors = [dense, block.kv_num_blocks, block.kv_indices, block.full_kv_num_blocks, block.full_kv_indices,
               block.q_num_blocks, block.q_indices]
    assert {t.device.type for t in tensors} == {"cpu"}
    assert elementwise(block, 200).equal(dense[:, 0])
