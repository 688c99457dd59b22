"""Revocation, pushed to the host: applied without waiting for a request, and reported once.

A watcher thread reads the governance snapshot every ``watch_interval_s`` (and on PostgreSQL
wakes on the projection follower's NOTIFY), so an idle host purges, drains and unloads a revoked
adapter and records the three steps within a second of the revocation. Requests queued on the
digest are refused; running ones drain, or, for the kill switch, end before their next token
(``backend.serving.scheduler``). The steps are recorded off the request path, on one thread of
their own, through the ``RevocationSteps`` the service was given. The service is typed by
:class:`WatchedService`, what this desk uses of it, not by importing ``backend.serving.service``:
the service imports this module, and tests/test_architecture.py refuses the cycle even under
``TYPE_CHECKING``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

from backend.serving.cache import AdapterCache
from backend.serving.load_records import LoadRecords
from backend.serving.requests import RevocationSteps
from backend.serving.scheduler import Scheduler
from control.contracts.config import Settings
from control.contracts.ledger import AdapterLoad, Ledger
from projections.host_view import ChangeListener, GovernanceState, HostGovernance

log = logging.getLogger("loraplane.backend")


class ResidentAdapters(Protocol):
    """What the watch asks of the engine: which digests are resident now."""

    def resident_adapters(self) -> dict[str, int]: ...


class WatchedService(Protocol):
    """What :class:`RevocationWatch` uses of ``backend.serving.service.LoraService``."""

    @property
    def settings(self) -> Settings: ...
    @property
    def host(self) -> str: ...
    @property
    def governance(self) -> HostGovernance: ...
    @property
    def ledger(self) -> Ledger: ...
    @property
    def cache(self) -> AdapterCache: ...
    @property
    def scheduler(self) -> Scheduler: ...
    @property
    def engine(self) -> ResidentAdapters: ...

    def _apply_governance(self, state: GovernanceState) -> None: ...


class RevocationWatch:
    """Applies one service's new revocations, and records its serving steps for each."""

    def __init__(self, service: WatchedService, start: GovernanceState,
                 steps: Callable[[Settings], RevocationSteps], listener: ChangeListener,
                 interval_s: float) -> None:
        self.service = service
        # Revoked before this process started: never resident here, nothing to drain or report.
        self._known_revoked: frozenset[str] = start.revoked
        self._known_killed: frozenset[str] = start.killed
        self._governance_lock = threading.Lock()
        self._reported: set[str] = set()
        self._reported_lock = threading.Lock()
        self._open_step_log = steps
        self._step_log: RevocationSteps | None = None
        self._steps = ThreadPoolExecutor(max_workers=1, thread_name_prefix="revocation-steps")
        # the cache's load records, written off its threads; a revocation's unload is reported
        # once its record is written
        self._loads = LoadRecords(service.ledger, self._written)
        self.closing = threading.Event()
        self.listener = listener
        self.interval_s = interval_s

    def watch(self) -> None:
        """Apply governance changes until closed, without waiting for a request."""
        failing = False
        while not self.closing.is_set():
            self.listener.wait(self.interval_s, self.closing)
            if self.closing.is_set():
                return
            try:
                self.service._apply_governance(self.service.governance.current())
                failing = False
            except Exception:
                if not failing:  # once per outage, not ten times a second
                    log.warning("cannot read governance state; retrying", exc_info=True)
                failing = True

    def apply(self, state: GovernanceState) -> None:
        """Apply revocations that are new to this host: purge now; refuse queued requests;
        unload once drained, or, for the kill switch, end running requests first."""
        with self._governance_lock:
            fresh = (state.revoked - self._known_revoked) | (state.killed - self._known_killed)
            if not fresh:
                return
            self._known_revoked = self._known_revoked | state.revoked
            self._known_killed = self._known_killed | state.killed
        svc = self.service
        for digest in sorted(fresh):
            svc.cache.revoke(digest)
            svc.scheduler.revoke(digest, immediate=digest in state.killed)
            if digest not in svc.engine.resident_adapters():
                # Never resident here, or unloaded at once: nothing left to drain on this host.
                self.report(digest)

    def record_load(self, digest: str, outcome: str, started: float, seconds: float,
                    nbytes: int | None, reason: str | None) -> None:
        """The cache's load event, on the ledger (``backend.serving.load_records``); an
        unload for revocation completes the digest's steps on this host."""
        self._loads.put(AdapterLoad(self.service.host, digest, started, seconds, outcome,
                                    nbytes, reason=reason))

    def _written(self, load: AdapterLoad) -> None:
        if load.outcome == "unloaded" and load.reason == "revoked":
            self.report(load.adapter_digest)

    def report(self, digest: str) -> None:
        """Record drained, purged, unloaded for ``digest`` on this host, once, off the hot path."""
        with self._reported_lock:
            if digest in self._reported:
                return
            self._reported.add(digest)
        self._steps.submit(self._record_serving_steps, digest)

    def _record_serving_steps(self, digest: str) -> None:
        svc = self.service
        try:
            if self._step_log is None:
                self._step_log = self._open_step_log(svc.settings)
            done = self._step_log.done(digest, svc.host)
            for step in ("drained", "purged", "unloaded")[len(done):]:
                self._step_log.record(digest, svc.host, step)
        except Exception:
            log.exception("could not record the revocation steps of this host")

    def close_steps(self) -> None:
        """Wait for the load records and the steps already handed over to be recorded."""
        self._loads.close()
        self._steps.shutdown(wait=True)
