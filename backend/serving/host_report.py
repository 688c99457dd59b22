"""A Triton host's status, written to ``host_status`` every few seconds for the operator console.

What the console's Hosts page shows of a host beyond its ledger rows: which adapters its device
slots and its host tier hold (digests and bytes, the requests holding each), how many loads are
waiting, its batch and queue, its KV positions, and the health figures of ``LoraService.health``.
Each figure comes from the service's public accessors (the cache's ``report`` and ``usage``, the
scheduler's ``load`` and ``kv_reserved``); the row's schema and its reader are in
``control.contracts.host_status``.

The depth of the load queue is read from the cache's report, as the placement metrics read it:
an adapter that is not in a slot yet while requests hold references to it is waiting for its
load (a request takes its reference before the load starts). The cache's own count of queued
loads has no public accessor.

The reporter runs on its own daemon thread and never touches the request path: a report that
cannot be read or written is logged (once, until one succeeds again) and tried again the next
period; serving goes on either way.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from control.contracts.db import make_engine
from control.contracts.host_status import (
    REPORT_INTERVAL_S,
    HostStatus,
    HostStatusTable,
    SlotEntry,
)

log = logging.getLogger("loraplane.backend.host_report")


class StatusSink(Protocol):
    def put(self, status: HostStatus) -> None: ...


def status_of(service: Any, started_at: float, now: float) -> HostStatus:
    """The status of a running :class:`backend.serving.service.LoraService` at ``now``."""
    report = service.cache.report()
    usage = service.cache.usage()
    running, waiting = service.scheduler.load()
    device, host_tier = [], []
    pending, waiters = 0, 0
    for d, r in sorted(report.items()):
        if r.tier == "device":
            device.append(SlotEntry(d, int(r.resident_bytes), int(r.active_requests),
                                    bool(r.revoked)))
        elif r.active_requests > 0 and not r.revoked:
            pending += 1  # referenced, not in a slot yet: its requests wait for its load
            waiters += int(r.active_requests)
        if r.host_bytes:
            host_tier.append(SlotEntry(d, int(r.host_bytes), int(r.active_requests),
                                       bool(r.revoked)))
    return HostStatus(
        host=service.host, reported_at=now, started_at=started_at,
        slots_total=int(service.engine.max_adapters), device=tuple(device),
        host_tier=tuple(host_tier), pending_loads=pending, load_waiters=waiters,
        load_queue_max=int(service.cache.quota.max_pending_loads), running=running,
        waiting=waiting, kv_tokens_reserved=int(service.scheduler.kv_reserved()),
        kv_tokens_budget=service.limits.max_kv_tokens,
        device_bytes=int(usage["device"]), device_budget=int(service.cache.budgets.device_bytes),
        host_bytes=int(usage["host"]), host_budget=int(service.cache.budgets.host_bytes),
        health=dict(service.health()))


class HostReporter:
    """Writes the service's status every ``interval_s`` from a thread of its own."""

    def __init__(self, service: Any, sink: Callable[[], StatusSink], *,
                 interval_s: float = REPORT_INTERVAL_S,
                 clock: Callable[[], float] = time.time) -> None:
        """``sink`` opens where reports go; called on the reporter's thread, and again after a
        failure, so a database that is down at start does not hold up the service."""
        self.service = service
        self.open_sink = sink
        self.interval_s = interval_s
        self.clock = clock
        self.started_at = clock()
        self.failing = False  # the last report failed (and that was logged)
        self._sink: StatusSink | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def into(cls, db_url: str, service: Any) -> HostReporter:
        """Reports ``service``'s status into ``host_status`` of the database at ``db_url``."""
        return cls(service, lambda: HostStatusTable(make_engine(db_url)))

    def start(self) -> HostReporter:
        self._thread = threading.Thread(target=self._run, name="host-report", daemon=True)
        self._thread.start()
        return self

    def close(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None

    def _run(self) -> None:
        while not self._stop.is_set():
            self.report_once()
            self._stop.wait(self.interval_s)

    def report_once(self) -> bool:
        """Read the status and write it; False (logged once per outage) when either failed."""
        try:
            if self._sink is None:
                self._sink = self.open_sink()
            self._sink.put(status_of(self.service, self.started_at, self.clock()))
        except Exception:
            self._sink = None  # opened afresh next time: the table may be created meanwhile
            if not self.failing:
                log.warning("could not write this host's status report (serving goes on; "
                            "retrying every %.0f s)", self.interval_s, exc_info=True)
            self.failing = True
            return False
        if self.failing:
            log.info("this host's status reports are written again")
        self.failing = False
        return True
