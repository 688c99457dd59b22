"""A clock for the tests' "in force within 1 s" checks that leaves out the time the test process
itself was frozen.

The product promises that a credential change bites at every gateway within 1 s of the command
starting; nominally it takes 10-30 ms here. On a busy CI machine the test process can be frozen
for over a second (the host deschedules it, or a full garbage collection of a suite-sized heap
holds the interpreter), and a wall clock then blames the product for time nothing of it ran.
A ticker thread notices such freezes as gaps between its ticks; ``counted`` subtracts them from
the wall time. Waits on the database are not freezes (the process is runnable while it waits, so
the ticker keeps ticking): a slow command or a slow projection still counts in full.
"""

from __future__ import annotations

import threading
import time
from types import TracebackType


class StallClock:
    """``with StallClock() as clock:`` ticks every ``tick_s`` on a daemon thread and records
    each gap longer than ``stall_s`` as a freeze."""

    def __init__(self, tick_s: float = 0.005, stall_s: float = 0.1) -> None:
        self.tick_s = tick_s
        self.stall_s = stall_s
        self._freezes: list[tuple[float, float]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._tick, name="stall-clock", daemon=True)

    def __enter__(self) -> StallClock:
        self._thread.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._stop.set()
        self._thread.join()

    def _tick(self) -> None:
        last = time.monotonic()
        while not self._stop.wait(self.tick_s):
            now = time.monotonic()
            if now - last > self.stall_s:
                with self._lock:  # frozen from one tick after the last until now
                    self._freezes.append((last + self.tick_s, now))
            last = now

    def frozen_between(self, start: float, end: float) -> float:
        """Seconds of [start, end] (``time.monotonic()`` values) during which the ticker could
        not run. Waits a few ticks first, so that a freeze that has just ended is recorded."""
        time.sleep(3 * self.tick_s)
        with self._lock:
            return sum(max(0.0, min(b, end) - max(a, start)) for a, b in self._freezes)

    def counted(self, since: float) -> tuple[float, float]:
        """(seconds since ``since`` that the process was running, seconds it was frozen)."""
        now = time.monotonic()
        frozen = self.frozen_between(since, now)
        return now - since - frozen, frozen
