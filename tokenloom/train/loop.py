"""The training loop, one for every layout: ``run(TrainConfig)``, also runnable as
``python -m tokenloom.train.loop --config F`` (what torchrun and srun start).

One iteration::

    lr = lr_at(it)                          pure function of the iteration (optim/schedule.py)
    strategy.train_step(micro-batches)      the layout's schedule, gradients finalised, clip, step
    every log_interval: loss reduced to every rank, a metrics record on rank 0
    by eval/save/exit interval (``due``): evaluation, checkpoint, stop

What differs per layout lives in :class:`~tokenloom.train.strategy.Strategy`; the config in
:mod:`.config`; the process setup (world, seeds, autocast, GC, host memory) in :mod:`.runtime`.

Choices and their costs:

* **Exact resume**: everything that decides the next step is in the checkpoint or a pure function
  of it: parameters, AdamW state, the iteration, the consumed samples and blend history (checked by
  :class:`~tokenloom.train.data.TrainData`), each rank's RNG states. On CPU in fp32 a resumed run
  reproduces the losses and parameters of an uninterrupted one bit for bit (tested); GPU runs only
  as far as their kernels are deterministic.
* **Host syncs**: losses are summed on the device and read every ``log_interval`` steps, so the
  logged ``train_loss`` is the interval's mean; the grad norm is the last step's.
* **Evaluation** runs without gradients on the same first ``eval_iters`` validation batches,
  before the first step, every ``eval_interval`` steps and at the end; a blend of two or more
  sources also gets each source's loss (:mod:`.source_loss`: per-token losses, one more reduction).
* **Data wait**: the host time spent taking batches is summed per interval (``data_wait_s``,
  ``data_wait_share``; no device sync), with a warning at the end above
  :data:`~tokenloom.train.summary.DATA_WAIT_WARN` of the training time.
* **What a person sees** on rank 0's stderr: a progress bar, a line per validation loss and per
  completed save; ``metrics.jsonl`` holds the same and more (:mod:`.metrics`).
* **Checkpoints** are written in the background (``async_save``, :mod:`.async_save`): each step
  boundary takes a finished write (its metrics record, or its failure as the run's error); the
  next save, :meth:`Trainer.finish` and a save-and-exit wait for it. A run that fails otherwise
  completes the write in flight when alone, abandons it with peers (never published partial).
* **Signals** (``save_on_signal``, :mod:`.stop`): SIGTERM or SIGINT to any rank ends the run on
  every rank after the same step, with a checkpoint and a line naming the resume command.
* **Failures**: a dead or stalled rank surfaces as a :class:`TokenloomError` from the next
  collective (within ``dist_timeout_s``); ``main`` prints it as one line and exits non-zero
  without tearing down the process group (which could block).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import sys
import time
import typing
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm import tqdm

from tokenloom.errors import TokenloomError
from tokenloom.fsio import atomic_writer, os_error_message
from tokenloom.train import faults
from tokenloom.train.checkpoint import commit as checkpoint
from tokenloom.train.checkpoint import hf
from tokenloom.train.config import (
    TrainConfig,
    check_resumable_model,
    check_resumable_schedule,
    config_to_dict,
    load_config,
)
from tokenloom.train.data import TrainData, open_tokenizer
from tokenloom.train.metrics import MetricsLogger, StepTimer, memory_fields, mfu, peak_flops, plot_loss
from tokenloom.train.optim.schedule import lr_at, set_lr
from tokenloom.train.runtime import (
    ManualGC,
    World,
    compute_dtype,
    join_world,
    seed_everything,
    tune_host_memory,
)
from tokenloom.train.source_loss import SourceLosses, losses_by_name
from tokenloom.train.stop import StopOnSignal, resume_command
from tokenloom.train.strategy import Strategy
from tokenloom.train.summary import RunFacts, data_wait_warning, startup_summary


def due(cfg: TrainConfig, iteration: int, done: bool, has_valid: bool) -> tuple[bool, bool, bool]:
    """(evaluate, exit, save) after ``iteration`` steps, by ``cfg``'s intervals (``done``: the
    last step)."""
    evaluating = bool(cfg.eval_interval) and has_valid and (iteration % cfg.eval_interval == 0 or done)
    exiting = bool(cfg.exit_interval and iteration % cfg.exit_interval == 0 and not done)
    saving = done or exiting or bool(cfg.save_interval and iteration % cfg.save_interval == 0)
    return evaluating, exiting, saving


def run(cfg: TrainConfig) -> dict:
    """Train as configured; returns ``{"iteration", "train_loss", "val_loss", "checkpoint", "exited",
    "tokens_per_s", "first_step_s", "saves"}`` (``saves``: per checkpoint written, its ``iter``,
    ``save_stall_s`` and ``save_write_s``, :class:`~tokenloom.train.checkpoint.async_save.SaveReport`)."""
    r = start_run(cfg)
    summary = r.train()
    if r.world.owns_group:
        dist.destroy_process_group()
    return summary


def start_run(cfg: TrainConfig, world: World | None = None) -> Trainer:
    """A run set up in this process (joining the launch's world), not yet stepped:
    ``for it in r.steps(): ...`` then ``r.finish()``; :func:`run` does ``start_run(cfg).train()``
    (``bench/train_bench.py`` steps it in turn with a baseline loop)."""
    return Trainer(cfg, world or join_world(cfg.dist_timeout_s, cfg.distributed_backend))


class Trainer:
    """State of one run; :meth:`train` is the loop."""

    def __init__(self, cfg: TrainConfig, world: World) -> None:
        cfg = hf.resolve_config(cfg)  # init_from_hf: the folder's model shape and tokenizer
        self.cfg, self.world = cfg, world
        tune_host_memory(cfg.keep_freed_memory, world.device, fully_sharded=cfg.fsdp)
        seed_everything(cfg.seed)
        tok_eod = self._check_tokenizer()
        gbs, evals = cfg.global_batch_size, cfg.eval_iters
        # Megatron also sizes a test split; training never reads it, so none is asked for here (a
        # split string that leaves a small source no test documents must not fail the run).
        sizes = (cfg.train_iters * gbs, evals * gbs if cfg.eval_interval else 0, 0)
        self.strategy = Strategy(cfg, world)
        self.data = TrainData(cfg.data, seq_len=cfg.model.seq_len, vocab_size=cfg.model.vocab_size, sizes=sizes,
                              tokenizer_eod=tok_eod, global_batch_size=gbs)
        self.iteration = 0
        self.saved_world_size: int | None = None  # the resumed checkpoint's
        self.resumed_from = self._resume()
        if cfg.init_from_hf is not None:
            self._init_from_hf(cfg.init_from_hf)
        peak = cfg.peak_flops or peak_flops(world.device)
        self.peak_total = peak * world.size if peak else None
        parameters, self.flops_per_token = self.strategy.model_size()
        self.metrics = None
        if world.rank == 0:
            config_json = Path(cfg.output_dir) / "config.json"
            with self._writing(config_json):
                config_json.parent.mkdir(parents=True, exist_ok=True)
                with atomic_writer(config_json, "w") as f:
                    f.write(json.dumps(config_to_dict(cfg), indent=2))
            with self._writing(self.metrics_path):
                self.metrics = MetricsLogger(self.metrics_path, tensorboard_dir=cfg.tensorboard_dir,
                                             resume_iteration=self.iteration if self.resumed_from else None,
                                             wandb_project=cfg.wandb_project, wandb_exp_name=cfg.wandb_exp_name,
                                             run_config=config_to_dict(cfg), wandb_dir=cfg.output_dir)
            s = self.strategy
            facts = RunFacts(world_size=world.size, dp=s.dp_size, accumulation=s.num_micro, device=world.device.type,
                             precision=str(compute_dtype(cfg.precision, world.device)).removeprefix("torch."),
                             parameters=parameters, train_samples=len(self.data.train), data_plan=self.data.plan,
                             resumed_at=self.iteration)
            print(startup_summary(cfg, facts), flush=True)
        if self.resumed_from is not None:  # a mark in loss.png; the layout it goes on with
            s = self.strategy
            self._record({"iter": self.iteration, "resumed_from": str(self.resumed_from),
                          "blend_changed": self.data.blend_changed, "world_size": world.size,
                          "saved_world_size": self.saved_world_size, "dp": s.dp_size, "micro_batches": s.num_micro})
            if self.saved_world_size not in (None, world.size):
                self._say(f"world size {self.saved_world_size} -> {world.size} since {self.resumed_from}: dp "
                          f"{s.dp_size} x {s.num_micro} micro-batch(es) of {cfg.micro_batch_size} keep the global "
                          f"batch {gbs} (tp {cfg.tp}, pp {cfg.pp}, cp {cfg.cp}, ep {cfg.ep} kept)")
        self._restarts: list[dict] = []  # this restart's records, logged after its first step (restart_s)
        if world.rank == 0 and (restart := faults.restart_count()) > 0:
            # not again after an elastic membership change (same restart count, resumed past the failure)
            self._restarts = [r for r in faults.wait_for_records(faults.log_dir(), restart)
                              if r.get("restart") == restart and self.iteration <= r.get("failed_iteration", 0)]

    @property
    def metrics_path(self) -> Path:
        return Path(self.cfg.metrics_path or Path(self.cfg.output_dir) / "metrics.jsonl")

    @contextlib.contextmanager
    def _writing(self, path: Path) -> Iterator[None]:
        """A full disk, too many open files, an I/O or permission error writing one of the run's
        own files (config, metrics) stops the run with one line naming the file and what to do:
        the checkpoints decide where a rerun continues, and metrics records after the checkpoint
        it resumes from are dropped then. The checkpoint write in flight settles first
        (:meth:`_drop_save`), so the line names the newest complete checkpoint."""
        try:
            yield
        except OSError as exc:
            self._drop_save()
            raise TokenloomError(f"{os_error_message(OSError(exc.errno, exc.strerror), path)}; "
                                 f"{checkpoint.resume_advice(self.cfg.ckpt_dir)}") from None

    def _record(self, record: dict) -> None:
        """One metrics record (rank 0; a no-op elsewhere)."""
        if self.metrics:
            with self._writing(self.metrics_path):
                self.metrics.log(record)

    def _say(self, line: str) -> None:
        """One line on rank 0's stderr, above the progress bar (which is redrawn below it)."""
        if self.world.rank == 0:
            tqdm.write(line, file=sys.stderr)
            sys.stderr.flush()

    def _check_tokenizer(self) -> int | None:
        if not self.cfg.tokenizer:
            return None
        tok = open_tokenizer(self.cfg.tokenizer)
        if tok.vocab_size > self.cfg.model.vocab_size:
            raise TokenloomError(f"the tokenizer has {tok.vocab_size} ids but model.vocab_size is "
                                 f"{self.cfg.model.vocab_size}; set model.vocab_size >= {tok.vocab_size}")
        return tok.eod

    def _resume(self) -> Path | None:
        if self.cfg.resume is None:
            return None
        path = checkpoint.resolve(self.cfg.resume, self.cfg.ckpt_dir)
        if self.cfg.resume == "auto" and self.cfg.local_save_dir is not None:
            path = self._newest_held(path)
        if path is None:
            return None
        saved = checkpoint.read_state(path)
        self.saved_world_size = saved.get("world_size")
        check_resumable_model(path, self.cfg, saved["config"]["model"])
        check_resumable_schedule(path, self.cfg, saved["config"])
        notes = self.data.load_state_dict(saved, force=self.cfg.force_data, where=str(path))
        self.strategy.load(path, saved)
        self.iteration = int(saved["iteration"])
        if self.world.rank == 0:
            for note in notes:
                print(note, file=sys.stderr)
            print(f"resumed from {path} at iteration {self.iteration} ({self.data.consumed} samples consumed)",
                  file=sys.stderr)
        return path

    def _newest_held(self, durable: Path | None) -> Path | None:
        """The newest checkpoint every rank holds complete: the local tier's newest that all ranks
        hold (:func:`~tokenloom.train.checkpoint.commit.holds`, agreed over the world) when it is
        newer than the durable ``durable``, else ``durable``. Collective."""
        local = Path(typing.cast(str, self.cfg.local_save_dir))
        mine = [it for it, p in checkpoint.complete_checkpoints(local) if checkpoint.holds(p, self.world.rank)]
        every: list[typing.Any] = [mine]
        if self.world.size > 1:
            every = [None] * self.world.size
            dist.all_gather_object(every, mine)  # in memory: nothing is unpickled from disk
        best = checkpoint.newest_held(int(durable.name.removeprefix("iter_")) if durable is not None else None, every)
        return local / checkpoint.checkpoint_name(best) if best is not None else durable

    def _init_from_hf(self, folder: str) -> None:
        """Start from the ``init_from_hf`` folder's weights, unless a checkpoint was resumed (it wins)."""
        if self.resumed_from is None:
            hf.init_from_hf(self.strategy, folder)
        if self.world.rank == 0:
            what = f"not loaded: resumed from {self.resumed_from}" if self.resumed_from else "loaded"
            print(f"init_from_hf {folder}: {what}", file=sys.stderr)

    def _save(self, local: bool = False) -> Path:
        """A durable checkpoint, or (``local``) one of the local tier."""
        state = {**self.data.state_dict(), "world_size": self.world.size, "config": config_to_dict(self.cfg)}
        path = self.strategy.save(self.iteration, state, Path(str(self.cfg.local_save_dir)) if local else None)
        self._saves_done()
        return path

    def _saves_done(self, wait: bool = False) -> None:
        """Take the finished checkpoint writes (``wait``: wait for the one in flight): a metrics
        record and a summary entry per save; a failed background write raises its error here."""
        saver = self.strategy.saver
        if wait:
            saver.wait()
        else:
            saver.poll()
        for report in saver.take_reports():
            record = report.record()
            self._save_reports.append({k: v for k, v in record.items() if k != "checkpoint"})
            self._record(record)
            self._say(f"iteration {record['iter']}: saved checkpoint {record['checkpoint']} (the loop waited "
                      f"{record['save_stall_s']:.2f} s, writing took {record['save_write_s']:.2f} s)")

    def _drop_save(self) -> None:
        """The run is failing: a single process still completes the write in flight (no peer
        can stall it; its own failure is left to the error already raised); with peers, which
        may be gone, it is abandoned (never published unless it completes)."""
        saver = self.strategy.saver
        if self.world.size == 1:
            with contextlib.suppress(Exception):
                saver.wait()
        else:
            saver.abandon()

    def evaluate(self) -> tuple[float, dict[str, float | None] | None]:
        """Mean validation loss over the first ``eval_iters`` global batches, on every rank, and
        for a blend of two or more sources each one's loss over its samples among them
        (:mod:`.source_loss`; None otherwise)."""
        cfg, s, names = self.cfg, self.strategy, self.data.source_names
        batches = s.global_batches(self.data.valid, eod=self.data.eod, consumed=0,
                                   total=cfg.eval_iters * cfg.global_batch_size, sources=names is not None)
        per_source = SourceLosses(len(names), self.world.device) if names is not None else None
        total = torch.zeros((), device=self.world.device)
        try:
            for _ in range(cfg.eval_iters):
                total += s.eval_loss_sum(next(batches), per_source)
        except StopIteration:
            raise TokenloomError(f"the validation split has fewer than {cfg.eval_iters} x {cfg.global_batch_size} "
                                 "samples; set eval_interval=0, lower eval_iters or give it more data") from None
        loss = s.loss_for_log(total / (cfg.eval_iters * s.num_micro), "validation loss reduction")
        if per_source is None or names is None:
            return loss, None
        return loss, losses_by_name(names, s.sums_for_log(per_source.take(), "validation loss reduction"))

    def _validate(self) -> None:
        """:meth:`evaluate` at this iteration, with its metrics record and progress line."""
        loss, per_source = self.evaluate()
        self._last["val_loss"] = loss
        record: dict = {"iter": self.iteration, "val_loss": loss}
        if per_source is not None:
            record["val_loss_per_source"] = self._last["val_loss_per_source"] = per_source
        self._record(record)
        self._say(f"iteration {self.iteration}: validation loss {loss:.4f}{_by_source(per_source)}")

    def train(self) -> dict:
        """The whole loop: :meth:`steps` to the end, then :meth:`finish`."""
        for _ in self.steps():
            pass
        return self.finish()

    def steps(self) -> Iterator[int]:
        """The loop, one optimizer step at a time: yields the iteration number after each step
        (with its logging, evaluation and checkpoint). ``train`` drains it; a benchmark can
        interleave it step by step with a baseline. Call :meth:`finish` afterwards."""
        try:
            with ManualGC(self.cfg.gc_interval) as self._gc, self._stop_on_signal() as self._stop:
                yield from self._loop()
        except GeneratorExit:
            raise
        except BaseException:
            self._drop_save()
            raise
        finally:
            if (progress := getattr(self, "_progress", None)) is not None:
                progress.close()  # the watchdog watches the steps only

    @contextlib.contextmanager
    def _stop_on_signal(self) -> Iterator[StopOnSignal | None]:
        stop = StopOnSignal(self.world.size) if self.cfg.save_on_signal else None
        failed = True
        try:
            yield stop
            failed = False
        finally:
            if stop is not None:
                stop.close(failed)

    def _loop(self) -> Iterator[int]:
        cfg, world, s = self.cfg, self.world, self.strategy
        self._bar = bar = tqdm(total=cfg.train_iters, initial=self.iteration,
                               disable=world.rank != 0 or not cfg.progress, dynamic_ncols=True, unit="it")
        loss_sum, since = torch.zeros((), device=world.device), 0
        names = self.data.source_names
        self._train_per_source = None
        if cfg.log_loss_per_source and names is not None:
            self._train_per_source = SourceLosses(len(names), world.device)
        self._timer = timer = StepTimer(cfg.global_batch_size * cfg.model.seq_len, world.device)
        self._last: dict = {"train_loss": None, "val_loss": None}
        self._exited = False
        self._save_reports: list[dict] = []
        last = self._last
        has_valid = self.data.valid is not None
        batches: Iterator[list] = iter(())
        if self.iteration < cfg.train_iters:
            batches = s.global_batches(self.data.train, eod=self.data.eod, consumed=self.data.consumed,
                                       total=cfg.train_iters * cfg.global_batch_size, workers=cfg.data.num_workers,
                                       sources=self._train_per_source is not None)
        if self.iteration == 0 and cfg.eval_interval and has_valid:
            # The starting point of the validation curve (eval mode: no RNG is consumed).
            self._validate()
        timer.start()
        self._progress = faults.Progress(world.rank, self.iteration, cfg.hang_timeout_s,
                                         enabled=faults.log_dir() is not None or cfg.hang_timeout_s is not None)
        while self.iteration < cfg.train_iters:
            if self.data.consumed in self.data.switches:  # a mark in loss.png where a schedule phase begins
                self._record({"iter": self.iteration, "schedule_phase": self.data.switches[self.data.consumed]})
            lr = lr_at(self.iteration, cfg.optim, cfg.train_iters)
            set_lr(s.optimizer, lr)
            fetch = time.perf_counter()
            batch = next(batches)
            waited = time.perf_counter() - fetch
            loss, norm = s.train_step(batch, self._train_per_source)
            self.iteration += 1
            self.data.consumed += cfg.global_batch_size
            loss_sum += loss
            since += 1
            timer.step(waited)
            bar.update(1)
            self._saves_done()  # a step boundary: a finished background write is reported (or its error raised)
            done = self.iteration == cfg.train_iters
            if self.iteration % cfg.log_interval == 0 or done:
                last["train_loss"] = self._log_train(loss_sum / since, norm, lr, bar)
                loss_sum.zero_()
                since = 0
            self._gc.step(self.iteration)
            evaluating, self._exited, saving = due(cfg, self.iteration, done, has_valid)
            local = bool(cfg.local_save_interval) and self.iteration % (cfg.local_save_interval or 1) == 0
            if self._stop is not None and not done and (signum := self._stop.agreed()):
                self._exited = saving = True
                last["stopped_by"] = signal.Signals(signum).name
            if evaluating or saving or local:
                with timer.paused():
                    if evaluating:
                        self._validate()
                    if local and not saving:  # the durable save, when due, is the newer of the two
                        self._save(local=True)
                    if saving:
                        last["checkpoint"] = str(self._save())
                        if self._exited:  # the checkpoint named below must be complete
                            self._saves_done(wait=True)
            if "stopped_by" in last and world.rank == 0:
                print(f"stopped by {last['stopped_by']} after iteration {self.iteration}: checkpoint "
                      f"{last['checkpoint']}; resume with: "
                      f"{resume_command(str(Path(cfg.output_dir) / 'config.json'), world.size)}",
                      file=sys.stderr, flush=True)
            self._progress.step(self.iteration)
            for record in self._restarts:  # the first step after a restart: how long the restart took
                self._record({"iter": record["resumes_from"], **record,
                              "restart_s": round(time.time() - record["failed_at"], 3)})
            self._restarts = []
            yield self.iteration
            if self._exited:
                break

    def finish(self) -> dict:
        """Close the progress bar and metrics, draw the loss plot; the run's summary."""
        cfg, last = self.cfg, self._last
        self._saves_done(wait=True)  # the last checkpoint is complete (or its failure raised) from here on
        self.strategy.finish_param_sync()  # the model holds the last step's parameters from here on
        self._bar.close()
        if "checkpoint" not in last and self.resumed_from is not None:
            last["checkpoint"] = str(self.resumed_from)  # resumed a finished run: nothing new to save
        warning = data_wait_warning(self._timer.data_wait_share, cfg.data.num_workers)
        if warning:
            self._say(f"warning: {warning}")
        if self.metrics:
            with self._writing(self.metrics_path):
                self.metrics.close()
            if cfg.plot and not self._exited:
                png = Path(cfg.output_dir) / "loss.png"
                try:  # the run is complete and saved: a missing picture is worth a warning, not a failure
                    plot_loss(self.metrics_path, png)
                except OSError as exc:
                    print(f"warning: no loss plot: {os_error_message(OSError(exc.errno, exc.strerror), png)}",
                          file=sys.stderr, flush=True)
        restarts = faults.read_records(faults.log_dir()) if faults.restart_count() > 0 else []
        return {"iteration": self.iteration, "exited": self._exited, **last, **self._timer.summary(),
                "saves": self._save_reports, "restarts": restarts}

    def _log_train(self, mean_loss: torch.Tensor, norm: torch.Tensor, lr: float, bar) -> float:
        loss = self.strategy.loss_for_log(mean_loss, "loss reduction")
        if not math.isfinite(loss):
            raise TokenloomError(f"training loss is {loss} at iteration {self.iteration}; lower optim.lr or "
                                 "check the data")
        timing = self._timer.interval()
        bubble = self.strategy.bubble_for_log()
        experts = self.strategy.moe_for_log()
        memory = memory_fields(self.world.device)
        per_source = {}
        if self._train_per_source is not None and self.data.source_names is not None:
            sums = self.strategy.sums_for_log(self._train_per_source.take(), "loss reduction")
            per_source = {"train_loss_per_source": losses_by_name(self.data.source_names, sums)}
        self._record({"iter": self.iteration, "train_loss": loss, **per_source, "lr": lr, "grad_norm": float(norm),
                      **timing, "consumed_samples": self.data.consumed,
                      "mfu": mfu(self.flops_per_token, timing["tokens_per_s"], self.peak_total), **memory,
                      **({} if bubble is None else {"pipeline_bubble": bubble}), **experts})
        device_mem = memory["device_mem_peak_gib"]
        bar.set_postfix(loss=f"{loss:.4f}", lr=f"{lr:.2e}", tok_s=f"{timing['tokens_per_s']:,.0f}",
                        **({} if device_mem is None else {"dev_mem": f"{device_mem:.2f}G"}),
                        rss=f"{memory['host_rss_gib']:.2f}G")
        return loss


def _by_source(losses: dict[str, float | None] | None) -> str:
    """`` (web 3.2100, code 2.9800)`` for a progress line; "-" for a source without tokens."""
    if not losses:
        return ""
    return " (" + ", ".join(f"{n} {'-' if v is None else f'{v:.4f}'}" for n, v in losses.items()) + ")"


# --------------------------------------------------------------------------- entry point


def main(argv: typing.Sequence[str] | None = None) -> int:
    """``python -m tokenloom.train.loop --config FILE [--set key=value ...]`` (what torchrun starts)."""
    parser = argparse.ArgumentParser(prog="python -m tokenloom.train.loop", description=__doc__.splitlines()[0])
    parser.add_argument("--config", help="train config file (.json, .yaml, .yml)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config value, e.g. --set optim.lr=3e-4 (repeatable)")
    args = parser.parse_args(argv)
    try:
        summary = run(load_config(args.config, args.overrides))
    except TokenloomError as e:
        prefix = f"rank {dist.get_rank()}: " if dist.is_initialized() else ""
        message = str(e) if str(e).startswith("rank ") else prefix + str(e)
        print(f"error: {' '.join(message.split())}", file=sys.stderr, flush=True)
        if dist.is_initialized():
            sys.stdout.flush()
            os._exit(e.exit_code)  # a dead peer can make process-group teardown block
        return e.exit_code
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
