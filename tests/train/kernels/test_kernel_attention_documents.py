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


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_flex_path_on_cuda_equals_the_dense_mask():
    torch.manual_seed(0)
    seq = 256
    cu_seqlens = torch.tensor([[0, 100, 130, 256] + [256] * 254], dtype=torch.int32, device="cuda")
    q, k, v = (torch.randn(1, 4, seq, 64, device="cuda") for _ in range(3))
    got = attention_sdpa(q, k, v, documents=cu_seqlens)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=document_mask(cu_seqlens, seq))
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)
