"""Training metrics: a JSONL file (the record of truth), optional TensorBoard and W&B, a loss-curve PNG, MFU.

Each line of ``metrics.jsonl`` is a JSON object with ``iter`` (completed steps) and ``time``
(unix seconds). Train records: ``train_loss``, ``lr``, ``grad_norm``, ``tokens_per_s``,
``step_time_s``, ``consumed_samples``, ``mfu`` (null when the peak is unknown), ``data_wait_s``,
``data_wait_share``, :func:`memory_fields`, ``first_step_s`` in the first step's interval, and
``train_loss_per_source`` with ``log_loss_per_source``. Evaluation records: ``val_loss`` and, for
a blend of two or more sources, ``val_loss_per_source``. A resume writes ``resumed_from`` and
``blend_changed``, a data schedule ``schedule_phase`` where each phase begins. A checkpoint record
(``checkpoint``, ``save_stall_s``, ``save_write_s``) is appended once its write completed, so it
may follow later train records and a killed run may lack the last one. On resume the file is cut
back to the checkpoint's iteration, so a resumed run's curve reads as an uninterrupted one's.

MFU is against the device's dense bf16 peak (:data:`PEAK_BF16_FLOPS`) times the device count,
fp32 runs too (nanoGPT's and Megatron's convention); CPUs have none unless ``peak_flops`` is given.
"""

from __future__ import annotations

import json
import math
import os
import resource
import sys
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from tokenloom.fsio import atomic_writer, naming

PEAK_BF16_FLOPS: list[tuple[str, float]] = [
    ("H200", 989e12),
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H100", 989e12),  # SXM
    ("A100", 312e12),
    ("L40S", 362e12),
    ("L4", 121e12),
]
"""(substring of ``torch.cuda.get_device_name()``, dense bf16 FLOP/s per device), first match wins."""


def peak_flops(device: torch.device) -> float | None:
    """Dense bf16 peak of one ``device`` from :data:`PEAK_BF16_FLOPS`, None when unknown (CPU)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_BF16_FLOPS if key in name), None)


def mfu(flops_per_token: float, tokens_per_s: float, peak_total: float | None) -> float | None:
    """Model FLOPs utilisation against all devices' ``peak_total``; None when unknown (the loop's and benches')."""
    return flops_per_token * tokens_per_s / peak_total if peak_total else None


class StepTimer:
    """Wall time of training steps: each log interval's mean step time and data wait, the run's
    tokens/s and data wait share. The first step is timed on its own (one device sync) and left out
    of the means: it carries one-off costs (compilation, CUDA context). :meth:`paused` takes out
    evaluation and saves. The data wait is host time, an upper bound of the stall on a GPU."""

    def __init__(self, tokens_per_step: int, device: torch.device) -> None:
        self.tokens_per_step = tokens_per_step
        self.device = device
        self.first_step_s: float | None = None
        self._t0 = time.perf_counter()
        self._steps = 0  # timed steps since the last interval
        self._first_unreported = False
        self._total_steps, self._total_s = 0, 0.0
        self._wait, self._first_wait, self._total_wait = 0.0, 0.0, 0.0  # data wait: interval, first step, run

    def _now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def start(self) -> None:
        """Start the clock (right before the first step)."""
        self._t0 = time.perf_counter()

    def step(self, data_wait_s: float = 0.0) -> None:
        """Call after every optimizer step, with the seconds it waited for its data."""
        if self.first_step_s is None:
            now = self._now()
            self.first_step_s, self._t0 = now - self._t0, now
            self._first_unreported = True
            self._first_wait = data_wait_s
        else:
            self._steps += 1
            self._wait += data_wait_s

    def interval(self) -> dict:
        """The timing fields of a train record for the steps since the previous call; restarts the interval."""
        now = self._now()
        first, self._first_unreported = (self.first_step_s if self._first_unreported else None), False
        if self._steps == 0:
            mean = self.first_step_s or 0.0
            wait, span = self._first_wait, mean
        else:
            mean = (now - self._t0) / self._steps
            self._total_steps += self._steps
            self._total_s += now - self._t0
            self._total_wait += self._wait
            wait, span = self._wait, now - self._t0
        self._t0, self._steps, self._wait = now, 0, 0.0
        timing = {"tokens_per_s": self.tokens_per_step / mean, "step_time_s": mean, "data_wait_s": wait,
                  "data_wait_share": wait / span if span > 0 else 0.0}
        if first is not None:
            timing["first_step_s"] = first
        return timing

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Leave the enclosed time (evaluation, checkpointing) out of the step times."""
        start = self._now()
        try:
            yield
        finally:
            self._t0 += self._now() - start

    @property
    def tokens_per_s(self) -> float | None:
        """Tokens/s over every step but the first that :meth:`interval` has closed; None before."""
        return self.tokens_per_step * self._total_steps / self._total_s if self._total_s > 0 else None

    @property
    def data_wait_share(self) -> float | None:
        """Data wait's share of the wall time of the steps :attr:`tokens_per_s` counts; None before."""
        return self._total_wait / self._total_s if self._total_s > 0 else None

    def summary(self) -> dict:
        return {"tokens_per_s": self.tokens_per_s, "first_step_s": self.first_step_s,
                "data_wait_share": self.data_wait_share}


GIB = float(1 << 30)


def memory_fields(device: torch.device) -> dict:
    """``device_mem_peak_gib`` (CUDA's peak since the last call, reset; null elsewhere), ``host_rss_gib``
    (now) and ``host_rss_peak_gib`` (the process's peak so far: no per-interval peak exists)."""
    peak = None
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device) / GIB
        torch.cuda.reset_peak_memory_stats(device)
    rss = _rss_bytes()  # the kernel's two counters are sampled apart: the peak is at least what is resident now
    return {"device_mem_peak_gib": peak, "host_rss_gib": rss / GIB, "host_rss_peak_gib": max(rss, _peak_rss_bytes()) / GIB}


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:  # not Linux: the peak is the best figure there is
        return _peak_rss_bytes()


def _peak_rss_bytes() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB elsewhere


def missing_package(what: str, package: str, extra: str) -> str:
    """The one line a run prints when an optional logger's package is missing."""
    return f"warning: {what} is ignored: the {package} package is not installed (pip install 'tokenloom[{extra}]')"


class MetricsLogger:
    """Appends records to a JSONL file (and TensorBoard, W&B: skipped with one line if missing). Rank 0
    only. W&B steps on ``iter`` as a metric (``step=`` drops late checkpoint records); mappings go
    out as ``field/key`` scalars."""

    def __init__(self, path: str | os.PathLike, *, resume_iteration: int | None = None,
                 tensorboard_dir: str | None = None, wandb_project: str | None = None,
                 wandb_exp_name: str | None = None, run_config: dict | None = None,
                 wandb_dir: str | os.PathLike | None = None) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        kept = []
        if resume_iteration is not None and self.path.exists():
            kept = [json.dumps(r) for r in _records(self.path.read_text()) if r.get("iter", 0) <= resume_iteration
                    and not (("resumed_from" in r or "schedule_phase" in r) and r["iter"] == resume_iteration)]
        with atomic_writer(self.path, "w") as f:
            f.write("".join(line + "\n" for line in kept))
        with naming(self.path):
            self._file = open(self.path, "a")  # noqa: SIM115 - closed in close()
        self._tb = None
        if tensorboard_dir:
            try:
                from torch.utils.tensorboard import SummaryWriter  # lazy: optional dependency, tensorboard
            except ImportError:
                print(missing_package(f"tensorboard_dir {tensorboard_dir}", "tensorboard", "tensorboard"),
                      file=sys.stderr, flush=True)
            else:
                self._tb = SummaryWriter(tensorboard_dir)
        self._wandb = None
        if wandb_project:
            try:
                import wandb  # lazy: optional dependency, wandb
            except ImportError:
                print(missing_package(f"wandb_project {wandb_project}", "wandb", "wandb"), file=sys.stderr, flush=True)
            else:
                self._wandb = wandb.init(project=wandb_project, name=wandb_exp_name, config=run_config,
                                         dir=str(wandb_dir) if wandb_dir else None, resume="allow")
                self._wandb.define_metric("iter")
                self._wandb.define_metric("*", step_metric="iter")

    def log(self, record: dict) -> None:
        """Append one record (flushed), stamped with ``time``; an :class:`OSError` names the metrics file."""
        record = {"iter": record["iter"], "time": round(time.time(), 3), **record}
        with naming(self.path):
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()
        flat = {f"{k}/{name}" if isinstance(v, dict) else k: x for k, v in record.items()
                for name, x in (v.items() if isinstance(v, dict) else [(None, v)])}
        numbers = {k: v for k, v in flat.items()
                   if k not in ("iter", "time") and isinstance(v, (int, float)) and not isinstance(v, bool)
                   and math.isfinite(v)}
        if self._tb is not None:
            for key, value in numbers.items():
                self._tb.add_scalar(key, value, record["iter"])
        if self._wandb is not None and numbers:
            self._wandb.log({"iter": record["iter"], **numbers})

    def close(self) -> None:
        with naming(self.path):
            self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def _records(text: str) -> list[dict]:
    """The records of a metrics file; a torn last line (a killed run, a full disk) is left out."""
    lines = [line for line in text.splitlines() if line.strip()]
    records = []
    for i, line in enumerate(lines):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if i < len(lines) - 1:
                raise
    return records


def read_metrics(path: str | os.PathLike) -> list[dict]:
    return _records(Path(path).read_text())


def plot_loss(metrics_path: str | os.PathLike, png_path: str | os.PathLike) -> Path | None:
    """:func:`loss_figure` of a metrics file as a PNG (matplotlib, Agg backend); None without matplotlib."""
    try:
        import matplotlib  # lazy: start-up time, matplotlib loads only when a plot is asked for

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # lazy: start-up time, matplotlib loads only when a plot is asked for
    except ImportError:
        warnings.warn("no loss-curve PNG: matplotlib is not installed", stacklevel=2)
        return None
    fig = loss_figure(read_metrics(metrics_path))
    png_path = Path(png_path)
    try:
        with atomic_writer(png_path) as f:  # a full disk leaves the old plot or none, never half a PNG
            fig.savefig(f, format="png")
    finally:
        plt.close(fig)
    return png_path


def loss_figure(records: list[dict]):
    """Losses above, learning rate below, against iteration, with vertical lines where the run resumed,
    the blend changed or a schedule phase began; the caller closes the figure."""
    import matplotlib.pyplot as plt  # lazy: start-up time, matplotlib loads only when a plot is asked for

    fig, (ax, lr_ax) = plt.subplots(2, 1, figsize=(7, 6), dpi=100, sharex=True, height_ratios=(2, 1))
    for key, style in (("train_loss", ".-"), ("val_loss", "o-")):
        points = [(r["iter"], r[key]) for r in records if r.get(key) is not None]
        if points:
            ax.plot(*zip(*points, strict=True), style, label=key.replace("_", " "), markersize=3 if len(points) > 1 else 6)
    sources = list(dict.fromkeys(name for r in records for key in ("val_loss_per_source", "train_loss_per_source")
                                 for name in r.get(key) or {}))
    for i, name in enumerate(sources):
        for key, style, what in (("val_loss_per_source", "o--", "val"), ("train_loss_per_source", ".:", "train")):
            points = [(r["iter"], r[key][name]) for r in records if (r.get(key) or {}).get(name) is not None]
            if points:
                ax.plot(*zip(*points, strict=True), style, color=f"C{(i + 3) % 10}", linewidth=1, markersize=2,
                        label=f"{what} loss {name}")
    rates = [(r["iter"], r["lr"]) for r in records if r.get("lr") is not None]
    if rates:
        lr_ax.plot(*zip(*rates, strict=True), ".-", color="tab:green", markersize=3 if len(rates) > 1 else 6)
    for r in records:
        if "schedule_phase" in r:
            for panel in (ax, lr_ax):
                panel.axvline(r["iter"], color="tab:purple", linestyle="-.",
                              label="data schedule phase" if panel is ax else None)
        if "resumed_from" in r:
            changed = bool(r.get("blend_changed"))
            label = "blend changed" if changed else "resumed"
            for panel in (ax, lr_ax):
                panel.axvline(r["iter"], color="tab:red" if changed else "tab:gray", linestyle="--" if changed else ":",
                              label=label if panel is ax else None)
    ax.set_ylabel("loss")
    lr_ax.set_ylabel("learning rate")
    lr_ax.set_xlabel("iteration")
    for panel in (ax, lr_ax):
        panel.grid(alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    unique = dict(zip(labels, handles, strict=True))  # one legend entry per kind of mark
    ax.legend(unique.values(), unique.keys())
    fig.tight_layout()
    return fig
