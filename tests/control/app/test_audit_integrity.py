"""``audit verify`` against real tampering: rows of the event table changed with SQL.

Each scenario builds a small history, seals it with a signed checkpoint, tampers with the stored
rows (or the checkpoints) directly in the database, and expects verify to name what happened.
One suite on SQLite and PostgreSQL.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from control.app.integrity import AuditSeal, Report
from control.app.registry import Registry
from control.contracts.config import Settings
from control.contracts.db import make_engine
from control.domain import TenantPolicy
from projections.follower import open_registry
from tests.fixtures_control import (
    OnPostgres,
    OnSQLite,
    close_registry,
    sqlite_settings,
)

EVENTS = "registry_events"


class IntegrityContract:
    @pytest.fixture
    def registry(self, settings: Settings) -> Iterator[Registry]:
        reg = open_registry(settings, follow=False)
        for i in range(6):
            reg.create_tenant(f"t{i}", actor="op", policy=TenantPolicy(max_adapters=i + 1))
        yield reg
        close_registry(reg)

    @pytest.fixture
    def seal(self, registry: Registry, settings: Settings) -> AuditSeal:
        s = AuditSeal.for_registry(registry)
        row = s.seal()
        assert row is not None and row["seq"] == 1 and row["last_position"] == 12
        return s

    def _sql(self, settings: Settings, *statements: str) -> None:
        with make_engine(settings.db_url).begin() as conn:
            for st in statements:
                conn.exec_driver_sql(st)

    def _kinds(self, report: Report) -> list[tuple[str, int]]:
        return [(p.kind, p.position) for p in report.problems]

    def test_intact_history_verifies(self, registry: Registry, seal: AuditSeal) -> None:
        report = seal.verify()
        assert report.ok and report.events == 12 and report.sealed_events == 12
        registry.create_tenant("late", actor="op")
        report = seal.verify()
        assert report.ok and report.unsealed_events == 1
        assert seal.seal() is not None and seal.verify().unsealed_events == 0
        assert seal.verify().checkpoints == 2

    def test_modified_event(self, seal: AuditSeal, settings: Settings) -> None:
        with make_engine(settings.db_url).begin() as conn:
            state = conn.execute(sa.text(f"SELECT state FROM {EVENTS} WHERE id = 5")).scalar()
            forged = bytes(state).replace(b'"op"', b'"eve"')
            assert forged != bytes(state)
            conn.execute(sa.text(f"UPDATE {EVENTS} SET state = :s WHERE id = 5"), {"s": forged})
        assert self._kinds(seal.verify()) == [("modified", 5)]

    def test_deleted_event(self, seal: AuditSeal, settings: Settings) -> None:
        self._sql(settings, f"DELETE FROM {EVENTS} WHERE id = 7")
        assert self._kinds(seal.verify()) == [("deleted", 7)]

    def test_reordered_events(self, seal: AuditSeal, settings: Settings) -> None:
        self._sql(settings, f"UPDATE {EVENTS} SET id = -1 WHERE id = 3",
                  f"UPDATE {EVENTS} SET id = 3 WHERE id = 4",
                  f"UPDATE {EVENTS} SET id = 4 WHERE id = -1")
        assert self._kinds(seal.verify()) == [("reordered", 3), ("reordered", 4)]

    def test_inserted_event(self, seal: AuditSeal, settings: Settings) -> None:
        # A forged copy of event 2 under a fresh aggregate id, slipped in at position 0.
        with make_engine(settings.db_url).begin() as conn:
            row = conn.execute(sa.text(
                f"SELECT originator_id, originator_version, topic, state FROM {EVENTS} "
                "WHERE id = 2")).one()
            other = conn.execute(sa.text(
                f"SELECT originator_id FROM {EVENTS} WHERE id = 12")).scalar()
            conn.execute(sa.text(
                f"INSERT INTO {EVENTS} (id, originator_id, originator_version, topic, state) "
                "VALUES (0, :o, 99, :t, :s)"), {"o": other, "t": row.topic, "s": row.state})
        assert self._kinds(seal.verify()) == [("inserted", 0)]

    def test_altered_checkpoint(self, seal: AuditSeal, settings: Settings) -> None:
        with make_engine(settings.db_url).begin() as conn:
            entries = json.loads(conn.execute(sa.text(
                "SELECT entries FROM audit_checkpoints WHERE seq = 1")).scalar())
            entries[4][1] = "0" * 64  # "launder" a change by rewriting the sealed hash
            conn.execute(sa.text("UPDATE audit_checkpoints SET entries = :e WHERE seq = 1"),
                         {"e": json.dumps(entries)})
        kinds = {k for k, _ in self._kinds(seal.verify())}
        assert "checkpoint" in kinds

    def test_deleted_checkpoints(self, registry: Registry, seal: AuditSeal,
                                 settings: Settings) -> None:
        self._sql(settings, f"DELETE FROM {EVENTS} WHERE id = 7",
                  "DELETE FROM audit_checkpoints")
        report = seal.verify()
        assert not report.ok
        assert ("checkpoint", 1) in self._kinds(report)  # the local anchor remembers it

    def test_foreign_key_cannot_vouch(self, seal: AuditSeal) -> None:
        report = seal.verify(Ed25519PrivateKey.generate().public_key())
        assert not report.ok and {p.kind for p in report.problems} == {"checkpoint"}


class TestIntegritySQLite(OnSQLite, IntegrityContract):
    pass


class TestIntegrityPostgres(OnPostgres, IntegrityContract):
    pass


def test_commands_seal_every_hundred_events_without_asking_each_time(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A registry that follows seals a checkpoint once 100 events are unsealed; between seals
    it does not query the checkpoint table after every command."""
    settings = sqlite_settings(tmp_path / "home")
    reg = open_registry(settings)
    asked: list[int] = []
    real = AuditSeal.pending

    def pending(self: AuditSeal) -> int:
        asked.append(1)
        return real(self)

    monkeypatch.setattr(AuditSeal, "pending", pending)
    try:
        for i in range(250):
            reg.create_tenant(f"t{i}", actor="op")
        report = reg.seal.verify()
        assert report.ok and report.checkpoints == 2
        assert report.sealed_events == 200 and report.unsealed_events == 50
        assert len(asked) <= 6, f"asked {len(asked)} times in 250 commands"
    finally:
        close_registry(reg)


def test_serve_seals_quiet_history_on_a_timer(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    import threading
    import time

    from control.contracts.config import SEAL_INTERVAL_ENV, ConfigError, seal_interval_from_env
    from control.ops.serve import keep_sealed

    reg = open_registry(sqlite_settings(tmp_path / "home"))
    stop = threading.Event()
    t = threading.Thread(target=keep_sealed, args=(reg, stop, 0.05))
    try:
        for i in range(3):
            reg.create_tenant(f"t{i}", actor="op")
        assert reg.seal.verify().unsealed_events == 3  # fewer than 100: no seal yet
        t.start()
        deadline = time.monotonic() + 10
        while reg.seal.verify().unsealed_events and time.monotonic() < deadline:
            time.sleep(0.05)
        report = reg.seal.verify()
        assert report.ok and report.unsealed_events == 0 and report.checkpoints == 1
    finally:
        stop.set()
        if t.is_alive():
            t.join(10)
        close_registry(reg)
    monkeypatch.setenv(SEAL_INTERVAL_ENV, "0")
    with pytest.raises(ConfigError, match="between 1 and 3600"):
        seal_interval_from_env()
    monkeypatch.setenv(SEAL_INTERVAL_ENV, "often")
    with pytest.raises(ConfigError, match="seconds"):
        seal_interval_from_env()
