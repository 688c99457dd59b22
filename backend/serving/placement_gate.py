"""The engine's lock as adapter placements take it, so that they are let in between steps.

Each batch step holds the engine's lock, and the scheduler takes it again for the next step
microseconds after releasing it. Python's locks are not fair: a load waiting to place its
adapter in a slot (``AdapterCache._place``) could lose that race step after step, and with Zipf
traffic over 1,000 adapters a request waited a quarter of a second (p95) for its load to get
in. Placements enter through :class:`PlacementGate`, which counts those waiting; between steps
the scheduler lets them in first (:meth:`PlacementGate.let_in`, bounded), so a load waits for
at most the step in progress.
"""

from __future__ import annotations

import threading
from types import TracebackType

LET_IN_S = 0.05  # the longest a step waits for placements to get in


class PlacementGate:
    """A context manager over ``lock`` (reentrant) that counts the threads waiting for it."""

    def __init__(self, lock: threading.RLock) -> None:
        self.lock = lock
        self._cv = threading.Condition()
        self._waiting = 0

    def __enter__(self) -> PlacementGate:
        with self._cv:
            self._waiting += 1
        try:
            self.lock.acquire()
        finally:  # in (or failed): no longer waiting
            with self._cv:
                self._waiting -= 1
                if self._waiting == 0:
                    self._cv.notify_all()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.lock.release()

    def let_in(self, timeout_s: float = LET_IN_S) -> bool:
        """Between steps, not holding the lock: wait until every placement waiting now has got
        in, at most ``timeout_s``; False if one still waits."""
        with self._cv:
            return self._cv.wait_for(lambda: self._waiting == 0, timeout_s)


def let_placements_in(engine: object) -> None:
    """The scheduler's call between steps: ``engine``'s placements first, if it has a gate."""
    gate = getattr(engine, "placement_lock", None)
    if isinstance(gate, PlacementGate):
        gate.let_in()
