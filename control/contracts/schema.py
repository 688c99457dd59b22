"""Schema versions of the tables beside the event store, and the one way to upgrade them.

Each component below has a row in ``loraplane_schema`` (component, version, upgraded_at):

- ``ledger``: ``request_ledger`` and ``adapter_loads`` (``control.contracts.ledger``). Evidence:
never
  dropped; upgraded in place by explicit steps. Version 1 is the ledger before release digests;
  version 2 adds ``request_ledger.release_digest`` and its (release_digest, admitted_at) index;
  version 3 adds ``request_ledger.served_digest`` (the digest the engine's slot held, the
  evidence of which adapter answered) with its index, and widens ``outcome`` to 32 characters
  for ``identity_mismatch``; version 4 adds the table ``request_feedback`` (tenant feedback, one
  rating per request).
- ``ledger_log``: each host's ledger as a Merkle log with signed checkpoints
  (``control.contracts.ledger_log``). Evidence too; version 1.
- ``audit``: ``audit_checkpoints`` (``control.app.integrity``). Evidence too; version 1.
- ``serving_reports``: ``serving_step_reports`` (``control.contracts.serving_reports``): the
  Triton hosts' revocation steps, which the control plane folds into events; version 1.
- ``host_status``: ``host_status`` (``control.contracts.host_status``): each Triton host's
  latest report of its slots, tiers, load queue and batch, for the operator console; a view of
  the moment, replaced by each report; version 1.
- ``projections``: the tables of ``projections.tables``. Derived from the event store, so an older
  version is not migrated: the tables are dropped, created afresh and replayed from the events.

The event store's own tables belong to ``eventsourcing`` and are not versioned here.

Opening a component (``Ledger(...)``; ``create_tables`` for the projections):

- no table of it exists: created at the latest version, version row written, one transaction;
- its tables exist without a version row (made before versions were recorded): the version is
  read from the columns (``request_ledger`` without ``release_digest`` is ledger version 1) and,
  when it is the latest, written;
- an older version: refused (:class:`SchemaOutdated`, "run `loraplane db upgrade`");
- a newer version: refused (:class:`SchemaTooNew`, "upgrade loraplane").

Why opening never upgrades an existing schema, not even the ledger's one ADD COLUMN: in a
scale-out deployment every Triton host opens the one shared ledger as it starts, an upgrade takes
an exclusive lock on the table every request writes to, and it changes the evidence store. That
is an operator's act, done once with the services stopped (``loraplane db upgrade``), not a side
effect of whichever host happens to start first. Failing fast at start also beats the
alternative: a host that starts and then fails every request on a missing column.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

VERSION_TABLE = "loraplane_schema"

_metadata = sa.MetaData()
versions = sa.Table(
    VERSION_TABLE, _metadata,
    sa.Column("component", sa.String(32), primary_key=True),
    sa.Column("version", sa.Integer, nullable=False),
    sa.Column("upgraded_at", sa.DateTime(timezone=True), nullable=False),
)

# pg_advisory_xact_lock key ("loraplan" in ASCII): serialises every process that creates,
# stamps or upgrades a schema on one PostgreSQL database. SQLite uses BEGIN IMMEDIATE.
_PG_LOCK_KEY = 0x6C6F7261706C616E

UPGRADE_ADVICE = ("stop the loraplane services that use this database and run "
                  "`loraplane db upgrade` (once, from one machine)")
TOO_NEW_ADVICE = ("this loraplane is older than the database: run a loraplane release that "
                  "knows this version on every process sharing the database; do not downgrade "
                  "the database")


class SchemaError(RuntimeError):
    """A component's schema is not the one this code works with. Names no tenant data."""

    def __init__(self, component: str, found: int, expected: int, advice: str) -> None:
        super().__init__(f"database schema of component '{component}' is at version {found}, "
                         f"this loraplane expects version {expected}: {advice}")
        self.component = component
        self.found = found
        self.expected = expected


class SchemaOutdated(SchemaError):
    """Older than this code: ``loraplane db upgrade`` brings it up to date."""

    def __init__(self, component: str, found: int, expected: int) -> None:
        super().__init__(component, found, expected, UPGRADE_ADVICE)


class SchemaTooNew(SchemaError):
    """Newer than this code knows: nothing here may write to it."""

    def __init__(self, component: str, found: int, expected: int) -> None:
        super().__init__(component, found, expected, TOO_NEW_ADVICE)


Step = Callable[[Connection], None]


@dataclass(frozen=True)
class Component:
    """One group of tables with one version number.

    ``detect`` reads the version of tables that exist without a version row. ``steps[n]``
    upgrades version n to n + 1 in place; a ``rebuildable`` component has no steps: an older
    version is dropped and rebuilt from the event store instead.
    """

    name: str
    latest: int
    metadata: sa.MetaData
    detect: Callable[[sa.Inspector], int]
    steps: Mapping[int, Step] = field(default_factory=dict)
    rebuildable: bool = False

    def __post_init__(self) -> None:
        if not self.rebuildable and set(self.steps) != set(range(1, self.latest)):
            raise ValueError(f"component {self.name}: one upgrade step per version below "
                             f"{self.latest}")


@dataclass(frozen=True)
class ComponentStatus:
    component: str
    found: int | None  # None: none of its tables exists yet
    expected: int
    stamped: bool  # a version row exists (else the version was read from the columns)

    @property
    def state(self) -> str:
        """absent | current | outdated | newer."""
        if self.found is None:
            return "absent"
        if self.found == self.expected:
            return "current"
        return "outdated" if self.found < self.expected else "newer"


@dataclass(frozen=True)
class Change:
    """What ``upgrade`` did to one component."""

    component: str
    before: int | None
    after: int
    action: str  # created | upgraded | rebuilt | stamped | current
    detail: str = ""


# -- the components -------------------------------------------------------------------------------
# Each owner declares its component beside its tables (control.contracts.ledger,
# control.app.integrity, projections.tables), so this module imports none of them. The order
# below is the order status and upgrade go through them.
ORDER = ("ledger", "ledger_log", "audit", "projections", "serving_reports", "ticket_seals",
         "host_status", "adapter_replicas")
OWNERS = {"ledger": "control.contracts.ledger", "ledger_log": "control.contracts.ledger_log",
          "audit": "control.app.integrity", "projections": "projections.tables",
          "serving_reports": "control.contracts.serving_reports",
          "ticket_seals": "control.contracts.ticket_seals",
          "host_status": "control.contracts.host_status",
          "adapter_replicas": "control.contracts.replica_claims"}
_declared: dict[str, Component] = {}


def declare(c: Component) -> Component:
    """Called once by each owner at import: the component joins :func:`all_components`."""
    if c.name not in ORDER:
        raise ValueError(f"unknown schema component {c.name!r}: add it to ORDER")
    _declared[c.name] = c
    return c


def all_components() -> tuple[Component, ...]:
    """Every component, in ORDER. A process that reads or upgrades the whole schema imports
    every owner first (``control.cli.database``); a missing one is a programming error."""
    missing = [n for n in ORDER if n not in _declared]
    if missing:
        raise RuntimeError(f"schema components {missing} are not declared in this process: "
                           f"import {', '.join(OWNERS[n] for n in missing)} first")
    return tuple(_declared[n] for n in ORDER)


def add_column(conn: Connection, column: sa.Column[object]) -> None:
    """ALTER TABLE ... ADD COLUMN, as SQLite and PostgreSQL both accept it (nullable, no
    default: existing rows read NULL, no table rewrite). For the owners' upgrade steps."""
    prep = conn.dialect.identifier_preparer
    conn.exec_driver_sql(
        f"ALTER TABLE {prep.format_table(column.table)} ADD COLUMN "
        f"{prep.format_column(column)} {column.type.compile(dialect=conn.dialect)}")


def index_named(table: sa.Table, name: str) -> sa.Index:
    return next(i for i in table.indexes if i.name == name)


# -- reading --------------------------------------------------------------------------------------

def _read(conn: Connection, c: Component) -> ComponentStatus:
    insp = sa.inspect(conn)
    if insp.has_table(VERSION_TABLE):
        found = conn.execute(sa.select(versions.c.version)
                             .where(versions.c.component == c.name)).scalar()
        if found is not None:
            return ComponentStatus(c.name, int(found), c.latest, stamped=True)
    if not any(insp.has_table(name) for name in c.metadata.tables):
        return ComponentStatus(c.name, None, c.latest, stamped=False)
    return ComponentStatus(c.name, c.detect(insp), c.latest, stamped=False)


def status(engine: Engine, components: tuple[Component, ...] | None = None,
           ) -> list[ComponentStatus]:
    """Each component's version as found (read only: writes nothing)."""
    with engine.connect() as conn:
        return [_read(conn, c) for c in components or all_components()]


def check(found: ComponentStatus) -> None:
    """Raise unless this code may use the component as it is (absent is fine: it is created)."""
    if found.found is None or found.state == "current":
        return
    if found.state == "newer":
        raise SchemaTooNew(found.component, found.found, found.expected)
    raise SchemaOutdated(found.component, found.found, found.expected)


def require_current(engine: Engine, components: tuple[Component, ...] | None = None) -> None:
    """Fail fast at start-up, before any service runs on a schema it cannot use."""
    for found in status(engine, components):
        check(found)


# -- writing --------------------------------------------------------------------------------------

@contextmanager
def _locked(engine: Engine) -> Iterator[Connection]:
    """One transaction holding the database's schema lock, committed on success.

    DDL is transactional on both databases, so creating or altering tables and writing the
    version row either all happen or none does.
    """
    with engine.connect() as conn:
        if engine.dialect.name == "sqlite":
            # The driver opens no transaction for DDL by itself; BEGIN IMMEDIATE opens one and
            # takes the write lock, so two processes never create or upgrade at once.
            conn.exec_driver_sql("BEGIN IMMEDIATE")
        elif engine.dialect.name == "postgresql":
            conn.execute(sa.select(sa.func.pg_advisory_xact_lock(_PG_LOCK_KEY)))
        try:
            versions.create(conn, checkfirst=True)
            yield conn
            conn.commit()
        except BaseException:
            conn.rollback()
            raise


def _stamp(conn: Connection, name: str, version: int) -> None:
    values = {"version": version, "upgraded_at": dt.datetime.now(dt.UTC)}
    updated = conn.execute(versions.update().where(versions.c.component == name).values(values))
    if updated.rowcount == 0:
        conn.execute(versions.insert().values(component=name, **values))


def _ensure(conn: Connection, c: Component) -> None:
    """Under the lock: create an absent component, stamp an unstamped current one, else refuse."""
    found = _read(conn, c)
    check(found)
    _bring_up(conn, c, found)  # only creates or stamps: check() refused everything else


def open_component(engine: Engine, c: Component) -> None:
    """Make ``c`` usable on ``engine`` or raise :class:`SchemaError` (see the module notes)."""
    with engine.connect() as conn:
        found = _read(conn, c)
    if found.stamped and found.state == "current":
        return  # the common case: one read, no lock
    check(found)
    with _locked(engine) as conn:
        _ensure(conn, c)  # reads again: another process may have got here first


def _upgrade_one(conn: Connection, c: Component) -> Change:
    found = _read(conn, c)
    if found.state == "newer":  # another process stamped it newer since upgrade() looked
        check(found)
    return _bring_up(conn, c, found)


def _bring_up(conn: Connection, c: Component, found: ComponentStatus) -> Change:
    """Under the lock: take ``c`` from ``found`` (not newer) to its latest version."""
    if found.found is None:
        c.metadata.create_all(conn, checkfirst=True)
        _stamp(conn, c.name, c.latest)
        return Change(c.name, None, c.latest, "created")
    if found.state == "current":
        # A table missing altogether (none of its rows to keep) is created in its latest form.
        c.metadata.create_all(conn, checkfirst=True)
        if found.stamped:
            return Change(c.name, found.found, c.latest, "current")
        _stamp(conn, c.name, c.latest)
        return Change(c.name, found.found, c.latest, "stamped", "version read from the columns")
    if c.rebuildable:
        # Derived tables: drop what this code knows and start afresh; the caller replays the
        # events after this commits. (A table an old version had and this one dropped stays.)
        c.metadata.drop_all(conn, checkfirst=True)
        c.metadata.create_all(conn)
        _stamp(conn, c.name, c.latest)
        return Change(c.name, found.found, c.latest, "rebuilt")
    for version in range(found.found, c.latest):
        c.steps[version](conn)
    c.metadata.create_all(conn, checkfirst=True)
    _stamp(conn, c.name, c.latest)
    return Change(c.name, found.found, c.latest, "upgraded")


def upgrade(
    engine: Engine,
    *,
    rebuild: Callable[[Engine], int] | None,
    components: tuple[Component, ...] | None = None,
) -> list[Change]:
    """Bring every component to its latest version; idempotent.

    Each component is upgraded in its own transaction, under the schema lock. ``rebuild``
    replays the event store into freshly created projection tables and returns the events it
    applied; it is only called for a rebuildable component that was outdated. Nothing is
    changed when any component is newer than this code.
    """
    components = components or all_components()
    before = status(engine, components)
    for found in before:
        if found.state == "newer":
            check(found)  # raises SchemaTooNew before anything is changed
    if rebuild is None and any(c.rebuildable and s.state == "outdated"
                               for c, s in zip(components, before, strict=True)):
        raise ValueError("rebuilding the projections needs the event store")
    changes: list[Change] = []
    for c in components:
        with _locked(engine) as conn:
            change = _upgrade_one(conn, c)
        if change.action == "rebuilt":
            assert rebuild is not None
            applied = rebuild(engine)
            change = Change(change.component, change.before, change.after, change.action,
                            f"{applied} events replayed")
        changes.append(change)
    return changes
