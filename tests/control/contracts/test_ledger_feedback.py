"""Tenant feedback beside the ledger (schema version 4) and the figures of a rollout window, on
SQLite and PostgreSQL: a tenant rates only its own requests, once; a version-3 ledger upgrades in
place keeping every row; a window counts what the serving side writes, the way it writes it."""

from __future__ import annotations

import re

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Engine

from control.contracts import schema
from control.contracts.config import Settings
from control.contracts.db import make_engine
from control.contracts.ledger import (
    BUSY_REASON,
    LEDGER,
    MEMORY_REFUSALS,
    AdapterLoad,
    AlreadyRated,
    Completion,
    Ledger,
    LedgerEntry,
    NotRatable,
    Outcome,
    p95,
    request_feedback,
)
from control.contracts.schema import SchemaOutdated, status, upgrade
from tests import REPO
from tests.fixtures_control import OnPostgres, OnSQLite

A = "sha256:" + "a" * 64  # the target's adapter
B = "sha256:" + "b" * 64  # the baseline's adapter
R_T = "sha256:" + "1" * 64  # the target release
R_B = "sha256:" + "2" * 64  # the baseline release


def entry(rid: str, tenant: str | None, *, at: float, release: str | None = R_T,
          adapter: str | None = A, outcome: str = "running",
          reason: str | None = None) -> LedgerEntry:
    return LedgerEntry(request_id=rid, ticket_id="t", tenant=tenant, model="lora_llm",
                       host="h1", base_digest=None, adapter_digest=adapter,
                       tokenizer_digest=None, admitted_at=at, outcome=outcome, reason=reason,
                       release_digest=release)


class FeedbackContract:
    @pytest.fixture
    def engine(self, settings: Settings) -> Engine:
        return make_engine(settings.db_url)

    @pytest.fixture
    def ledger(self, engine: Engine) -> Ledger:
        led = Ledger(engine)
        led.admit([entry("acme-1", "acme", at=10.0), entry("globex-1", "globex", at=10.0),
                   entry("busy-1", None, at=10.0, release=None, adapter=None,
                         outcome="rejected", reason="busy")])
        return led

    def test_a_tenant_rates_its_own_request_once(self, ledger: Ledger) -> None:
        rating = ledger.rate("acme-1", "acme", False, now=12.5)
        assert (rating.success, rating.rated_at) == (False, 12.5)
        with pytest.raises(AlreadyRated):
            ledger.rate("acme-1", "acme", True)
        stored = ledger.rating("acme-1")
        assert stored is not None and stored.success is False  # the first rating stays

    def test_another_tenants_request_and_an_unknown_one_are_one_refusal(
            self, ledger: Ledger) -> None:
        for rid, tenant in (("globex-1", "acme"), ("nope", "acme"), ("busy-1", "acme")):
            with pytest.raises(NotRatable):
                ledger.rate(rid, tenant, True)
        assert ledger.rating("globex-1") is None and ledger.rating("busy-1") is None

    def test_a_version_3_ledger_upgrades_keeping_every_row(self, engine: Engine,
                                                           ledger: Ledger) -> None:
        ledger.complete([Completion("acme-1", Outcome.OK, 3, 4)], now=11.0)
        with engine.begin() as conn:  # the ledger as version 3 left it
            request_feedback.drop(conn)
            conn.execute(schema.versions.update().where(
                schema.versions.c.component == "ledger").values(version=3))
        with pytest.raises(SchemaOutdated, match="version 3"):
            Ledger(engine)
        changes = {c.component: c for c in upgrade(engine, rebuild=None, components=(LEDGER,))}
        assert (changes["ledger"].before, changes["ledger"].after,
                changes["ledger"].action) == (3, LEDGER.latest, "upgraded")
        assert sa.inspect(engine).has_table("request_feedback")
        again = Ledger(engine)
        assert [r.request_id for r in again.query()] == ["acme-1", "busy-1", "globex-1"]
        again.rate("acme-1", "acme", True)
        again_changes = upgrade(engine, rebuild=None, components=(LEDGER,))
        assert [(c.component, c.action) for c in again_changes] == [("ledger", "current")]

    def test_an_unstamped_version_3_ledger_is_read_as_3(self, engine: Engine,
                                                        ledger: Ledger) -> None:
        with engine.begin() as conn:
            request_feedback.drop(conn)
            conn.execute(schema.versions.delete())
        found = {s.component: s for s in status(engine, (LEDGER,))}["ledger"]
        assert (found.found, found.stamped, found.state) == (3, False, "outdated")

    def test_a_window_counts_the_serving_sides_rows(self, ledger: Ledger) -> None:
        rows = [
            entry("t-ok-1", "acme", at=100.0), entry("t-ok-2", "acme", at=101.0),
            entry("t-fail", "acme", at=102.0),
            entry("t-mm", "acme", at=103.0),
            entry("t-busy", "acme", at=104.0, outcome="rejected", reason=BUSY_REASON),
            entry("t-oom", "acme", at=105.0, outcome="rejected", reason="adapter_no_room"),
            entry("t-late", "acme", at=160.0),  # after the window
            entry("b-ok", "acme", at=100.5, release=R_B, adapter=B),
            # the ticket named the baseline, the slot held the target's adapter
            entry("b-mm", "acme", at=106.0, release=R_B, adapter=B),
            entry("host-busy", None, at=107.0, release=None, adapter=None, outcome="rejected",
                  reason=BUSY_REASON),
        ]
        ledger.admit(rows)
        ledger.complete([Completion("t-ok-1", Outcome.OK), Completion("b-ok", Outcome.OK)],
                        now=100.5 + 0.25)
        ledger.complete([Completion("t-ok-2", Outcome.OK)], now=101.0 + 2.0)
        ledger.complete([Completion("t-fail", Outcome.FAILED),
                         Completion("t-mm", Outcome.IDENTITY_MISMATCH, served_digest=B),
                         Completion("b-mm", Outcome.IDENTITY_MISMATCH, served_digest=A),
                         Completion("t-late", Outcome.OK)], now=150.0)
        ledger.record_load(AdapterLoad("h1", A, 100.2, 0.1, "failed", reason="corrupt"))
        ledger.record_load(AdapterLoad("h1", A, 100.3, 0.1, "loaded", 10))
        ledger.record_load(AdapterLoad("h1", A, 99.0, 0.1, "failed"))  # before the window
        ledger.rate("t-ok-1", "acme", True)
        ledger.rate("t-ok-2", "acme", False)
        w = ledger.release_window(R_T, A, 100.0, 160.0)
        assert (w.requests, w.ok, w.failed, w.busy, w.memory_refusals) == (6, 2, 1, 1, 1)
        assert w.identity_mismatches == 2  # its own, and the baseline's whose slot held A
        assert (w.load_failures, w.rated, w.successes) == (1, 2, 1)
        assert w.p95_latency_s == pytest.approx(2.0)
        base = ledger.release_window(R_B, B, 100.0, 160.0)
        # its own, and the target's whose slot held B
        assert (base.requests, base.ok, base.identity_mismatches) == (2, 1, 2)
        assert ledger.unattributed_busy(100.0, 160.0) == 1


class TestFeedbackSQLite(OnSQLite, FeedbackContract):
    pass


class TestFeedbackPostgres(OnPostgres, FeedbackContract):
    pass


def test_p95_is_the_nearest_rank() -> None:
    assert p95([]) is None and p95([3.0]) == 3.0
    assert p95([float(i) for i in range(1, 101)]) == 95.0
    assert p95([float(i) for i in range(1, 21)]) == 19.0


def test_the_refusal_reasons_a_window_counts_are_the_ones_serving_writes() -> None:
    """``BUSY_REASON`` and ``MEMORY_REFUSALS`` name what backend/serving writes on the ledger:
    the service's busy refusals and ``adapter_`` + the cache's out-of-room reasons."""
    service = (REPO / "backend" / "serving" / "service.py").read_text()
    cache = (REPO / "backend" / "serving" / "cache.py").read_text()
    assert f'reason="{BUSY_REASON}"' in service and '"adapter_{e.reason}"' in service
    cache_reasons = set(re.findall(r'CacheRefused\("([a-z_]+)"', cache))
    assert {r.removeprefix("adapter_") for r in MEMORY_REFUSALS} <= cache_reasons
    assert {"no_room", "device_budget", "tenant_share"} == {
        r.removeprefix("adapter_") for r in MEMORY_REFUSALS}
