"""Start training in this process, or under torchrun with N ranks per node; checks first.

``launch(cfg)`` runs :func:`tokenloom.train.preflight.check` and then
:func:`tokenloom.train.loop.run` here (which joins a torchrun / Slurm job if the
environment describes one). ``launch(cfg, nproc_per_node=N)`` checks the config for the
whole world (``N x nodes.nnodes``) in this process, writes the resolved config to
``OUTPUT_DIR/launch_config.json`` and starts::

    python -m torch.distributed.run --standalone --nproc-per-node N \\
        -m tokenloom.train.launch --config OUTPUT_DIR/launch_config.json --log-dir LOGS

(``--nnodes/--node-rank/--master-addr/--master-port`` or ``--rdzv-endpoint`` for several nodes).

Output: each rank (:func:`main`) sends its stdout and stderr to ``LOGS/rank{N}.log`` and
torchrun's own output goes to ``LOGS/torchrun.log``; rank 0's stdout (the start-up
summary, the final JSON) stays on the terminal and this process relays its log (progress
bar, warnings; its ``error:`` lines stay in the file). If the terminal's reader goes away
(``train ... | head``), stdout goes to ``/dev/null`` and training goes on. A failed run ends with one
:class:`TokenloomError` line (the first failing rank and its error, the log directory), not a traceback
per rank; the price is that ranks other than 0 are silent on the terminal (``verbose=True`` streams
everything unchanged, as torchrun does, and writes no log files).

Signals: SIGTERM or SIGINT to this process goes to every rank (:class:`Forwarder`), which
finish the same step, save and stop (:mod:`tokenloom.train.stop`); rank 0's line naming the
checkpoint and the resume command reaches the terminal through the relay, and this process
exits with ``128 + signal``. torchrun runs in a session of its own (a terminal's Ctrl-C
reaches this process only) and dies with it (``PR_SET_PDEATHSIG``), as do the ranks with
torchrun; a second signal kills the job at once. In an elastic launch (``--nnodes MIN:MAX``) both
deaths are SIGKILL: a node whose launcher or torchrun is gone leaves the job without a stop the
other nodes would agree to, and they go on at the world left (:func:`check_elastic`, docs/faults.md).

Which rank failed first is decided from what this process sees while it polls the ranks every
:data:`POLL_S`: when a rank's log shows an error, or its process vanished without finishing (a kill,
the OOM killer). A death without a message outranks an error seen in the same poll (peers report a
dead rank within milliseconds); an error that only reports a failed collective (:data:`PEER_SYMPTOM`)
is outranked by any other failure, being its symptom; ranks torchrun stopped after the failure (its
``closing signal`` lines) are not failures.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import traceback
import typing
from dataclasses import dataclass
from pathlib import Path

from tokenloom.blending.args import load_blend_file, parse_data_args, phase_sources, resolve_schedule
from tokenloom.errors import Stopped, TokenloomError
from tokenloom.train import faults
from tokenloom.train.checkpoint import commit as checkpoint
from tokenloom.train.config import TrainConfig, config_to_dict, load_config
from tokenloom.train.data import open_tokenizer

POLL_S = 0.1


@dataclass(frozen=True)
class Nodes:
    """How the nodes of a torchrun job meet (torchrun's flags of the same names)."""

    nnodes: int = 1
    """Nodes in the job (each runs this command with its own node rank); MIN:MAX (c10d rendezvous): an elastic
    job that starts with up to MAX nodes and goes on, after a node is lost, with the nodes left while they
    are at least MIN, at a smaller data-parallel size and the same global batch (docs/faults.md)."""
    node_rank: int = 0
    """This node's rank, 0 .. nnodes-1 (static rendezvous with master_addr/master_port)."""
    master_addr: str | None = None
    """Address of node 0 (static rendezvous); None with one node means a local standalone job."""
    master_port: int | None = None
    """Port on node 0 for the rendezvous (default 29500)."""
    rdzv_endpoint: str | None = None
    """HOST:PORT of a c10d rendezvous (instead of master_addr/master_port; node ranks assigned by torchrun)."""
    rdzv_id: str | None = None
    """Job id shared by the nodes of a c10d rendezvous (default: tokenloom)."""
    rdzv_conf: str | None = None
    """torchrun's KEY=VALUE,... settings of the c10d rendezvous (e.g. last_call_timeout=30,keep_alive_interval=5,
    keep_alive_max_attempt=3: how long a round waits for more nodes once MIN are in, and when a silent node is
    taken for lost; is_host=1 on the node that hosts the rendezvous at --rdzv-endpoint)."""
    min_nodes: int | None = None
    """The MIN of ``--nnodes MIN:MAX`` (None: a fixed ``nnodes``)."""

    def __post_init__(self) -> None:
        if self.nnodes < 1:
            raise TokenloomError(f"--nnodes must be >= 1, got {self.nnodes}")
        if not 0 <= self.node_rank < self.nnodes:
            raise TokenloomError(f"--node-rank {self.node_rank} must be in 0..{self.nnodes - 1} (--nnodes "
                                 f"{self.nnodes})")
        if self.rdzv_endpoint and (self.master_addr or self.master_port):
            raise TokenloomError("give either --rdzv-endpoint or --master-addr/--master-port, not both")
        if self.min_nodes is not None:
            if not 1 <= self.min_nodes <= self.nnodes:
                raise TokenloomError(f"--nnodes {self.min_nodes}:{self.nnodes}: MIN must be in 1..MAX")
            if self.elastic and not self.rdzv_endpoint:
                raise TokenloomError(f"--nnodes {self.min_nodes}:{self.nnodes} needs --rdzv-endpoint HOST:PORT (a "
                                     "c10d rendezvous; --master-addr/--master-port make a fixed world)")
        if self.rdzv_conf and not self.rdzv_endpoint:
            raise TokenloomError("--rdzv-conf needs --rdzv-endpoint (it configures the c10d rendezvous)")

    @property
    def elastic(self) -> bool:
        """``--nnodes MIN:MAX`` with MIN < MAX: the world may shrink and grow between attempts."""
        return self.min_nodes is not None and self.min_nodes < self.nnodes

    @property
    def nnodes_flag(self) -> str:
        return f"{self.min_nodes}:{self.nnodes}" if self.elastic else str(self.nnodes)

    def torchrun_flags(self) -> list[str]:
        if self.rdzv_endpoint:
            return ["--nnodes", self.nnodes_flag, "--rdzv-backend", "c10d", "--rdzv-endpoint", self.rdzv_endpoint,
                    "--rdzv-id", self.rdzv_id or "tokenloom", *(["--rdzv-conf", self.rdzv_conf] if self.rdzv_conf
                                                                 else [])]
        if self.nnodes == 1 and not self.master_addr and not self.master_port:
            return ["--standalone"]
        return ["--nnodes", str(self.nnodes), "--node-rank", str(self.node_rank), "--master-addr",
                self.master_addr or "127.0.0.1", "--master-port", str(self.master_port or 29500)]


def parse_nnodes(text: str) -> tuple[int | None, int]:
    """``--nnodes N`` -> (None, N); ``--nnodes MIN:MAX`` -> (MIN, MAX), torchrun's spelling."""
    lo, sep, hi = str(text).partition(":")
    try:
        return (int(lo), int(hi)) if sep else (None, int(lo))
    except ValueError:
        raise TokenloomError(f"--nnodes {text}: give a number of nodes N or MIN:MAX (e.g. 2 or 1:4)") from None


def torchrun_command(config_path: str | os.PathLike, nproc_per_node: int, nodes: Nodes = Nodes(),
                     log_dir: str | os.PathLike | None = None, max_restarts: int = 0) -> list[str]:
    """The command line that :func:`launch` runs; ranks log to ``log_dir`` (None: they print)."""
    entry = ["tokenloom.train.launch", "--config", str(config_path), "--log-dir", str(log_dir)] if log_dir else \
        ["tokenloom.train.loop", "--config", str(config_path)]
    restarts = ["--max-restarts", str(max_restarts)] if max_restarts else []
    return [sys.executable, "-m", "torch.distributed.run", *nodes.torchrun_flags(), *restarts, "--nproc-per-node",
            str(nproc_per_node), "-m", *entry]


ELASTIC_ENV = "TOKENLOOM_ELASTIC"
"""Set (to ``MIN:MAX``) in the ranks of an elastic launch (``--nnodes MIN:MAX``); see :func:`main`."""


def torchrun_env(max_restarts: int, nodes: Nodes = Nodes()) -> dict[str, str]:
    """torchrun's environment: this one, and with restarts ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``.
    By default the ranks of every attempt share the rendezvous's TCP store and the process groups of
    a restarted attempt use the same keys as the attempt before, so a rank can read a dead peer's
    address and fail to connect; with the variable each rendezvous round gets a store of its own
    (hosted by rank 0), the price one more port per round. An elastic launch also gets
    :data:`ELASTIC_ENV`."""
    env = dict(os.environ)
    if max_restarts:
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    env.pop(ELASTIC_ENV, None)
    if nodes.elastic:
        env[ELASTIC_ENV] = nodes.nnodes_flag
    return env


def check_elastic(cfg: TrainConfig, nproc_per_node: int, nodes: Nodes, max_restarts: int) -> None:
    """An elastic launch (``--nnodes MIN:MAX``) can go on at every world size it may reach: the layout and
    the global batch fit each of ``nproc_per_node x n`` ranks, n in MIN..MAX (only data parallelism shrinks:
    tp, pp, cp and ep are kept, and the micro-batches per step grow so the global batch stays); a lost
    node is survived by a restart, so ``max_restarts`` is at least 1; the ranks resume from the run's
    newest checkpoint on every start (a node joining mid-run included), so ``resume`` is None or auto."""
    from tokenloom.train import preflight  # lazy: start-up time
    from tokenloom.train.parallel.state import ParallelLayout  # lazy: start-up time (torch.distributed)

    flag = f"--nnodes {nodes.nnodes_flag}"
    if max_restarts < 1:
        raise TokenloomError(f"{flag} goes on after a lost node by a restart of the ranks left; give --max-restarts "
                             "N (N >= 1; each lost node costs one, as in torchrun)")
    if cfg.resume not in (None, "auto"):
        raise TokenloomError(f"--resume {cfg.resume} with {flag}: an elastic job's ranks resume from {cfg.ckpt_dir}'s "
                             "newest checkpoint on every start (a node joining mid-run included); copy the checkpoint "
                             "there and use --resume auto, or give a fixed --nnodes")
    for n in range(typing.cast(int, nodes.min_nodes), nodes.nnodes + 1):
        world = nproc_per_node * n
        try:
            ParallelLayout(world, tp=cfg.tp, pp=cfg.pp, vpp=cfg.vpp, cp=cfg.cp, ep=cfg.ep)
            preflight.check_layout(cfg, world)
            dp = world // (cfg.tp * cfg.pp * cfg.cp)
            if cfg.global_batch_size % (cfg.micro_batch_size * dp):
                raise TokenloomError(f"--global-batch-size {cfg.global_batch_size} is not a multiple of "
                                     f"--micro-batch-size {cfg.micro_batch_size} x {dp} data-parallel rank(s)")
        except TokenloomError as exc:
            raise TokenloomError(f"{flag}: with {n} node(s) ({world} ranks): {exc}") from None


class _ReaderOptional:
    """``sys.stdout`` that outlives its reader: the first write or flush that finds the pipe
    closed (``train ... | head``) points file descriptor 1 at ``/dev/null`` and goes on.

    The run's product is its checkpoints, metrics and logs; stdout (the start-up summary,
    the final JSON) is a view of them, and a reader that went away must not end hours of
    training, or raise a traceback at its end (Python ignores SIGPIPE and raises
    ``BrokenPipeError`` on the write instead). The price: output written after the
    reader left is lost, as it would be anyway."""

    def __init__(self, stream: typing.TextIO) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            self._to_devnull()
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            self._to_devnull()

    def _to_devnull(self) -> None:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, self._stream.fileno())
        os.close(devnull)

    def __getattr__(self, name: str) -> typing.Any:
        return getattr(self._stream, name)


def stdout_outlives_its_reader() -> None:
    """Make ``sys.stdout`` survive a closed reader (:class:`_ReaderOptional`); for the
    ``train`` command and rank 0, not for library callers, whose stdout is their own."""
    if not isinstance(sys.stdout, _ReaderOptional):
        sys.stdout = _ReaderOptional(sys.stdout)


def launch(cfg: TrainConfig | str | os.PathLike, nproc_per_node: int | None = None, nodes: Nodes = Nodes(),
           verbose: bool = False, echo: typing.Callable[[str], None] | None = None,
           max_restarts: int = 0) -> dict | None:
    """Check, then train from a config object or file; in-process without ``nproc_per_node``,
    else via torchrun (see the module docstring). ``echo`` gets the log directory's path.

    Returns the run summary in-process; after a torchrun launch None, or ``{"stopped_by": NAME}``
    when a signal to this process stopped the ranks (they saved; rank 0 printed the checkpoint and
    the resume command). Signals: :class:`Forwarder`; a signal to torchrun stops the ranks the same
    way (torchrun sends them SIGTERM), and so does one to a rank (the ranks agree on the step).
    torchrun runs in its own session with ``PR_SET_PDEATHSIG`` and so do the ranks, so none of the
    job outlives this process.

    ``max_restarts`` (torchrun's ``--max-restarts``): when a rank fails, torchrun restarts this
    node's ranks up to that many times and they resume from the newest complete checkpoint; this
    process writes a restart record per restart (:mod:`tokenloom.train.faults`) and ends the job
    with one line instead when a restart would repeat the failure (:func:`faults.deterministic`).
    With ``nodes.elastic`` (``--nnodes MIN:MAX``) a lost node is such a failure for the others, whose
    restart forms the next world from the nodes left (:func:`check_elastic` first).
    """
    from tokenloom.train import preflight  # lazy: start-up time (in-process runs only)

    if not isinstance(cfg, TrainConfig):
        cfg = load_config(cfg)
    if cfg.init_from_hf is not None:  # before the checks: the folder's model shape and tokenizer
        from tokenloom.train.checkpoint.hf import resolve_config  # lazy: start-up time (torch, the model)

        cfg = resolve_config(cfg)
    if nproc_per_node is None:
        from tokenloom.train.dist import launch_env  # lazy: start-up time (in-process runs only)
        from tokenloom.train.loop import run  # lazy: start-up time (in-process runs only)

        preflight.check(cfg, int(launch_env()["WORLD_SIZE"]))  # torchrun's, or an srun step's
        return run(cfg)
    if nproc_per_node < 1:
        raise TokenloomError(f"--nproc-per-node must be >= 1, got {nproc_per_node}")
    if max_restarts < 0:
        raise TokenloomError(f"--max-restarts must be >= 0, got {max_restarts}")
    if nodes.elastic:
        check_elastic(cfg, nproc_per_node, nodes, max_restarts)
    preflight.check(cfg, nproc_per_node * nodes.nnodes)
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    config_path = out / "launch_config.json"
    tmp = out / f".launch_config.json.tmp-{os.getpid()}"  # nodes sharing the output dir write the same bytes
    tmp.write_text(json.dumps(config_to_dict(cfg), indent=2))
    os.replace(tmp, config_path)
    if verbose:  # a signal goes to torchrun, which sends the ranks SIGTERM
        proc = subprocess.Popen(torchrun_command(config_path, nproc_per_node, nodes, max_restarts=max_restarts),
                                start_new_session=True, env=torchrun_env(max_restarts, nodes),
                                preexec_fn=torchrun_death(nodes))
        forward = Forwarder(proc, None)
        try:
            with forward.installed():
                code = proc.wait()
        finally:
            if proc.poll() is None:
                proc.terminate()
                proc.wait()
        if forward.signum is not None:
            return {"stopped_by": signal_name(forward.signum)}
        if code != 0:
            raise TokenloomError(f"training with {nproc_per_node * nodes.nnodes} ranks failed (torchrun exit "
                                 f"status {code}); the failing rank's error is printed above")
        return None
    log_dir = new_log_dir(out / "logs", nodes)
    if echo is not None:
        echo(f"logs: {log_dir} (rank{{N}}.log per rank, torchrun.log)")
    with open(log_dir / "torchrun.log", "wb") as torchrun_log:  # its stdout is rank 0's: kept
        # a session of its own: a terminal's Ctrl-C reaches this process only, which forwards it
        proc = subprocess.Popen(torchrun_command(config_path, nproc_per_node, nodes, log_dir, max_restarts),
                                stderr=torchrun_log, start_new_session=True, preexec_fn=torchrun_death(nodes),
                                env=torchrun_env(max_restarts, nodes))
        watch = RankWatch(log_dir, ckpt_dirs=[cfg.ckpt_dir, *([cfg.local_save_dir] if cfg.local_save_dir else [])],
                          max_restarts=max_restarts, node=nodes.node_rank)
        forward = Forwarder(proc, log_dir)
        try:
            with forward.installed():
                while proc.poll() is None:
                    watch.poll()
                    if watch.stop_reason is not None:  # a restart would repeat the failure: end the job now
                        end_job(proc, forward.rank_pids())
                        break
                    time.sleep(POLL_S)
        finally:
            if proc.poll() is None:  # interrupted: torchrun stops its ranks on SIGTERM
                proc.terminate()
                proc.wait()
        if watch.stop_reason is None:
            watch.poll()
    if watch.stop_reason is not None:
        raise TokenloomError(f"{watch.stop_reason}; full logs: {log_dir}")
    stopped = forward.signum is not None
    ranks_done = bool(watch.ranks) and all((log_dir / f"rank{r}.done").exists() for r in watch.ranks)
    if proc.returncode != 0 and not ranks_done:
        if forward.signum is not None:
            raise Stopped(f"stopped by {signal_name(forward.signum)} before the ranks could save; "
                          f"{checkpoint.resume_advice(cfg.ckpt_dir)}; full logs: {log_dir}", forward.signum)
        raise TokenloomError(f"{watch.first_failure(proc.returncode)}; full logs: {log_dir}")
    return {"stopped_by": signal_name(forward.signum)} if stopped else None


def end_job(proc: subprocess.Popen, rank_pids: list[int]) -> None:
    """Kill torchrun and every rank it started, at once: torchrun is frozen first (SIGSTOP: it starts
    no rank meanwhile), then its children are killed (each rank is in a session of its own, and one
    just started may not have written its pid file nor asked to die with its parent), then torchrun."""
    _kill(proc.pid, signal.SIGSTOP)
    for pid in {*rank_pids, *children(proc.pid)}:
        _kill(pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def children(pid: int) -> list[int]:
    """The child processes of ``pid`` (Linux ``/proc``; elsewhere none)."""
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError, ValueError):
            out += [int(c) for c in (task / "children").read_text().split()]
    return out


def signal_name(signum: int | None) -> str | None:
    return None if signum is None else signal.Signals(signum).name


class Forwarder:
    """While installed (main thread only), SIGTERM and SIGINT to this process go to every rank
    of this node (their pids from ``LOGS/rank{N}.pid``), which save and stop
    (:mod:`tokenloom.train.stop`); before any rank has started, to torchrun, which stops them. Not
    to torchrun once ranks run: it would signal them a second time, which stops a rank at once.
    A second signal kills the ranks and torchrun's process group and raises :class:`Stopped`."""

    def __init__(self, proc: subprocess.Popen, log_dir: Path | None) -> None:
        self.proc, self.dir = proc, log_dir
        self.signum: int | None = None

    @contextlib.contextmanager
    def installed(self) -> typing.Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {s: signal.signal(s, self._handle) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            yield
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)

    def rank_pids(self) -> list[int]:
        pids = []
        for pid_file in self.dir.glob("rank*.pid") if self.dir is not None else ():
            try:
                pids.append(int(pid_file.read_text()))
            except (ValueError, OSError):
                continue
        return pids

    def _handle(self, signum: int, frame) -> None:
        if self.signum is not None:  # the second one: nothing of the job may outlive this process
            for pid in self.rank_pids():
                _kill(pid, signal.SIGKILL)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            where = f"; logs: {self.dir}" if self.dir is not None else ""
            raise Stopped(f"stopped at once by a second {signal_name(signum)}, without a checkpoint of this "
                          f"step{where}", signum)
        self.signum = signum
        pids = self.rank_pids()
        for pid in pids:
            _kill(pid, signum)
        if not pids:
            _kill(self.proc.pid, signal.SIGTERM)


def _kill(pid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, signum)


def torchrun_death(nodes: Nodes) -> typing.Callable[[], None]:
    """torchrun's ``preexec_fn``: it dies with this process, by SIGTERM (its agent stops the ranks, which save
    and stop) or, in an elastic launch, by SIGKILL: this node leaves the job and its ranks die with their
    agent (:func:`main`), so the other nodes go on without them instead of stopping with them."""
    return lambda: die_with_parent(signal.SIGKILL if nodes.elastic else signal.SIGTERM)


def die_with_parent(signum: int = signal.SIGTERM) -> None:
    """Have the kernel send ``signum`` to this process when its parent dies (Linux
    ``PR_SET_PDEATHSIG``; elsewhere nothing), so no process of a job outlives the one that
    started it, even one killed with SIGKILL. For ``preexec_fn`` and the start of a rank."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, int(signum), 0, 0, 0)  # PR_SET_PDEATHSIG


def new_log_dir(root: Path, nodes: Nodes) -> Path:
    """A fresh ``root/YYYYmmdd-HHMMSS[-nodeK][-n]`` folder for one launch's logs."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime()) + (f"-node{nodes.node_rank}" if nodes.nnodes > 1 else "")
    root.mkdir(parents=True, exist_ok=True)
    for n in range(1000):
        path = root / (stamp if n == 0 else f"{stamp}-{n}")
        try:
            path.mkdir()
            return path
        except FileExistsError:
            continue
    raise TokenloomError(f"cannot make a new log directory under {root}")


@dataclasses.dataclass
class RankState:
    pid: int
    offset: int = 0
    failed_at: float | None = None
    message: str | None = None
    died: bool = False
    held: bytes = b""  # the end of the relayed log that may still become an ``error: `` line
    wall: float | None = None  # unix time of the failure
    mark: faults.StepMark | None = None  # its last ``rank{N}.step``


HANG_GRACE_S = 5.0
"""How long the launcher waits, after a rank's watchdog fired, for the other live ranks' to."""
_ERROR = b"error: "
PEER_SYMPTOM = "another rank has probably died or stalled"
"""Part of every error a rank raises when a collective fails because of another rank
(:func:`tokenloom.train.runtime.collective`, the DDP bucket wait): the symptom, not the cause."""


def without_error_lines(held: bytes, chunk: bytes) -> tuple[bytes, bytes]:
    """(what to show, what to hold) of a log's next ``chunk``: its ``error: `` lines are left out
    (the launcher ends with the first failure's line itself, so the terminal shows one error line),
    and so are a rank's traceback lines (:data:`TRACEBACK`), which stay in the log.
    Lines end at ``\n`` or ``\r`` (progress bars); an unfinished one is held only while it may
    still become an error line, so a progress bar is shown as it is drawn."""
    parts = re.split(rb"(?<=[\r\n])", held + chunk)
    tail = parts.pop()  # after the last line end (empty when the chunk ends one)
    shown = b"".join(p for p in parts if not p.startswith((_ERROR, TRACEBACK)))
    if any(tail.startswith(h) or h.startswith(tail) for h in (_ERROR, TRACEBACK)):
        return shown, tail
    return shown + tail, b""


class RankWatch:
    """Follows the ranks of this node through ``LOGS/rank{N}.attempt``, ``.log``, ``.step``, ``.hang``
    and ``.done`` (written by :func:`main` and :mod:`tokenloom.train.faults`): relays rank 0's log
    to this process's stderr and notes when each rank failed (see the module docstring).

    Under torchrun's restarts each restart is an attempt (``TORCHELASTIC_RESTART_COUNT``): when the
    next attempt's ranks appear (by then torchrun has logged how the ranks ended), the attempt's first
    failure becomes a restart record (``LOGS/restarts.jsonl``) unless no restart is left; a failure a
    restart would repeat sets :attr:`stop_reason` (the launcher then ends the job). A ``.hang`` file
    (a rank's watchdog fired) is followed, once every other live rank wrote one or after
    :data:`HANG_GRACE_S`, by one line naming the ranks that wrote none (they had not reached the
    collective: stopped, or stuck outside Python), which are then killed so torchrun restarts now."""

    def __init__(self, log_dir: Path, ckpt_dirs: typing.Sequence[str | os.PathLike] = (), max_restarts: int = 0,
                 node: int = 0) -> None:
        self.dir, self.ckpt_dirs, self.max_restarts, self.node = log_dir, list(ckpt_dirs), max_restarts, node
        self.ranks: dict[int, RankState] = {}
        self.attempt = 0
        self.closed = False  # the current attempt's failure is recorded
        self.records: list[dict] = []
        self.stop_reason: str | None = None
        self.hang: tuple[float, str, list[int]] | None = None  # (first seen, line, ranks without stacks)
        self.hang_named = False
        self.world = 0  # the current attempt's world size (0: not known yet)
        self.group = ""  # the current group's rendezvous round (its store's address), and all of this attempt's
        self.groups: set[str] = {""}
        self._relayed = 0

    def poll(self) -> None:
        now = time.monotonic()
        for pid_file in self.dir.glob("rank*.pid"):
            rank = int(pid_file.stem.removeprefix("rank"))
            try:
                pid = int(pid_file.read_text())
                attempt_text = read_text(self.dir / f"rank{rank}.attempt").split()
                if attempt_text and len(attempt_text) != 4:
                    raise ValueError(attempt_text)
                attempt, attempt_pid, world = (int(v) for v in attempt_text[:3]) if attempt_text else (0, pid, 0)
                group = attempt_text[3] if attempt_text else ""
            except ValueError:  # being written
                continue
            if attempt_pid != pid:  # the next attempt's files are being written
                continue
            if attempt > self.attempt:  # torchrun restarted this node's ranks
                self._close_attempt(world)
                self._new_group(attempt, world, group)
            elif attempt == self.attempt and group not in self.groups:  # torchrun's membership change: the
                self._new_group(attempt, world, group)  # ranks of a new round, no restart counted
            if attempt < self.attempt or group != self.group:  # an earlier attempt's or round's
                continue
            self.world = self.world or world
            if rank not in self.ranks:
                self.ranks[rank] = RankState(pid)
            state = self.ranks[rank]
            mark = faults.read_step(self.dir / f"rank{rank}.step")
            if mark is not None and (state.mark is None or mark.time >= state.mark.time):
                state.mark = mark
            if rank == 0:
                self._relay(state)
            if state.failed_at is not None:
                continue
            error = rank_error(self.dir / f"rank{rank}.log", rank)
            if error is not None:
                state.failed_at, state.message, state.wall = now, error, time.time()
            elif not process_alive(state.pid) and not (self.dir / f"rank{rank}.done").exists():
                state.failed_at, state.died, state.wall = now, True, time.time()
        self._watch_hang(now)

    def _watch_hang(self, now: float) -> None:
        hung = {r for r in self.ranks if (self.dir / f"rank{r}.hang").exists()}
        if not hung or self.hang_named:
            return
        if self.hang is None:
            self.hang = (now, "", [])
            for rank, state in self.ranks.items():  # every live rank's stacks into its log
                if rank not in hung and state.failed_at is None:
                    _kill(state.pid, faults.DUMP_SIGNAL)
        silent = sorted(r for r, s in self.ranks.items() if r not in hung and process_alive(s.pid))
        if silent and now - self.hang[0] < HANG_GRACE_S:
            return
        marks = [s.mark.last for s in self.ranks.values() if s.mark is not None]
        line = (f"hang after iteration {max(marks) if marks else '?'}: "
                + (f"rank(s) {', '.join(map(str, silent))} had not reached the collective (no stacks: stopped or "
                   "stuck outside Python); " if silent else "")
                + f"rank(s) {', '.join(map(str, sorted(hung)))} waited in it (their Python stacks are in their logs)")
        self.hang, self.hang_named = (self.hang[0], line, silent), True
        print(line, file=sys.stderr, flush=True)
        for rank in silent:  # a stopped process never exits by itself: torchrun would wait for it
            _kill(self.ranks[rank].pid, signal.SIGKILL)

    def _new_group(self, attempt: int, world: int, group: str) -> None:
        if attempt > self.attempt:
            self.groups = set()
        self.attempt, self.ranks, self.closed, self.hang, self.hang_named = attempt, {}, False, None, False
        self.world, self.group = world, group
        self.groups.add(group)

    def _close_attempt(self, new_world: int = 0) -> None:
        """Record the current attempt's first failure (once), if it had one and a restart is left;
        ``new_world``: the world size of the next attempt (0: not known)."""
        if self.closed or not any(s.failed_at is not None for s in self.ranks.values()):
            return
        self.closed = True
        if self.attempt >= self.max_restarts:  # torchrun gives up: the run's error line says why
            return
        failure = self.failure()
        if failure is None:
            return
        rank, why = failure
        if self.hang is not None and self.hang[2]:
            rank, why = self.hang[2][0], self.hang[1]
        marks = [s.mark for s in self.ranks.values() if s.mark is not None]
        walls = [s.wall for s in self.ranks.values() if s.wall is not None]
        # the newest complete checkpoint of either tier (a local one that misses a rank's files is
        # skipped by the ranks, which agree on what they resume from; this is the record's estimate)
        done = [c for root in self.ckpt_dirs for c in checkpoint.complete_checkpoints(root)]
        record = faults.restart_record(restart=self.attempt + 1, rank=rank, why=why,
                                       failed_at=min(walls) if walls else time.time(),
                                       failed_iteration=max((m.last for m in marks), default=0),
                                       resumes_from=max((it for it, _ in done), default=0), node=self.node,
                                       world_size=self.world or None, new_world_size=new_world or None)
        reason = faults.deterministic(self.records, record, min((m.start for m in marks), default=None))
        if reason is not None:
            self.stop_reason = f"{why} (after iteration {record['failed_iteration']}); not restarting: {reason}"
            return
        self.records.append(record)
        faults.append_record(self.dir, record)

    def _relay(self, state: RankState) -> None:
        try:
            with open(self.dir / "rank0.log", "rb") as f:
                f.seek(self._relayed)
                chunk = f.read()
        except FileNotFoundError:
            return
        if chunk:
            self._relayed += len(chunk)
            chunk, state.held = without_error_lines(state.held, chunk)
            stream = getattr(sys.stderr, "buffer", None)
            if stream is not None:
                stream.write(chunk)
            else:
                sys.stderr.write(chunk.decode(errors="replace"))
            sys.stderr.flush()

    def failure(self) -> tuple[int, str] | None:
        """The current attempt's first failing rank and its one-line error (None: no failure)."""
        torchrun_log = read_text(self.dir / "torchrun.log")
        stopped = {int(p) for p in re.findall(r"Sending process (\d+) closing signal", torchrun_log)}
        failed = [(bool(s.message and PEER_SYMPTOM in s.message), s.failed_at, not s.died, rank, s)
                  for rank, s in self.ranks.items() if s.failed_at is not None and not (s.died and s.pid in stopped)]
        if not failed:
            return None
        *_, rank, state = min(failed, key=lambda f: f[:4])
        if not state.died and state.message is not None:  # a rank that did not die failed with a message
            return rank, state.message
        code = (re.search(rf"exitcode\s*:\s*(-?\d+)\s*\(pid:\s*{state.pid}\)", torchrun_log)
                or re.search(rf"failed \(exitcode: (-?\d+)\) local_rank: \d+ \(pid: {state.pid}\)", torchrun_log))
        how = f"exit code {code.group(1)}" if code else "no exit status seen"
        if code and int(code.group(1)) < 0:
            how = f"killed by {signal.Signals(-int(code.group(1))).name}"
        return rank, (f"rank {rank}: its process (pid {state.pid}) died without an error message ({how}; a kill, "
                      "the OOM killer or a crash in native code)")

    def first_failure(self, torchrun_status: int) -> str:
        """One line: the first failing rank and its error, or torchrun's last words."""
        failure = self.failure()
        if failure is not None:
            return failure[1]
        last = [line for line in read_text(self.dir / "torchrun.log").splitlines() if line.strip()]
        return (f"torchrun failed (exit status {torchrun_status}) before any rank reported an error"
                + (f": {last[-1].strip()}" if last else ""))


def read_text(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except FileNotFoundError:
        return ""


ATTEMPT_MARK = "tokenloom: attempt "
"""Start of the line a restarted rank writes first into its log: what follows is that attempt's."""


def rank_error(log: Path, rank: int) -> str | None:
    """The rank's one-line error (``error: ...`` as :func:`tokenloom.train.loop.main` prints
    it), or the last line of a Python traceback, as ``rank N: ...``; None if neither."""
    text = read_text(log).rsplit(ATTEMPT_MARK, 1)[-1]  # this attempt's part
    lines = [line.strip() for line in text.replace("\r", "\n").splitlines() if line.strip()]
    errors = [line.removeprefix("error: ") for line in lines if line.startswith("error: ")]
    if errors:
        message = errors[-1]
    elif "Traceback (most recent call last):" in text:
        message = lines[-1]
    else:
        return None
    return message if message.startswith(f"rank {rank}") else f"rank {rank}: {message}"


def process_alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie counts as dead: torchrun has not reaped it yet)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        if Path("/proc/self/stat").exists():
            return False
    except (OSError, IndexError):
        pass
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def main(argv: typing.Sequence[str] | None = None) -> int:
    """One rank under torchrun: ``python -m tokenloom.train.launch --config F --log-dir LOGS``.

    Writes ``LOGS/rank{RANK}.attempt`` (``ATTEMPT PID WORLD_SIZE ROUND``: the rendezvous round's store) and ``LOGS/rank{RANK}.pid``, sends
    stderr (and stdout, except on rank 0) to ``LOGS/rank{RANK}.log``, runs :func:`tokenloom.train.loop.main`
    and writes ``LOGS/rank{RANK}.done`` when it returns (a rank that fails with an error exits inside it).

    In an elastic launch (:data:`ELASTIC_ENV`) the rank resumes from the newest complete checkpoint on
    every start, and dies by SIGKILL with its torchrun agent: a node whose launcher or agent is gone
    leaves the job without a signal its peers would agree to stop on, while SIGTERM or SIGINT to the
    ranks or the launcher still stops the whole job, saved.
    """
    parser = argparse.ArgumentParser(prog="python -m tokenloom.train.launch")
    parser.add_argument("--config", required=True)
    parser.add_argument("--log-dir", required=True)
    args = parser.parse_args(argv)
    rank, log_dir = int(os.environ.get("RANK", "0")), Path(args.log_dir)
    fd = os.open(log_dir / f"rank{rank}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 2)
    if rank != 0:
        os.dup2(fd, 1)
    os.close(fd)
    faults.dump_on_signal()
    attempt = faults.restart_count()
    os.environ[faults.LOG_DIR_ENV] = str(log_dir)
    for stale in (f"rank{rank}.done", f"rank{rank}.hang", f"rank{rank}.step"):  # the previous attempt's
        with contextlib.suppress(FileNotFoundError):
            (log_dir / stale).unlink()
    if attempt > 0:
        print(f"{ATTEMPT_MARK}{attempt} of rank {rank} (pid {os.getpid()}): resuming from the newest complete "
              "checkpoint", file=sys.stderr, flush=True)
    elastic = bool(os.environ.get(ELASTIC_ENV))
    # torchrun gone (even by SIGKILL): this rank saves and stops as on SIGTERM; in an elastic job the
    # node is leaving and the rank dies at once, leaving no stop for the other nodes to agree on
    die_with_parent(signal.SIGKILL if elastic else signal.SIGTERM)
    for s in (signal.SIGTERM, signal.SIGINT):  # the steps install their own (tokenloom.train.stop)
        signal.signal(s, _stop_outside_steps)
    tmp = log_dir / f".rank{rank}.attempt.tmp"  # before the pid: the watch pairs them
    # the rendezvous round's store (a new one per round, TORCH_DISABLE_SHARE_RDZV_TCP_STORE) tells this
    # attempt's groups apart: torchrun's membership change starts one without counting a restart
    group = f"{os.environ.get('MASTER_ADDR', '-')}:{os.environ.get('MASTER_PORT', '-')}"
    tmp.write_text(f"{attempt} {os.getpid()} {os.environ.get('WORLD_SIZE', '1')} {group}")
    os.replace(tmp, log_dir / f"rank{rank}.attempt")
    tmp = log_dir / f".rank{rank}.pid.tmp"
    tmp.write_text(str(os.getpid()))
    os.replace(tmp, log_dir / f"rank{rank}.pid")
    from tokenloom.train import loop  # lazy: start-up time (rank process only)

    if rank == 0:  # on the launching terminal or pipe
        stdout_outlives_its_reader()
    try:
        # a restart resumes from the newest complete checkpoint, whatever the first attempt was told; so
        # does every start of an elastic job's ranks (a node that joins a running job among them)
        auto = attempt > 0 or elastic
        code = loop.main(["--config", args.config, *(["--set", 'resume="auto"'] if auto else [])])
    except Exception as exc:  # noqa: BLE001 (a bug or a library's error: one line, its traceback in the log)
        report_unexpected(exc, rank, log_dir / f"rank{rank}.log")
    sys.stdout.flush()
    (log_dir / f"rank{rank}.done").write_text(str(code))
    return code


def _stop_outside_steps(signum: int, frame) -> None:
    """A rank's SIGTERM or SIGINT before or after its training steps: one line, and the process ends."""
    rank = os.environ.get("RANK", "0")
    print(f"error: rank {rank}: stopped by {signal_name(signum)} outside the training steps (nothing saved for "
          "it)", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(128 + signum)


TRACEBACK = b"traceback: "
"""Prefix of each line of a rank's unexpected traceback in its log (:func:`report_unexpected`);
the relay of rank 0's log leaves these lines out, as it does ``error: `` lines."""


def report_unexpected(exc: Exception, rank: int, log: Path) -> typing.NoReturn:
    """End a rank on an exception that is not a :class:`TokenloomError`: its traceback goes to the
    log, each line prefixed with :data:`TRACEBACK`, then one ``error:`` line as ``loop.main``
    prints them, and the process exits at once (a dead peer can make process-group teardown block)."""
    lines = traceback.format_exception(exc)
    sys.stderr.write("".join(f"{TRACEBACK.decode()}{line}\n" for line in "".join(lines).splitlines()))
    message = " ".join(f"{type(exc).__name__}: {exc}".split())
    print(f"error: rank {rank}: {message} (traceback in {log})", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(1)


def flag_overrides(*, data: typing.Sequence[str] = (), blend_file: str | None = None, mock_data: bool = False,
                   tokenizer: str | None = None,
                   attention_dropout: float | None = None, hidden_dropout: float | None = None,
                   group_query_attention: bool = False, **fields) -> list[str]:
    """``--set`` overrides for the ``train`` command's convenience flags (None means not given).

    ``data`` holds WEIGHT PREFIX pairs and replaces the data section with that blend, as does
    ``blend_file`` (:func:`~tokenloom.blending.args.load_blend_file`: one blend, its names and its
    data schedule too);
    ``tokenizer`` also sizes ``model.vocab_size`` to it (an explicit ``--set`` wins, as
    it is applied after these). ``fields`` maps flag names to config keys (:data:`FLAG_KEYS`),
    Megatron's spellings of a value becoming ours (:data:`MEGATRON_VALUES`).

    Megatron's two dropouts map onto the model's one (``model.dropout``: embeddings, attention
    probabilities and residual branches): either sets it, and a pair that differs is refused
    naming both. ``group_query_attention`` (Megatron's switch for ``--num-query-groups``) needs
    ``num_query_groups``, which alone sets the key/value heads as it always has here.
    """
    if attention_dropout is not None and hidden_dropout is not None and attention_dropout != hidden_dropout:
        raise TokenloomError(f"--attention-dropout {attention_dropout:g} and --hidden-dropout {hidden_dropout:g} "
                             "differ: the model has one dropout (model.dropout: embeddings, attention probabilities "
                             "and residual branches); give them the same value")
    if fields.get("dropout") is None:
        fields["dropout"] = attention_dropout if attention_dropout is not None else hidden_dropout
    if group_query_attention and fields.get("num_query_groups") is None:
        raise TokenloomError("--group-query-attention needs --num-query-groups N (the key/value heads)")
    out: list[str] = []
    if data and blend_file:
        raise TokenloomError("give the blend either as --data or as --blend-file, not both")
    if blend_file:
        spec = load_blend_file(blend_file)
        if "data_per_split" in spec:
            raise TokenloomError(f"--blend-file {blend_file}: train takes one blend ({{data: [...]}}) that --split "
                                 "divides; a blend per split is for build")
        out += ["data.mock=null", f"data.blend.prefixes={json.dumps([[w, p] for w, p in spec['data']])}"]
        if "names" in spec:
            out.append(f"data.blend.names={json.dumps(spec['names'])}")
        if "schedule" in spec:  # checked here too, so that a bad phase's line names the file
            keys = phase_sources([p for _, p in spec["data"]], spec.get("names"), f"{blend_file}: names")
            resolve_schedule([(p["start_iter"], p["blend"]) for p in spec["schedule"]], keys, "schedule",
                             "the file's data", file=blend_file)
            out.append(f"data.schedule={json.dumps(spec['schedule'])}")
    if data:
        pairs = [[w, p] for w, p in parse_data_args(list(data))]
        out += ["data.mock=null", f"data.blend.prefixes={json.dumps(pairs)}"]
    elif mock_data:
        out += ["data.blend=null", "data.mock={}"]
    if tokenizer is not None:
        out += [f"tokenizer={json.dumps(tokenizer)}", f"model.vocab_size={open_tokenizer(tokenizer).vocab_size}"]
    for name, value in fields.items():
        if value is not None:
            value = MEGATRON_VALUES.get(name, {}).get(value, value)
            out.append(f"{FLAG_KEYS[name]}={json.dumps(value)}")
    if fields.get("bias") is False:  # Megatron's --disable-bias-linear: the linears only, LayerNorm keeps its bias
        out.append("model.norm_bias=true")
    return out


def megatron_swiglu_width(cfg: TrainConfig, swiglu_flag: bool) -> TrainConfig:
    """``cfg`` with Megatron's default SwiGLU width when its ``--swiglu`` flag was given without a
    width (no ``--ffn-hidden-size``, no ``model.ffn_hidden_size``): ``int(4 * h * 2 / 3 / 64) * 64``,
    rounded down as Megatron rounds. ``model.mlp=swiglu`` alone keeps tokenloom's own default
    (:attr:`~tokenloom.train.model.config.GPTConfig.ffn_size`, rounded up, the Llama preset's), so a
    config written for tokenloom builds the model it always built."""
    if not swiglu_flag or cfg.model.ffn_hidden_size is not None:
        return cfg
    width = int(4 * cfg.model.d_model * 2 / 3 / 64) * 64
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, ffn_hidden_size=width))


def check_max_position_embeddings(cfg: TrainConfig, max_position_embeddings: int | None) -> None:
    """Megatron's ``--max-position-embeddings`` is accepted when it covers the run's sequences: the
    model's positions (a learned table or RoPE's tables) have ``model.seq_len`` rows, enough for
    every sample, so a larger value changes nothing trained; a smaller one is refused."""
    if max_position_embeddings is not None and max_position_embeddings < cfg.model.seq_len:
        raise TokenloomError(f"--max-position-embeddings {max_position_embeddings} is shorter than the sequence "
                             f"length {cfg.model.seq_len} (--seq-length): a sample would have positions the model "
                             "lacks; give at least the sequence length")


FLAG_KEYS = {
    "seq_length": "model.seq_len", "num_layers": "model.n_layers", "hidden_size": "model.d_model",
    "num_attention_heads": "model.n_heads", "num_query_groups": "model.n_kv_heads",
    "ffn_hidden_size": "model.ffn_hidden_size", "make_vocab_size_divisible_by": "model.make_vocab_size_divisible_by",
    "kernels": "model.kernels", "train_iters": "train_iters", "micro_batch_size": "micro_batch_size",
    "global_batch_size": "global_batch_size", "lr": "optim.lr", "min_lr": "optim.min_lr",
    "lr_warmup_iters": "optim.warmup_iters", "lr_decay_iters": "optim.lr_decay_iters",
    "weight_decay": "optim.weight_decay", "clip_grad": "optim.grad_clip", "seed": "seed",
    "eval_interval": "eval_interval", "eval_iters": "eval_iters", "log_interval": "log_interval",
    "save_interval": "save_interval", "hang_timeout": "hang_timeout_s",
    "local_save_interval": "local_save_interval", "local_save_dir": "local_save_dir", "output_dir": "output_dir", "resume": "resume",
    "cache_dir": "data.blend.cache_dir", "split": "data.blend.split", "precision": "precision",
    "tp": "tp", "cp": "cp", "ep": "ep", "pp": "pp", "vpp": "vpp", "sp": "sp", "zero1": "zero1", "fsdp": "fsdp",
    "num_layers_in_first_pipeline_stage": "num_layers_in_first_pipeline_stage",
    "num_layers_in_last_pipeline_stage": "num_layers_in_last_pipeline_stage",
    "account_for_embedding_in_pipeline_split": "account_for_embedding_in_pipeline_split",
    "account_for_loss_in_pipeline_split": "account_for_loss_in_pipeline_split",
    "overlap_param_gather": "overlap_param_gather", "fp8": "fp8", "init_from_hf": "init_from_hf",
    "norm": "model.norm", "mlp": "model.mlp", "positions": "model.positions", "rotary_base": "model.rope_theta",
    "tie_embeddings": "model.tie_embeddings", "bias": "model.bias", "dropout": "model.dropout",
    "init_method_std": "model.init_std", "num_experts": "model.num_experts", "moe_router_topk": "model.moe_router_topk",
    "moe_ffn_hidden_size": "model.moe_ffn_hidden_size", "moe_layer_freq": "model.moe_layer_freq",
    "moe_router_load_balancing_type": "model.moe_router_load_balancing_type",
    "moe_aux_loss_coeff": "model.moe_aux_loss_coeff", "moe_z_loss_coeff": "model.moe_z_loss_coeff",
    "moe_grouped_gemm": "model.moe_grouped_gemm", "moe_token_dispatcher_type": "model.moe_token_dispatcher_type",
    "optimizer": "optim.name", "muon_momentum": "optim.muon_momentum", "muon_num_ns_steps": "optim.muon_ns_steps",
    "muon_tp_mode": "optim.muon_tp_mode", "force_optimizer": "force_optimizer",
    "adam_beta1": "optim.beta1", "adam_beta2": "optim.beta2",
    "adam_eps": "optim.eps", "lr_decay_style": "optim.decay_style",
    "lr_wsd_decay_iters": "optim.wsd_decay_iters", "lr_wsd_decay_style": "optim.wsd_decay_style", "tensorboard_dir": "tensorboard_dir",
    "save_on_signal": "save_on_signal", "distributed_backend": "distributed_backend",
    "override_opt_param_scheduler": "override_opt_param_scheduler",
    "wandb_project": "wandb_project", "wandb_exp_name": "wandb_exp_name",
}
"""``train`` flag (its Python name) -> the config key it sets."""

MEGATRON_VALUES = {
    "norm": {"LayerNorm": "layernorm", "RMSNorm": "rmsnorm"},
    "positions": {"learned_absolute": "learned", "rope": "rope"},
}
"""``train`` flag -> Megatron's spelling of a value -> the config's (values not listed pass as they are)."""


if __name__ == "__main__":
    sys.exit(main())
