"""SIGTERM / SIGINT stop long-running processes, and never deadlock doing so."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from control.contracts.signals import TerminationSignals
from tests import REPO

ROOT = REPO


def test_signal_is_noted_not_raised_and_handlers_come_back() -> None:
    before = signal.getsignal(signal.SIGTERM)
    with TerminationSignals() as term:
        assert term.received is None
        threading.Timer(0.05, os.kill, (os.getpid(), signal.SIGTERM)).start()
        assert term.wait(poll_s=0.01) == signal.SIGTERM
        os.kill(os.getpid(), signal.SIGINT)  # noted too, not a KeyboardInterrupt
        time.sleep(0.05)
        assert term.received == signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) is before


def test_follower_process_exits_on_sigterm_whenever_it_arrives(tmp_path: Path) -> None:
    """The follower once hung for good when SIGTERM landed while its loop was waiting on the
    stop event (Event.set() from a handler, on the lock the main thread held). Signals sent at
    different moments of its loop must each end the process promptly with status 0."""
    env = {**os.environ, "LORAPLANE_HOME": str(tmp_path / "home"),
           "LORAPLANE_DB_URL": f"sqlite:///{tmp_path / 'home' / 'loraplane.db'}"}
    for delay in (0.0, 0.03, 0.07, 0.11, 0.16):
        proc = subprocess.Popen([sys.executable, "-m", "projections.follower"], env=env,
                                cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 60
            assert proc.stdout is not None
            line = b""
            while b"following the event store" not in line and time.monotonic() < deadline:
                line = proc.stdout.readline()
            time.sleep(delay)
            proc.send_signal(signal.SIGTERM)
            out, _ = proc.communicate(timeout=20)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        assert proc.returncode == 0, out.decode(errors="replace")[-2000:]
        assert b"stopped at position" in out
