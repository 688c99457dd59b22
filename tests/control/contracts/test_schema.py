"""Schema versions and ``loraplane db status|upgrade``, on SQLite and on PostgreSQL.

``SchemaContract`` is one suite; each backend subclasses it and provides ``settings`` (a fresh
PostgreSQL schema per test there).
"""

from __future__ import annotations

import dataclasses
import json
import threading
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Engine
from typer.testing import CliRunner

from control.app.integrity import AUDIT
from control.app.registry import NotYetVisible, Registry
from control.cli.main import app
from control.contracts import (
    host_status,  # noqa: F401  (declares its schema component)
    ledger_log,  # noqa: F401  (declares its schema component)
    replica_claims,  # noqa: F401  (declares its schema component)
    schema,
    serving_reports,  # noqa: F401  (declares its schema component)
    ticket_seals,  # noqa: F401  (declares its schema component)
)
from control.contracts.config import Settings
from control.contracts.db import make_engine
from control.contracts.ledger import LEDGER, Completion, Ledger, LedgerEntry, Outcome
from control.contracts.schema import (
    SchemaOutdated,
    SchemaTooNew,
    open_component,
    status,
    upgrade,
)
from projections import tables as projection_tables
from projections.follower import ProjectionFollower, open_registry, snapshot
from projections.tables import PROJECTIONS, create_tables
from tests.fixtures_control import (
    Artifacts,
    OnPostgres,
    OnSQLite,
    close_registry,
)

D = "sha256:" + "1" * 64
RELEASE = "sha256:" + "2" * 64

# The ledger as the release before schema versions created it (version 1), written out here
# rather than derived from the code under test.
_v1 = sa.MetaData()
V1_LEDGER = sa.Table(
    "request_ledger", _v1,
    sa.Column("request_id", sa.String(36), primary_key=True),
    sa.Column("ticket_id", sa.String(64), nullable=True),
    sa.Column("tenant", sa.String(128), nullable=True),
    sa.Column("model", sa.String(128), nullable=False),
    sa.Column("host", sa.String(128), nullable=False),
    sa.Column("base_digest", sa.String(71), nullable=True),
    sa.Column("adapter_digest", sa.String(71), nullable=True),
    sa.Column("tokenizer_digest", sa.String(71), nullable=True),
    sa.Column("admitted_at", sa.Float, nullable=False),
    sa.Column("finished_at", sa.Float, nullable=True),
    sa.Column("tokens_in", sa.Integer, nullable=True),
    sa.Column("tokens_out", sa.Integer, nullable=True),
    sa.Column("outcome", sa.String(16), nullable=False),
    sa.Column("reason", sa.String(64), nullable=True),
    sa.Index("ix_ledger_adapter_time", "adapter_digest", "admitted_at"),
    sa.Index("ix_ledger_time", "admitted_at"),
)
V1_LOADS = sa.Table(
    "adapter_loads", _v1,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("host", sa.String(128), nullable=False),
    sa.Column("adapter_digest", sa.String(71), nullable=False, index=True),
    sa.Column("started_at", sa.Float, nullable=False),
    sa.Column("seconds", sa.Float, nullable=False),
    sa.Column("outcome", sa.String(16), nullable=False),
    sa.Column("resident_bytes", sa.BigInteger, nullable=True),
    sa.Column("reason", sa.String(64), nullable=True),
)


def _v1_rows(n: int) -> list[dict[str, Any]]:
    return [dict(request_id=f"r{i:04d}", ticket_id=f"t{i}", tenant=("acme", "globex")[i % 2],
                 model="lora_llm", host="h1", base_digest=D, adapter_digest=D if i % 3 else None,
                 tokenizer_digest=D, admitted_at=1000.0 + i, finished_at=1001.0 + i,
                 tokens_in=i, tokens_out=2 * i, outcome=("ok", "rejected")[i % 5 == 0],
                 reason=None if i % 5 else "signature") for i in range(n)]


def _make_v1(engine: Engine, *, stamped: bool, n: int = 57) -> list[dict[str, Any]]:
    """A version-1 ledger holding ``n`` requests and two loads; ``stamped``: with its version
    row (else as the release before schema versions left it: tables only)."""
    rows = _v1_rows(n)
    with engine.begin() as conn:
        _v1.create_all(conn)
        conn.execute(V1_LEDGER.insert(), rows)
        conn.execute(V1_LOADS.insert(), [
            dict(host="h1", adapter_digest=D, started_at=1.0, seconds=0.5, outcome="loaded",
                 resident_bytes=10, reason=None),
            dict(host="h1", adapter_digest=D, started_at=2.0, seconds=0.1, outcome="failed",
                 resident_bytes=None, reason="digest")])
        if stamped:
            schema.versions.create(conn)
            conn.execute(schema.versions.insert().values(
                component="ledger", version=1, upgraded_at=sa.func.now()))
    return rows


def _by_component(engine: Engine) -> dict[str, schema.ComponentStatus]:
    return {s.component: s for s in status(engine)}


def _cli(settings: Settings, *args: str) -> Any:
    return CliRunner().invoke(app, ["--home", str(settings.home), *args],
                              env={"LORAPLANE_DB_URL": settings.db_url})


class SchemaContract:
    @pytest.fixture
    def engine(self, settings: Settings) -> Engine:
        return make_engine(settings.db_url)

    # -- fresh databases ------------------------------------------------------------------------

    def test_fresh_database_is_created_at_the_latest_version(self, engine: Engine) -> None:
        assert {s.state for s in status(engine)} == {"absent"}
        Ledger(engine)
        create_tables(engine)
        found = _by_component(engine)
        assert (found["ledger"].found, found["ledger"].stamped) == (LEDGER.latest, True)
        assert (found["projections"].found, found["projections"].stamped) == (
            PROJECTIONS.latest, True)
        assert found["audit"].state == "absent"  # created by the audit seal when first used
        columns = {c["name"] for c in sa.inspect(engine).get_columns("request_ledger")}
        assert "release_digest" in columns
        changes = upgrade(engine, rebuild=None)
        assert [(c.component, c.action) for c in changes] == [
            ("ledger", "current"), ("ledger_log", "created"), ("audit", "created"),
            ("projections", "current"), ("serving_reports", "created"),
            ("ticket_seals", "created"), ("host_status", "created"),
            ("adapter_replicas", "created")]
        assert {s.state for s in status(engine)} == {"current"}

    def test_concurrent_first_opens_create_once(self, engine: Engine) -> None:
        errors: list[BaseException] = []

        def open_all() -> None:
            try:
                Ledger(engine)
                create_tables(engine)
            except BaseException as e:  # reported below
                errors.append(e)

        threads = [threading.Thread(target=open_all) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        assert {s.component: s.state for s in status(engine)} == {
            "ledger": "current", "ledger_log": "absent", "audit": "absent",
            "projections": "current", "serving_reports": "absent",
            "ticket_seals": "absent", "host_status": "absent", "adapter_replicas": "absent"}

    def test_audit_seal_creates_its_table_stamped(self, engine: Engine,
                                                  settings: Settings) -> None:
        from control.app.integrity import AuditSeal
        from projections.follower import open_registry
        from tests.fixtures_control import close_registry

        reg = open_registry(settings, follow=False)
        try:
            AuditSeal.for_registry(reg)
        finally:
            close_registry(reg)
        audit = _by_component(engine)["audit"]
        assert (audit.found, audit.stamped) == (AUDIT.latest, True)

    # -- the ledger, version 1 -> latest --------------------------------------------------------

    @pytest.mark.parametrize("stamped", [False, True], ids=["previous-release", "stamped-v1"])
    def test_v1_ledger_upgraded_without_losing_a_row(self, engine: Engine, settings: Settings,
                                                     stamped: bool) -> None:
        rows = _make_v1(engine, stamped=stamped)
        found = _by_component(engine)["ledger"]
        assert (found.found, found.stamped, found.state) == (1, stamped, "outdated")
        # Opening it fails fast with what to do, rather than on a missing column later.
        with pytest.raises(SchemaOutdated) as e:
            Ledger(engine)
        assert "'ledger'" in str(e.value) and "version 1" in str(e.value)
        assert f"expects version {LEDGER.latest}" in str(e.value)
        assert "loraplane db upgrade" in str(e.value)

        changes = {c.component: c for c in upgrade(engine, rebuild=None)}
        assert (changes["ledger"].before, changes["ledger"].after,
                changes["ledger"].action) == (1, LEDGER.latest, "upgraded")
        insp = sa.inspect(engine)
        columns = {c["name"] for c in insp.get_columns("request_ledger")}
        assert {"release_digest", "served_digest"} <= columns
        indexes = [i["column_names"] for i in insp.get_indexes("request_ledger")]
        assert ["release_digest", "admitted_at"] in indexes
        assert ["served_digest", "admitted_at"] in indexes
        ledger = Ledger(engine)
        kept = ledger.query()
        assert [{k: getattr(r, k) for k in rows[0]} for r in kept] == rows
        assert all(r.release_digest is None and r.served_digest is None for r in kept)
        assert [load.outcome for load in ledger.loads()] == ["loaded", "failed"]
        # The new column works.
        ledger.admit([LedgerEntry("new", "t", "acme", "lora_llm", "h1", D, D, D, 5000.0,
                                  release_digest=RELEASE)])
        assert [r.request_id for r in ledger.query(release=RELEASE)] == ["new"]
        # The widened outcome holds the longest outcome (PostgreSQL enforces the length).
        ledger.complete([Completion("new", Outcome.IDENTITY_MISMATCH, 1, 1,
                                    reason="stale_slot", served_digest=RELEASE)])
        row = ledger.get("new")
        assert row is not None and row.outcome == "identity_mismatch"
        assert [r.request_id for r in ledger.query(adapter=RELEASE)] == ["new"]

        # Idempotent: a second upgrade changes nothing.
        again = upgrade(engine, rebuild=None)
        assert {c.component: c.action for c in again}["ledger"] == "current"
        assert len(ledger.query()) == len(rows) + 1

    def test_failed_upgrade_leaves_version_1_whole(self, engine: Engine,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
        """The ALTER TABLE and the version row commit together or not at all."""
        rows = _make_v1(engine, stamped=True, n=7)
        real_step = LEDGER.steps[1]

        def crash_after_alter(conn: sa.Connection) -> None:
            real_step(conn)
            raise RuntimeError("killed mid-upgrade")

        monkeypatch.setitem(LEDGER.steps, 1, crash_after_alter)
        with pytest.raises(RuntimeError, match="killed"):
            upgrade(engine, rebuild=None)
        assert "release_digest" not in {
            c["name"] for c in sa.inspect(engine).get_columns("request_ledger")}
        assert _by_component(engine)["ledger"].found == 1
        monkeypatch.setitem(LEDGER.steps, 1, real_step)
        upgrade(engine, rebuild=None)
        assert len(Ledger(engine).query()) == len(rows)

    def test_v1_ledger_through_the_cli(self, engine: Engine, settings: Settings) -> None:
        _make_v1(engine, stamped=False, n=5)
        result = _cli(settings, "--json", "db", "status")
        assert result.exit_code == 1, result.output
        states = {r["component"]: r for r in json.loads(result.stdout)}
        assert (states["ledger"]["found"], states["ledger"]["state"]) == (1, "outdated")
        assert "db upgrade" in states["ledger"]["note"]
        # Long-running commands refuse to start on it, naming the fix.
        serve = _cli(settings, "serve")
        assert serve.exit_code == 2
        assert "loraplane db upgrade" in serve.output.replace("\n", " ")
        result = _cli(settings, "--json", "db", "upgrade")
        assert result.exit_code == 0, result.output
        assert {r["component"]: r["action"] for r in json.loads(result.stdout)}["ledger"] == (
            "upgraded")
        assert _cli(settings, "db", "status").exit_code == 0
        assert len(Ledger(engine).query()) == 5

    # -- newer than this code -------------------------------------------------------------------

    def test_newer_version_is_refused_and_left_alone(self, engine: Engine,
                                                     settings: Settings) -> None:
        Ledger(engine)
        with engine.begin() as conn:
            conn.execute(schema.versions.update().where(schema.versions.c.component == "ledger")
                         .values(version=LEDGER.latest + 1))
        with pytest.raises(SchemaTooNew) as e:
            Ledger(engine)
        msg = str(e.value)
        assert "'ledger'" in msg and f"version {LEDGER.latest + 1}" in msg
        assert f"expects version {LEDGER.latest}" in msg and "do not downgrade" in msg
        with pytest.raises(SchemaTooNew):
            upgrade(engine, rebuild=None)
        found = _by_component(engine)
        assert found["ledger"].found == LEDGER.latest + 1
        assert found["audit"].state == "absent"  # upgrade changed nothing at all
        result = _cli(settings, "db", "upgrade")
        assert result.exit_code == 2 and "SchemaTooNew" in result.output
        assert _cli(settings, "db", "status").exit_code == 1

    def test_newer_projections_refused_on_open(self, engine: Engine) -> None:
        create_tables(engine)
        with engine.begin() as conn:
            conn.execute(schema.versions.update()
                         .where(schema.versions.c.component == "projections")
                         .values(version=PROJECTIONS.latest + 1))
        with pytest.raises(SchemaTooNew, match="'projections'"):
            create_tables(engine)

    # -- projections ----------------------------------------------------------------------------

    def test_latest_tables_without_a_version_row_are_stamped_not_rebuilt(
            self, engine: Engine) -> None:
        """What a process sees between another's CREATE and its version row (two first starts
        at once): the latest tables, to be stamped and kept, never refused as old."""
        projection_tables.metadata.create_all(engine)
        with engine.begin() as conn:
            conn.execute(projection_tables.tenants.insert().values(
                name="acme", created_at=sa.func.now()))
        found = _by_component(engine)["projections"]
        assert (found.found, found.stamped) == (projection_tables.SCHEMA_VERSION, False)
        create_tables(engine)
        found = _by_component(engine)["projections"]
        assert (found.found, found.stamped) == (projection_tables.SCHEMA_VERSION, True)
        with engine.connect() as conn:
            assert conn.execute(sa.select(projection_tables.tenants.c.name)).scalars().all() == [
                "acme"]

    def test_tables_of_the_release_before_versions_are_rebuilt_by_upgrade(
            self, settings: Settings, engine: Engine) -> None:
        """The release before versions left version-1 projection tables, unstamped: today's
        tables without ``signing_keys.retired_at`` (version 2). They are refused on open and
        rebuilt from the event store by ``upgrade``, never stamped as current."""
        projection_tables.metadata.create_all(engine)
        with engine.begin() as conn:
            conn.exec_driver_sql("ALTER TABLE signing_keys DROP COLUMN retired_at")
            conn.exec_driver_sql("ALTER TABLE tenants DROP COLUMN tickets_not_before")
            conn.execute(projection_tables.tenants.insert().values(
                name="acme", created_at=sa.func.now()))  # no event says so
        found = _by_component(engine)["projections"]
        assert (found.found, found.stamped, found.state) == (1, False, "outdated")
        with pytest.raises(SchemaOutdated, match="loraplane db upgrade"):
            create_tables(engine)
        registry = open_registry(settings, follow=False)
        try:
            changes = {c.component: c for c in upgrade(
                engine, rebuild=lambda e: ProjectionFollower(registry, e).rebuild_into(e))}
        finally:
            close_registry(registry)
        assert (changes["projections"].before, changes["projections"].action) == (1, "rebuilt")
        assert _by_component(engine)["projections"].found == projection_tables.SCHEMA_VERSION
        assert "retired_at" in {c["name"] for c in sa.inspect(engine).get_columns(
            "signing_keys")}
        with engine.connect() as conn:
            assert conn.execute(sa.select(projection_tables.tenants.c.name)).all() == []

    def test_old_projections_are_rebuilt_from_the_events(
            self, settings: Settings, engine: Engine, artifacts: Artifacts,
            tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        registry = open_registry(settings, follow=False)
        try:
            self._history(registry, artifacts)
            follower = ProjectionFollower(registry, engine)
            follower.catch_up()
            # The projection tables as an older loraplane left them: a column this code does
            # not know, and rows that the events do not say (stale or wrong).
            with engine.begin() as conn:
                conn.execute(projection_tables.tenants.delete()
                             .where(projection_tables.tenants.c.name == "globex"))
                conn.execute(projection_tables.revocations.delete())
                conn.exec_driver_sql("ALTER TABLE routes ADD COLUMN legacy_weight INTEGER")
            # This code's projections are one version ahead of the database's.
            newer = dataclasses.replace(PROJECTIONS, latest=PROJECTIONS.latest + 1)
            monkeypatch.setitem(schema._declared, "projections", newer)
            monkeypatch.setattr(projection_tables, "PROJECTIONS", newer)
            assert _by_component(engine)["projections"].state == "outdated"
            with pytest.raises(SchemaOutdated, match="'projections'"):
                create_tables(engine)
            with pytest.raises(ValueError, match="event store"):
                upgrade(engine, rebuild=None)

            changes = {c.component: c for c in upgrade(
                engine, rebuild=lambda e: ProjectionFollower(registry, e).rebuild_into(e))}
            total = int(registry.recorder.max_notification_id() or 0)
            assert changes["projections"].action == "rebuilt"
            assert changes["projections"].detail == f"{total} events replayed"
            assert _by_component(engine)["projections"].found == newer.latest
            assert "legacy_weight" not in {
                c["name"] for c in sa.inspect(engine).get_columns("routes")}
            fresh = sa.create_engine(f"sqlite:///{tmp_path / 'fresh.db'}")
            try:
                ProjectionFollower(registry, fresh).rebuild_into(fresh)
                rebuilt = snapshot(engine)
                assert rebuilt == snapshot(fresh)
                assert rebuilt["revocations"] and len(rebuilt["tenants"]) == 2
            finally:
                fresh.dispose()
            assert ProjectionFollower(registry, engine).position() == total
            again = {c.component: c.action for c in upgrade(engine, rebuild=None)}
            assert again["projections"] == "current"
        finally:
            close_registry(registry)

    @staticmethod
    def _history(registry: Registry, artifacts: Artifacts) -> None:
        registry.register_base(artifacts.base, artifacts.tokenizer, name="tiny", actor="op",
                               alias="tiny-base")
        registry.create_tenant("acme", actor="op")
        registry.create_tenant("globex", actor="op")
        alpha = registry.register_adapter(artifacts.adapters["alpha"], tenant="acme",
                                          alias="acme-chat", actor="alice")
        registry.grant("acme", "acme-chat", actor="op")
        registry.grant("globex", "tiny-base", actor="op")
        registry.advance(alpha, external=True, evaluation={"suite": "smoke", "passed": True},
                         actor="alice")
        # This registry does not follow and no follower runs: recorded, not yet visible.
        with pytest.raises(NotYetVisible):
            registry.revoke(alpha, "test", actor="sec", wait_s=0)


def test_open_component_only_reads_when_current(tmp_path: Path) -> None:
    """The common open takes no lock: a database locked by a writer is still opened."""
    engine = make_engine(f"sqlite:///{tmp_path / 'l.db'}")
    Ledger(engine)
    with engine.connect() as holder:
        holder.exec_driver_sql("BEGIN IMMEDIATE")  # another process mid-write
        try:
            open_component(engine, LEDGER)
        finally:
            holder.rollback()


class TestSchemaSQLite(OnSQLite, SchemaContract):
    pass


class TestSchemaPostgres(OnPostgres, SchemaContract):
    pass
