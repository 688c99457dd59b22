"""PostgreSQL roles and grants: each part of a deployment holds its own credential.

A Triton host runs tenant-influenced input through a Python backend, and Triton's 2025-26
advisories chain one request to code execution on such a host. So a host's credential must not be
able to rewrite the platform's trust or its evidence. ``loraplane db roles`` creates, on the
schema the connection's ``search_path`` names:

- ``<prefix>_control`` (LOGIN): the control plane. Owns every mapped table, so it reads and
  writes everything, creates and upgrades the schema, and is not subject to row-level security.
- ``<prefix>_gateway`` (LOGIN): reads the routing projections; reads the request ledger's
  usage columns (the OpenAI route's ``usage``, ``/v1/stats``, the feedback route's ownership
  check) and inserts ratings into ``request_feedback``; reads the hosts' ledger logs and the
  control plane's verified checkpoints (``ledger_log``, ``ledger_verified``: the receipts
  route). Nothing else.
- ``<prefix>_host`` (NOLOGIN), and one LOGIN role per Triton host, named by its host id
  (``LORAPLANE_HOST_ID``) and a member of ``<prefix>_host``: reads the host view (revocations,
  signing keys, releases, bases, the tenants' ticket cut-offs, the projections' position),
  inserts its own ledger and adapter-load rows, updates only its own rows' completion columns,
  reports revocation steps into ``serving_step_reports`` (the control plane folds them into
  events), replaces its own row of ``host_status`` (its slots, tiers and load queue, for the
  operator console), and makes, renews and deletes its own claims in ``adapter_replicas`` while
  reading everyone's (an adapter's ``max_replicas`` counts them). Never the event store, a
  projection's rows, or the API-key hashes.

Whose rows are "own" is decided by row-level security on ``host = session_user``: the login
role the host connected as. ``current_user`` would follow a ``SET ROLE`` to the group role;
``session_user`` changes only by ``SET SESSION AUTHORIZATION``, which needs a superuser, so a
host cannot claim another's rows (PostgreSQL 15 has no ``GRANT ... WITH SET FALSE`` that would
make ``current_user`` as safe).

:data:`GRANTS` is the whole truth: every run revokes what gateway and host roles hold on the
schema's tables and grants exactly what the map says, so re-running is idempotent and a grant
removed from the map is removed from the database. A table the map does not name stays the
control plane's alone (default deny), and the run reports it. To give a new table to a role,
add one entry (see :data:`GRANTS`) and run ``loraplane db roles`` again.

Passwords: given ones (``--password-file``, or ``LORAPLANE_DB_ROLE_PASSWORDS``) or generated
ones (``--new-passwords``, printed once to stdout) are sent as SCRAM-SHA-256 verifiers computed
here, so no plaintext password reaches the server, its statement log, or this process's logs.
SQLite has no roles: role separation needs PostgreSQL.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import re
import secrets
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from control.contracts.host_status import host_status

# -- the grant map ------------------------------------------------------------------------------

CONTROL, GATEWAY, HOST = "control", "gateway", "host"
EVERY_COLUMN = ("*",)
DEFAULT_PREFIX = "loraplane"


@dataclass(frozen=True)
class Grant:
    """What one role may do on one table. ``select``/``update`` name columns (``EVERY_COLUMN``:
    all of them); ``own_rows`` names the column that must equal the session's login role for
    every row the role reads, inserts, updates or deletes (row-level security); ``reads_all``:
    it may still read every row, and writes only its own (a table whose rows the hosts count
    together, ``adapter_replicas``)."""

    select: tuple[str, ...] = ()
    insert: bool = False
    update: tuple[str, ...] = ()
    own_rows: str | None = None
    delete: bool = False
    reads_all: bool = False

    def describe(self) -> str:
        def cols(c: tuple[str, ...]) -> str:
            return "" if c == EVERY_COLUMN else f"({', '.join(c)})"

        parts = ([f"SELECT{cols(self.select)}"] if self.select else []) + (
            ["INSERT"] if self.insert else []) + (
            [f"UPDATE{cols(self.update)}"] if self.update else []) + (
            ["DELETE"] if self.delete else [])
        if self.own_rows:
            parts.append(f"{'writes ' if self.reads_all else ''}own rows "
                         f"({self.own_rows} = session_user)")
        return ", ".join(parts)


READ = Grant(select=EVERY_COLUMN)
# The columns a host sets when its request ends (control.contracts.ledger: Ledger.complete and
# fail_running); everything else on a row is fixed at admission.
COMPLETION_COLUMNS = ("outcome", "finished_at", "tokens_in", "tokens_out", "reason",
                      "served_digest")
# What the gateway reads of the ledger: usage sums, a tenant's own per-digest stats, and the
# rating route's ownership check (control.gateway.openai_api, observability, server).
GATEWAY_LEDGER_COLUMNS = ("request_id", "tenant", "adapter_digest", "release_digest", "outcome",
                          "tokens_in", "tokens_out", "admitted_at", "finished_at")
OWN_HOST = "host"  # the column naming the host on host-written tables
# What a host's status report replaces each time: every column but ``host`` (the row's key,
# whose policy names the host).
HOST_STATUS_COLUMNS = tuple(c.name for c in host_status.columns if c.name != OWN_HOST)

# table -> role -> what it may do. The control plane owns every table named here; a role not
# named for a table gets nothing on it. Adding a table: one line, e.g. a host-written log
#     "ledger_log": {HOST: Grant(select=EVERY_COLUMN, insert=True, own_rows=OWN_HOST)},
# and a table only the control plane touches: ``"table": {}`` (named, so the run does not
# report it as unmapped).
GRANTS: dict[str, dict[str, Grant]] = {
    # the event store and its seals: the control plane alone
    "registry_events": {},
    "registry_events_chain": {},  # each event's link, written with it (control.app.chain)
    "audit_checkpoints": {},
    # schema versions: every process checks them at start
    "loraplane_schema": {GATEWAY: READ, HOST: READ},
    # the routing projections
    "routes": {GATEWAY: READ},
    "grants": {GATEWAY: READ},
    "api_keys": {GATEWAY: READ},  # hashes: the gateway authenticates; hosts never see them
    "adapters": {GATEWAY: READ},
    "session_pins": {GATEWAY: READ},
    "serving_steps": {GATEWAY: READ},
    "releases": {GATEWAY: READ, HOST: READ},
    "bases": {GATEWAY: READ, HOST: READ},
    "revocations": {GATEWAY: READ, HOST: READ},
    "signing_keys": {GATEWAY: READ, HOST: READ},
    "tenants": {GATEWAY: READ, HOST: Grant(select=("name", "tickets_not_before",
                                                   "resident_share", "loads_per_minute",
                                                   "max_replicas", "pool", "regions"))},
    "projection_tracking": {GATEWAY: READ, HOST: READ},
    "routing_changes": {GATEWAY: READ},  # what each batch changed: the route cache's refresh
    # the request ledger and what hangs off it
    "request_ledger": {
        GATEWAY: Grant(select=GATEWAY_LEDGER_COLUMNS),
        HOST: Grant(select=EVERY_COLUMN, insert=True, update=COMPLETION_COLUMNS,
                    own_rows=OWN_HOST),
    },
    "adapter_loads": {HOST: Grant(select=EVERY_COLUMN, insert=True, own_rows=OWN_HOST)},
    # the hosts' claims on an adapter's replicas (control.contracts.replica_claims): every host
    # counts everyone's live claims, and makes, renews and gives up its own only
    "adapter_replicas": {HOST: Grant(select=EVERY_COLUMN, insert=True,
                                     update=("claimed_at", "expires_at", "for_owner"),
                                     delete=True,
                                     own_rows=OWN_HOST, reads_all=True)},
    "request_feedback": {GATEWAY: Grant(select=("request_id",), insert=True)},
    # a host's revocation steps, folded into events by the control plane
    "serving_step_reports": {HOST: Grant(select=EVERY_COLUMN, insert=True, own_rows=OWN_HOST)},
    # each host's Merkle log of its ledger rows (control.contracts.ledger_log): a host appends
    # to its own log, moves its own head, signs its own checkpoints and publishes its own key;
    # the gateway reads the log and the control plane's verified checkpoints to build a
    # tenant's receipt (control.gateway.receipts), never the unverified notes or host keys
    "ledger_log": {GATEWAY: READ,
                   HOST: Grant(select=EVERY_COLUMN, insert=True, own_rows=OWN_HOST)},
    "ledger_verified": {GATEWAY: READ},  # written by the control plane alone
    "ledger_log_heads": {HOST: Grant(select=EVERY_COLUMN, insert=True, update=("size",),
                                     own_rows=OWN_HOST)},
    "ledger_checkpoints": {HOST: Grant(select=EVERY_COLUMN, insert=True, own_rows=OWN_HOST)},
    "ledger_host_keys": {HOST: Grant(select=EVERY_COLUMN, insert=True, own_rows=OWN_HOST)},
    # the keys that open tickets' sealed arms (control.contracts.ticket_seals): a gateway
    # publishes the seal of the key it signs with; a host reads them and keeps only rows whose
    # proof a trusted signing key made
    "ticket_seals": {GATEWAY: Grant(select=EVERY_COLUMN, insert=True), HOST: READ},
    # each host's latest status report (control.contracts.host_status): a host replaces its own
    # row and no other; the console reads them as the control plane, the gateway never does
    "host_status": {HOST: Grant(select=EVERY_COLUMN, insert=True, update=HOST_STATUS_COLUMNS,
                                own_rows=OWN_HOST)},
}


# -- roles ------------------------------------------------------------------------------------

HOST_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
PREFIX_RE = re.compile(r"^[a-z][a-z0-9_]{0,40}$")
POLICY_PREFIX = "loraplane_"
_LOCK_KEY = 0x6C6F7261726F6C65  # "lorarole": one `db roles` at a time on a database


class RolesError(RuntimeError):
    """Roles cannot be set up as asked; the message says why and what to do."""


@dataclass(frozen=True)
class RoleNames:
    prefix: str = DEFAULT_PREFIX

    def __post_init__(self) -> None:
        if not PREFIX_RE.match(self.prefix):
            raise RolesError(f"role prefix must be lower-case letters, digits and _ (starting "
                             f"with a letter, at most 41 characters), not {self.prefix!r}")

    @property
    def control(self) -> str:
        return f"{self.prefix}_control"

    @property
    def gateway(self) -> str:
        return f"{self.prefix}_gateway"

    @property
    def hosts(self) -> str:
        """The group role every host's login role belongs to (NOLOGIN)."""
        return f"{self.prefix}_host"

    def of(self, kind: str) -> str:
        return {CONTROL: self.control, GATEWAY: self.gateway, HOST: self.hosts}[kind]


def check_host_id(host: str) -> str:
    if not HOST_ID_RE.match(host):
        raise RolesError(f"a host id names its database role: letters, digits, '.', '_' and "
                         f"'-', at most 63 characters, not {host!r}")
    return host


@dataclass(frozen=True)
class RoleRow:
    role: str
    kind: str  # control | gateway | host group | host
    action: str  # created | kept
    password: str  # set | unchanged


@dataclass(frozen=True)
class TableRow:
    table: str
    gateway: str
    host: str
    note: str = ""


@dataclass
class RolesReport:
    roles: list[RoleRow] = field(default_factory=list)
    tables: list[TableRow] = field(default_factory=list)
    unmapped: list[str] = field(default_factory=list)


def scram_verifier(password: str, *, iterations: int = 4096, salt: bytes | None = None) -> str:
    """PostgreSQL's SCRAM-SHA-256 password verifier (RFC 5802/7677, as ``pg_authid`` stores
    it): ``ALTER ROLE ... PASSWORD`` given this never sees the plaintext."""
    salt = salt or secrets.token_bytes(16)
    salted = hashlib.pbkdf2_hmac("sha256", password.encode(), salt, iterations)
    client_key = hmac.new(salted, b"Client Key", hashlib.sha256).digest()
    stored_key = hashlib.sha256(client_key).digest()
    server_key = hmac.new(salted, b"Server Key", hashlib.sha256).digest()

    def b64(b: bytes) -> str:
        return base64.b64encode(b).decode()

    return f"SCRAM-SHA-256${iterations}:{b64(salt)}${b64(stored_key)}:{b64(server_key)}"


def new_password() -> str:
    return secrets.token_urlsafe(24)


# Passwords to set, as a JSON object (role name -> password): for a one-shot job such as compose's
# ``db-roles`` service, which gets them from its environment rather than from a file.
PASSWORDS_ENV = "LORAPLANE_DB_ROLE_PASSWORDS"


def parse_passwords(text: str, source: str) -> dict[str, str]:
    """Role name -> password from a JSON object; RolesError naming ``source`` (never the text,
    which holds the passwords) when it is not one."""
    try:
        given = json.loads(text)
    except ValueError:
        raise RolesError(f"{source}: not JSON (expected an object of role name -> "
                         "password)") from None
    if not isinstance(given, dict) or not all(
            isinstance(k, str) and isinstance(v, str) and v for k, v in given.items()):
        raise RolesError(f"{source}: expected a JSON object of role name -> non-empty password")
    return dict(given)


# -- applying ---------------------------------------------------------------------------------

class _Sql:
    """Identifier quoting and the catalogue reads, on one connection."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.q = conn.dialect.identifier_preparer.quote

    def run(self, sql: str) -> None:
        self.conn.exec_driver_sql(sql)

    def role(self, name: str) -> sa.Row[tuple[bool, bool]] | None:
        return self.conn.execute(sa.text(
            "SELECT rolsuper, rolbypassrls FROM pg_roles WHERE rolname = :n"), {"n": name}
        ).first()

    def member_of(self, member: str, group: str) -> bool:
        return self.conn.execute(sa.text(
            "SELECT 1 FROM pg_auth_members m JOIN pg_roles g ON g.oid = m.roleid "
            "JOIN pg_roles u ON u.oid = m.member WHERE g.rolname = :g AND u.rolname = :u"),
            {"g": group, "u": member}).first() is not None

    def tables(self) -> list[str]:
        return [str(t) for t in self.conn.execute(sa.text(
            "SELECT c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
            "WHERE n.nspname = current_schema() AND c.relkind IN ('r', 'p') ORDER BY 1"))
            .scalars()]

    def sequences(self, table: str) -> list[str]:
        """The sequences feeding ``table``'s serial or identity columns."""
        return [str(s) for s in self.conn.execute(sa.text(
            "SELECT pg_get_serial_sequence(quote_ident(current_schema()) || '.' || "
            "quote_ident(:t), a.attname) FROM pg_attribute a JOIN pg_class c ON c.oid = "
            "a.attrelid JOIN pg_namespace n ON n.oid = c.relnamespace WHERE c.relname = :t "
            "AND n.nspname = current_schema() AND a.attnum > 0 AND NOT a.attisdropped"),
            {"t": table}).scalars() if s]

    def policies(self, table: str) -> list[str]:
        return [str(p) for p in self.conn.execute(sa.text(
            "SELECT policyname FROM pg_policies WHERE schemaname = current_schema() "
            "AND tablename = :t"), {"t": table}).scalars()
            if str(p).startswith(POLICY_PREFIX)]


def _ensure_role(sql: _Sql, name: str, kind: str, *, login: bool, group: str | None,
                 password: str | None) -> RoleRow:
    found = sql.role(name)
    q = sql.q(name)
    if found is None:
        sql.run(f"CREATE ROLE {q} {'LOGIN' if login else 'NOLOGIN'}"
                + (f" IN ROLE {sql.q(group)}" if group else ""))
        action = "created"
    else:
        if found[0] or found[1]:
            raise RolesError(f"role {name} exists as a superuser or with BYPASSRLS: it cannot "
                             "be a least-privilege loraplane role; drop it or pick another "
                             "--prefix / host id")
        if group is not None and not sql.member_of(name, group):
            raise RolesError(f"role {name} exists and is not a member of {group}: refusing to "
                             "make an existing role a loraplane host; pick another host id")
        action = "kept"
    if password is not None:
        # A verifier, never the plaintext (module notes); it holds no quote character.
        sql.run(f"ALTER ROLE {q} PASSWORD '{scram_verifier(password)}'")
    return RoleRow(name, kind, action, "set" if password is not None else "unchanged")


def _columns(cols: tuple[str, ...], quote: Callable[[str], str]) -> str:
    return "" if cols == EVERY_COLUMN else "(" + ", ".join(quote(c) for c in cols) + ")"


def _grant_table(sql: _Sql, table: str, grants: Mapping[str, Grant], names: RoleNames,
                 logins: Sequence[str]) -> None:
    t = sql.q(table)
    sql.run(f"ALTER TABLE {t} OWNER TO {sql.q(names.control)}")
    others = [names.gateway, names.hosts, *logins]
    sql.run(f"REVOKE ALL ON TABLE {t} FROM {', '.join(sql.q(r) for r in others)}")
    sequences = sql.sequences(table)
    for seq in sequences:  # qualified and quoted by pg_get_serial_sequence already
        sql.run(f"REVOKE ALL ON SEQUENCE {seq} FROM {', '.join(sql.q(r) for r in others)}")
    for policy in sql.policies(table):
        sql.run(f"DROP POLICY {sql.q(policy)} ON {t}")
    for kind, g in grants.items():
        role = sql.q(names.of(kind))
        if g.select:
            sql.run(f"GRANT SELECT{_columns(g.select, sql.q)} ON TABLE {t} TO {role}")
        if g.insert:
            sql.run(f"GRANT INSERT ON TABLE {t} TO {role}")
            for seq in sequences:
                sql.run(f"GRANT USAGE ON SEQUENCE {seq} TO {role}")
        if g.update:
            sql.run(f"GRANT UPDATE{_columns(g.update, sql.q)} ON TABLE {t} TO {role}")
        if g.delete:
            sql.run(f"GRANT DELETE ON TABLE {t} TO {role}")
    guarded = any(g.own_rows for g in grants.values())
    sql.run(f"ALTER TABLE {t} {'ENABLE' if guarded else 'DISABLE'} ROW LEVEL SECURITY")
    if not guarded:
        return
    for kind, g in grants.items():
        name = sql.q(f"{POLICY_PREFIX}{kind}")
        role = sql.q(names.of(kind))
        if g.own_rows:
            mine = f"{sql.q(g.own_rows)} = session_user"
            sql.run(f"CREATE POLICY {name} ON {t} TO {role} USING ({mine}) WITH CHECK ({mine})")
            if g.reads_all:  # permissive policies add up: every row for SELECT, own for writes
                reads = sql.q(f"{POLICY_PREFIX}{kind}_reads")
                sql.run(f"CREATE POLICY {reads} ON {t} FOR SELECT TO {role} USING (true)")
        else:  # its column grants already say what it may do; every row is visible to it
            sql.run(f"CREATE POLICY {name} ON {t} FOR SELECT TO {role} USING (true)")


def apply_roles(engine: Engine, *, names: RoleNames | None = None, hosts: Iterable[str] = (),
                passwords: Mapping[str, str] | None = None,
                grants: Mapping[str, Mapping[str, Grant]] | None = None) -> RolesReport:
    """Create the roles (``hosts``: host ids, one login role each) and make the schema's tables'
    privileges exactly :data:`GRANTS`; one transaction, idempotent. ``passwords``: role name ->
    password to set (roles not named keep theirs). Raises :class:`RolesError` on SQLite, on a bad
    host id, or on an existing role that must not become one of these."""
    if engine.dialect.name != "postgresql":
        raise RolesError("database roles need PostgreSQL: SQLite is the embedded, single-user "
                         "default and has no roles or grants (set LORAPLANE_DB_URL to a "
                         "postgresql+psycopg:// URL)")
    names = names or RoleNames()
    grants = GRANTS if grants is None else grants
    logins = sorted({check_host_id(h) for h in hosts})
    passwords = dict(passwords or {})
    known = {names.control, names.gateway, *logins}
    stray = sorted(set(passwords) - known)
    if stray:
        raise RolesError(f"passwords given for roles this run does not manage: {stray}")
    report = RolesReport()
    try:
        with engine.begin() as conn:
            conn.execute(sa.select(sa.func.pg_advisory_xact_lock(_LOCK_KEY)))
            sql = _Sql(conn)
            for name, kind, login, group in (
                    (names.control, CONTROL, True, None), (names.gateway, GATEWAY, True, None),
                    (names.hosts, "host group", False, None),
                    *((h, HOST, True, names.hosts) for h in logins)):
                report.roles.append(_ensure_role(sql, name, kind, login=login, group=group,
                                                 password=passwords.get(name)))
            schema = sql.q(str(conn.execute(sa.text("SELECT current_schema()")).scalar()))
            sql.run(f"GRANT USAGE, CREATE ON SCHEMA {schema} TO {sql.q(names.control)}")
            sql.run(f"GRANT USAGE ON SCHEMA {schema} TO {sql.q(names.gateway)}, "
                    f"{sql.q(names.hosts)}")
            for table in sql.tables():
                if table not in grants:
                    report.unmapped.append(table)
                    continue
                _grant_table(sql, table, grants[table], names, logins)
                g, h = grants[table].get(GATEWAY), grants[table].get(HOST)
                report.tables.append(TableRow(table, g.describe() if g else "",
                                              h.describe() if h else ""))
    except sa.exc.DBAPIError as e:
        raise RolesError(f"could not set up the roles: {e.orig}") from None
    return report


def role_url(url: sa.engine.URL, role: str, password: str | None) -> str:
    """``url`` with ``role`` (and ``password``, when given) as its credentials."""
    out = url.set(username=role, password=password)
    return out.render_as_string(hide_password=password is None)
