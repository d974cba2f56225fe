"""Helpers shared by every test folder (``tests/`` is on pytest's ``pythonpath``).

Test folders have no ``__init__.py`` and several have a ``conftest.py``, so
``from conftest import ...`` would be ambiguous; shared code lives here instead.
"""

from __future__ import annotations

import atexit
import io
import json
import multiprocessing
import os
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

TIMEOUT_SCALE = float(os.environ.get("TL_TIMEOUT_SCALE", "1"))
"""Every timeout of the suite is multiplied by ``$TL_TIMEOUT_SCALE`` (default 1): pytest-timeout's per
test (``tests/conftest.py``), ``run_cli``'s, and the rank launchers' hang deadlines (:func:`limit_s`).
``TL_TIMEOUT_SCALE=0.333 bash scripts/test.sh`` proves that every test fits in a third of its timeout
here, so a machine three times slower still passes. Collective timeouts inside ranks are not scaled:
they bound one wait on a peer, not the test's work."""

DEADLINES: list[tuple[str, float, float]] = []
"""``(what, seconds taken, limit in seconds)`` of each timed wait since ``tests/conftest.py`` last moved
them onto the running test's report (:func:`timed`); the conftest prints the tightest ratios."""


def limit_s(seconds: float) -> float:
    """A timeout of ``seconds`` on this suite's scale (:data:`TIMEOUT_SCALE`)."""
    return seconds * TIMEOUT_SCALE


@contextmanager
def timed(what: str, seconds: float) -> Iterator[float]:
    """Yield the scaled limit for a wait of at most ``seconds``, and record how long the block took
    against it (:data:`DEADLINES`): a wait inside a test has a timeout of its own, tighter than the test's,
    and the suite's timing check must see it too."""
    limit = limit_s(seconds)
    start = time.monotonic()
    try:
        yield limit
    finally:
        DEADLINES.append((what, time.monotonic() - start, limit))


FORK_PRELOAD = ["tokenloom.cli", "torch", "torch.distributed", "torch._dynamo", "torch.optim", "tokenloom.train.loop",
                "frozen_heap"]
"""What the fork server of test ranks and ``cli.py`` commands imports once (``tokenloom.cli`` first, as
``cli.py`` does: it imports numpy with one BLAS thread; ``torch._dynamo``: torch's optimizers load it when
they are built; ``frozen_heap`` last: what the others made, frozen out of the forked processes' collections)."""


def rank_context():
    """The ``multiprocessing`` context test ranks start in: ranks fork from one ``forkserver`` per
    test process that has imported :data:`FORK_PRELOAD` once, where a spawned rank re-imports
    torch and the run (seconds of CPU that every launch of the multi-rank suites paid again). A
    forked rank is as fresh as a spawned one (the server is a new interpreter that ran only those
    imports); its environment is the server's from its start, so a launcher passes its own
    (:func:`apply_environ`)."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(FORK_PRELOAD)  # read when the server starts: this process's first launch
    return ctx


def apply_environ(environ: dict[str, str]) -> None:
    """In a rank: take the launching process's environment (``dict(os.environ)`` there)."""
    os.environ.clear()
    os.environ.update(environ)


@contextmanager
def reaped(*procs: subprocess.Popen) -> Iterator[None]:
    """Kill and reap every one of ``procs`` still running when the block ends (its wait timed out,
    an assertion failed): no test leaves a process behind."""
    try:
        yield
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def shared_data_dir() -> Path:
    """``$TOKENLOOM_SHARED_DATA`` or ``../shared/data`` beside the repository."""
    return Path(os.environ.get("TOKENLOOM_SHARED_DATA", REPO.parent / "shared" / "data"))


def run_cli(*args, cwd: Path | None = None, timeout: float = 300, env: dict | None = None
            ) -> subprocess.CompletedProcess:
    """Run ``python cli.py ARGS`` as a user would and return what it printed and its exit status; this
    checkout comes first on ``PYTHONPATH``, so processes it starts (torchrun's ranks) import it too.
    The command runs in a process forked from the warm server of :func:`rank_context`
    (:func:`cli_in_fork`): a fresh interpreter that has only imported :data:`FORK_PRELOAD`, where a new
    ``python`` would spend a second of CPU importing torch first; ``env`` (default :func:`cli_env`) is
    applied there. An ``env`` that changes what acts at interpreter start (:func:`starts_alike`: a fault
    planted by ``sitecustomize`` on ``PYTHONPATH``, thread counts) runs a new ``python``."""
    argv = [str(a) for a in args]
    with timed(f"cli.py {argv[0] if argv else ''}", timeout) as limit:
        if env is not None and not starts_alike(env):
            return subprocess.run([sys.executable, str(REPO / "cli.py"), *argv], capture_output=True, text=True,
                                  cwd=cwd, timeout=limit, env=env)
        return cli_in_fork(argv, cwd, limit, env)


def starts_alike(env: dict[str, str]) -> bool:
    """``env`` agrees with :func:`cli_env` on every variable read when an interpreter or torch starts
    (``PYTHON*``, ``LD_*``, ``*_NUM_THREADS``, ``TORCH*``), so a process forked from the warm server
    behaves as a new one started with it."""
    def start_keys(e: dict[str, str]) -> dict[str, str]:
        return {k: v for k, v in e.items() if k.startswith(("PYTHON", "LD_", "TORCH")) or k.endswith("_NUM_THREADS")}
    return start_keys(env) == start_keys(cli_env())


def cli_in_fork(argv: list[str], cwd: Path | None, limit: float, env: dict[str, str] | None = None
                ) -> subprocess.CompletedProcess:
    """``cli.py ARGV`` in a process of :func:`rank_context`'s server with ``env`` (default :func:`cli_env`), ``cwd`` and
    stdout and stderr in files; killed after ``limit`` seconds (:class:`subprocess.TimeoutExpired`, as
    ``subprocess.run``)."""
    cmd = [sys.executable, str(REPO / "cli.py"), *argv]
    with tempfile.TemporaryDirectory() as tmp:
        out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
        proc = rank_context().Process(target=_cli_main, args=(argv, str(cwd or os.getcwd()), env or cli_env(), str(out),
                                                              str(err)))
        proc.start()
        proc.join(limit)
        if proc.is_alive():
            proc.kill()
            proc.join()
            raise subprocess.TimeoutExpired(cmd, limit, output=out.read_text(), stderr=err.read_text())
        return subprocess.CompletedProcess(cmd, proc.exitcode, out.read_text(), err.read_text())


def _cli_main(argv: list[str], cwd: str, environ: dict[str, str], out: str, err: str) -> None:
    """In the forked process: become ``python cli.py ARGV`` (environment, directory, argv, stdout and
    stderr on files as on pipes: block-buffered and line-buffered), run it and exit with its status
    after the exit handlers a new interpreter would run."""
    apply_environ(environ)
    os.chdir(cwd)
    for fd, path in ((1, out), (2, err)):
        os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False))
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), errors="backslashreplace", line_buffering=True)
    sys.argv = [str(REPO / "cli.py"), *argv]
    code = 0
    try:
        from tokenloom.cli import main
        main()
    except SystemExit as exc:
        if isinstance(exc.code, int) or exc.code is None:
            code = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def one_line_error(done: subprocess.CompletedProcess, *fragments: str) -> str:
    """The command failed with exactly one stderr line holding every fragment, no traceback."""
    assert done.returncode != 0, done.stdout
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), done.stderr
    assert "Traceback" not in done.stdout + done.stderr
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    return lines[0]


def cli_env() -> dict[str, str]:
    """This process's environment with the checkout first on ``PYTHONPATH``."""
    path = os.environ.get("PYTHONPATH")
    return dict(os.environ, PYTHONPATH=str(REPO) + (os.pathsep + path if path else ""))


def fault_env(op: str, err: int, path: str | Path, room: int = 0, count: int = 1) -> dict[str, str]:
    """:func:`cli_env` plus an operating-system fault (``tests/fault_site/sitecustomize.py``):
    ``op`` (open, write, fsync, rename) on files matching the glob ``path`` fails with ``err``;
    ``signal`` sends signal ``err`` to the process group at the ``count``-th open of such a file."""
    env = cli_env()
    env["PYTHONPATH"] = env["PYTHONPATH"] + os.pathsep + str(REPO / "tests" / "fault_site")
    env["TOKENLOOM_TEST_FAULT"] = json.dumps({"op": op, "errno": err, "path": str(path), "room": room,
                                              "count": count})
    return env


def import_megatron(module: str):
    """Import a megatron.core module quietly, or skip the test when megatron-core is missing or
    fails to import (the ``[interop]`` extra; under ``CI=true`` the skip fails the run)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return pytest.importorskip(module, reason="megatron-core not installed or not importable "
                                   "(pip install -e '.[interop]')", exc_type=ImportError)


# --------------------------------------------------------------------------- object storage

ACCESS_DENIED = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>AccessDenied</Code>'
                 b"<Message>Access Denied</Message></Error>")
BAD_KEY = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>InvalidAccessKeyId</Code>'
           b"<Message>The AWS Access Key Id you provided does not exist in our records.</Message></Error>")
SLOW_DOWN = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code>'
             b"<Message>Please reduce your request rate.</Message></Error>")
S3_KEY = "testing"
"""The access key (and secret) the test server accepts; any other key is refused with 403 InvalidAccessKeyId."""


def closed_port() -> int:
    """A local port nothing listens on (an unreachable endpoint)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class S3Server:
    """moto's S3 on 127.0.0.1 in a thread (the ``s3`` fixture of ``conftest.py`` starts one per module).

    ``deny`` holds (methods, path prefix, path suffix) rules answered with ``403 AccessDenied`` (a
    bucket policy that denies, seen by the client exactly as from a real store); a request signed
    with an access key other than :data:`S3_KEY` is answered ``403 InvalidAccessKeyId``.
    """

    def __init__(self):
        import threading

        from moto.moto_server import werkzeug_app as moto_server
        from werkzeug.serving import make_server

        self.deny: list[tuple[set[str], str, str]] = []
        app = moto_server.DomainDispatcherApplication(moto_server.create_backend_app)

        def refuse(start_response, method: str, body: bytes):
            body = b"" if method == "HEAD" else body
            start_response("403 Forbidden", [("Content-Type", "application/xml"), ("Content-Length", str(len(body)))])
            return [body]

        def guarded(environ, start_response):
            path, method = environ.get("PATH_INFO", ""), environ["REQUEST_METHOD"]
            auth = environ.get("HTTP_AUTHORIZATION", "")
            if "Credential=" in auth and f"Credential={S3_KEY}/" not in auth:
                return refuse(start_response, method, BAD_KEY)
            if any(method in methods and path.startswith(start) and path.endswith(end)
                   for methods, start, end in self.deny):
                return refuse(start_response, method, ACCESS_DENIED)
            return app(environ, start_response)

        self.server = make_server("127.0.0.1", 0, guarded, threaded=True,
                                  request_handler=moto_server.MotoRequestHandler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def env(self, endpoint: str | None = None, key: str = S3_KEY) -> dict[str, str]:
        """:func:`cli_env` with only this server's endpoint and credentials among the AWS variables."""
        env = cli_env()
        for name in list(env):
            if name.startswith("AWS_"):
                del env[name]
        env.update(AWS_ENDPOINT_URL=endpoint or self.endpoint, AWS_ACCESS_KEY_ID=key,
                   AWS_SECRET_ACCESS_KEY=key, AWS_DEFAULT_REGION="us-east-1")
        return env

    def fs(self):
        import s3fs

        return s3fs.S3FileSystem(key=S3_KEY, secret=S3_KEY, skip_instance_cache=True,
                                 client_kwargs={"endpoint_url": self.endpoint})

    def close(self) -> None:
        self.server.shutdown()
        self.thread.join()


class FaultProxy:
    """An HTTP proxy on 127.0.0.1 in front of ``upstream`` (a thread): every request waits ``latency``
    seconds, and a share ``drop`` of them fails, half by closing the connection without an answer and
    half with ``503 SlowDown`` (what a loaded S3 answers); a seeded draw, so runs see a similar mix.
    ``requests`` and ``dropped`` count what it saw; ``log`` holds each request's (method, path, Range)."""

    def __init__(self, upstream: str, drop: float = 0.0, latency: float = 0.0, seed: int = 0):
        import http.client
        import random
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
        from urllib.parse import urlsplit

        target = urlsplit(upstream)
        rng, lock, proxy = random.Random(seed), threading.Lock(), self
        self.requests = self.dropped = 0
        self.log: list[tuple[str, str, str | None]] = []

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # quiet
                pass

            def relay(self):
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                if latency:
                    time.sleep(latency)
                with lock:
                    draw = rng.random()
                    proxy.requests += 1
                    proxy.log.append((self.command, self.path, self.headers.get("Range")))
                    proxy.dropped += draw < drop
                if draw < drop / 2:
                    self.close_connection = True  # no answer at all
                    return
                if draw < drop:
                    self.send_response(503)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(0 if self.command == "HEAD" else len(SLOW_DOWN)))
                    self.end_headers()
                    if self.command != "HEAD":
                        self.wfile.write(SLOW_DOWN)
                    return
                conn = http.client.HTTPConnection(target.hostname, target.port, timeout=60)
                try:
                    conn.request(self.command, self.path, body, dict(self.headers))
                    answer = conn.getresponse()
                    data = answer.read()
                finally:
                    conn.close()
                self.send_response(answer.status)
                for name, value in answer.getheaders():
                    if name.lower() not in ("transfer-encoding", "connection", "content-length", "date", "server"):
                        self.send_header(name, value)
                size = answer.getheader("Content-Length") if self.command == "HEAD" else None
                self.send_header("Content-Length", size if size is not None else str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = relay

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()


def patch_datatrove_xxhash(monkeypatch) -> None:
    """datatrove 0.10 (a test oracle of ``--dedup minhash``) hashes ``str`` with xxhash, whose 4.x API
    takes only bytes: give it the UTF-8 bytes, which is what xxhash 3.x hashed for a ``str``."""
    import xxhash  # lazy: only the dedup oracle tests need it
    from datatrove.utils.hashes import xxhash as module  # lazy: a test-only oracle

    monkeypatch.setattr(module, "xxhash64", lambda s: xxhash.xxh64_intdigest(s.encode() if isinstance(s, str) else s))
