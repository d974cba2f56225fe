"""GPT model sanity: shapes, init, tying, GQA, recompute, loss, parameter counts."""

from __future__ import annotations

import math

import pytest
import torch

from tokenloom.errors import TokenloomError
from tokenloom.train.model.config import GPTConfig
from tokenloom.train.model.gpt import GPT


def cfg(**kw) -> GPTConfig:
    base = dict(vocab_size=100, seq_len=16, n_layers=2, n_heads=4, d_model=32)
    base.update(kw)
    return GPTConfig(**base)


LLAMA = dict(arch="llama", bias=False, n_kv_heads=2)


@pytest.mark.parametrize("arch", [{}, LLAMA], ids=["gpt2", "llama"])
def test_logits_shape_and_padded_vocab(arch):
    model = GPT(cfg(**arch))
    assert model.cfg.padded_vocab_size == 128  # 100 rounded up to a multiple of 128
    tokens = torch.randint(0, 100, (3, 16))
    assert model(tokens).shape == (3, 16, 128)
    assert model(tokens[:, :5]).shape == (3, 5, 128)


def test_features_resolve_from_the_arch_preset():
    gpt2, llama = cfg(), cfg(arch="llama")
    assert (gpt2.norm, gpt2.mlp, gpt2.positions, gpt2.bias) == ("layernorm", "gelu", "learned", True)
    assert (llama.norm, llama.mlp, llama.positions, llama.bias) == ("rmsnorm", "swiglu", "rope", False)
    assert gpt2.tie_embeddings and llama.tie_embeddings
    mixed = cfg(arch="llama", norm="layernorm", positions="learned")  # an explicit feature wins
    assert (mixed.norm, mixed.mlp, mixed.positions) == ("layernorm", "swiglu", "learned")
    with pytest.raises(TokenloomError, match="model.norm must be one of layernorm, rmsnorm, got 'batchnorm'"):
        cfg(norm="batchnorm")
    with pytest.raises(TokenloomError, match="RoPE needs an even head dimension"):
        cfg(positions="rope", n_heads=32)  # head dim 1


def test_the_presets_build_the_models_their_features_name():
    """A preset and its features spelled out are one model, bit for bit (old configs build as before)."""
    tokens = torch.randint(0, 100, (2, 16))
    for arch, features in [("gpt2", dict(norm="layernorm", mlp="gelu", positions="learned", bias=True)),
                           ("llama", dict(norm="rmsnorm", mlp="swiglu", positions="rope", bias=False))]:
        preset, spelled = GPT(cfg(arch=arch)), GPT(cfg(arch="gpt2" if arch == "llama" else "llama", **features))
        assert {n: p.shape for n, p in preset.state_dict().items()} == \
            {n: p.shape for n, p in spelled.state_dict().items()}
        for (name, a), b in zip(preset.state_dict().items(), spelled.state_dict().values(), strict=True):
            assert torch.equal(a, b), name
        assert torch.equal(preset(tokens, tokens), spelled(tokens, tokens))


@pytest.mark.parametrize("features", [dict(positions="rope"), dict(mlp="swiglu", bias=False),
                                      dict(arch="llama", norm="layernorm", positions="learned", bias=True)],
                         ids=["gpt2_rope", "layernorm_swiglu", "llama_learned_layernorm"])
def test_every_feature_combination_builds_and_trains(features):
    model = GPT(cfg(**features))
    m = model.cfg
    assert (model.pos_emb is None) == (m.positions == "rope")
    assert isinstance(model.norm, torch.nn.RMSNorm if m.norm == "rmsnorm" else torch.nn.LayerNorm)
    inner = model.blocks["0"].mlp.fc.weight.shape[0]
    assert inner == (2 * m.ffn_size if m.mlp == "swiglu" else m.ffn_size)
    assert m.ffn_size == (4 * 32 if m.mlp == "gelu" else 64 * math.ceil(8 * 32 / 3 / 64))
    assert (model.blocks["0"].attn.qkv.bias is not None) == m.bias
    tokens = torch.randint(0, 100, (2, 16))
    loss = model(tokens, tokens)
    loss.backward()
    assert torch.isfinite(loss) and all(p.grad is not None for p in model.parameters())


def test_init_is_deterministic_and_seeded():
    a, b, c = GPT(cfg()), GPT(cfg()), GPT(cfg(seed=1))
    torch.manual_seed(123)  # global RNG must not matter
    d = GPT(cfg())
    for pa, pb, pd in zip(a.parameters(), b.parameters(), d.parameters(), strict=True):
        assert torch.equal(pa, pb) and torch.equal(pa, pd)
    assert not torch.equal(a.tok_emb.weight, c.tok_emb.weight)


def test_residual_projections_use_scaled_init():
    model = GPT(cfg(n_layers=8, d_model=64, init_std=0.02))
    resid = torch.cat([b.mlp.proj.weight.flatten() for b in model.blocks.values()])
    plain = torch.cat([b.mlp.fc.weight.flatten() for b in model.blocks.values()])
    assert resid.std().item() == pytest.approx(0.02 / math.sqrt(16), rel=0.05)
    assert plain.std().item() == pytest.approx(0.02, rel=0.05)


def test_tied_embeddings_share_storage():
    tied, untied = GPT(cfg(tie_embeddings=True)), GPT(cfg(tie_embeddings=False))
    assert tied.lm_head.weight is tied.tok_emb.weight
    assert tied.lm_head.weight.data_ptr() == tied.tok_emb.weight.data_ptr()
    assert untied.lm_head.weight.data_ptr() != untied.tok_emb.weight.data_ptr()
    assert tied.num_params() == untied.num_params() - 128 * 32


def test_gqa_shapes():
    model = GPT(cfg(**LLAMA))
    qkv = model.blocks["0"].attn.qkv.weight
    assert qkv.shape == ((4 + 2 * 2) * 8, 32)  # 4 query heads + 2 K + 2 V heads of dim 8
    assert GPT(cfg(arch="llama")).blocks["0"].attn.qkv.bias is None  # llama: no biases by default
    with pytest.raises(TokenloomError, match="n_kv_heads"):
        cfg(arch="llama", n_kv_heads=3)


def test_gqa_with_full_kv_heads_equals_mha():
    """n_kv_heads == n_heads is plain multi-head attention (same params, same output)."""
    a, b = GPT(cfg(arch="llama", n_kv_heads=4)), GPT(cfg(arch="llama", n_kv_heads=None))
    tokens = torch.randint(0, 100, (2, 16))
    torch.testing.assert_close(a(tokens), b(tokens), rtol=0, atol=0)


@pytest.mark.parametrize("arch", [{}, LLAMA], ids=["gpt2", "llama"])
def test_recompute_gives_equal_grads(arch):
    tokens = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(0))
    grads = []
    for layers in [(), (0, 1)]:
        model = GPT(cfg(recompute_layers=layers, **arch))
        model(tokens, tokens).backward()
        grads.append([p.grad for p in model.parameters()])
    for g0, g1 in zip(*grads, strict=True):
        torch.testing.assert_close(g0, g1, rtol=0, atol=1e-6)


def test_loss_mask_and_causality():
    model = GPT(cfg())
    tokens = torch.randint(0, 100, (2, 16))
    logits = model(tokens)
    changed = tokens.clone()
    changed[:, 10:] = (changed[:, 10:] + 1) % 100  # future tokens must not affect earlier logits
    torch.testing.assert_close(model(changed)[:, :10], logits[:, :10])
    mask = torch.zeros(2, 16)
    mask[:, :10] = 1
    full = torch.nn.functional.cross_entropy(logits[:, :10].reshape(-1, 128), tokens[:, :10].reshape(-1))
    torch.testing.assert_close(model(tokens, tokens, mask), full)


@pytest.mark.parametrize("arch", [{}, LLAMA], ids=["gpt2", "llama"])
def test_tiny_overfit_loss_decreases(arch):
    torch.manual_seed(0)
    model = GPT(cfg(dropout=0.1, **arch))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data = torch.randint(0, 100, (4, 17), generator=torch.Generator().manual_seed(1))
    losses = []
    for _ in range(40):
        loss = model(data[:, :-1], data[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[0] > math.log(100) - 0.5
    assert losses[-1] < 0.5 * losses[0]


def test_num_params_without_embeddings():
    model = GPT(cfg(tie_embeddings=True))
    assert model.num_params(exclude_embeddings=True) == model.num_params() - 16 * 32  # minus position table
    untied = GPT(cfg(tie_embeddings=False))
    assert untied.num_params(exclude_embeddings=True) == untied.num_params() - 16 * 32 - 128 * 32


def test_parameter_split_sums_to_the_total():
    for features in ({}, dict(tie_embeddings=False, positions="rope")):
        model = GPT(cfg(**features))
        split = model.param_split()
        assert sum(split.values()) == model.num_params()
        learned = 16 * 32 if model.pos_emb is not None else 0
        assert split["embedding"] == 128 * 32 + learned
        assert split["head"] == 2 * 32 + (0 if model.cfg.tie_embeddings else 128 * 32)  # final LayerNorm (+ head)


def test_too_long_sequence_is_a_user_error():
    with pytest.raises(TokenloomError, match="seq_len"):
        GPT(cfg())(torch.zeros(1, 17, dtype=torch.long))


@pytest.mark.parametrize("kernels", ["reference", "compiled"])
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_documents_attend_alone(arch, kernels):
    """A sample packed from three documents, with document masking and restarting positions,
    gives each document the logits it gets when it is the whole input (learned positions and
    RoPE both restart)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(arch=arch, vocab_size=64, seq_len=16, n_layers=2, n_heads=2, d_model=32,
                          kernels=kernels)).eval()
    lengths = [5, 8, 3]
    docs = [torch.randint(0, 64, (1, n)) for n in lengths]
    tokens = torch.cat(docs, dim=1)
    starts = [0, 5, 13]
    cu_seqlens = torch.tensor([[*starts, 16] + [16] * (16 - len(starts))], dtype=torch.int32)
    positions = torch.tensor([list(range(5)) + list(range(8)) + list(range(3))])
    with torch.no_grad():
        packed = model(tokens, documents=cu_seqlens, positions=positions)
        alone = torch.cat([model(d) for d in docs], dim=1)
        plain = model(tokens)
    torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(plain[:, 5:], alone[:, 5:], atol=1e-3)  # without masking they differ


def test_the_document_mask_is_built_once_per_forward(monkeypatch):
    """Every block of one forward takes the mask the model built before them (a mask built
    per layer would repeat the work in each, and inside compiled blocks)."""
    import tokenloom.train.kernels.attention as attention_module
    import tokenloom.train.model.gpt as model_module

    built = []
    real = attention_module.document_attention_mask
    for module in (model_module, attention_module):  # the model's call and any layer's
        monkeypatch.setattr(module, "document_attention_mask", lambda *a, **k: built.append(1) or real(*a, **k))
    model = GPT(GPTConfig(vocab_size=64, seq_len=16, n_layers=3, n_heads=2, d_model=32))
    cu_seqlens = torch.tensor([[0, 5, 16] + [16] * 14], dtype=torch.int32)
    model(torch.zeros(1, 16, dtype=torch.long), documents=cu_seqlens, positions=torch.zeros(1, 16, dtype=torch.long))
    assert len(built) == 1


def test_layernorm_biases_follow_bias_unless_norm_bias_says_otherwise():
    """``norm_bias`` None follows ``bias`` (every earlier config builds the model it built); Megatron's
    ``--disable-bias-linear`` (bias false, norm_bias true) drops the linears' biases and keeps LayerNorm's."""
    def names(**kw) -> set[str]:
        model = GPT(GPTConfig(vocab_size=64, seq_len=8, n_layers=1, n_heads=2, d_model=16, **kw))
        return {n for n, _ in model.named_parameters() if n.endswith(".bias")}

    assert names() == names(norm_bias=True) and "blocks.0.attn.qkv.bias" in names()
    assert names(bias=False) == set()
    assert names(bias=False, norm_bias=True) == {"blocks.0.norm1.bias", "blocks.0.norm2.bias", "norm.bias"}
