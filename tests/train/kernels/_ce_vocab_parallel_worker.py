"""One rank of the vocab-parallel cross-entropy check (gloo, CPU), run as a subprocess.

Usage: ``python _ce_vocab_parallel_worker.py RANK WORLD STORE_FILE``. Every rank builds
the same full problem from a seed, keeps its vocabulary shard of the LM-head weight,
runs ``chunked_cross_entropy(..., group=WORLD)`` and compares the loss, the hidden
gradient and its weight-gradient shard against the single-process reference.
Prints one JSON line with the max absolute errors (float64 throughout).
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist

from tokenloom.train.kernels.cross_entropy import chunked_cross_entropy, cross_entropy_reference


def main() -> None:
    rank, world, store_file = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    dist.init_process_group("gloo", store=dist.FileStore(store_file, world), rank=rank, world_size=world)
    g = torch.Generator().manual_seed(0)
    tokens, hidden, vocab = 23, 8, 12 * world
    h = torch.randn(tokens, hidden, dtype=torch.float64, generator=g)
    w = torch.randn(vocab, hidden, dtype=torch.float64, generator=g)
    t = torch.randint(0, vocab, (tokens,), generator=g)
    t[3] = -100
    mask = (torch.rand(tokens, generator=g) > 0.2).double()

    ref_h, ref_w = h.clone().requires_grad_(), w.clone().requires_grad_()
    ref = cross_entropy_reference(ref_h, ref_w, t, loss_mask=mask)
    ref.backward()

    shard = slice(rank * vocab // world, (rank + 1) * vocab // world)
    par_h, par_w = h.clone().requires_grad_(), w[shard].clone().requires_grad_()
    loss = chunked_cross_entropy(par_h, par_w, t, loss_mask=mask, chunk_size=5, group=dist.group.WORLD)
    loss.backward()
    errors = {
        "loss": (loss - ref).abs().item(),
        "grad_hidden": (par_h.grad - ref_h.grad).abs().max().item(),
        "grad_weight": (par_w.grad - ref_w.grad[shard]).abs().max().item(),
    }
    print(json.dumps(errors))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
