"""Sample text from a training checkpoint: ``generate(GenerateConfig(...)) -> str``.

Shape and tokenizer come from the checkpoint's ``state.json``; weights load ``weights_only``. No
KV cache (each token re-runs the last ``seq_len`` tokens): O(n^2), but one code path with training;
a longer prompt is cropped with a warning. A private generator seeded with ``seed`` makes output
deterministic and leaves the global RNG alone.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from tokenloom.errors import TokenloomError
from tokenloom.train.checkpoint import commit as checkpoint
from tokenloom.train.checkpoint.format import model_tensors
from tokenloom.train.config import config_from_dict
from tokenloom.train.data import open_tokenizer
from tokenloom.train.model.config import GPTConfig
from tokenloom.train.model.gpt import GPT


@dataclass(kw_only=True)
class GenerateConfig:
    """What to sample from which checkpoint."""

    checkpoint: str
    """A checkpoint directory, or a checkpoint root (its latest complete checkpoint is used)."""
    prompt: str = ""
    """Text to continue (an empty prompt starts from the EOD token)."""
    max_new_tokens: int = 100
    """Tokens to generate (fewer if EOD is produced and stop_at_eod is set)."""
    temperature: float = 1.0
    """Softmax temperature; 0 picks the most likely token every time."""
    top_k: int | None = 50
    """Sample only among the k most likely tokens; None uses all."""
    seed: int = 0
    """Seed of the sampling generator (same seed, same text)."""
    stop_at_eod: bool = True
    """Stop when the model emits the tokenizer's EOD id."""
    tokenizer: str | None = None
    """Override the tokenizer path stored in the checkpoint."""
    device: str = "auto"
    """"auto" (cuda if available, else cpu), "cpu", "cuda", ..."""


def load_model(path: str | os.PathLike, device: torch.device | str = "cpu") -> tuple[GPT, dict]:
    """The one-process model (eval mode) of a checkpoint of any layout, and its ``state.json``."""
    path = Path(path)
    state = checkpoint.read_state(path)
    # built on ``device``: the model chooses its kernels for the device it is built on
    model = GPT(config_from_dict(GPTConfig, state["config"]["model"], "model."), device=device)
    model.load_state_dict(model_tensors(path, state))
    return model.eval(), state


@torch.no_grad()
def sample(model: GPT, ids: torch.Tensor, max_new_tokens: int, *, temperature: float, top_k: int | None,
           generator: torch.Generator, eod: int | None = None) -> torch.Tensor:
    """Append up to ``max_new_tokens`` sampled ids to the 1-D ``ids``; returns only the new ids."""
    seq_len, vocab = model.cfg.seq_len, model.cfg.vocab_size
    out = ids.clone()
    for _ in range(max_new_tokens):
        logits = model(out[-seq_len:].unsqueeze(0))[0, -1, :vocab].float()
        if temperature == 0:
            nxt = logits.argmax().view(1)
        else:
            logits = logits / temperature
            if top_k is not None and top_k < vocab:
                kth = torch.topk(logits, top_k).values[-1]
                logits = logits.masked_fill(logits < kth, -float("inf"))
            probs = torch.softmax(logits, dim=-1)
            nxt = torch.multinomial(probs.cpu(), 1, generator=generator).to(out.device)
        out = torch.cat([out, nxt])
        if eod is not None and int(nxt) == eod:
            break
    return out[len(ids):]


def generate(cfg: GenerateConfig) -> str:
    """The prompt followed by the sampled continuation (EOD, if produced, is not decoded)."""
    if cfg.temperature < 0 or cfg.max_new_tokens < 0 or (cfg.top_k is not None and cfg.top_k < 1):
        raise TokenloomError("need temperature >= 0, max_new_tokens >= 0 and top_k >= 1 (or None)")
    path = checkpoint.resolve(cfg.checkpoint, cfg.checkpoint, flag="--checkpoint")
    if path is None:  # only "auto" resolves to nothing; generate has no run directory to look in
        raise TokenloomError("--checkpoint auto: give a checkpoint directory or a run's checkpoint root")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu") if cfg.device == "auto" else cfg.device
    model, state = load_model(path, device)
    tok_name = cfg.tokenizer or state["config"].get("tokenizer")
    if not tok_name:
        raise TokenloomError(f"{path} was trained without a tokenizer; pass --tokenizer PATH to decode")
    tok = open_tokenizer(tok_name)
    prompt_ids = [int(i) for i in tok.encode(cfg.prompt)] if cfg.prompt else [tok.eod]
    if len(prompt_ids) > model.cfg.seq_len:
        print(f"warning: the prompt has {len(prompt_ids)} tokens, more than the model's context of "
              f"{model.cfg.seq_len}: it continues from the last {model.cfg.seq_len} only", file=sys.stderr, flush=True)
    ids = torch.tensor(prompt_ids, dtype=torch.long, device=device)
    generator = torch.Generator().manual_seed(cfg.seed)
    new = sample(model, ids, cfg.max_new_tokens, temperature=cfg.temperature, top_k=cfg.top_k,
                 generator=generator, eod=tok.eod if cfg.stop_at_eod else None)
    new_ids = [int(i) for i in new.tolist() if not (cfg.stop_at_eod and i == tok.eod)]
    return cfg.prompt + tok.decode(new_ids)
