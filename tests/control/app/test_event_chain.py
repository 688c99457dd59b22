"""No unsealed window: each event is chained in the transaction that records it
(``control.app.chain``), so an edit made at any time after the write, before or after a
checkpoint, is located by ``audit verify``; and a reader that cannot decode an event names it
and points to ``audit verify``. One suite on SQLite and PostgreSQL.

The first test is the issue's reproduction: before the chain, an event edited between its write
and its checkpoint was sealed as edited and verified intact.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from typer.testing import CliRunner

from control.app.audit import audit_log
from control.app.chain import ChainBroken, DamagedEvent, event_hash, link
from control.app.integrity import AuditSeal, Report
from control.app.registry import Registry
from control.contracts.config import Settings
from control.contracts.db import make_engine
from control.domain import TenantPolicy, tenant_id
from projections.follower import ProjectionFollower, open_registry
from tests.fixtures_control import OnPostgres, OnSQLite, close_registry, sqlite_settings

EVENTS = "registry_events"
CHAIN = "registry_events_chain"
SECRET_TENANT = "acme-secret-name"


def _kinds(report: Report) -> list[tuple[str, int]]:
    return [(p.kind, p.position) for p in report.problems]


class ChainContract:
    @pytest.fixture
    def registry(self, settings: Settings) -> Iterator[Registry]:
        reg = open_registry(settings, follow=False)
        for i in range(4):
            reg.create_tenant(f"t{i}", actor="op", policy=TenantPolicy(max_adapters=i + 1))
        yield reg
        close_registry(reg)

    def _edit(self, settings: Settings, position: int, old: bytes, new: bytes) -> None:
        with make_engine(settings.db_url).begin() as conn:
            state = bytes(conn.execute(sa.text(f"SELECT state FROM {EVENTS} WHERE id = :i"),
                                       {"i": position}).scalar_one())
            assert old in state
            conn.execute(sa.text(f"UPDATE {EVENTS} SET state = :s WHERE id = :i"),
                         {"s": state.replace(old, new), "i": position})

    def _position_of_last(self, settings: Settings) -> int:
        with make_engine(settings.db_url).connect() as conn:
            return int(conn.execute(sa.text(f"SELECT max(id) FROM {EVENTS}")).scalar_one())

    def test_an_edit_before_the_checkpoint_is_located(
            self, registry: Registry, settings: Settings) -> None:
        seal = AuditSeal.for_registry(registry)
        assert seal.seal() is not None
        registry.create_tenant("late", actor="op")
        late = self._position_of_last(settings)
        self._edit(settings, late, b'"op"', b'"eve"')  # right after the write, unsealed
        row = seal.seal()  # the periodic seal comes along afterwards
        assert row is not None and row["last_position"] == late
        report = seal.verify()
        assert _kinds(report) == [("modified", late)]
        assert "modified after it was recorded" in report.problems[0].detail

    def test_an_edit_with_no_checkpoint_at_all_is_located(
            self, registry: Registry, settings: Settings) -> None:
        self._edit(settings, 3, b'"op"', b'"eve"')
        report = AuditSeal.for_registry(registry).verify()
        assert report.checkpoints == 0 and report.chained_events == report.events
        assert _kinds(report) == [("modified", 3)]

    def test_a_checkpoint_signs_the_chain_head(
            self, registry: Registry, settings: Settings) -> None:
        row = AuditSeal.for_registry(registry).seal()
        assert row is not None
        with make_engine(settings.db_url).connect() as conn:
            chain = conn.execute(sa.text(
                f"SELECT position, event_hash, chain_hash FROM {CHAIN} ORDER BY position")).all()
            first = conn.execute(sa.text(
                f"SELECT originator_id, originator_version, topic, state FROM {EVENTS} "
                "WHERE id = 1")).one()
        assert [p for p, _, _ in chain] == list(range(1, row["last_position"] + 1))
        assert chain[-1].chain_hash == row["chain_hash"]
        assert chain[0].chain_hash == link("0" * 64, 1, chain[0].event_hash)
        assert len(chain[0].event_hash) == 64 and first.originator_version == 1
        assert event_hash(registry.recorder.select_notifications(1, 1)[0]) == \
            chain[0].event_hash

    def test_a_rewritten_chain_row_is_reported(
            self, registry: Registry, settings: Settings) -> None:
        seal = AuditSeal.for_registry(registry)
        assert seal.seal() is not None
        self._edit(settings, 2, b'"op"', b'"eve"')
        with make_engine(settings.db_url).begin() as conn:
            # "Launder" the edit: the chain row now carries the edited event's hash.
            n = registry.recorder.select_notifications(2, 1)[0]
            conn.execute(sa.text(f"UPDATE {CHAIN} SET event_hash = :h WHERE position = 2"),
                         {"h": event_hash(n)})
        kinds = _kinds(seal.verify())
        assert ("modified", 2) in kinds and ("chain", 2) in kinds

    def test_a_failed_command_leaves_no_chain_row(
            self, registry: Registry, settings: Settings) -> None:
        before = self._position_of_last(settings)
        with pytest.raises(Exception, match="already exists"):
            registry.create_tenant("t1", actor="op")
        with make_engine(settings.db_url).connect() as conn:
            assert conn.execute(sa.text(f"SELECT max(position) FROM {CHAIN}")).scalar() == before
        # Two writers interleaved: each chains after the other's events, never after the head
        # it last wrote itself (the recorder reads the head back unless it wrote the last one).
        other = open_registry(settings, follow=False)
        try:
            for i in range(3):
                other.create_tenant(f"x{i}", actor="op")
                registry.create_tenant(f"y{i}", actor="op")
                registry.create_tenant(f"z{i}", actor="op")
        finally:
            close_registry(other)
        report = AuditSeal.for_registry(registry).verify()
        assert report.ok and report.chained_events == report.events == before + 9

    def test_a_store_from_before_the_chain_is_chained_on_open(
            self, registry: Registry, settings: Settings) -> None:
        seal = AuditSeal.for_registry(registry)
        assert seal.seal() is not None
        registry.create_tenant("unsealed", actor="op")
        self._edit(settings, 2, b'"op"', b'"eve"')  # edited after sealing
        with make_engine(settings.db_url).begin() as conn:
            conn.exec_driver_sql(f"DROP TABLE {CHAIN}")
        reopened = open_registry(settings, follow=False)  # chains the existing store
        try:
            report = AuditSeal.for_registry(reopened).verify()
            # the sealed position keeps its sealed hash: the old edit is still located
            assert _kinds(report) == [("modified", 2)]
            assert report.chained_events == report.events
            reopened.create_tenant("after", actor="op")
            assert _kinds(AuditSeal.for_registry(reopened).verify()) == [("modified", 2)]
        finally:
            close_registry(reopened)

    # -- damaged stores explain themselves ----------------------------------------------------

    def _damage(self, registry: Registry, settings: Settings) -> int:
        registry.create_tenant(SECRET_TENANT, actor="op")
        position = self._position_of_last(settings)
        with make_engine(settings.db_url).begin() as conn:
            conn.execute(sa.text(f"UPDATE {EVENTS} SET state = :s WHERE id = :i"),
                         {"s": b"\x00not json", "i": position})
        return position

    def _assert_named(self, e: DamagedEvent | BaseException, position: int) -> None:
        assert isinstance(e, DamagedEvent)
        text = str(e)
        assert f"event #{position}" in text and "version 1" in text
        assert str(tenant_id(SECRET_TENANT)) in text
        assert "loraplane audit verify" in text and SECRET_TENANT not in text
        assert e.position == position and e.originator_version == 1

    def test_every_reader_names_the_event_it_cannot_decode(
            self, registry: Registry, settings: Settings) -> None:
        position = self._damage(registry, settings)
        reopened = open_registry(settings, follow=False)
        try:
            with pytest.raises(DamagedEvent) as by_aggregate:
                reopened.tenant(SECRET_TENANT)  # read by aggregate: no position in hand
            self._assert_named(by_aggregate.value, position)
            with pytest.raises(DamagedEvent) as by_log:
                audit_log(reopened)
            self._assert_named(by_log.value, position)
            follower = ProjectionFollower(reopened, make_engine(settings.db_url))
            with pytest.raises(DamagedEvent) as by_follower:
                follower.catch_up()
            self._assert_named(by_follower.value, position)
            assert ("modified", position) in _kinds(AuditSeal.for_registry(reopened).verify())
        finally:
            close_registry(reopened)

    def test_an_unknown_topic_is_named_too(
            self, registry: Registry, settings: Settings) -> None:
        registry.create_tenant(SECRET_TENANT, actor="op")
        position = self._position_of_last(settings)
        with make_engine(settings.db_url).begin() as conn:
            conn.execute(sa.text(f"UPDATE {EVENTS} SET topic = 'control.domain.gone:X.Y' "
                                 "WHERE id = :i"), {"i": position})
        with pytest.raises(DamagedEvent) as e:
            audit_log(registry)
        self._assert_named(e.value, position)

    def test_the_cli_names_it_and_points_to_audit_verify(
            self, registry: Registry, settings: Settings) -> None:
        from control.cli.main import app

        position = self._damage(registry, settings)
        result = CliRunner().invoke(app, ["--home", str(settings.home), "audit", "log"],
                                    env={"LORAPLANE_DB_URL": settings.db_url,
                                         "COLUMNS": "300"})
        assert result.exit_code == 2, result.output
        out = " ".join(result.output.split())
        assert f"event #{position}" in out and "loraplane audit verify" in out
        assert "Traceback" not in out and SECRET_TENANT not in out


class TestChainSQLite(OnSQLite, ChainContract):
    pass


class TestChainPostgres(OnPostgres, ChainContract):
    pass



def test_deleting_the_newest_event_is_named_at_the_next_write(tmp_path: Path) -> None:
    # SQLite gives a deleted newest event's position to the next one: that write says why it
    # cannot be chained instead of failing as a lost race.
    settings = sqlite_settings(tmp_path / "home")
    reg = open_registry(settings, follow=False)
    try:
        reg.create_tenant("a", actor="op")
        reg.create_tenant("b", actor="op")
        with make_engine(settings.db_url).begin() as conn:
            conn.exec_driver_sql(f"DELETE FROM {EVENTS} WHERE id = (SELECT max(id) FROM {EVENTS})")
        with pytest.raises(ChainBroken, match="audit verify"):
            reg.create_tenant("c", actor="op")
        assert ("deleted", 2) in _kinds(AuditSeal.for_registry(reg).verify())
    finally:
        close_registry(reg)
