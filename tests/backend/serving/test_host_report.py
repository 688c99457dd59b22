"""A host's status report (``backend.serving.host_report``): what it reads from the service, that
a failing database never reaches serving, that the row is replaced in place, and, through a real
``LoraService`` on the kit, that an adapter a request loaded is in the report's device slots."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from backend.serving.cache import CacheBudgets, CacheQuota, DigestReport
from backend.serving.host_report import HostReporter, status_of
from backend.serving.service import IncomingRequest
from control.contracts.config import Settings
from control.contracts.db import make_engine
from control.contracts.host_status import HostStatus, HostStatusTable, SlotEntry
from tests.serving_home import Sink, provision_home

A, B, C, D = ("sha256:" + ch * 64 for ch in "abcd")
MIB = 1 << 20


def _digest(digest: str, tier: str, *, device: int = 0, host: int = 0, active: int = 0,
            revoked: bool = False) -> DigestReport:
    return DigestReport(digest=digest, tier=tier, tenant="acme", resident_bytes=device,
                        host_bytes=host, store_bytes=0, active_requests=active, hits=0,
                        misses=0, loads=0, load_failures=0, last_load_seconds=None,
                        evictions={}, revoked=revoked)


@dataclass
class StandIn:
    """The parts of a LoraService a report reads."""

    report: dict[str, DigestReport]
    host: str = "h-1"
    health_figures: dict[str, int] = field(default_factory=lambda: {"violations": 0})

    def __post_init__(self) -> None:
        report = self.report
        self.cache = type("Cache", (), {
            "report": lambda _s: report, "usage": lambda _s: {"device": 8 * MIB,
                                                               "host": 3 * MIB, "store": 0},
            "budgets": CacheBudgets(device_bytes=16 * MIB, host_bytes=64 * MIB),
            "quota": CacheQuota(max_pending_loads=64)})()
        self.scheduler = type("Sched", (), {"load": lambda _s: (2, 5),
                                            "kv_reserved": lambda _s: 300})()
        self.limits = type("Limits", (), {"max_kv_tokens": 4096})()
        self.engine = type("Eng", (), {"max_adapters": 4})()

    def health(self) -> dict[str, int]:
        return self.health_figures


def test_the_report_reads_slots_tiers_and_the_load_queue() -> None:
    service = StandIn({
        A: _digest(A, "device", device=4 * MIB, host=MIB, active=2),
        B: _digest(B, "device", device=4 * MIB, host=2 * MIB, revoked=True, active=1),
        C: _digest(C, "store", active=3),  # its requests wait for its load
        D: _digest(D, "none", revoked=True),  # a revoked tombstone: in no tier
    })
    st = status_of(service, started_at=10.0, now=12.5)
    assert st.device == (SlotEntry(A, 4 * MIB, 2), SlotEntry(B, 4 * MIB, 1, revoked=True))
    assert [e.digest for e in st.host_tier] == [A, B] and st.host_tier[1].bytes == 2 * MIB
    assert (st.pending_loads, st.load_waiters, st.load_queue_max) == (1, 3, 64)
    assert (st.running, st.waiting, st.slots_total) == (2, 5, 4)
    assert (st.kv_tokens_reserved, st.kv_tokens_budget) == (300, 4096)
    assert (st.device_bytes, st.device_budget, st.host_bytes, st.host_budget) == (
        8 * MIB, 16 * MIB, 3 * MIB, 64 * MIB)
    assert (st.host, st.reported_at, st.started_at) == ("h-1", 12.5, 10.0)
    assert st.health == {"violations": 0}


def test_the_row_is_replaced_in_place_and_read_back(tmp_path: Path) -> None:
    table = HostStatusTable(make_engine(f"sqlite:///{tmp_path / 'db.sqlite'}"))
    first = HostStatus("h-1", 100.0, 90.0, 4, device=(SlotEntry(A, 5, 1),), pending_loads=2,
                       health={"violations": 0})
    table.put(first)
    table.put(HostStatus("h-2", 101.0, 90.0, 2))
    later = HostStatus("h-1", 102.0, 90.0, 4, host_tier=(SlotEntry(B, 7, 0),),
                       health={"ledger_backlog": 3})
    table.put(later)
    assert table.all() == [later, HostStatus("h-2", 101.0, 90.0, 2)]
    assert [s.host for s in table.all(since=101.5)] == ["h-1"]


class Flaky:
    """A sink that fails while ``down`` is set, and counts how often it was opened."""

    def __init__(self) -> None:
        self.down = True
        self.opened = 0
        self.written: list[HostStatus] = []

    def open(self) -> Flaky:
        self.opened += 1
        if self.down:
            raise OSError("database unreachable")
        return self

    def put(self, status: HostStatus) -> None:
        if self.down:
            raise OSError("database unreachable")
        self.written.append(status)


def test_a_failing_database_is_logged_once_and_retried(caplog: pytest.LogCaptureFixture) -> None:
    sink = Flaky()
    reporter = HostReporter(StandIn({}), sink.open, interval_s=60.0)
    with caplog.at_level(logging.INFO, logger="loraplane.backend.host_report"):
        assert [reporter.report_once() for _ in range(3)] == [False, False, False]
        warned = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warned) == 1 and "serving goes on" in warned[0].getMessage()
        assert sink.opened == 3  # opened afresh each period: the table may appear meanwhile
        sink.down = False
        assert reporter.report_once() and reporter.report_once()
        assert len(sink.written) == 2 and sink.opened == 4  # kept open once it works
        assert any("written again" in r.getMessage() for r in caplog.records)
        sink.down = True
        assert not reporter.report_once()  # a new outage is logged again
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 2


def test_a_report_that_cannot_be_read_does_not_raise() -> None:
    class Broken(StandIn):
        def health(self) -> dict[str, int]:
            raise RuntimeError("lock poisoned")

    sink = Flaky()
    sink.down = False
    reporter = HostReporter(Broken({}), sink.open, interval_s=60.0)
    assert reporter.report_once() is False and sink.written == []


def test_the_thread_reports_every_period_and_stops_when_closed() -> None:
    sink = Flaky()
    sink.down = False
    reporter = HostReporter(StandIn({}), sink.open, interval_s=0.05).start()
    deadline = time.monotonic() + 10
    while len(sink.written) < 3 and time.monotonic() < deadline:
        time.sleep(0.02)
    reporter.close()
    assert len(sink.written) >= 3
    assert not any(t.name == "host-report" and t.is_alive() for t in threading.enumerate())
    written = len(sink.written)
    time.sleep(0.2)
    assert len(sink.written) == written


def test_a_loaded_adapter_is_in_a_real_services_report(kit_dir: Path, tmp_path: Path) -> None:
    settings = Settings(home=tmp_path, db_url=f"sqlite:///{tmp_path / 'loraplane.db'}")
    home = provision_home(settings, kit_dir)
    svc = home.service(host="report-host", max_adapters=4)
    try:
        table = HostStatusTable(make_engine(settings.db_url))
        reporter = HostReporter(svc, lambda: table)
        assert reporter.report_once()
        (empty,) = table.all()
        assert (empty.host, empty.slots_total, empty.device) == ("report-host", 4, ())
        sink = Sink()
        svc.submit(IncomingRequest(b"Hi", home.ticket("acme", "acme-alpha"), max_tokens=2),
                   sink)
        answer = sink.wait()
        assert answer.ok, answer
        assert reporter.report_once()
        (st,) = table.all()
        digest = home.digests["alpha"]
        assert [e.digest for e in st.device] == [digest]
        assert st.device[0].bytes > 0 and st.device[0].active == 0  # its request has ended
        assert digest in [e.digest for e in st.host_tier]
        assert (st.pending_loads, st.running, st.waiting) == (0, 0, 0)
        assert st.device_bytes == st.device[0].bytes and st.health["violations"] == 0
    finally:
        svc.close()
