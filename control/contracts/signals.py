"""Stopping long-running processes on SIGTERM / SIGINT without deadlocking.

A signal handler runs in the main thread between two bytecodes of whatever it interrupted. If
the handler calls ``threading.Event.set()`` while the main thread is inside ``Event.wait()`` (in
the middle of re-acquiring the event's lock), the handler blocks on that same lock forever: the
follower process once hung this way on SIGTERM in CI. So the handler here only appends to a
list (atomic, takes no lock), and the main thread polls it with ``time.sleep``, which a signal
interrupts cleanly.
"""

from __future__ import annotations

import signal
import time
from types import FrameType, TracebackType
from typing import Any

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class TerminationSignals:
    """``with TerminationSignals() as term: ...; term.wait()``: SIGTERM and SIGINT are noted
    (not raised) while the block runs; the previous handlers come back afterwards."""

    def __init__(self) -> None:
        self._received: list[int] = []
        self._previous: dict[int, Any] = {}

    def _note(self, signum: int, _frame: FrameType | None) -> None:
        self._received.append(signum)  # nothing that takes a lock: see the module notes

    def __enter__(self) -> TerminationSignals:
        for s in SIGNALS:
            self._previous[s] = signal.signal(s, self._note)
        return self

    def __exit__(self, _t: type[BaseException] | None, _e: BaseException | None,
                 _tb: TracebackType | None) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)

    @property
    def received(self) -> int | None:
        """The first signal noted, or None."""
        return self._received[0] if self._received else None

    def wait(self, poll_s: float = 0.2) -> int:
        """Block until a signal is noted; return its number."""
        while not self._received:
            time.sleep(poll_s)
        return self._received[0]
