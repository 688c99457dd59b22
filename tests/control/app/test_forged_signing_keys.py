"""A ``SigningKeyRecorded`` the root did not sign is ignored by every reader that decides trust
(the host's governance snapshot, the gateway's and control plane's key choices, the host key-file
sync) and named by ``audit verify``. Forged two ways: a row written with SQL (a stolen root
signature copied from a genuine record), and an event saved through the application without a
root signature (a host that can write events). One suite on SQLite and PostgreSQL.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import sqlalchemy as sa
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from typer.testing import CliRunner, Result

from control.app import key_ring
from control.app.integrity import AuditSeal
from control.app.registry import Registry
from control.contracts import root_of_trust as rot
from control.contracts.config import Settings
from control.contracts.db import make_engine
from control.contracts.tickets import TicketSigner
from control.domain import SigningKey
from control.ops.key_sync import sync_public_keys
from projections.follower import open_registry
from projections.host_view import HostGovernance
from projections.routing import RoutingView
from tests.fixtures_control import OnPostgres, OnSQLite, close_registry, sqlite_settings

EVENTS = "registry_events"


@dataclass
class Keys:
    genuine: str
    by_sql: str
    by_sql_position: int
    unsigned: str
    unsigned_position: int


def _signer() -> TicketSigner:
    return TicketSigner(Ed25519PrivateKey.generate())


class ForgedKeysContract:
    @pytest.fixture
    def registry(self, settings: Settings, monkeypatch: pytest.MonkeyPatch
                 ) -> Iterator[Registry]:
        monkeypatch.delenv(rot.ROOT_ENV, raising=False)
        reg = open_registry(settings)
        yield reg
        close_registry(reg)

    @pytest.fixture
    def keys(self, registry: Registry, settings: Settings) -> Keys:
        root = rot.dev_root(settings.keys_dir)
        good = _signer()
        registry.save(SigningKey(kid=good.kid, public_key_b64=good.public_b64, actor="op",
                                 root_signature=rot.sign(root, rot.RECORD, good.kid,
                                                         good.public_b64)))
        engine = make_engine(settings.db_url)
        # 1. SQL: a copy of the genuine record naming the attacker's key, signature and all.
        evil = _signer()
        with engine.begin() as conn:
            row = conn.execute(sa.text(
                f"SELECT topic, state FROM {EVENTS} ORDER BY id DESC LIMIT 1")).one()
            state = json.loads(bytes(row.state))
            assert state["kid"] == good.kid and state["root_signature"]
            state.update(kid=evil.kid, public_key_b64=evil.public_b64)
            # a plain INSERT (the table's column types store the aggregate id as each
            # database does), outside the application and its chain
            events = registry.recorder.events_record_cls.__table__  # type: ignore[attr-defined]
            conn.execute(events.insert().values(
                originator_id=uuid.uuid4(), originator_version=1, topic=row.topic,
                state=json.dumps(state).encode()))
            by_sql_position = int(conn.execute(sa.text(
                f"SELECT max(id) FROM {EVENTS}")).scalar_one())
        # 2. Through the application, with no root signature.
        unsigned = _signer()
        registry.save(SigningKey(kid=unsigned.kid, public_key_b64=unsigned.public_b64,
                                 actor="host:h1"))
        unsigned_position = int(registry.recorder.max_notification_id() or 0)
        registry.follower.catch_up()
        return Keys(good.kid, evil.kid, by_sql_position, unsigned.kid, unsigned_position)

    def test_readers_trust_only_what_the_root_signed(
            self, keys: Keys, settings: Settings) -> None:
        engine = make_engine(settings.db_url)
        view = RoutingView(engine)
        # all three were projected: the projection does not decide trust, its readers do
        assert set(view.signing_keys()) == {keys.genuine, keys.by_sql, keys.unsigned}
        assert set(view.vouched_signing_keys(settings.keys_dir)) == {keys.genuine}
        assert HostGovernance(engine, settings.keys_dir).current().recorded_kids == {
            keys.genuine}
        assert HostGovernance(engine).current().recorded_kids == frozenset()  # no root: none
        sync_public_keys(settings, view)
        assert sorted(p.name for p in (settings.keys_dir / "public").iterdir()) == [
            f"{keys.genuine}.pub"]

    def test_a_configured_root_wins_over_the_home(
            self, keys: Keys, settings: Settings, monkeypatch: pytest.MonkeyPatch) -> None:
        other = Ed25519PrivateKey.generate()
        monkeypatch.setenv(rot.ROOT_ENV, rot.public_b64(other.public_key()))
        engine = make_engine(settings.db_url)
        assert RoutingView(engine).vouched_signing_keys(settings.keys_dir) == {}
        assert HostGovernance(engine, settings.keys_dir).current().recorded_kids == frozenset()

    def test_audit_verify_names_each_forged_key(
            self, registry: Registry, keys: Keys) -> None:
        report = AuditSeal.for_registry(registry).verify()
        problems = {(p.kind, p.position) for p in report.problems}
        assert ("key", keys.by_sql_position) in problems
        assert ("inserted", keys.by_sql_position) in problems  # SQL writes carry no chain row
        assert ("key", keys.unsigned_position) in problems
        assert {p for p in problems if p[0] == "key"} == {
            ("key", keys.by_sql_position), ("key", keys.unsigned_position)}
        detail = next(p.detail for p in report.problems if p.kind == "key")
        assert "not vouched for" in detail and "ignore it" in detail


class TestForgedKeysSQLite(OnSQLite, ForgedKeysContract):
    pass


class TestForgedKeysPostgres(OnPostgres, ForgedKeysContract):
    pass


def test_an_offline_root_vouches_only_when_its_file_is_given(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from control.cli.main import app

    monkeypatch.delenv(rot.ROOT_ENV, raising=False)
    settings = sqlite_settings(tmp_path / "home")
    settings.ensure_dirs()
    keys = settings.keys_dir

    def cli(*args: str) -> Result:
        return CliRunner().invoke(app, ["--home", str(settings.home), *args],
                                  env={"LORAPLANE_DB_URL": settings.db_url, "COLUMNS": "300"})

    reg = open_registry(settings)
    try:
        first, _ = reg.rotate_signing_key(actor="op")  # a demo home: its development root
        assert rot.dev_root_path(keys).is_file()
        view = RoutingView(make_engine(settings.db_url))
        assert set(view.vouched_signing_keys(keys)) == {first}

        offline = tmp_path / "offline" / "root.pem"
        made = cli("key", "root", "init", "--out", str(offline))
        assert made.exit_code == 0, made.output
        assert not rot.dev_root_path(keys).exists()
        assert view.vouched_signing_keys(keys) == {}  # the former root vouches no more

        # Without the root's file nothing is recorded and the active key stays.
        refused = cli("key", "rotate")
        assert refused.exit_code == 2 and "--root-key" in refused.output
        assert key_ring.active_signer(keys).kid == first  # type: ignore[union-attr]
        rotated = cli("--json", "keys", "rotate", "--root-key", str(offline))
        assert rotated.exit_code == 0, rotated.output
        second = json.loads(rotated.stdout.strip().splitlines()[-1])["kid"]
        assert set(view.vouched_signing_keys(keys)) == {second}

        # Another root's file, or a signature that does not verify: refused, nothing recorded.
        stranger = tmp_path / "stranger.pem"
        rot.init_root(stranger, tmp_path / "elsewhere")
        extra = _signer()
        with pytest.raises(rot.RootError, match="not the root this deployment trusts"):
            reg.record_signing_key(extra.kid, extra.public_b64, actor="op", root_key=stranger)
        with pytest.raises(rot.RootError, match="does not vouch"):
            reg.record_signing_key(extra.kid, extra.public_b64, actor="op",
                                   root_signature=rot.sign(rot.load_root_private(offline),
                                                           rot.RECORD, "other", extra.public_b64))
        assert extra.kid not in view.signing_keys()
        with pytest.raises(rot.RootError, match="--root-key"):
            reg.retire_signing_key(first, actor="op")
        reg.retire_signing_key(first, actor="op", reason="old root", root_key=offline)
        assert first in view.retired_key_ids()
        # audit verify names the key the former root vouched for, and only that one
        report = AuditSeal.for_registry(reg).verify()
        assert [p.kind for p in report.problems] == ["key"] and first in report.problems[0].detail
    finally:
        close_registry(reg)
