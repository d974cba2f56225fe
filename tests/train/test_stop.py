"""StopOnSignal in one process: the first signal asks for a stop, the second ends the process."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

from tl_testing import limit_s

REPO = Path(__file__).resolve().parents[2]


def test_first_signal_asks_the_second_ends_the_process_at_once():
    code = ("import os, signal\nfrom tokenloom.train.stop import StopOnSignal\nstop = StopOnSignal(1)\n"
            "print(stop.agreed(), flush=True)\nos.kill(os.getpid(), signal.SIGTERM)\n"
            "print(stop.agreed(), flush=True)\nos.kill(os.getpid(), signal.SIGINT)\nprint('survived', flush=True)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=limit_s(120))
    assert done.returncode == -signal.SIGINT, done.stderr
    assert done.stdout.split() == ["None", str(int(signal.SIGTERM))]
    assert done.stderr.strip() == "SIGTERM: saving a checkpoint at the end of the step (send it again to stop at once)"


def test_close_restores_the_handlers():
    from tokenloom.train.stop import StopOnSignal

    before = signal.getsignal(signal.SIGINT)
    stop = StopOnSignal(1)
    assert signal.getsignal(signal.SIGINT) is not before
    stop.close()
    assert signal.getsignal(signal.SIGINT) is before
