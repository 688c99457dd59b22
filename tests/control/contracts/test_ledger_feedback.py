"""Tenant feedback beside the ledger (schema versions 4 and 5) and the figures of a rollout
window, on SQLite and PostgreSQL: a tenant rates only its own requests, once, and only those
served under a release it owns; a rating binds to that release; a request that did not end ok is
never a success; the control plane's own requests stay out of windows; version-3 and version-4
ledgers upgrade in place keeping every row; a window counts what the serving side writes, the way
it writes it."""

from __future__ import annotations

import json
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
    TENANT_BUSY_REASON,
    AdapterLoad,
    AlreadyRated,
    Completion,
    Ledger,
    LedgerEntry,
    NotRatable,
    NotTheOwner,
    Outcome,
    p95,
    request_feedback,
    request_ledger,
)
from control.contracts.schema import SchemaOutdated, status, upgrade
from control.contracts.synthetic import GATE_TENANT, PROBE_TENANT
from tests import REPO
from tests.fixtures_control import OnPostgres, OnSQLite

A = "sha256:" + "a" * 64  # the target's adapter
B = "sha256:" + "b" * 64  # the baseline's adapter
R_T = "sha256:" + "1" * 64  # the target release
R_B = "sha256:" + "2" * 64  # the baseline release
R_BASE = "sha256:" + "3" * 64  # a base-only release: no owner
OWNERS = {R_T: "acme", R_B: "acme", R_BASE: None}  # what the routing projection says


def owner_of(release: str) -> str | None:
    return OWNERS.get(release)


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
            _drop_version_6_columns(conn)
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
            entry("t-tb", "acme", at=105.5, outcome="rejected", reason=TENANT_BUSY_REASON),
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
        assert (w.requests, w.ok, w.failed, w.busy, w.memory_refusals) == (7, 2, 1, 2, 1)
        assert w.identity_mismatches == 2  # its own, and the baseline's whose slot held A
        assert (w.load_failures, w.rated, w.successes) == (1, 2, 1)
        assert w.p95_latency_s == pytest.approx(2.0)
        base = ledger.release_window(R_B, B, 100.0, 160.0)
        # its own, and the target's whose slot held B
        assert (base.requests, base.ok, base.identity_mismatches) == (2, 1, 2)
        assert ledger.unattributed_busy(100.0, 160.0) == 1


    # -- whose ratings count, and for what (issue 21) ------------------------------------------

    def _served(self, ledger: Ledger, rid: str, tenant: str, outcome: str = Outcome.OK, *,
                at: float = 200.0, release: str | None = R_T) -> None:
        ledger.admit([entry(rid, tenant, at=at, release=release)])
        ledger.complete([Completion(rid, outcome)], now=at + 0.5)

    def test_only_the_releases_owner_rates_it(self, ledger: Ledger) -> None:
        self._served(ledger, "own-1", "acme")
        self._served(ledger, "granted-1", "globex")  # globex uses acme's alias: acme's release
        self._served(ledger, "base-1", "globex", release=R_BASE)
        self._served(ledger, "norelease-1", "globex", release=None)
        with pytest.raises(NotTheOwner):
            ledger.rate("granted-1", "globex", False, owner_of=owner_of)
        for rid in ("base-1", "norelease-1"):
            with pytest.raises(NotTheOwner):
                ledger.rate(rid, "globex", True, owner_of=owner_of)
        assert ledger.rating("granted-1") is None and ledger.rating("base-1") is None
        rating = ledger.rate("own-1", "acme", True, owner_of=owner_of)
        assert rating.release_digest == R_T
        assert ledger.rating("own-1") == rating

    def test_a_granted_tenant_cannot_decide_the_owners_rollout(self, ledger: Ledger) -> None:
        """The reviewer's two cases: a granted tenant's bad ratings against a canary its owner
        rated all good, and its good ratings flipping the success source to feedback on a
        canary that failed 10 of 40 requests in the engine."""
        for i in range(10):
            self._served(ledger, f"own-{i}", "acme")
            ledger.rate(f"own-{i}", "acme", True, owner_of=owner_of)
        for i in range(20):
            self._served(ledger, f"theirs-{i}", "globex")
            with pytest.raises(NotTheOwner):
                ledger.rate(f"theirs-{i}", "globex", False, owner_of=owner_of)
        w = ledger.release_window(R_T, A, 150.0, 300.0)
        assert (w.rated, w.successes) == (10, 10)  # the owner's 100 % stands
        for i in range(40):
            self._served(ledger, f"late-{i}", "globex",
                         Outcome.FAILED if i < 10 else Outcome.OK, at=400.0)
            with pytest.raises(NotTheOwner):
                ledger.rate(f"late-{i}", "globex", True, owner_of=owner_of)
        w = ledger.release_window(R_T, A, 350.0, 450.0)
        assert (w.requests, w.ok, w.failed, w.rated) == (40, 30, 10, 0)  # no feedback to use

    def test_a_request_that_did_not_end_ok_is_never_a_success(self, ledger: Ledger) -> None:
        # (rated without an owner lookup: the trusted callers' path; the owner is acme anyway)
        for rid, outcome in (("f-1", Outcome.FAILED), ("m-1", Outcome.IDENTITY_MISMATCH),
                             ("c-1", Outcome.CANCELLED), ("ok-1", Outcome.OK)):
            self._served(ledger, rid, "acme", outcome)
            ledger.rate(rid, "acme", True)  # recorded as the tenant said
        ledger.admit([entry("r-1", "acme", at=200.0, outcome="rejected", reason="busy")])
        ledger.rate("r-1", "acme", True)
        ledger.admit([entry("run-1", "acme", at=200.0)])  # a stream still running
        ledger.rate("run-1", "acme", True)
        w = ledger.release_window(R_T, A, 150.0, 300.0)
        # five finished rated requests, one ok: one success; the running one is not judged yet
        assert (w.rated, w.successes) == (5, 1)
        ledger.complete([Completion("run-1", Outcome.OK)], now=201.0)
        w = ledger.release_window(R_T, A, 150.0, 300.0)
        assert (w.rated, w.successes) == (6, 2)

    def test_a_rating_binds_to_the_release_that_served_the_request(
            self, engine: Engine, ledger: Ledger) -> None:
        self._served(ledger, "own-1", "acme")
        ledger.rate("own-1", "acme", True)
        # a host that rewrites its row afterwards does not carry the rating to another arm
        with engine.begin() as conn:
            conn.execute(request_ledger.update().where(
                request_ledger.c.request_id == "own-1").values(release_digest=R_B))
        moved = ledger.release_window(R_B, B, 150.0, 300.0)
        assert (moved.requests, moved.rated) == (1, 0)
        assert ledger.release_window(R_T, A, 150.0, 300.0).rated == 0

    def test_synthetic_requests_stay_out_of_the_window(self, ledger: Ledger) -> None:
        self._served(ledger, "tenant-1", "acme")
        self._served(ledger, "gate-1", GATE_TENANT)
        self._served(ledger, "gate-2", GATE_TENANT, Outcome.FAILED)
        ledger.admit([entry("probe-1", PROBE_TENANT, at=200.0, outcome="rejected",
                            reason=BUSY_REASON)])
        self._served(ledger, "gate-mm", GATE_TENANT, Outcome.IDENTITY_MISMATCH)
        with pytest.raises(NotRatable):  # no tenant is the synthetic one
            ledger.rate("gate-1", "acme", True)
        w = ledger.release_window(R_T, A, 150.0, 300.0)
        assert (w.requests, w.ok, w.failed, w.busy, w.synthetic) == (1, 1, 0, 0, 4)
        assert w.identity_mismatches == 1  # the engine's fault, whoever asked

    def test_a_version_4_ledger_upgrades_and_its_old_ratings_count_for_nothing(
            self, engine: Engine, ledger: Ledger, settings: Settings) -> None:
        self._served(ledger, "old-1", "globex")  # rated by a granted tenant before version 5
        self._served(ledger, "old-2", "acme")
        with engine.begin() as conn:  # the ledger as version 4 left it
            request_feedback.drop(conn)
            sa.Table("request_feedback", sa.MetaData(),
                     sa.Column("request_id", sa.String(36), primary_key=True),
                     sa.Column("tenant", sa.String(128), nullable=False),
                     sa.Column("success", sa.Boolean, nullable=False),
                     sa.Column("rated_at", sa.Float, nullable=False)).create(conn)
            conn.execute(sa.text("INSERT INTO request_feedback VALUES "
                                 "('old-1', 'globex', :f, 1.0), ('old-2', 'acme', :t, 1.0)"),
                         {"f": False, "t": True})
            _drop_version_6_columns(conn)
            conn.execute(schema.versions.update().where(
                schema.versions.c.component == "ledger").values(version=4))
        found = {s.component: s for s in status(engine, (LEDGER,))}["ledger"]
        assert (found.found, found.state) == (4, "outdated")
        with pytest.raises(SchemaOutdated, match="version 4"):
            Ledger(engine)
        # the operator's command, as the services' refusal names it
        from typer.testing import CliRunner

        from control.cli.main import app

        done = CliRunner().invoke(app, ["--home", str(settings.home), "--json", "db",
                                        "upgrade"], env={"LORAPLANE_DB_URL": settings.db_url})
        assert done.exit_code == 0, done.output
        changes = {c["component"]: c for c in json.loads(done.stdout)}
        assert LEDGER.latest == 7
        assert (changes["ledger"]["action"], status(engine, (LEDGER,))[0].found) == (
            "upgraded", 7)
        again = Ledger(engine)
        kept = again.rating("old-1")
        assert kept is not None and kept.release_digest is None and kept.success is False
        w = again.release_window(R_T, A, 150.0, 300.0)
        assert (w.requests, w.rated) == (2, 0)  # unchecked ratings count for no window
        self._served(again, "new-1", "acme")
        again.rate("new-1", "acme", True, owner_of=owner_of)
        assert again.release_window(R_T, A, 150.0, 300.0).rated == 1


def _drop_version_6_columns(conn: sa.Connection) -> None:
    """The request ledger as it stood before version 6 (no sampling values, nor version 7's
    index)."""
    conn.exec_driver_sql("DROP INDEX ix_ledger_base_time")
    for column in ("max_tokens", "temperature", "top_p", "seed"):
        conn.exec_driver_sql(f"ALTER TABLE request_ledger DROP COLUMN {column}")


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
    # wherever in the serving package the service writes its refusals
    service = "\n".join(f.read_text() for f in sorted((REPO / "backend" / "serving").glob("*.py")))
    cache = "\n".join((REPO / "backend" / "serving" / name).read_text()
                      for name in ("cache.py", "cache_entries.py"))  # where it refuses
    assert f'reason="{BUSY_REASON}"' in service and '"adapter_{e.reason}"' in service
    cache_reasons = set(re.findall(r'CacheRefused\("([a-z_]+)"', cache))
    assert {r.removeprefix("adapter_") for r in MEMORY_REFUSALS} <= cache_reasons
    assert {"no_room", "device_budget", "tenant_share"} == {
        r.removeprefix("adapter_") for r in MEMORY_REFUSALS}
