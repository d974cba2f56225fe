"""The train config's keys: every unknown one (nested sections too) in one message; the schedule a
resume must keep."""

from __future__ import annotations

import dataclasses

import pytest

from tokenloom.errors import TokenloomError
from tokenloom.train.config import (
    SMALL_MODEL,
    TrainConfig,
    check_resumable_model,
    check_resumable_schedule,
    config_to_dict,
    load_config,
    small_model_overrides,
    unknown_keys,
)
from tokenloom.train.model.config import GPTConfig
from tokenloom.train.optim.adamw import OptimConfig


def test_unknown_keys_lists_every_misspelling_with_the_nearest_field():
    data = {"train_iter": 5, "optim": {"min_llr": 1, "lr": 1}, "data": {"mock": {"num_sequence": 3}},
            "model": {"zzz": 1}, "seed": 1}
    assert unknown_keys(TrainConfig, data) == [
        "train_iter (did you mean train_iters?)", "optim.min_llr (did you mean optim.min_lr?)",
        "data.mock.num_sequence (did you mean data.mock.num_sequences?)",
        f"model.zzz (known in model: {', '.join(TrainConfig().model.__dataclass_fields__)})"]
    assert unknown_keys(TrainConfig, {"optim": None, "seed": 3}) == []


def test_load_config_names_the_file_and_every_key(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("optim: {warmup_iter: 3}\nsave_intervall: 5\n")
    with pytest.raises(TokenloomError) as err:
        load_config(path, ["model.n_layer=2"])
    assert str(err.value) == (f"unknown config keys in {path} and --set: optim.warmup_iter (did you mean "
                              "optim.warmup_iters?); save_intervall (did you mean save_interval?); model.n_layer "
                              "(did you mean model.n_layers?)")


def test_a_schedule_change_names_every_key_and_the_override_lets_it_pass():
    saved = config_to_dict(TrainConfig(train_iters=30))
    del saved["optim"]["warmup_iters"]  # a checkpoint that predates a key had its default
    cfg = TrainConfig(train_iters=45, optim=OptimConfig(warmup_iters=100, lr=1e-3))
    with pytest.raises(TokenloomError) as err:
        check_resumable_schedule("ck", cfg, saved)
    assert str(err.value).startswith("ck was trained with another learning-rate schedule (train_iters 30 -> 45; "
                                     "optim.lr 0.0006 -> 0.001); resume with its values, or pass "
                                     "--override-opt_param-scheduler")
    check_resumable_schedule("ck", dataclasses.replace(cfg, override_opt_param_scheduler=True), saved)
    check_resumable_schedule("ck", TrainConfig(train_iters=30, seed=5, eval_interval=7), saved)  # not the schedule


def test_the_small_model_default_applies_only_when_no_shape_is_given(tmp_path):
    assert small_model_overrides(None, ["train_iters=3", "model.vocab_size=96"]) == list(SMALL_MODEL)
    cfg = load_config(None, [*small_model_overrides(None, []), "model.vocab_size=96"])
    assert (cfg.model.n_layers, cfg.model.d_model, cfg.model.n_heads, cfg.model.seq_len) == (4, 256, 4, 256)
    assert small_model_overrides(None, ["model.seq_len=64"]) == []
    assert small_model_overrides(None, ["init_from_hf=folder"]) == []
    path = tmp_path / "c.yaml"
    path.write_text("model: {d_model: 64}\n")
    assert small_model_overrides(path, []) == []
    path.write_text("model: {dropout: 0.1}\n")
    assert small_model_overrides(path, []) == list(SMALL_MODEL)
    assert TrainConfig().model.n_layers == 12  # the library keeps GPTConfig's defaults


def test_expert_parallelism_is_refused_where_it_cannot_run():
    """ep needs experts it divides, and runs with data, tensor (+ sequence) and pipeline parallelism
    and zero1 only in this version: each unsupported companion is named."""
    moe = GPTConfig(n_layers=2, num_experts=4, moe_router_topk=2)
    assert TrainConfig(model=moe, ep=4).ep == 4
    assert TrainConfig(model=moe, ep=2, zero1=True).zero1
    with pytest.raises(TokenloomError, match=r"^ep=2 splits the experts .* set model.num_experts"):
        TrainConfig(ep=2)
    with pytest.raises(TokenloomError, match=r"^ep=3 must divide model.num_experts=4$"):
        TrainConfig(model=moe, ep=3)
    with pytest.raises(TokenloomError, match=r"^ep must be >= 1, got ep=0$"):
        TrainConfig(model=moe, ep=0)
    assert TrainConfig(model=moe, ep=2, tp=2, sp=True, pp=2, zero1=True).ep == 2
    with pytest.raises(TokenloomError, match=r"^model.num_experts=4 at tp=2 needs sequence parallelism \(sp=true"):
        TrainConfig(model=moe, ep=2, tp=2)
    with pytest.raises(TokenloomError, match=r"pipeline parallelism and zero1 only in this version; cp=2, fsdp=True is not"):
        TrainConfig(model=moe, ep=2, tp=2, sp=True, pp=2, cp=2, fsdp=True)


def test_a_resume_may_change_the_token_dispatcher_but_not_the_experts():
    """The dispatcher moves tokens, not parameters: a checkpoint of either resumes with the other."""
    saved = config_to_dict(TrainConfig(model=GPTConfig(n_layers=2, num_experts=4)))["model"]
    check_resumable_model("ckpt", TrainConfig(model=GPTConfig(n_layers=2, num_experts=4,
                                                              moe_token_dispatcher_type="allgather")), saved)
    with pytest.raises(TokenloomError, match=r"^ckpt was trained with a different model \(model.num_experts 4 -> 8\)"):
        check_resumable_model("ckpt", TrainConfig(model=GPTConfig(n_layers=2, num_experts=8)), saved)
    with pytest.raises(TokenloomError, match=r"^model.moe_token_dispatcher_type must be alltoall or allgather, got 'x'$"):
        GPTConfig(num_experts=4, moe_token_dispatcher_type="x")  # type: ignore[arg-type]
