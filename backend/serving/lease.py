"""One owned handle per admitted request: its adapter's cache reference and slot pin.

Why one handle: the cache's reference (nothing evicts the adapter) and the engine's pin (nothing
reuses its slot) protect the same thing, so they are taken together and given back together,
exactly once. Before this handle they were two counters decremented from two places, and a
failing decode step that ended a job twice released them twice: the count fell to zero under a
queued request, another tenant's adapter took the slot, and the request was answered with the
wrong weights under the right name (issue 10).

Rules:

- ``release()`` gives every part back the first time and is a no-op afterwards. A second call is
  never a second decrement; it is counted as ``double_release`` (a caller lost track of who owns
  the handle), so tests and metrics see it.
- A counter that would go negative, or a pin on a slot that no longer holds the pinned load, is
  a broken invariant: :class:`InvariantViolation` is raised, counted in :class:`Violations`, and
  the value is never clamped.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

log = logging.getLogger("loraplane.lease")

# The kinds of broken invariants; metric labels come only from this list.
VIOLATION_KINDS = (
    "double_release",  # a lease released again (no-op)
    "double_finish",  # a scheduler job ended again (no-op)
    "negative_ref",  # a cache reference count would go below zero
    "negative_pin",  # a slot pin count would go below zero
    "pinned_unload",  # an unload asked for a slot that live sequences pin
    "stale_slot",  # a row's slot no longer holds the load it was admitted on
    "slot_weights",  # a slot's weights no longer sum what was placed (backend.serving.fingerprint)
)


class InvariantViolation(RuntimeError):
    """A lease, pin or job invariant broke; the serving path must not carry on as if not."""


class Violations:
    """Thread-safe counts of broken invariants, by kind (exported as a metric)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(VIOLATION_KINDS, 0)

    def count(self, kind: str, detail: str = "") -> None:
        if kind not in self._counts:
            raise ValueError(f"unknown violation kind {kind!r}")
        with self._lock:
            self._counts[kind] += 1
        log.error("invariant violation %s %s", kind, detail)

    def raise_(self, kind: str, message: str) -> None:
        """Count ``kind`` and raise :class:`InvariantViolation` (loudly, never clamped)."""
        self.count(kind, message)
        raise InvariantViolation(f"{kind}: {message}")

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)

    @property
    def total(self) -> int:
        with self._lock:
            return sum(self._counts.values())


class Lease:
    """A request's hold on one adapter: released once, whatever path ends the request.

    ``digest`` is None for a base-model request, whose lease holds nothing but is still owned
    and released like any other, so every path treats every request alike.
    """

    def __init__(self, digest: str | None, violations: Violations) -> None:
        self.digest = digest
        self._violations = violations
        self._parts: list[Callable[[], None]] = []
        self._lock = threading.Lock()
        self._released = False

    def attach(self, give_back: Callable[[], None]) -> None:
        """Add one part (a cache reference, a slot pin) to give back on release."""
        with self._lock:
            if self._released:
                # Taking a hold through a released lease would leak it: give it back now.
                give_back()
                self._violations.raise_("double_release",
                                        "a part was attached to a released lease")
            self._parts.append(give_back)

    @property
    def released(self) -> bool:
        with self._lock:
            return self._released

    def release(self) -> bool:
        """Give back every part, newest first; True the first time, False (counted) after."""
        with self._lock:
            if self._released:
                self._violations.count("double_release", f"lease on {self.digest}")
                return False
            self._released = True
            parts, self._parts = self._parts[::-1], []
        errors: list[BaseException] = []
        for give_back in parts:
            try:
                give_back()
            except BaseException as e:  # every part is given back even if one breaks
                errors.append(e)
        if errors:
            raise errors[0]
        return True
