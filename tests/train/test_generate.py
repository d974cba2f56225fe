"""generate(): text from a checkpoint with its stored model config and tokenizer, seeded."""

from __future__ import annotations

import pytest
import torch

from tokenloom.errors import TokenloomError
from tokenloom.train.checkpoint import format as ckpt_format
from tokenloom.train.config import TrainConfig
from tokenloom.train.data import DataConfig, MockDataConfig
from tokenloom.train.generate import GenerateConfig, generate, load_model
from tokenloom.train.loop import run
from tokenloom.train.model.config import GPTConfig


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny GPT trained for a few steps on mock data with the byte tokenizer's vocabulary."""
    out = tmp_path_factory.mktemp("gen")
    cfg = TrainConfig(
        model=GPTConfig(vocab_size=259, make_vocab_size_divisible_by=32, seq_len=32, n_layers=2, n_heads=2,
                        d_model=32),
        data=DataConfig(mock=MockDataConfig(num_sequences=200, max_length=100)),
        micro_batch_size=4, global_batch_size=4, train_iters=6, eval_interval=0, log_interval=3,
        output_dir=str(out), tokenizer="byte", progress=False, plot=False,
    )
    return run(cfg)["checkpoint"]


def test_same_seed_same_text(trained):
    make = dict(checkpoint=trained, prompt="def main", max_new_tokens=20, top_k=20, stop_at_eod=False)
    a, b = generate(GenerateConfig(seed=3, **make)), generate(GenerateConfig(seed=3, **make))
    assert a == b and a.startswith("def main") and len(a) > len("def main")
    others = {generate(GenerateConfig(seed=s, **make)) for s in (4, 5, 6)}
    assert others - {a}  # another seed gives other text
    greedy = dict(make, temperature=0.0)
    assert generate(GenerateConfig(seed=1, **greedy)) == generate(GenerateConfig(seed=2, **greedy))


def test_greedy_text_is_the_models_argmax_continuation(trained):
    """Greedy text equals a decode written here from the checkpoint's raw tensors (argmax of
    the last position's logits over the real vocabulary, 12 times), and top_k=1 sampling at
    any temperature or seed equals greedy (only one token can be drawn)."""
    import json
    from pathlib import Path

    import torch

    from tokenloom.tokenizers import load_tokenizer
    from tokenloom.train.model.gpt import GPT

    path = Path(trained)
    stored = json.loads((path / "state.json").read_text())["config"]["model"]
    model = GPT(GPTConfig(**{k: v for k, v in stored.items() if k in GPTConfig.__dataclass_fields__}))
    model.load_state_dict(ckpt_format.read(path)[0])
    model.eval()
    tok = load_tokenizer(kind="byte")
    ids = list(tok.encode("ab"))
    with torch.no_grad():
        for _ in range(12):
            ids.append(int(model(torch.tensor([ids[-32:]]))[0, -1, :259].argmax()))
    expected = "ab" + tok.decode(ids[2:])
    greedy = dict(checkpoint=trained, prompt="ab", max_new_tokens=12, stop_at_eod=False)
    assert generate(GenerateConfig(temperature=0.0, **greedy)) == expected
    assert generate(GenerateConfig(temperature=1.7, top_k=1, seed=9, **greedy)) == expected


def test_checkpoint_root_and_errors(trained, tmp_path):
    from pathlib import Path

    root = str(Path(trained).parent)
    text = generate(GenerateConfig(checkpoint=root, prompt="x", max_new_tokens=5, seed=0, stop_at_eod=False))
    assert text.startswith("x")
    with pytest.raises(TokenloomError, match="temperature"):
        generate(GenerateConfig(checkpoint=trained, temperature=-1))
    with pytest.raises(TokenloomError, match="does not exist"):
        generate(GenerateConfig(checkpoint=str(tmp_path / "none")))


def test_a_tensor_parallel_checkpoint_generates_as_the_one_process_model(tmp_path):
    """A tp 2 run's sharded checkpoint is gathered back into the one-process model: greedy text
    from it equals greedy text from the same run trained in one process."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent / "parallel"))
    from compose_helpers import launch

    kw = dict(train_iters=3, eval_interval=0, tokenizer="byte", save_interval=None,
              model=GPTConfig(vocab_size=259, make_vocab_size_divisible_by=64, seq_len=16, n_layers=2, n_heads=4,
                              d_model=32, bias=False))
    launch([("train", dict(out=str(tmp_path / "tp2"), tp=2, **kw))], 2, tmp_path)
    launch([("train", dict(out=str(tmp_path / "one"), **kw))], 1, tmp_path)
    greedy = dict(prompt="ab", max_new_tokens=12, temperature=0.0, stop_at_eod=False)
    one = generate(GenerateConfig(checkpoint=str(tmp_path / "one" / "checkpoints"), **greedy))
    tp2 = generate(GenerateConfig(checkpoint=str(tmp_path / "tp2" / "checkpoints"), **greedy))
    assert (tmp_path / "tp2" / "checkpoints" / "iter_0000003" / "tp1_pp0_dp0.pt").exists()
    from_str, _ = load_model(str(tmp_path / "tp2" / "checkpoints" / "iter_0000003"))  # str and Path alike
    from_path, _ = load_model(tmp_path / "tp2" / "checkpoints" / "iter_0000003")
    assert all(torch.equal(a, b) for a, b in zip(from_str.state_dict().values(), from_path.state_dict().values(),
                                                 strict=True))
    assert tp2 == one and len(one) > len("ab")


def test_a_prompt_longer_than_the_context_is_cropped_with_a_warning(trained, capsys):
    text = generate(GenerateConfig(checkpoint=trained, prompt="x" * 40, max_new_tokens=3, temperature=0.0,
                                   stop_at_eod=False))
    assert text.startswith("x" * 40)
    assert capsys.readouterr().err == ("warning: the prompt has 40 tokens, more than the model's context of 32: it "
                                       "continues from the last 32 only\n")
    generate(GenerateConfig(checkpoint=trained, prompt="x" * 32, max_new_tokens=1))
    assert capsys.readouterr().err == ""
