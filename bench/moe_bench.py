"""Mixture of experts: quality and speed against a dense GPT of the same active parameters.

    .venv/bin/python bench/moe_bench.py [--steps 200] [--d-model 64] [--experts 8] [--topk 2]
        [--aux-loss-coeff 0.05] [--speed-iters 5] [--quality-only | --speed-only] [--device cpu|cuda]

Quality (issue 43, acceptance 4): a Llama-style MoE (``--experts`` experts of inner size F, top
``--topk``, balance loss weighted ``--aux-loss-coeff``) and a dense model whose MLP is ``topk x F``
wide (the same parameters per token, the router aside) train ``--steps`` steps through the one loop
(``loop.start_run``) on the shared tinyshakespeare prefix (GPT-2 tokens), same seed, data
order and schedule; the table gives both final validation losses (lower is better; target: MoE
lower) and the smallest share of routed tokens any expert of any layer got over the run's last
log interval (target >= 5%; 1/E is perfect balance).

Speed: tokens/s of one training step (forward, backward, AdamW) of the MoE vs the dense model
of the same active parameters (target: as close to 1 as the routing allows; the MoE does the
same matmul FLOPs plus routing and permutation), and of the MoE's experts as one grouped GEMM
(``torch._grouped_mm``) vs a loop over experts (``model.moe_grouped_gemm``; higher is better),
steps taken in turn, best of ``--speed-iters``, eager, on ``--device`` (CUDA: bf16 autocast and
fused AdamW, where ``torch._grouped_mm`` runs on Hopper; what ``run_all.py --gpu`` measures). Expert
parallelism (ep 2 vs ep 1, with and without ZeRO-1, on gloo ranks) is ``parallel_bench.py``'s
expert-parallel table (``--ep-only``).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _table import print_table  # noqa: E402

from tokenloom.train.config import TrainConfig  # noqa: E402
from tokenloom.train.data import BlendDataConfig, DataConfig  # noqa: E402
from tokenloom.train.loop import start_run  # noqa: E402
from tokenloom.train.metrics import read_metrics  # noqa: E402
from tokenloom.train.model.config import GPTConfig
from tokenloom.train.model.gpt import GPT  # noqa: E402
from tokenloom.train.optim.adamw import OptimConfig  # noqa: E402
from tokenloom.train.runtime import World  # noqa: E402

PREFIX = Path("/work/shared/data/megatron-reference/tinyshakespeare_gpt2_eod")


def model_config(args, *, moe: bool, **kw) -> GPTConfig:
    """The MoE (``moe``) or its dense twin: the dense MLP is ``topk x`` the expert's width."""
    inner = 2 * args.d_model
    shape = dict(arch="llama", vocab_size=50257, seq_len=args.seq_len, n_layers=args.n_layers,
                 n_heads=max(4, args.d_model // 128),
                 d_model=args.d_model)
    if moe:
        shape.update(ffn_hidden_size=inner, num_experts=args.experts, moe_router_topk=args.topk,
                     moe_aux_loss_coeff=args.aux_loss_coeff)
    else:
        shape.update(ffn_hidden_size=args.topk * inner)
    return GPTConfig(**{**shape, **kw})


def train(args, out: Path, *, moe: bool) -> dict:
    """One run through the loop; its final validation loss and its last interval's smallest expert share."""
    cfg = TrainConfig(model=model_config(args, moe=moe),
                      data=DataConfig(blend=BlendDataConfig(prefixes=[(1.0, str(args.prefix))], split="949,50,1",
                                                            cache_dir=str(out / "cache"))),
                      optim=OptimConfig(lr=3e-3, min_lr=3e-4, warmup_iters=20),
                      micro_batch_size=args.micro, global_batch_size=args.micro, train_iters=args.steps,
                      eval_interval=args.steps, eval_iters=8, log_interval=args.steps // 4, save_interval=None,
                      output_dir=str(out / ("moe" if moe else "dense")), progress=False, plot=False)
    summary = start_run(cfg, World(0, 1, torch.device("cpu"), False)).train()
    shares = [r["moe_min_expert_share"] for r in read_metrics(Path(cfg.output_dir) / "metrics.jsonl")
              if "moe_min_expert_share" in r]
    return {"val_loss": summary["val_loss"], "min_share": shares[-1] if shares else None,
            "params": GPT(cfg.model, device="meta").num_params(),
            "active": GPT(cfg.model, device="meta").num_active_params()}


def step_time(model: GPT, tokens: torch.Tensor, opt: torch.optim.Optimizer) -> float:
    cuda = tokens.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    with torch.autocast("cuda", torch.bfloat16, enabled=cuda):
        loss = model(tokens[:, :-1], tokens[:, 1:])
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - start


def speed(args) -> list[tuple]:
    """Tokens/s of the MoE (grouped GEMM and loop) and the dense twin, steps in turn."""
    torch.manual_seed(0)
    device = torch.device(args.device)
    models = {"moe": GPT(model_config(args, moe=True, vocab_size=4096), device=device),
              "moe_loop": GPT(model_config(args, moe=True, vocab_size=4096, moe_grouped_gemm=False), device=device),
              "dense": GPT(model_config(args, moe=False, vocab_size=4096), device=device)}
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-4, fused=device.type == "cuda") for k, m in models.items()}
    tokens = torch.randint(0, 4096, (args.micro, args.seq_len + 1), device=device)
    best = dict.fromkeys(models, float("inf"))
    for i in range(args.speed_iters + 1):
        for k, m in models.items():
            t = step_time(m, tokens, opts[k])
            if i:  # the first step of each warms up
                best[k] = min(best[k], t)
    per_s = {k: args.micro * args.seq_len / t for k, t in best.items()}
    return [("tokens/s, MoE vs dense of the same active parameters", f"{per_s['moe']:,.0f}",
             f"{per_s['dense']:,.0f}", f"{per_s['moe'] / per_s['dense']:.3f}x"),
            ("tokens/s, MoE experts as one grouped GEMM vs a loop over experts", f"{per_s['moe']:,.0f}",
             f"{per_s['moe_loop']:,.0f}", f"{per_s['moe'] / per_s['moe_loop']:.3f}x")]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--n-layers", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--micro", type=int, default=8)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--aux-loss-coeff", type=float, default=0.05)
    p.add_argument("--speed-iters", type=int, default=5)
    p.add_argument("--prefix", type=Path, default=PREFIX)
    p.add_argument("--quality-only", action="store_true")
    p.add_argument("--speed-only", action="store_true")
    p.add_argument("--device", default="cpu", help="where the speed rows run (cuda: bf16 autocast)")
    args = p.parse_args()
    shape = f"{args.n_layers} layers x {args.d_model}, seq {args.seq_len}, micro {args.micro}"
    if not args.speed_only:
        with tempfile.TemporaryDirectory() as tmp:
            moe, dense = train(args, Path(tmp), moe=True), train(args, Path(tmp), moe=False)
        rows = [("validation loss after the run (lower is better; target: MoE lower)", f"{moe['val_loss']:.4f}",
                 f"{dense['val_loss']:.4f}", f"{moe['val_loss'] / dense['val_loss']:.3f}x"),
                ("parameters active per token (MoE: router included)", f"{moe['active']:,}", f"{dense['active']:,}",
                 f"{moe['active'] / dense['active']:.3f}x"),
                ("parameters in all", f"{moe['params']:,}", f"{dense['params']:,}",
                 f"{moe['params'] / dense['params']:.3f}x"),
                ("smallest share of routed tokens of any expert, last interval (target >= 5%)",
                 f"{100 * moe['min_share']:.1f}%", "", "")]
        print_table(f"MoE ({args.experts} experts, top-{args.topk}) vs dense of the same active parameters, "
                    f"{args.steps} steps on tinyshakespeare (GPT-2 tokens), {shape} (tokenloom = MoE, baseline = dense)",
                    rows)
    if not args.quality_only:
        where = (f"cuda ({torch.cuda.get_device_name()}, bf16)" if args.device == "cuda"
                 else f"cpu ({torch.get_num_threads()} threads)")
        print_table(f"MoE step speed, {where}, {shape}, {args.experts} experts top-{args.topk}, vocab 4096 "
                    "(tokenloom = MoE)",
                    speed(args))


if __name__ == "__main__":
    main()
