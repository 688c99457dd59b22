"""Database roles on a real PostgreSQL: each role's forbidden writes are refused by the server,
and what each part of a deployment really does still works with its own credential.

One fresh schema and one set of uniquely named roles per module (roles are cluster-wide, so
the names carry a random suffix), dropped afterwards.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Engine

from control.app.db_roles import (
    GRANTS,
    RoleNames,
    RolesError,
    apply_roles,
    scram_verifier,
)
from control.contracts.config import Settings
from control.contracts.ledger import AdapterLoad, Completion, Ledger, LedgerEntry, Outcome
from control.domain import hash_api_key
from tests.fixtures_control import close_registry, postgres_settings, sqlite_settings

DIGEST = "sha256:" + "a" * 64
BASE = "sha256:" + "b" * 64
TOK = "sha256:" + "c" * 64
RELEASE = "sha256:" + "d" * 64
API_KEY = "lp-test-key"


@dataclass
class Deployment:
    settings: Settings
    names: RoleNames
    admin: Engine
    control: Engine
    gateway: Engine
    host_a: Engine
    host_b: Engine
    host_a_id: str
    host_b_id: str


def _url(url: str, role: str) -> str:
    return sa.make_url(url).set(username=role, password=None).render_as_string(
        hide_password=False)


def _as(url: str, role: str) -> Engine:
    return sa.create_engine(_url(url, role), poolclass=sa.pool.NullPool)


def _seed(settings: Settings) -> None:
    """Every component's tables and the event store, with one row where a test needs one."""
    from control.app.registry import Registry
    from control.cli.database import _declare_components
    from control.contracts.schema import upgrade

    _declare_components()
    engine = sa.create_engine(settings.db_url, poolclass=sa.pool.NullPool)
    upgrade(engine, rebuild=None)
    registry = Registry(settings, follow=False)  # creates the event store's table
    close_registry(registry)
    now = time.time()
    with engine.begin() as conn:
        conn.execute(sa.text(
            "INSERT INTO registry_events (originator_id, originator_version, topic, state) "
            "VALUES (:i, 1, 'x', '\\x00')"), {"i": uuid.uuid4()})
        conn.execute(sa.text("INSERT INTO api_keys VALUES (:h, 'acme')"),
                     {"h": hash_api_key(API_KEY)})
        conn.execute(sa.text("INSERT INTO tenants VALUES ('acme', now(), :t)"), {"t": now - 60})
        conn.execute(sa.text("INSERT INTO bases VALUES (:b, 'tiny', :t)"), {"b": BASE, "t": TOK})
        conn.execute(sa.text("INSERT INTO revocations VALUES (:d, 'leak', now(), false)"),
                     {"d": DIGEST})
        conn.execute(sa.text("INSERT INTO signing_keys VALUES ('k1', 'pub', now(), NULL)"))
        conn.execute(sa.text("INSERT INTO projection_tracking VALUES ('routing', 7)"))
    engine.dispose()


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    home = tmp_path_factory.mktemp("roles") / "home"
    suffix = uuid.uuid4().hex[:8]
    names = RoleNames(f"lp_{suffix}")
    host_a, host_b = f"host-a-{suffix}", f"host-b-{suffix}"
    with postgres_settings(home) as s:
        s.ensure_dirs()
        _seed(s)
        admin = sa.create_engine(s.db_url, poolclass=sa.pool.NullPool)
        try:
            apply_roles(admin, names=names, hosts=[host_a, host_b])
            control, gateway, a, b = engines = [
                _as(s.db_url, r) for r in (names.control, names.gateway, host_a, host_b)]
            yield Deployment(s, names, admin, control, gateway, a, b, host_a, host_b)
            for e in engines:
                e.dispose()
        finally:
            # Roles are cluster-wide: drop what they own or hold here (the schema's tables),
            # then the roles themselves.
            with admin.begin() as conn:
                for role in (names.control, names.gateway, host_a, host_b, names.hosts):
                    conn.exec_driver_sql(f'DROP OWNED BY "{role}"')
                    conn.exec_driver_sql(f'DROP ROLE "{role}"')
            admin.dispose()


def _refused(engine: Engine, sql: str, **params: object) -> str:
    """Run ``sql`` in its own transaction; it must fail for want of privilege (a grant or a
    row-level security policy). Returns the server's message."""
    with pytest.raises(sa.exc.ProgrammingError) as caught, engine.begin() as conn:
        conn.execute(sa.text(sql), params)
    message = str(caught.value.orig)
    assert "permission denied" in message or "row-level security" in message, message
    return message


def _count(engine: Engine, sql: str, **params: object) -> int:
    with engine.begin() as conn:
        return int(conn.execute(sa.text(sql), params).rowcount)


def _entry(rid: str, host: str) -> LedgerEntry:
    return LedgerEntry(request_id=rid, ticket_id="jti", tenant="acme", model="lora_llm",
                       host=host, base_digest=BASE, adapter_digest=DIGEST, tokenizer_digest=TOK,
                       admitted_at=time.time(), release_digest=RELEASE)


EVENTS_AND_SEALS = ("registry_events", "audit_checkpoints")
PROJECTIONS = ("routes", "releases", "grants", "api_keys", "tenants", "adapters", "bases",
               "revocations", "signing_keys", "serving_steps", "session_pins",
               "projection_tracking", "routing_changes")


@pytest.mark.postgres
class TestHostRole:
    def test_writes_its_own_ledger_rows_and_completes_them(self, deployment: Deployment) -> None:
        ledger = Ledger(deployment.host_a)
        rid = str(uuid.uuid4())
        entry = _entry(rid, deployment.host_a_id)
        ledger.admit([entry])
        ledger.admit([entry])  # a retried write is idempotent
        ledger.complete([Completion(rid, Outcome.OK, 3, 5, served_digest=DIGEST)])
        row = Ledger(deployment.admin).get(rid)
        assert row is not None and row.outcome == "ok" and row.tokens_out == 5
        ledger.record_load(AdapterLoad(deployment.host_a_id, DIGEST, time.time(), 0.1,
                                       "loaded"))
        ledger.admit([_entry(str(uuid.uuid4()), deployment.host_a_id)])
        assert ledger.fail_running(deployment.host_a_id) == 1

    def test_reads_the_host_view(self, deployment: Deployment) -> None:
        from projections.host_view import HostGovernance, tokenizer_of

        state = HostGovernance(deployment.host_a).current()
        assert state.position == 7 and DIGEST in state.revoked
        # (whether k1 counts as recorded is the root of trust's business: it is unsigned here)
        assert state.recorded_kids <= {"k1"} and "acme" in state.tickets_not_before
        assert tokenizer_of(deployment.host_a, BASE) == TOK

    def test_cannot_write_events_seals_or_projections(self, deployment: Deployment) -> None:
        host = deployment.host_a
        _refused(host, "INSERT INTO registry_events (originator_id, originator_version, topic, "
                 "state) VALUES (:i, 1, 'SigningKeyRecorded', '\\x00')", i=uuid.uuid4())
        for table in EVENTS_AND_SEALS + PROJECTIONS:
            _refused(host, f"DELETE FROM {table}")
            _refused(host, f"UPDATE {table} SET {_first_column(deployment, table)} = NULL")
        _refused(host, "INSERT INTO revocations VALUES ('x', 'r', now(), false)")
        _refused(host, "INSERT INTO signing_keys VALUES ('forged', 'pub', now(), NULL)")
        _refused(host, "UPDATE loraplane_schema SET version = 1")

    def test_cannot_read_api_keys_or_the_gateways_projections(self,
                                                              deployment: Deployment) -> None:
        for table in ("api_keys", "grants", "routes", "adapters", "session_pins",
                      "registry_events", "request_feedback"):
            _refused(deployment.host_a, f"SELECT * FROM {table}")
        _refused(deployment.host_a, "SELECT created_at FROM tenants")

    def test_cannot_touch_another_hosts_rows(self, deployment: Deployment) -> None:
        theirs = str(uuid.uuid4())
        Ledger(deployment.host_b).admit([_entry(theirs, deployment.host_b_id)])
        a = deployment.host_a
        # Inserting a row in another host's name, or a load, is refused by the policy.
        _refused(a, "INSERT INTO request_ledger (request_id, model, host, admitted_at, outcome) "
                 "VALUES (:r, 'm', :h, 0, 'running')", r=str(uuid.uuid4()),
                 h=deployment.host_b_id)
        _refused(a, "INSERT INTO adapter_loads (host, adapter_digest, started_at, seconds, "
                 "outcome) VALUES (:h, 'd', 0, 0, 'loaded')", h=deployment.host_b_id)
        # Their rows are invisible: an update or a read reaches none of them.
        assert _count(a, "UPDATE request_ledger SET outcome = 'ok' WHERE request_id = :r",
                      r=theirs) == 0
        assert Ledger(a).get(theirs) is None
        assert Ledger(a).fail_running(deployment.host_b_id) == 0
        # Moving its own row to another host's name is refused too (column and policy).
        mine = str(uuid.uuid4())
        Ledger(a).admit([_entry(mine, deployment.host_a_id)])
        _refused(a, "UPDATE request_ledger SET host = :h WHERE request_id = :r",
                 h=deployment.host_b_id, r=mine)
        row = Ledger(deployment.admin).get(theirs)
        assert row is not None and row.outcome == "running"

    def test_cannot_change_what_was_admitted_or_delete(self, deployment: Deployment) -> None:
        rid = str(uuid.uuid4())
        a = deployment.host_a
        Ledger(a).admit([_entry(rid, deployment.host_a_id)])
        for column in ("tenant", "adapter_digest", "ticket_id", "release_digest", "admitted_at",
                       "base_digest", "tokenizer_digest", "request_id"):
            _refused(a, f"UPDATE request_ledger SET {column} = NULL WHERE request_id = :r",
                     r=rid)
        _refused(a, "DELETE FROM request_ledger WHERE request_id = :r", r=rid)
        _refused(a, "DELETE FROM adapter_loads")
        _refused(a, "UPDATE adapter_loads SET outcome = 'failed'")
        _refused(a, "TRUNCATE request_ledger")

    def test_reports_revocation_steps_only_as_itself(self, deployment: Deployment) -> None:
        from control.app.serving_steps import fold_reports
        from control.contracts.serving_reports import TableSteps

        a = deployment.host_a_id
        steps = TableSteps(replace(deployment.settings,
                                   db_url=_url(deployment.settings.db_url, a)))
        steps.record(DIGEST, a, "drained")
        steps.record(DIGEST, a, "drained")
        assert steps.done(DIGEST, a) == ["drained"]
        with pytest.raises(sa.exc.ProgrammingError, match="row-level security"):
            steps.record(DIGEST, deployment.host_b_id, "drained")
        _refused(deployment.host_a, "UPDATE serving_step_reports SET folded_at = 1")
        _refused(deployment.host_a, "DELETE FROM serving_step_reports")
        _refused(deployment.gateway, "SELECT * FROM serving_step_reports")

        class Folder:  # the registry's side, as the control plane runs it
            def __init__(self) -> None:
                self.recorded: list[str] = []

            def adapter(self, _digest: str) -> object:
                return type("A", (), {"serving_steps": {}})()

            def record_serving_step(self, _d: str, _h: str, step: str, *, actor: str) -> None:
                self.recorded.append(f"{actor}:{step}")

        folder = Folder()
        assert fold_reports(folder, deployment.control) == 1  # type: ignore[arg-type]
        assert folder.recorded == [f"host:{a}:drained"]

    def test_reports_its_status_only_as_itself(self, deployment: Deployment) -> None:
        """A host replaces its own ``host_status`` row; another host's it can neither write,
        overwrite, take over, nor read; the gateway gets nothing of the table."""
        from control.contracts.host_status import HostStatus, HostStatusTable, SlotEntry

        a, b = deployment.host_a_id, deployment.host_b_id
        HostStatusTable(deployment.host_b).put(HostStatus(b, 1.0, 1.0, 4))
        mine = HostStatusTable(deployment.host_a)
        mine.put(HostStatus(a, 1.0, 1.0, 4))
        mine.put(HostStatus(a, 2.0, 1.0, 4, device=(SlotEntry(DIGEST, 5, 1),)))  # replaced
        assert [(s.host, s.reported_at) for s in mine.all()] == [(a, 2.0)]  # b's is invisible
        with pytest.raises(sa.exc.ProgrammingError, match="row-level security"):
            mine.put(HostStatus(b, 3.0, 1.0, 9))  # in b's name: its update reaches no row
        assert _count(deployment.host_a, "UPDATE host_status SET slots_total = 0 "
                      "WHERE host = :h", h=b) == 0
        _refused(deployment.host_a, "UPDATE host_status SET host = :h WHERE host = :a",
                 h=b + "-x", a=a)
        _refused(deployment.host_a, "DELETE FROM host_status")
        theirs = HostStatusTable(deployment.admin).all()
        assert {(s.host, s.reported_at, s.slots_total) for s in theirs} >= {
            (a, 2.0, 4), (b, 1.0, 4)}
        _refused(deployment.gateway, "SELECT * FROM host_status")

    def test_counts_every_replica_claim_and_writes_only_its_own(
            self, deployment: Deployment) -> None:
        """Hosts see each other's claims on an adapter's replicas (the bound counts them all)
        but make, renew and give up only their own; the gateway gets nothing of the table."""
        from control.contracts.replica_claims import ReplicaTable

        a, b = deployment.host_a_id, deployment.host_b_id
        digest = "sha256:" + uuid.uuid4().hex * 2
        mine, theirs = ReplicaTable(deployment.host_a, a), ReplicaTable(deployment.host_b, b)
        assert mine.claim(digest, 1)
        assert not theirs.claim(digest, 1)  # a's claim, counted through b's role
        assert theirs.holders(digest) == [a]
        assert theirs.claim(digest, 2)
        assert mine.claim(digest, 2)  # a renews its own
        assert _count(deployment.host_b, "DELETE FROM adapter_replicas WHERE host = :h",
                      h=a) == 0
        assert _count(deployment.host_b, "UPDATE adapter_replicas SET expires_at = 0 "
                      "WHERE host = :h", h=a) == 0
        _refused(deployment.host_b, "UPDATE adapter_replicas SET host = :a WHERE host = :b",
                 a=a + "-x", b=b)
        _refused(deployment.host_b, "INSERT INTO adapter_replicas VALUES (:d, :h, 0, 1e12)",
                 d="sha256:" + "e" * 64, h=a)
        theirs.release(digest)
        assert mine.holders(digest) == [a]
        _refused(deployment.gateway, "SELECT * FROM adapter_replicas")

    def test_cannot_become_another_role(self, deployment: Deployment) -> None:
        """The rows it may touch follow the login role, not a role it can switch to."""
        a = deployment.host_a
        with a.begin() as conn:
            conn.exec_driver_sql(f'SET ROLE "{deployment.names.hosts}"')
            with pytest.raises(sa.exc.ProgrammingError):
                conn.execute(sa.text(
                    "INSERT INTO request_ledger (request_id, model, host, admitted_at, outcome)"
                    " VALUES (:r, 'm', :h, 0, 'running')"),
                    {"r": str(uuid.uuid4()), "h": deployment.names.hosts})
        for other in (deployment.names.control, deployment.names.gateway, deployment.host_b_id):
            with pytest.raises(sa.exc.ProgrammingError), a.begin() as conn:
                conn.exec_driver_sql(f'SET ROLE "{other}"')


@pytest.mark.postgres
class TestGatewayRole:
    def test_reads_routing_and_rates_its_tenants_requests(self, deployment: Deployment) -> None:
        from projections.route_cache import CachedRoutingView

        view = CachedRoutingView(deployment.gateway)  # what a gateway's ticket office reads
        assert view.tenant_for_api_key(API_KEY) == "acme"
        assert view.retired_key_ids() == frozenset()
        assert view.resolve("acme", "no-such-alias") is None
        rid = str(uuid.uuid4())
        Ledger(deployment.host_a).admit([_entry(rid, deployment.host_a_id)])
        rating = Ledger(deployment.gateway).rate(rid, "acme", True)
        assert rating.release_digest == RELEASE
        with deployment.gateway.connect() as conn:
            used = conn.execute(sa.text("SELECT sum(tokens_in) FROM request_ledger")).scalar()
        assert used is None or used >= 0

    def test_cannot_write_events_projections_or_ledger(self, deployment: Deployment) -> None:
        g = deployment.gateway
        _refused(g, "INSERT INTO registry_events (originator_id, originator_version, topic, "
                 "state) VALUES (:i, 1, 'x', '\\x00')", i=uuid.uuid4())
        for table in EVENTS_AND_SEALS + PROJECTIONS + ("request_ledger", "adapter_loads",
                                                       "request_feedback"):
            _refused(g, f"DELETE FROM {table}")
            _refused(g, f"UPDATE {table} SET {_first_column(deployment, table)} = NULL")
        _refused(g, "INSERT INTO api_keys VALUES ('x', 'acme')")
        _refused(g, "INSERT INTO request_ledger (request_id, model, host, admitted_at, outcome) "
                 "VALUES (:r, 'm', 'h', 0, 'ok')", r=str(uuid.uuid4()))

    def test_reads_nothing_beyond_its_columns(self, deployment: Deployment) -> None:
        for sql in ("SELECT host FROM request_ledger", "SELECT ticket_id FROM request_ledger",
                    "SELECT * FROM adapter_loads", "SELECT * FROM registry_events",
                    "SELECT * FROM audit_checkpoints", "SELECT success FROM request_feedback",
                    "SELECT * FROM ledger_checkpoints", "SELECT * FROM ledger_host_keys",
                    "SELECT * FROM ledger_log_heads"):
            _refused(deployment.gateway, sql)

    def test_reads_the_logs_and_verified_checkpoints_for_receipts_and_writes_neither(
            self, deployment: Deployment) -> None:
        # Every host's log is readable (a receipt's proof hashes its neighbours' entries),
        # through the policy that lets the gateway see rows hosts see only their own of.
        with deployment.admin.begin() as conn:
            conn.execute(sa.text("INSERT INTO ledger_log (host, idx, request_id, leaf) VALUES "
                                 "(:h, :i, 'r', '{}')"), {"h": deployment.host_a_id,
                                                          "i": uuid.uuid4().int % 10 ** 12})
        with deployment.gateway.connect() as conn:
            for table in ("ledger_log", "ledger_verified"):
                conn.execute(sa.text(f"SELECT * FROM {table}")).all()
            seen = conn.execute(sa.text("SELECT count(*) FROM ledger_log")).scalar()
        assert seen is not None and seen >= 1
        assert seen == _count(deployment.admin, "SELECT * FROM ledger_log")
        _refused(deployment.gateway, "INSERT INTO ledger_verified (host, size, root, note, "
                 "verified_at) VALUES ('h', 1, 'r', 'n', 0)")
        _refused(deployment.gateway, "INSERT INTO ledger_log (host, idx, request_id, leaf) "
                 "VALUES ('h', 0, 'r', '{}')")
        for table in ("ledger_log", "ledger_verified"):
            _refused(deployment.gateway, f"DELETE FROM {table}")
        _refused(deployment.host_a, "SELECT * FROM ledger_verified")
        _refused(deployment.host_a, "INSERT INTO ledger_verified (host, size, root, note, "
                 "verified_at) VALUES (:h, 1, 'r', 'n', 0)", h=deployment.host_a_id)


@pytest.mark.postgres
class TestControlRole:
    def test_owns_and_writes_everything(self, deployment: Deployment) -> None:
        c = deployment.control
        with c.begin() as conn:
            conn.execute(sa.text(
                "INSERT INTO registry_events (originator_id, originator_version, topic, state) "
                "VALUES (:i, 1, 'x', '\\x00')"), {"i": uuid.uuid4()})
            conn.execute(sa.text("UPDATE projection_tracking SET position = position"))
            seen = conn.execute(sa.text("SELECT count(*) FROM request_ledger")).scalar()
        assert seen == _count(deployment.admin, "SELECT * FROM request_ledger")
        assert Ledger(c).fail_running(deployment.host_b_id) >= 1  # every host's rows


@pytest.mark.postgres
def test_rerunning_is_idempotent_and_the_map_is_the_whole_truth(
        deployment: Deployment) -> None:
    # A stray grant made by hand is taken away by the next run.
    with deployment.admin.begin() as conn:
        conn.exec_driver_sql(f'GRANT DELETE ON request_ledger TO "{deployment.names.hosts}"')
    report = apply_roles(deployment.admin, names=deployment.names,
                         hosts=[deployment.host_a_id, deployment.host_b_id])
    assert {r.action for r in report.roles} == {"kept"}
    assert report.unmapped == []
    _refused(deployment.host_a, "DELETE FROM request_ledger")


@pytest.mark.postgres
def test_refuses_to_adopt_an_existing_role(deployment: Deployment) -> None:
    with pytest.raises(RolesError, match="not a member"):
        apply_roles(deployment.admin, names=deployment.names, hosts=[deployment.names.gateway])


@pytest.mark.postgres
def test_every_table_of_every_component_is_mapped(deployment: Deployment) -> None:
    """A table added to a component without a decision on who may touch it fails here."""
    from control.cli.database import _declare_components
    from control.contracts.schema import all_components

    _declare_components()
    with deployment.admin.connect() as conn:  # the event store's tables are eventsourcing's
        present = {str(t) for t in conn.execute(sa.text(
            "SELECT tablename FROM pg_tables WHERE schemaname = current_schema()")).scalars()}
    declared = {t for c in all_components() for t in c.metadata.tables}
    assert (declared | present) - set(GRANTS) == set()


@pytest.mark.postgres
def test_the_db_roles_verb(deployment: Deployment, monkeypatch: pytest.MonkeyPatch,
                           tmp_path: Path) -> None:
    """`loraplane db roles` on the deployment's database: idempotent, new passwords printed
    once (set as SCRAM verifiers), each login role's URL named."""
    from typer.testing import CliRunner

    from control.cli.main import app

    monkeypatch.setenv("LORAPLANE_DB_URL", deployment.settings.db_url)
    monkeypatch.setenv("LORAPLANE_HOME", str(tmp_path))
    args = ["--json", "db", "roles", "--prefix", deployment.names.prefix,
            "--host", deployment.host_a_id, "--new-passwords"]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    out = json.loads(res.output.splitlines()[-1])
    urls = {r["role"]: r["url"] for r in out["roles"]}
    assert {r["action"] for r in out["roles"]} == {"kept"}
    password = sa.make_url(urls[deployment.host_a_id]).password
    assert password and urls[deployment.names.hosts] == ""
    with deployment.admin.connect() as conn:
        stored = conn.execute(sa.text("SELECT rolpassword FROM pg_authid WHERE rolname = :r"),
                              {"r": deployment.host_a_id}).scalar()
    assert str(stored).startswith("SCRAM-SHA-256$") and password not in str(stored)
    assert out["unmapped"] == []
    ledger = {t["table"]: t for t in out["tables"]}["request_ledger"]
    assert "own rows" in ledger["host"] and "UPDATE(outcome" in ledger["host"]
    # Passwords from the environment (compose's db-roles job); a malformed value is named,
    # never echoed.
    monkeypatch.setenv("LORAPLANE_DB_ROLE_PASSWORDS", json.dumps({deployment.host_a_id: "pw-a"}))
    res = CliRunner().invoke(app, args[:-1])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output.splitlines()[-1])
    url = {r["role"]: r["url"] for r in out["roles"]}[deployment.host_a_id]
    assert sa.make_url(url).password == "pw-a"
    monkeypatch.setenv("LORAPLANE_DB_ROLE_PASSWORDS", '{"x": "secret-1"')
    res = CliRunner().invoke(app, args[:-1])
    assert res.exit_code == 2 and "LORAPLANE_DB_ROLE_PASSWORDS" in res.output
    assert "secret-1" not in res.output
    monkeypatch.delenv("LORAPLANE_DB_ROLE_PASSWORDS")
    monkeypatch.setenv("LORAPLANE_DB_URL", f"sqlite:///{tmp_path / 'x.db'}")
    res = CliRunner().invoke(app, ["db", "roles"])
    assert res.exit_code == 2 and "need PostgreSQL" in res.output


def test_sqlite_has_no_roles(tmp_path: Path) -> None:
    s = sqlite_settings(tmp_path)
    with pytest.raises(RolesError, match="need PostgreSQL"):
        apply_roles(sa.create_engine(s.db_url))


def test_bad_host_ids_and_scram_verifier() -> None:
    engine = sa.create_engine("postgresql+psycopg://nobody@127.0.0.1:1/none")
    for bad in ("", "a b", "x;drop", "é", "h" * 64, '"q"'):
        with pytest.raises(RolesError, match="host id"):
            apply_roles(engine, hosts=[bad])
    v = scram_verifier("secret", salt=b"0123456789abcdef")
    assert v.startswith("SCRAM-SHA-256$4096:") and "secret" not in v and "'" not in v
    assert json.dumps(v)


def _first_column(deployment: Deployment, table: str) -> str:
    with deployment.admin.connect() as conn:
        return str(conn.execute(sa.text(
            "SELECT column_name FROM information_schema.columns WHERE table_schema = "
            "current_schema() AND table_name = :t ORDER BY ordinal_position LIMIT 1"),
            {"t": table}).scalar())
