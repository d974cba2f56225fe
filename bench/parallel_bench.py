"""Step time, communication volume, optimizer state and pipeline bubble per (dp, tp, pp) layout (gloo ranks).

    .venv/bin/python bench/parallel_bench.py [--world 2] [--steps 5] [--d-model 64] [--micro-batches 4]
        [--layouts dp,zero1,tp,pp,vpp] [--bubble-d-model 512] [--bubble-layers 32] [--bubble-micro-batches 4,8]
        [--bubble-steps 9] [--no-bubble | --bubble-only] [--split-last 4] [--no-split | --split-only]
        [--no-rss | --rss-only] [--no-memory | --memory-only] [--no-ep | --ep-only] [--ep-rounds 2]

Every layout of ``--world`` ranks (2 or 4), and pure data parallelism with ZeRO-1
(``zero1``) or fully sharded (``fsdp``), trains the same GPT with
:class:`tokenloom.train.strategy.Strategy` of the training loop on mock data: one warmup step, then
``--steps`` timed steps (best step kept: the box is shared). Every rank runs one torch
thread (as under torchrun's ``OMP_NUM_THREADS=1``; two ranks on two cores do not
oversubscribe them). ``--layouts`` picks layouts by name (``dp``, ``zero1``, ``fsdp``, ``tp``, ``pp``,
``vpp``, ``cp`` (context parallelism over every rank), and at ``--world 4`` ``tp_pp``, ``dp_tp``,
``dp_pp``, ``dp_pp_zero1``, ``dp_tp_fsdp``, ``dp_pp_fsdp``, ``dp_cp``). Reported per layout:

* step time of one global batch (the same for every layout: ``2 x world x
  --micro-batches`` sequences), against pure data parallelism on the same ranks;
* payload bytes handed to collectives and p2p sends per rank per step (all-reduce
  counted once per call, not the ring's 2(n-1)/n traffic), against the baseline;
* optimizer-state bytes of the largest rank
  (:meth:`~tokenloom.train.strategy.Strategy.optimizer_state_bytes`: AdamW moments and
  steps), against plain AdamW at dp = world: 1/dp with ZeRO-1, 1/(tp pp) with model
  parallelism (plus padding and the per-parameter step scalars);
* exposed communication: the same steps again with every collective and p2p transfer
  replaced by a local no-op of equal shape (``_Counter.silent``), best step each; the share
  of the step the communication adds, ``1 - without / with``. Under pipeline parallelism the
  no-op receives also remove the stages' waiting on one another, so there it counts the
  bubble's wait too;
* unless ``--no-bubble``, a second table for the pipelined layouts: the pipeline-wide
  bubble (:func:`~tokenloom.train.parallel.schedules.pipeline_bubble_fraction`,
  ``1 - sum(compute) / (pp x max(total))`` over the pipeline ranks: compute is each rank's
  time inside its stage forwards, losses and backwards, total the wall time of the
  schedule on the slowest rank) against ``(p - 1) / (v M + p - 1)``; the busiest rank's
  idle share (``1 - max(compute) / max(total)``, the same for equal stages); and, for
  information, how much more the busiest rank computed than the lightest (:func:`compute_spread`),
  with its own model: ``--bubble-d-model`` wide (512), ``--bubble-layers`` (32), at each
  ``--bubble-micro-batches`` (``M`` per pipeline, 4 and 8: theory 0.2 and 0.111 at pp 2, 0.111
  and 0.059 at pp 2 x vpp 2), ``--bubble-steps`` timed steps, the median step's bubbles and
  every step's pipeline-wide one reported. The theory holds for stages of equal cost and free
  communication. A micro-batch of the main table's 64-wide model computes in about a
  millisecond, as long as a gloo p2p round trip and the Python around it, so there the ratio
  would measure the transport, not the schedule. At 512 wide an 8-layer chunk's forward takes
  ~75 ms, its backward ~150 ms, and the p2p transfers (posted early, waited for late: see
  :mod:`tokenloom.train.parallel.p2p`) run under the next compute. What keeps a measured
  bubble above theory is paid per micro-batch, so its share of the step falls as a chunk's
  compute grows: the last stage also runs the LM head and loss (~5 ms forward and backward
  per micro-batch), which no schedule removes and the pipeline-wide bubble counts (the lighter
  rank idles by the difference; the busiest rank's share does not count it), and each
  transfer still costs the compute threads some time on this 2-core box (gloo's transport
  threads share the cores with both ranks' compute) plus the Python between ops. Hence 32
  layers (8 per chunk at pp 2 x vpp 2). Measured 2026-11-26, interleaved at M 8, median step
  over theory, pipeline-wide / busiest rank (stages' compute spread): 16 layers 1.24-1.41x /
  1.14-1.23x (+2.6%), 32 layers 1.17-1.26x / 1.08-1.12x (+0.9%); at 8 layers 1.4-2.0x. A fixed
  excess weighs twice as much against M 8's theory as against M 4's. The time other processes
  take from a rank moves single steps both ways, hence the median;
* unless ``--no-split`` (``--split-only``: nothing else), an uneven pipeline split against the
  even one at pp 2 (:func:`split_rows`): a 12-layer GPT-2-shaped model whose last stage also
  runs the head and loss over a 50257-token vocabulary, with ``--split-last`` layers on the
  last rank (``num_layers_in_last_pipeline_stage``), step time and the stages' compute spread;
* unless ``--no-rss`` (``--rss-only``: nothing else): the peak resident memory
  (``ru_maxrss``) of the largest rank after a warmup and one training step of a
  GPT-2-small shape (124 M parameters, vocab 50304, seq 128, micro-batch 1) at dp 2,
  tp 2 and pp 2 on 2 ranks, against dp 2 (tp 1): parameters, gradients and AdamW state
  are split by tp and pp, replicated by dp;
* unless ``--no-memory`` (``--memory-only``: nothing else): at dp 4 on 4 ranks, the same
  GPT-2-small shape (micro-batch 1, global batch 4) with DDP, ZeRO-1 and fsdp: the largest
  rank's parameters + gradients + optimizer state (:func:`model_state_bytes`), its peak RSS
  and its resident memory after the step once glibc returns freed heap (:func:`resident_after_trim`),
  against DDP's;
* unless ``--no-ep`` (``--ep-only``: nothing else), expert parallelism at dp 2 on 2 ranks
  (:func:`ep_rows`): a mixture-of-experts GPT (``--ep-layers`` blocks ``--ep-d-model`` wide, every
  block's MLP ``--ep-experts`` experts of inner size 2 x d_model, top-2) trained at ep 2 (each rank
  holds half the experts; tokens exchanged by all-to-all, the experts' grads not reduced), at ep 2
  with ZeRO-1 and at ep 2 with the allgather token dispatcher, against ep 1 (every rank holds every
  expert; the experts' grads all-reduced with the dense ones): tokens/s, the payload of every collective (all-to-all included) and the
  optimizer state, runs alternated over ``--ep-rounds`` rounds, each side's step times pooled and
  the median taken. These runs time no step without communication: an all-to-all has no local
  stand-in (its exchanged split sizes drive the rest of the step).
"""

from __future__ import annotations

import argparse
import ctypes
import inspect
import multiprocessing as mp
import resource
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _table import print_table  # noqa: E402

from tokenloom.train.config import TrainConfig  # noqa: E402
from tokenloom.train.data import DataConfig, MockDataConfig  # noqa: E402
from tokenloom.train.model.config import GPTConfig  # noqa: E402
from tokenloom.train.optim.adamw import OptimConfig  # noqa: E402
from tokenloom.train.parallel import fsdp, mappings  # noqa: E402
from tokenloom.train.parallel.schedules import pipeline_bubble_fraction, theoretical_bubble_fraction  # noqa: E402


class _Done:
    """A finished communication handle (what the no-op collectives return for ``async_op``)."""

    def wait(self) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def _gather_locally(output: torch.Tensor, inp: torch.Tensor, *args, **kwargs) -> None:
    output.view(-1, inp.numel()).copy_(inp.reshape(1, -1).clone())  # this rank's piece into every slot (FSDP2's
    # input is a view of the output)


def _scatter_locally(output: torch.Tensor, inp: torch.Tensor, *args, **kwargs) -> None:
    output.copy_(inp.reshape(-1)[: output.numel()].view_as(output))  # the first piece, unreduced


def _no_local_exchange(*args, **kwargs) -> None:
    raise RuntimeError("parallel_bench: all_to_all_single has no local stand-in (the split sizes it exchanges "
                       "drive the step); expert-parallel runs are timed with their communication only")


class _Counter:
    """Wraps the collectives tokenloom.train.parallel calls: counts their payload bytes and, while
    ``silent``, replaces each by a no-op of equal shape (the result buffer written locally, as a
    copy would: all-reduce/broadcast leave the tensor, all-gather copies this rank's piece into
    every slot, reduce-scatter its first piece, a p2p receive zero-fills), so the same step can be
    timed without communication."""

    def __init__(self) -> None:
        self.bytes = 0
        self.silent = False
        nothing = lambda *args, **kwargs: None  # noqa: E731
        for name, arg, fake in (("all_reduce", 0, nothing), ("broadcast", 0, nothing),
                                ("all_gather_single", 1, _gather_locally),
                                ("reduce_scatter_single", 0, _scatter_locally),
                                ("all_to_all_single", 1, _no_local_exchange)):  # expert parallelism's tokens
            if hasattr(dist, name):
                setattr(dist, name, self._wrap(getattr(dist, name), arg, fake))
        mappings._all_gather_flat = self._wrap(mappings._all_gather_flat, 1, _gather_locally)
        mappings._reduce_scatter_flat = self._wrap(mappings._reduce_scatter_flat, 1, _scatter_locally)
        batch = dist.batch_isend_irecv

        def batch_isend_irecv(ops):
            self.bytes += sum(op.tensor.numel() * op.tensor.element_size() for op in ops if op.op is dist.isend)
            if not self.silent:
                return batch(ops)
            for op in ops:
                if op.op is not dist.isend:
                    op.tensor.zero_()
            return [_Done() for _ in ops]

        dist.batch_isend_irecv = batch_isend_irecv

    def _wrap(self, fn, arg: int, fake):
        signature = inspect.signature(fn)

        def wrapped(*args, **kwargs):
            given = list(signature.bind(*args, **kwargs).arguments.values())  # FSDP2 passes keywords
            t = given[arg] if len(given) > arg else None
            if isinstance(t, torch.Tensor):
                self.bytes += t.numel() * t.element_size()
            if not self.silent:
                return fn(*args, **kwargs)
            fake(*given[:2])
            return _Done() if kwargs.get("async_op") else None

        return wrapped


def config(args, out: Path, dp: int, tp: int, pp: int, vpp: int | None, shard: str | None, cp: int = 1,
           ep: int = 1) -> TrainConfig:
    """The run of one layout; ``shard``: None (DDP), "zero1" or "fsdp" over its dp ranks; ``cp``:
    context-parallel ranks splitting each sequence; ``ep``: expert-parallel ranks (the MoE model
    of the ep table when ``args.moe``)."""
    if args.moe:  # every block's MLP a mixture of experts
        model = GPTConfig(bias=False, vocab_size=1000, make_vocab_size_divisible_by=128, seq_len=args.seq_len,
                          n_layers=args.ep_layers, n_heads=4, d_model=args.ep_d_model, num_experts=args.ep_experts,
                          moe_router_topk=2, moe_ffn_hidden_size=2 * args.ep_d_model,
                          moe_token_dispatcher_type=getattr(args, "ep_dispatcher", "alltoall"))
        micro, gbs = 2, 2 * args.world * args.micro_batches
    elif args.rss:  # GPT-2 small (124 M parameters)
        model = GPTConfig(vocab_size=50257, seq_len=128, n_layers=12, n_heads=12, d_model=768)
        micro, gbs = 1, max(2, dp)
    elif args.split:  # GPT-2's vocabulary: the head and loss weigh several blocks
        model = GPTConfig(vocab_size=50257, seq_len=args.seq_len, n_layers=args.split_layers, n_heads=12,
                          d_model=args.split_d_model)
        micro, gbs = 1, args.split_micro_batches
    elif args.bubble:
        model = GPTConfig(bias=False, vocab_size=1000, make_vocab_size_divisible_by=128, seq_len=args.seq_len,
                          n_layers=args.bubble_layers, n_heads=8, d_model=args.bubble_d_model)
        micro, gbs = 2, 2 * dp * args.bubble_micro_batches
    else:
        model = GPTConfig(bias=False, vocab_size=1000, make_vocab_size_divisible_by=128, seq_len=args.seq_len,
                          n_layers=2 * args.world, n_heads=4, d_model=args.d_model)  # pp = world x vpp 2 chunks
        micro, gbs = 2, 2 * args.world * args.micro_batches
    return TrainConfig(model=model, data=DataConfig(mock=MockDataConfig(num_sequences=2000, max_length=256)),
                       optim=OptimConfig(warmup_iters=1), micro_batch_size=micro,
                       global_batch_size=gbs, train_iters=2 * args.steps + 1,
                       eval_interval=0, save_interval=None, plot=False, progress=False, output_dir=str(out),
                       tp=tp, pp=pp, vpp=vpp, cp=cp, ep=ep, zero1=shard == "zero1", fsdp=shard == "fsdp",
                       dist_timeout_s=120.0,
                       num_layers_in_last_pipeline_stage=args.split_last if args.split else None)


def worker(rank: int, world: int, init: str, args, layout, out: str) -> None:
    from tokenloom.train.loop import start_run

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    counter = _Counter()
    dp, tp, pp, vpp, shard, *rest = layout
    trainer = start_run(config(args, Path(out) / "run", dp, tp, pp, vpp, shard, *rest))
    run = trainer.strategy
    batches = run.global_batches(trainer.data.train, eod=trainer.data.eod, consumed=0,
                                 total=(2 * args.steps + 1) * run.cfg.global_batch_size)
    run.train_step(next(batches))  # warmup
    times, bubbles, busiest, imbalance, start_bytes = [], [], [], [], counter.bytes
    for _ in range(args.steps):
        dist.barrier()
        t0 = time.perf_counter()
        run.train_step(next(batches))
        times.append(time.perf_counter() - t0)
        if pp > 1:
            bubbles.append(pipeline_bubble_fraction(run.last_stats, run.state.pp_group))
            busiest.append(pipeline_bubble_fraction(run.last_stats, run.state.pp_group, busiest=True))
            imbalance.append(compute_spread(run.last_stats.compute_s, run.state.pp_group))
    comm = (counter.bytes - start_bytes) / args.steps
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    model_state = model_state_bytes(run)
    resident = resident_after_trim() if args.rss else 0.0
    silent = []  # the same steps with every collective and p2p a local no-op (the model is spoilt after)
    if not args.rss and not args.bubble and not args.split and not args.moe:
        for _ in range(args.steps):
            dist.barrier()
            counter.silent = True
            t0 = time.perf_counter()
            run.train_step(next(batches))
            silent.append(time.perf_counter() - t0)
            counter.silent = False
    t = torch.tensor([min(times), comm, rss, run.optimizer_state_bytes(), min(silent, default=0.0), model_state,
                      resident],
                     dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    step_times = torch.tensor(times, dtype=torch.float64)  # each step's slowest rank
    dist.all_reduce(step_times, op=dist.ReduceOp.MAX)
    if rank == 0:
        theory = theoretical_bubble_fraction(pp, run.num_micro, vpp or 1) if pp > 1 else 0.0
        torch.save({"step_s": float(t[0]), "comm_bytes": float(t[1]), "bubbles": bubbles, "busiest": busiest, "imbalance": imbalance,
                    "theory": theory, "num_micro": run.num_micro, "peak_rss": float(t[2]),
                    "state_bytes": float(t[3]), "silent_step_s": float(t[4]), "model_state_bytes": float(t[5]),
                    "resident_bytes": float(t[6]),
                    "steps_s": step_times.tolist()},
                   Path(out) / "result.pt")
    dist.destroy_process_group()


def model_state_bytes(run) -> int:
    """Bytes of this rank's parameters, gradients and optimizer state after a step: the local
    shards under fsdp, DDP's bucket views and ZeRO-1's full grad buffer as they are held."""
    params = sum(fsdp.local(p).numel() * p.element_size() for p in run.params)
    grads = sum(fsdp.local(p.grad).numel() * p.grad.element_size() for p in run.params if p.grad is not None)
    if run.cfg.zero1:  # the grads are views of one padded buffer
        grads = run.optimizer.grad_buffer.numel() * run.optimizer.grad_buffer.element_size()
    return params + grads + run.optimizer_state_bytes()


def resident_after_trim() -> float:
    """This process's resident bytes now, after glibc hands its freed heap back
    (``malloc_trim``; the trainer keeps freed memory for the next step, see
    :mod:`tokenloom.train.host_alloc`): what the live tensors and the runtime hold. 0 off Linux/glibc."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
        return int(Path("/proc/self/statm").read_text().split()[1]) * resource.getpagesize()
    except (OSError, AttributeError):
        return 0.0


def compute_spread(compute_s: float, group) -> float:
    """``max / min - 1`` of the pipeline ranks' compute seconds in one step (collective): how
    unequal the stages were, which the theory assumes away."""
    hi = torch.tensor([compute_s], dtype=torch.float64)
    lo = hi.clone()
    dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=group)
    dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=group)
    return float(hi / lo) - 1.0


def measure(args, layout) -> dict:
    dp, tp, pp = layout[:3]
    world = dp * tp * pp * (layout[5] if len(layout) > 5 else 1)
    with tempfile.TemporaryDirectory() as tmp:
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=worker, args=(r, world, f"{tmp}/init", args, layout, tmp)) for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=600)
            if p.is_alive():
                p.kill()
        return torch.load(Path(tmp) / "result.pt")


def layouts_of(world: int) -> dict[str, tuple]:
    """Name -> (dp, tp, pp, vpp, sharding: None, "zero1" or "fsdp"[, cp]) of every layout measured on
    ``world`` ranks."""
    w = world
    layouts = {"dp": (w, 1, 1, None, None), "zero1": (w, 1, 1, None, "zero1"), "fsdp": (w, 1, 1, None, "fsdp"),
               "tp": (1, w, 1, None, None), "pp": (1, 1, w, None, None), "vpp": (1, 1, w, 2, None),
               "cp": (1, 1, 1, None, None, w)}
    if w == 4:
        layouts.update({"tp_pp": (1, 2, 2, None, None), "dp_tp": (2, 2, 1, None, None),
                        "dp_pp": (2, 1, 2, None, None), "dp_pp_zero1": (2, 1, 2, None, "zero1"),
                        "dp_tp_fsdp": (2, 2, 1, None, "fsdp"), "dp_pp_fsdp": (2, 1, 2, None, "fsdp"),
                        "dp_cp": (2, 1, 1, None, None, 2)})
    return layouts


def layout_name(dp: int, tp: int, pp: int, vpp: int | None, shard: str | None, cp: int = 1, ep: int = 1) -> str:
    return (f"dp{dp} tp{tp}" + (f" cp{cp}" if cp > 1 else "") + f" pp{pp}" + (f" vpp{vpp}" if vpp else "")
            + (f" ep{ep}" if ep > 1 else "") + (f" {shard}" if shard else ""))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2, choices=(2, 4))
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--micro-batches", type=int, default=4,
                        help="micro-batches per step at dp = world (global batch = 2 x world x this)")
    parser.add_argument("--layouts", default=None,
                        help="comma-separated layout names to measure (default: all; dp is measured "
                             "anyway when the main table runs: it is the baseline)")
    parser.add_argument("--no-bubble", dest="with_bubble", action="store_false",
                        help="skip the pipeline-bubble table")
    parser.add_argument("--bubble-only", action="store_true", help="only the pipeline-bubble table")
    parser.add_argument("--bubble-d-model", type=int, default=512, help="model width of the bubble table")
    parser.add_argument("--bubble-layers", type=int, default=32, help="layers of the bubble table's model")
    parser.add_argument("--bubble-micro-batches", type=lambda s: [int(m) for m in s.split(",")], default=[4, 8],
                        help="micro-batches per pipeline (M) in the bubble table, comma-separated: each "
                             "pipelined layout is measured at each")
    parser.add_argument("--bubble-steps", type=int, default=9, help="timed steps per layout in the bubble table")
    parser.add_argument("--no-split", dest="with_split", action="store_false",
                        help="skip the uneven-split table (GPT-2's vocabulary at pp 2)")
    parser.add_argument("--split-only", action="store_true", help="only the uneven-split table")
    parser.add_argument("--split-layers", type=int, default=12, help="layers of the split table's model")
    parser.add_argument("--split-d-model", type=int, default=768, help="model width of the split table")
    parser.add_argument("--split-last", type=int, default=4,
                        help="layers on the last of the 2 pipeline ranks in the uneven run")
    parser.add_argument("--split-micro-batches", type=int, default=8, help="micro-batches per step (M)")
    parser.add_argument("--split-steps", type=int, default=6, help="timed steps per run in the split table")
    parser.add_argument("--split-rounds", type=int, default=2,
                        help="runs of each side, alternating (even, uneven, even, ...)")
    parser.add_argument("--no-rss", dest="with_rss", action="store_false",
                        help="skip the peak-memory rows (a 124 M-parameter model on 2 ranks)")
    parser.add_argument("--rss-only", action="store_true", help="only the peak-memory rows")
    parser.add_argument("--no-memory", dest="with_memory", action="store_false",
                        help="skip the dp 4 memory table (DDP, ZeRO-1 and fsdp, a 124 M-parameter model on 4 ranks)")
    parser.add_argument("--memory-only", action="store_true", help="only the dp 4 memory table")
    parser.add_argument("--no-ep", dest="with_ep", action="store_false",
                        help="skip the expert-parallel table (a mixture-of-experts GPT at dp 2, ep 2 vs ep 1)")
    parser.add_argument("--ep-only", action="store_true", help="only the expert-parallel table")
    parser.add_argument("--ep-layers", type=int, default=4, help="blocks of the expert-parallel table's MoE")
    parser.add_argument("--ep-d-model", type=int, default=128, help="model width of the expert-parallel table")
    parser.add_argument("--ep-experts", type=int, default=8, help="experts per block in the expert-parallel table")
    parser.add_argument("--ep-rounds", type=int, default=2,
                        help="runs of each side of the expert-parallel table, alternating (ep1, ep2, ep2 zero1, ...)")
    args = parser.parse_args()
    args.rss = args.bubble = args.split = args.moe = False
    if args.ep_only:
        print_table(ep_title(args), ep_rows(args))
        return
    if args.split_only:
        print_table(split_title(args), split_rows(args))
        return
    if args.memory_only:
        print_table(MEMORY_TITLE, memory_rows(args))
        return
    if args.rss_only:
        print_table("peak RSS per rank, GPT-2 small (124 M parameters), 2 gloo ranks (baseline: dp2, tp1)",
                    rss_rows(args))
        return
    known = layouts_of(args.world)
    names = list(known) if args.layouts is None else args.layouts.split(",")
    unknown = [n for n in names if n not in known]
    if unknown:
        parser.error(f"unknown layout(s) {', '.join(unknown)}; choose from {', '.join(known)}")
    if not args.bubble_only:
        print_table(f"tp x pp x dp on {args.world} gloo ranks (baseline: dp{args.world})",
                    main_rows(args, [known["dp"], *(known[n] for n in names)]))
    pipelined = [known[n] for n in names if known[n][2] > 1]
    if (args.with_bubble or args.bubble_only) and pipelined:
        print_table(f"pipeline bubble on {args.world} gloo ranks, GPT {args.bubble_layers} layers x "
                    f"{args.bubble_d_model} wide, seq {args.seq_len}, micro-batch 2, median of "
                    f"{args.bubble_steps} steps (baseline: (p-1)/(vM+p-1), lower is better)",
                    [row for m in args.bubble_micro_batches for row in bubble_rows(args, pipelined, m)])
    if args.with_split and not args.bubble_only:
        print_table(split_title(args), split_rows(args))
    if args.with_rss and not args.bubble_only:
        print_table("peak RSS per rank, GPT-2 small (124 M parameters), 2 gloo ranks (baseline: dp2, tp1)",
                    rss_rows(args))
    if args.with_memory and not args.bubble_only:
        print_table(MEMORY_TITLE, memory_rows(args))
    if args.with_ep and not args.bubble_only:
        print_table(ep_title(args), ep_rows(args))


def main_rows(args, layouts: list[tuple]) -> list[tuple[str, str, str, str]]:
    """Step time, communication bytes, optimizer state and exposed communication per layout,
    against the first layout (dp = world)."""
    results = {lay: measure(args, lay) for lay in dict.fromkeys(layouts)}
    base = results[layouts[0]]
    rows = []
    for lay, r in results.items():
        name = layout_name(*lay)
        rows.append((f"step s ({name})", f"{r['step_s']:.3f}", f"{base['step_s']:.3f}",
                     f"{r['step_s'] / base['step_s']:.2f}x"))
        rows.append((f"comm MB/rank/step ({name})", f"{r['comm_bytes'] / 1e6:.2f}",
                     f"{base['comm_bytes'] / 1e6:.2f}", f"{r['comm_bytes'] / max(base['comm_bytes'], 1):.2f}x"))
        rows.append((f"optimizer state bytes/rank ({name})", f"{r['state_bytes']:.0f}", f"{base['state_bytes']:.0f}",
                     f"{r['state_bytes'] / base['state_bytes']:.3f}x"))
        exposed = 1 - r["silent_step_s"] / r["step_s"]
        rows.append((f"exposed communication: step s vs without it ({name})",
                     f"{r['step_s']:.3f} ({exposed:.0%} exposed)", f"{r['silent_step_s']:.3f}",
                     f"{r['step_s'] / r['silent_step_s']:.2f}x"))
    return rows


def bubble_rows(args, layouts: list[tuple], micro_batches: int) -> list[tuple[str, str, str, str]]:
    """Per pipelined layout, at ``micro_batches`` per pipeline: the median step's bubble against
    theory, pipeline-wide and the busiest rank's, and every step's pipeline-wide bubble.

    The median, not the best step: on a shared box time taken from a rank during its compute
    counts as compute, so it can lower a step's bubble as well as raise it (steps read 0.084
    against a theory of 0.111), and the lowest of several steps reads below what the schedule
    gives."""
    args = argparse.Namespace(**{**vars(args), "bubble": True, "steps": args.bubble_steps,
                                 "bubble_micro_batches": micro_batches})
    rows = []
    for lay in layouts:
        r = measure(args, lay)
        name, bubbles = f"{layout_name(*lay)}, M {r['num_micro']}", sorted(r["bubbles"])
        median, busiest = statistics.median(bubbles), statistics.median(r["busiest"])
        rows.append((f"bubble, median step, vs (p-1)/(vM+p-1) ({name})", f"{median:.3f}",
                     f"{r['theory']:.3f}", f"{median / r['theory']:.2f}x"))
        rows.append((f"busiest rank's idle share, median step, vs (p-1)/(vM+p-1) ({name})", f"{busiest:.3f}",
                     f"{r['theory']:.3f}", f"{busiest / r['theory']:.2f}x"))
        rows.append((f"for information: busiest rank's compute over the lightest's, median step ({name})",
                     f"+{statistics.median(r['imbalance']):.1%}", "", ""))
        rows.append((f"for information: bubble of each step, lowest to highest ({name})",
                     " ".join(f"{b:.3f}" for b in bubbles), "", ""))
    return rows


def split_title(args) -> str:
    return (f"uneven pipeline split, pp 2 (1F1B) on 2 gloo ranks, GPT {args.split_layers} layers x "
            f"{args.split_d_model} wide, vocab 50257, seq {args.seq_len}, micro-batch 1, M {args.split_micro_batches}: "
            f"{args.split_layers - args.split_last} + {args.split_last} layers against the even split, median step "
            f"of {args.split_rounds} alternating runs of {args.split_steps} steps each (lower is better)")


def split_rows(args) -> list[tuple[str, str, str, str]]:
    """Step time and the stages' compute spread with ``--split-last`` layers on the last rank
    (``num_layers_in_last_pipeline_stage``) against the even split, same model and batch.

    The last stage also runs the LM head and the loss over GPT-2's 50257-token vocabulary
    (``d x V`` multiply-adds per token, about five 768-wide blocks' worth), so with equal
    blocks the first rank idles by that much on every micro-batch. Runs alternate sides
    (the box's load drifts over minutes); each side's step times are pooled, median taken."""
    steps: dict[bool, list[float]] = {False: [], True: []}
    spread: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(args.split_rounds):
        for uneven in (False, True):
            run_args = argparse.Namespace(**{**vars(args), "split": True, "steps": args.split_steps,
                                             "split_last": args.split_last if uneven else None})
            r = measure(run_args, (1, 1, 2, None, None))
            steps[uneven] += r["steps_s"]
            spread[uneven] += r["imbalance"]
    even, uneven = statistics.median(steps[False]), statistics.median(steps[True])
    last = args.split_last
    first = args.split_layers - last
    half = args.split_layers // 2
    return [(f"step s ({first} + {last} layers vs {half} + {half})", f"{uneven:.3f}", f"{even:.3f}",
             f"{uneven / even:.2f}x"),
            ("busiest rank's compute over the lightest's, median step", f"+{statistics.median(spread[True]):.0%}",
             f"+{statistics.median(spread[False]):.0%}", "")]


def rss_rows(args) -> list[tuple[str, str, str, str]]:
    """Peak RSS of the largest rank after a warmup and one step, per 2-rank layout, vs dp2."""
    args = argparse.Namespace(**{**vars(args), "rss": True, "steps": 1})
    layouts = [(2, 1, 1, None, None), (1, 2, 1, None, None), (1, 1, 2, None, None)]
    results = {lay: measure(args, lay) for lay in layouts}
    base = results[layouts[0]]["peak_rss"]
    return [(f"peak RSS MB (dp{dp} tp{tp} pp{pp})", f"{r['peak_rss'] / 1e6:.0f}", f"{base / 1e6:.0f}",
             f"{r['peak_rss'] / base:.2f}x") for (dp, tp, pp, _, _), r in results.items()]


MEMORY_TITLE = ("memory per rank, GPT-2 small (124 M parameters), 4 gloo ranks, after a warmup and one step "
                "(baseline: dp4 DDP)")


def memory_rows(args) -> list[tuple[str, str, str, str]]:
    """Parameters + gradients + optimizer state (:func:`model_state_bytes`) and peak RSS of the
    largest rank at dp 4, DDP against ZeRO-1 and fsdp. FSDP's peak includes the full model each
    rank builds before sharding it, and the embedding and head (the chunk's own parameters),
    which stay gathered from the forward until the backward is back through the final norm."""
    args = argparse.Namespace(**{**vars(args), "rss": True, "steps": 1})
    layouts = [(4, 1, 1, None, None), (4, 1, 1, None, "zero1"), (4, 1, 1, None, "fsdp")]
    results = {lay: measure(args, lay) for lay in layouts}
    base = results[layouts[0]]
    rows = []
    for lay, r in results.items():
        name = layout_name(*lay)
        rows.append((f"params + grads + optimizer state MB ({name})", f"{r['model_state_bytes'] / 1e6:.0f}",
                     f"{base['model_state_bytes'] / 1e6:.0f}", f"{r['model_state_bytes'] / base['model_state_bytes']:.2f}x"))
        rows.append((f"peak RSS MB ({name})", f"{r['peak_rss'] / 1e6:.0f}", f"{base['peak_rss'] / 1e6:.0f}",
                     f"{r['peak_rss'] / base['peak_rss']:.2f}x"))
        rows.append((f"resident MB after the step, freed heap trimmed ({name})", f"{r['resident_bytes'] / 1e6:.0f}",
                     f"{base['resident_bytes'] / 1e6:.0f}", f"{r['resident_bytes'] / base['resident_bytes']:.2f}x"))
    return rows


def ep_title(args) -> str:
    return (f"expert parallelism on 2 gloo ranks (dp 2), MoE GPT {args.ep_layers} layers x {args.ep_d_model} wide, "
            f"{args.ep_experts} experts of {2 * args.ep_d_model} per block, top-2, seq {args.seq_len}, global batch "
            f"{4 * args.micro_batches}, median step of {args.ep_rounds} alternating runs of {args.steps} steps "
            "(baseline: ep 1; tokens/s higher is better)")


def ep_rows(args) -> list[tuple[str, str, str, str]]:
    """ep 2 and ep 2 with ZeRO-1 against ep 1 at dp 2, the same MoE model and batches: tokens/s of
    the median step (each side's steps pooled over ``--ep-rounds`` alternating runs: the box's
    load drifts over minutes), collective payload per rank and step, optimizer state of the
    largest rank.

    At ep 1 each rank runs every expert on its own tokens and all-reduces every expert's grads;
    at ep 2 each rank runs half the experts on both ranks' tokens routed to them (the same
    FLOPs), exchanging the routed rows by all-to-all (forward and backward, plus a host sync on
    the split sizes per MoE layer and pass), and its experts' grads need no reduction (one rank
    per expert-data-parallel group). ``ep2 allgather``: Megatron's allgather dispatcher instead of
    the all-to-all (every token's hidden state and routing gathered, the outputs reduce-scattered:
    fixed-size collectives, no host sync on the grouped GEMM)."""
    sides = {"ep1": (2, 1, 1, None, None, 1, 1), "ep2": (2, 1, 1, None, None, 1, 2),
             "ep2 zero1": (2, 1, 1, None, "zero1", 1, 2), "ep2 allgather": (2, 1, 1, None, None, 1, 2)}
    moe_args = argparse.Namespace(**{**vars(args), "world": 2, "moe": True})
    gather_args = argparse.Namespace(**{**vars(moe_args), "ep_dispatcher": "allgather"})
    steps: dict[str, list[float]] = {k: [] for k in sides}
    last: dict[str, dict] = {}
    for _ in range(args.ep_rounds):
        for name, lay in sides.items():
            last[name] = r = measure(gather_args if name.endswith("allgather") else moe_args, lay)
            steps[name] += r["steps_s"]
    tokens = 4 * args.micro_batches * args.seq_len  # global batch x sequence
    per_s = {k: tokens / statistics.median(v) for k, v in steps.items()}
    base = per_s["ep1"]
    rows = []
    for name in sides:
        rows.append((f"tokens/s ({name} vs ep1)", f"{per_s[name]:,.0f}", f"{base:,.0f}", f"{per_s[name] / base:.2f}x"))
        rows.append((f"comm MB/rank/step ({name} vs ep1)", f"{last[name]['comm_bytes'] / 1e6:.2f}",
                     f"{last['ep1']['comm_bytes'] / 1e6:.2f}",
                     f"{last[name]['comm_bytes'] / last['ep1']['comm_bytes']:.2f}x"))
        rows.append((f"optimizer state bytes/rank ({name} vs ep1)", f"{last[name]['state_bytes']:.0f}",
                     f"{last['ep1']['state_bytes']:.0f}",
                     f"{last[name]['state_bytes'] / last['ep1']['state_bytes']:.3f}x"))
    return rows


if __name__ == "__main__":
    main()
