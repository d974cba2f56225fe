"""Single-process checks of :mod:`tokenloom.train.parallel.fsdp` on a 1-rank gloo group (fast);
the layouts against one process are in test_fsdp.py."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from tokenloom.train.model.config import GPTConfig
from tokenloom.train.model.gpt import GPT
from tokenloom.train.parallel import fsdp

CFG = GPTConfig(vocab_size=50, make_vocab_size_divisible_by=64, seq_len=8, n_layers=2, n_heads=4, d_model=16)


def test_the_chunks_own_parameters_are_freed_once_the_backward_is_back_through_the_final_norm(group):
    """The tied embedding / LM head is sharded again before the embedding's backward (which reads
    only the token ids), not at the end of the backward; the gradients and a second forward and
    backward (gathering again) equal the unsharded model's."""
    torch.manual_seed(0)
    ref = GPT(CFG)
    model = copy.deepcopy(ref)
    fsdp.shard_fully([model], [list(model.blocks.values())], dist.group.WORLD, torch.device("cpu"))
    sharded_at_embedding_backward = []

    def watch(module, args, out):
        out.register_hook(lambda grad: sharded_at_embedding_backward.append(isinstance(model.tok_emb.weight, DTensor)))

    model.tok_emb.register_forward_hook(watch)
    tokens = torch.randint(0, CFG.vocab_size, (2, CFG.seq_len))
    labels = torch.randint(0, CFG.vocab_size, (2, CFG.seq_len))
    for _ in range(2):  # the second forward gathers the freed parameters again
        loss, ref_loss = model(tokens, labels), ref(tokens, labels)
        loss.backward()
        ref_loss.backward()
        assert torch.equal(loss, ref_loss)
    assert sharded_at_embedding_backward == [True, True]
    fsdp.reshard([model])
    assert model.lm_head.weight is model.tok_emb.weight
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert torch.equal(fsdp.local(p.grad), q.grad), name
