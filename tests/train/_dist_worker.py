"""One rank of a multi-process DDP test; started by ``_launch.run_world`` as a script.

Usage: python _dist_worker.py SCENARIO OUT_DIR   (RANK, WORLD_SIZE, MASTER_* in env)

Each scenario writes ``OUT_DIR/rank<r>.json`` with plain numbers/strings the test
asserts on, so a failure on any rank is visible in the parent.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from tokenloom.errors import TokenloomError
from tokenloom.train.dist import init_from_env
from tokenloom.train.model.config import GPTConfig
from tokenloom.train.model.gpt import GPT
from tokenloom.train.parallel.ddp import DistributedDataParallel

VOCAB, SEQ, BATCH = 96, 16, 2

CONFIGS = {
    # name: (model config, ddp kwargs for ours, torch DDP kwargs, optimizer, micro-batches, zero-to-none)
    "gpt2_tied_sgd": (
        dict(arch="gpt2", tie_embeddings=True),
        dict(bucket_cap_mb=0.02),
        dict(bucket_cap_mb=0.02),
        "sgd",
        1,
        False,
    ),
    # as above with the weight-gradient fusion off: autograd's graph, and so the grad-ready
    # order that the rebuilt buckets follow, is then torch DDP's (test_rebuilt_buckets_match_torch)
    "gpt2_tied_sgd_unfused": (
        dict(arch="gpt2", tie_embeddings=True),
        dict(bucket_cap_mb=0.02, wgrad_fusion=False),
        dict(bucket_cap_mb=0.02),
        "sgd",
        1,
        False,
    ),
    "llama_gqa_untied_adamw_accum_unfused": (
        dict(arch="llama", n_kv_heads=2, tie_embeddings=False, bias=False, recompute_layers=(1,)),
        dict(wgrad_fusion=False),
        dict(),
        "adamw",
        3,
        False,
    ),
    "llama_gqa_untied_adamw_accum": (
        dict(arch="llama", n_kv_heads=2, tie_embeddings=False, bias=False, recompute_layers=(1,)),
        dict(),
        dict(),
        "adamw",
        3,
        False,
    ),
    # Different bucket caps from torch's (so a different gloo summation order at 4 ranks,
    # ~1e-8 grad differences). SGD here: AdamW turns such rounding differences in
    # near-zero grads into ~1e-5 parameter differences (m/sqrt(v) ~ sign(g)).
    "gpt2_untied_sgd_accum_set_to_none_small_buckets": (
        dict(arch="gpt2", tie_embeddings=False),
        dict(bucket_cap_mb=0.01, first_bucket_cap_mb=0.002),
        dict(),
        "sgd",
        2,
        True,
    ),
}


def tiny_gpt(**overrides) -> GPT:
    cfg = dict(
        vocab_size=VOCAB, make_vocab_size_divisible_by=32, seq_len=SEQ, n_layers=2, n_heads=4, d_model=32
    )
    cfg.update(overrides)
    return GPT(GPTConfig(**cfg))


def batch(step: int, micro: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    x = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    return x[:, :-1], x[:, 1:]


def make_opt(kind: str, params) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def train_step(ddp, opt, step: int, micro_batches: int, rank: int, set_to_none: bool) -> None:
    opt.zero_grad(set_to_none=set_to_none)
    for m in range(micro_batches):
        x, y = batch(step, m, rank)
        last = m == micro_batches - 1
        if last:
            (ddp(x, y) / micro_batches).backward()
        else:
            with ddp.no_sync():
                (ddp(x, y) / micro_batches).backward()


def max_diff(a: list[torch.Tensor | None], b: list[torch.Tensor | None]) -> float:
    worst = 0.0
    for x, y in zip(a, b, strict=True):
        if (x is None) != (y is None):
            return float("inf")
        if x is not None:
            worst = max(worst, (x - y).abs().max().item())
    return worst


def compare_with_torch(name: str, rank: int, steps: int = 3) -> dict:
    model_cfg, ours_kw, torch_kw, opt_kind, micro, to_none = CONFIGS[name]
    ours_model, ref_model = tiny_gpt(**model_cfg), tiny_gpt(**model_cfg)
    if rank == 1:  # different init on one rank: both wrappers must broadcast rank 0's
        with torch.no_grad():
            for p in [*ours_model.parameters(), *ref_model.parameters()]:
                p.add_(1.0)
    ours = DistributedDataParallel(ours_model, **ours_kw)
    ref = TorchDDP(ref_model, **torch_kw)
    opt_ours, opt_ref = (
        make_opt(opt_kind, ours_model.parameters()),
        make_opt(opt_kind, ref_model.parameters()),
    )
    grad_diff = param_diff = 0.0
    views = True
    for step in range(steps):
        train_step(ours, opt_ours, step, micro, rank, to_none)
        train_step(ref, opt_ref, step, micro, rank, to_none)
        grad_diff = max(
            grad_diff,
            max_diff([p.grad for p in ours_model.parameters()], [p.grad for p in ref_model.parameters()]),
        )
        for i, p in enumerate(ours.module.parameters()):
            views &= p.grad.data_ptr() == ours._views[i].data_ptr()
        opt_ours.step()
        opt_ref.step()
        param_diff = max(param_diff, max_diff(list(ours_model.parameters()), list(ref_model.parameters())))
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, [p.detach().sum().item() for p in ours_model.parameters()])
    return {
        "grad_diff": grad_diff,
        "param_diff": param_diff,
        "grads_are_bucket_views": bool(views),
        "ranks_agree": all(g == gathered[0] for g in gathered),
        "num_buckets": len(ours.bucket_indices),
        "our_bucket_sizes": ours.bucket_sizes_bytes,
        "our_bucket_indices": ours.bucket_indices,
        "torch_rebuilt_bucket_sizes": _logged_ints(ref, "rebuilt_bucket_sizes"),
        "torch_rebuilt_bucket_indices": [
            [int(i) for i in b.split()]
            for b in str(log_data(ref).get("rebuilt_per_bucket_param_indices", "")).split(", ")
        ],
    }


def log_data(ddp: TorchDDP) -> dict:
    return ddp._get_ddp_logging_data()


def _logged_ints(ddp: TorchDDP, key: str) -> list[int]:
    """torch logs bucket layouts as comma-separated strings."""
    return [int(s) for s in str(log_data(ddp).get(key, "")).split(", ") if s]


class Branchy(nn.Module):
    """``never`` is unused everywhere; ``rank0_only`` is used on rank 0 only."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(8, 8)
        self.rank0_only = nn.Linear(8, 8)
        self.never = nn.Linear(8, 8)
        self.out = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor, use_branch: bool) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        if use_branch:
            h = h + self.rank0_only(h)
        return self.out(h).sum()


def unused_params(rank: int) -> dict:
    ours_model, ref_model = Branchy(), Branchy()
    ours = DistributedDataParallel(ours_model, find_unused_parameters=True, bucket_cap_mb=0.0001)
    ref = TorchDDP(ref_model, find_unused_parameters=True, bucket_cap_mb=0.0001)
    diffs = []
    for step in range(2):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step * 10 + rank))
        for model in (ours_model, ref_model):
            model.zero_grad(set_to_none=True)
        ours(x, rank == 0).backward()
        ref(x, rank == 0).backward()
        diffs.append(
            max_diff([p.grad for p in ours_model.parameters()], [p.grad for p in ref_model.parameters()])
        )
    # accumulation: a no_sync micro-batch uses the branch everywhere, the synced one on rank 0
    # only, so rank 1 reduces the branch's accumulated grad without a hook (averaged too)
    for model in (ours_model, ref_model):
        model.zero_grad(set_to_none=False)
    for ddp in (ours, ref):
        with ddp.no_sync():
            ddp(x, True).backward()
        ddp(x * 2, rank == 0).backward()
    diffs.append(max_diff([p.grad for p in ours_model.parameters()], [p.grad for p in ref_model.parameters()]))
    result = {
        "unused_diff": max(diffs),
        "never_grad_is_none": ours_model.never.weight.grad is None,
        "rank0_only_has_grad": ours_model.rank0_only.weight.grad is not None,
    }
    # Without find_unused_parameters the same model is an error naming the parameters.
    strict = DistributedDataParallel(Branchy())
    try:
        strict(torch.randn(4, 8), True).backward()
        result["strict_error"] = ""
    except TokenloomError as e:
        result["strict_error"] = str(e)
    dist.barrier()
    return result


def shape_mismatch(rank: int) -> dict:
    model = tiny_gpt(d_model=32, ffn_hidden_size=64 if rank == 0 else 48)
    try:
        DistributedDataParallel(model)
        return {"mismatch_error": ""}
    except TokenloomError as e:
        return {"mismatch_error": str(e)}


def suite(rank: int) -> dict:
    out = {"mismatch": shape_mismatch(rank)}
    for name in CONFIGS:
        out[name] = compare_with_torch(name, rank)
    out["unused"] = unused_params(rank)
    return out


def peer_failure(rank: int, how: str) -> dict:
    """At step 2 rank 1 either exits abruptly (``killed``: its sockets close) or goes
    silent while alive (``stalled``: only the collective timeout can catch it).
    The survivors report what they raised and how long after the step started."""
    model = tiny_gpt()
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.01)
    opt = make_opt("sgd", model.parameters())
    start = time.monotonic()
    try:
        for step in range(5):
            if step == 2 and rank == 1:
                if how == "stalled":
                    time.sleep(float(os.environ["TL_TEST_TIMEOUT_S"]) + 2.0)  # outlive the peer's timeout
                os._exit(3)
            train_step(ddp, opt, step, 1, rank, False)
            opt.step()
            start = time.monotonic()
    except Exception as e:
        return {"error_type": type(e).__name__, "error": str(e), "seconds": time.monotonic() - start}
    return {"error_type": "", "error": "", "seconds": time.monotonic() - start}


SCENARIOS = {
    "suite": suite,
    "killed": lambda rank: peer_failure(rank, "killed"),
    "stalled": lambda rank: peer_failure(rank, "stalled"),
}


def main() -> None:
    scenario, out_dir = sys.argv[1], Path(sys.argv[2])
    torch.set_num_threads(1)
    info = init_from_env(timeout_s=float(os.environ.get("TL_TEST_TIMEOUT_S", "60")))
    try:
        result = SCENARIOS[scenario](info.rank)
    except Exception:
        result = {"crash": traceback.format_exc()}
    (out_dir / f"rank{info.rank}.json").write_text(json.dumps(result))
    os._exit(0)  # skip process-group teardown: a dead peer could make it block


if __name__ == "__main__":
    main()
