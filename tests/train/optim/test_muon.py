"""Muon on one process against torch.optim.Muon (the oracle) and torch's AdamW."""

import pytest
import torch

from tokenloom.errors import TokenloomError
from tokenloom.train.config import TrainConfig, check_resumable_optimizer
from tokenloom.train.model.config import GPTConfig
from tokenloom.train.model.gpt import GPT
from tokenloom.train.optim.adamw import OptimConfig
from tokenloom.train.optim.muon import Muon, assign, newton_schulz, split_params


def _model(**kw) -> GPT:
    torch.manual_seed(0)
    cfg = dict(vocab_size=64, make_vocab_size_divisible_by=64, seq_len=8, n_layers=1, n_heads=4, d_model=32)
    return GPT(GPTConfig(**{**cfg, **kw}))


def _grads(model: GPT, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 64, (2, 9), generator=g)
    model.zero_grad()
    model(x[:, :-1], x[:, 1:]).float().backward()


def _oracle_step(matrices, adam, state, cfg: OptimConfig) -> None:
    """torch.optim.Muon on each whole matrix (q, k, v and each expert apart), torch AdamW on the rest."""
    for m in matrices:
        p = m.param
        pieces = list(p.grad.unbind(0)) if m.experts else list(p.grad.split(m.parts or [p.shape[0]], 0))
        values = list(p.detach().unbind(0)) if m.experts else list(p.detach().split(m.parts or [p.shape[0]], 0))
        for i, (g, v) in enumerate(zip(pieces, values, strict=True)):
            key = (id(p), i)
            if key not in state:
                # an expert is stored [in, out]: the oracle sees the out x in matrix
                w = torch.nn.Parameter((v.T if m.experts else v).clone())
                state[key] = (w, torch.optim.Muon([w], lr=cfg.lr, weight_decay=cfg.weight_decay,
                                                  momentum=cfg.muon_momentum, adjust_lr_fn=cfg.muon_scale))
            w, opt = state[key]
            w.grad = (g.T if m.experts else g).clone()
            opt.step()
    adam.step()


@pytest.mark.parametrize("kw,scale", [(dict(), "match_rms_adamw"), (dict(), "original"),
                                      (dict(n_kv_heads=2, arch="llama"), "match_rms_adamw"),
                                      (dict(num_experts=4, moe_router_topk=2, tie_embeddings=False), "original")],
                         ids=["gpt2", "gpt2-original", "gqa-swiglu", "moe-untied"])
def test_one_process_equals_torch_muon(kw, scale):
    cfg = OptimConfig(name="muon", lr=2e-2, weight_decay=0.1, muon_scale=scale, fused=False)
    ours, ref = _model(**kw), _model(**kw)
    matrices, groups = split_params(ours, cfg.weight_decay)
    kinds = {n for n, p in ours.named_parameters() if any(m.param is p for m in matrices)}
    assert kinds and all(".blocks." in f".{n}" or n.startswith("blocks") for n in kinds), kinds
    assert "tok_emb.weight" not in kinds and "lm_head.weight" not in kinds
    if "n_kv_heads" in kw:
        assert any(m.parts == [32, 16, 16] for m in matrices)  # GQA: q wider than k and v
    if "num_experts" in kw:
        assert any(m.experts for m in matrices)
    opt = Muon(matrices, groups, cfg)
    ref_matrices, ref_groups = split_params(ref, cfg.weight_decay)
    adam = torch.optim.AdamW([g for g in ref_groups if g["params"]], lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                             eps=cfg.eps)
    state: dict = {}
    for step in range(2):
        _grads(ours, step)  # the same gradients into both: AdamW amplifies rounding where grads are ~0
        for a, b in zip(ours.parameters(), ref.parameters(), strict=True):
            b.grad = a.grad.clone()
        opt.step()
        _oracle_step(ref_matrices, adam, state, cfg)
        for m in ref_matrices:  # the oracle's matrices back into the reference model
            parts = [state[(id(m.param), i)][0].detach() for i in range(len(m.parts or [1]) if not m.experts
                                                                       else m.param.shape[0])]
            with torch.no_grad():
                m.param.copy_(torch.stack([w.T for w in parts]) if m.experts else torch.cat(parts, 0))
    diffs = {name: float((a - b).abs().max()) for (name, a), b in zip(ours.named_parameters(), ref.parameters(),
                                                                       strict=True)}
    assert max(diffs.values()) <= 1e-6, diffs
    moved = [(a - b).abs().max() for a, b in zip(ours.parameters(), _model(**kw).parameters(), strict=True)]
    assert min(moved) > 0  # every parameter stepped


def test_ns_fp32_is_near_orthogonal():
    x = torch.randn(48, 16, generator=torch.Generator().manual_seed(0))
    y = newton_schulz(x, 5, torch.float32)
    s = torch.linalg.svdvals(y)
    assert s.min() > 0.5 and s.max() < 1.5  # the quintic's band around 1, not U V^T exactly
    torch.testing.assert_close(y, newton_schulz(x, 5).float(), atol=0.05, rtol=0)


def test_assign_balances_whole_matrices():
    sizes = [100, 90, 50, 40, 30, 10]
    owner = assign(sizes, 2)
    loads = [sum(s for s, o in zip(sizes, owner, strict=True) if o == r) for r in range(2)]
    assert sorted(loads) == [150, 170]  # LPT: 100+40+30 and 90+50+10
    assert assign(sizes, 2) == owner


def test_bad_settings_are_refused():
    with pytest.raises(TokenloomError, match="optim.name"):
        OptimConfig(name="sgd")  # type: ignore[arg-type]
    with pytest.raises(TokenloomError, match="muon_scale"):
        OptimConfig(name="muon", muon_scale="spectral")  # type: ignore[arg-type]


def test_resume_with_another_optimizer_is_refused_unless_forced(tmp_path):
    saved = {"optim": {"name": "adamw"}}
    cfg = TrainConfig(optim=OptimConfig(name="muon"))
    with pytest.raises(TokenloomError, match="trained with optimizer adamw.*--force-optimizer"):
        check_resumable_optimizer(tmp_path, cfg, saved)
    check_resumable_optimizer(tmp_path, TrainConfig(optim=OptimConfig(name="muon"), force_optimizer=True), saved)
    check_resumable_optimizer(tmp_path, TrainConfig(), {"optim": {}})  # before the field: AdamW
    with pytest.raises(TokenloomError, match="overlap_param_gather"):
        TrainConfig(optim=OptimConfig(name="muon"), zero1=True, overlap_param_gather=False)
