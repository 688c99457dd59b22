"""The stall clock leaves out exactly the time the process was frozen, and nothing else: a wait
on another process (a database, a server) is counted in full."""

from __future__ import annotations

import os
import signal
import subprocess
import time

from tests.stall_clock import StallClock


def test_a_frozen_process_is_left_out_and_a_wait_is_not() -> None:
    with StallClock() as clock:
        start = time.monotonic()
        time.sleep(0.3)  # waiting, as on a query: runnable, so counted
        elapsed, frozen = clock.counted(start)
        assert frozen == 0.0 and elapsed >= 0.3

        # Freeze the whole process as a busy host does: SIGSTOP, and SIGCONT from outside.
        thaw = subprocess.Popen(["sh", "-c", f"sleep 0.4; kill -CONT {os.getpid()}"])
        frozen_at = time.monotonic()
        os.kill(os.getpid(), signal.SIGSTOP)
        thaw.wait(timeout=10)
        elapsed, frozen = clock.counted(frozen_at)
        wall = time.monotonic() - frozen_at
        assert 0.25 <= frozen <= wall, (frozen, wall)
        assert abs(elapsed + frozen - wall) < 0.05
        assert elapsed < 0.2, elapsed  # what ran after the thaw, not the freeze
