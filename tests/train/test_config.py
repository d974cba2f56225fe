"""The train config's keys: every unknown one (nested sections too) in one message."""

from __future__ import annotations

import pytest

from tokenloom.errors import TokenloomError
from tokenloom.train.config import TrainConfig, load_config, unknown_keys


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
