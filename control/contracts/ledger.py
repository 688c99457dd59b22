"""The request ledger: one durable row per request, written before its response leaves.

Rows are keyed by request id and indexed by adapter digest and time, and by release manifest
digest and time, so an incident responder can ask which requests a digest or a release served,
for whom, and when. The ledger lives in the same database as the event store (one URL); it is
append-mostly: a row is inserted at admission (or refusal) and updated once when the request
finishes. Its schema is versioned (``control.contracts.schema``, component ``ledger``): opening a
ledger
creates a fresh one at the latest version and refuses an older one.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from control.contracts.schema import Component, add_column, declare, index_named, open_component

metadata = sa.MetaData()


class Outcome(StrEnum):
    """How a request ended, as the ledger records it."""

    RUNNING = "running"  # admitted, not finished (or its host died: marked failed at restart)
    OK = "ok"
    REJECTED = "rejected"  # refused before generation: ticket, revocation, limits, busy
    FAILED = "failed"
    CANCELLED = "cancelled"  # the client cancelled or went away
    # The slot that computed the row did not hold the adapter the ticket named: the request
    # failed closed, and the row names both digests.
    IDENTITY_MISMATCH = "identity_mismatch"


request_ledger = sa.Table(
    "request_ledger",
    metadata,
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
    sa.Column("outcome", sa.String(32), nullable=False),  # an Outcome (32 since version 3)
    sa.Column("reason", sa.String(64), nullable=True),
    # Schema version 2: the release manifest the verified ticket named (None for rows whose ticket
    # did not verify, for a base without a release, and for rows written before version 2).
    sa.Column("release_digest", sa.String(71), nullable=True),
    # Schema version 3: the adapter digest the engine's slot held while it computed this row's
    # tokens, read from the slot, not from the ticket (None: the base slot, or never computed).
    # ``adapter_digest`` is what the verified ticket named; the two differ only on an
    # identity_mismatch row, and the incident view searches both.
    sa.Column("served_digest", sa.String(71), nullable=True),
    sa.Index("ix_ledger_adapter_time", "adapter_digest", "admitted_at"),
    sa.Index("ix_ledger_time", "admitted_at"),
    sa.Index("ix_ledger_release_time", "release_digest", "admitted_at"),
    sa.Index("ix_ledger_served_time", "served_digest", "admitted_at"),
)

OUTCOMES = tuple(o.value for o in Outcome)

# One row per attempt to make an adapter resident on a host: the evidence that a refused request
# never caused a load, and the record of loads that failed (bytes changed in the store, say).
adapter_loads = sa.Table(
    "adapter_loads",
    metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("host", sa.String(128), nullable=False),
    sa.Column("adapter_digest", sa.String(71), nullable=False, index=True),
    sa.Column("started_at", sa.Float, nullable=False),
    sa.Column("seconds", sa.Float, nullable=False),
    sa.Column("outcome", sa.String(16), nullable=False),  # loaded | failed | unloaded
    sa.Column("resident_bytes", sa.BigInteger, nullable=True),
    sa.Column("reason", sa.String(64), nullable=True),
)


@dataclass(frozen=True)
class AdapterLoad:
    host: str
    adapter_digest: str
    started_at: float
    seconds: float
    outcome: str
    resident_bytes: int | None = None
    reason: str | None = None


@dataclass(frozen=True)
class LedgerEntry:
    request_id: str
    ticket_id: str | None
    tenant: str | None
    model: str
    host: str
    base_digest: str | None
    adapter_digest: str | None
    tokenizer_digest: str | None
    admitted_at: float
    finished_at: float | None = None
    tokens_in: int | None = None
    tokens_out: int | None = None
    outcome: str = Outcome.RUNNING
    reason: str | None = None
    release_digest: str | None = None
    served_digest: str | None = None


@dataclass(frozen=True)
class Completion:
    request_id: str
    outcome: str
    tokens_in: int | None = None
    tokens_out: int | None = None
    reason: str | None = None
    served_digest: str | None = None  # read from the slot that computed the tokens


# -- the ledger's schema component (control.contracts.schema) -----------------------------------

def _ledger_version(insp: sa.Inspector) -> int:
    # Versions 2 and 3 each added one column; the newest column present tells the version.
    # Without a request_ledger (only adapter_loads) nothing needs altering: the missing table
    # is created at the latest version.
    if not insp.has_table(request_ledger.name):
        return LEDGER_VERSION
    columns = {c["name"] for c in insp.get_columns(request_ledger.name)}
    if "served_digest" in columns:
        return 3
    return 2 if "release_digest" in columns else 1


def _ledger_1_to_2(conn: Connection) -> None:
    add_column(conn, request_ledger.c.release_digest)
    index_named(request_ledger, "ix_ledger_release_time").create(conn)


def _ledger_2_to_3(conn: Connection) -> None:
    add_column(conn, request_ledger.c.served_digest)
    index_named(request_ledger, "ix_ledger_served_time").create(conn)
    if conn.dialect.name == "postgresql":  # SQLite does not enforce VARCHAR lengths
        conn.exec_driver_sql("ALTER TABLE request_ledger ALTER COLUMN outcome TYPE VARCHAR(32)")


LEDGER_VERSION = 3
LEDGER = declare(Component("ledger", LEDGER_VERSION, metadata, _ledger_version,
                           steps={1: _ledger_1_to_2, 2: _ledger_2_to_3}))


class Ledger:
    """Writes and queries the request ledger."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        # Creates a fresh ledger at the latest version; refuses an older or newer one with a
        # message naming `loraplane db upgrade` (no silent ALTER on the evidence table).
        open_component(engine, LEDGER)

    def admit(self, entries: Sequence[LedgerEntry]) -> None:
        """Insert rows (admitted or refused) in one transaction."""
        self.write(entries, ())

    def complete(self, completions: Sequence[Completion], now: float | None = None) -> None:
        """Record how requests ended, in one transaction; only running rows change."""
        self.write((), completions, now)

    def write(self, entries: Sequence[LedgerEntry], completions: Sequence[Completion],
              now: float | None = None) -> None:
        """Insert ``entries`` and apply ``completions``, all in one transaction."""
        if not entries and not completions:
            return
        with self.engine.begin() as conn:
            if entries:
                conn.execute(request_ledger.insert(), [_row(e) for e in entries])
            if completions:
                _complete(conn, completions, time.time() if now is None else now)

    def fail_running(self, host: str, reason: str = "host_restart") -> int:
        """Mark rows this host left running (it died mid-request) as failed."""
        with self.engine.begin() as conn:
            res = conn.execute(
                request_ledger.update()
                .where(request_ledger.c.host == host)
                .where(request_ledger.c.outcome == "running")
                .values(outcome="failed", reason=reason, finished_at=time.time())
            )
            return int(res.rowcount or 0)

    def query(
        self,
        *,
        adapter: str | None = None,
        release: str | None = None,
        tenant: str | None = None,
        since: float | None = None,
        until: float | None = None,
        outcome: str | None = None,
    ) -> list[LedgerEntry]:
        """Rows matching every given filter, oldest first."""
        q = sa.select(request_ledger)
        if adapter is not None:  # what the ticket named, or what the slot held
            q = q.where(sa.or_(request_ledger.c.adapter_digest == adapter,
                               request_ledger.c.served_digest == adapter))
        if release is not None:
            q = q.where(request_ledger.c.release_digest == release)
        if tenant is not None:
            q = q.where(request_ledger.c.tenant == tenant)
        if since is not None:
            q = q.where(request_ledger.c.admitted_at >= since)
        if until is not None:
            q = q.where(request_ledger.c.admitted_at < until)
        if outcome is not None:
            q = q.where(request_ledger.c.outcome == outcome)
        q = q.order_by(request_ledger.c.admitted_at, request_ledger.c.request_id)
        with self.engine.connect() as conn:
            return [LedgerEntry(**dict(r._mapping)) for r in conn.execute(q)]

    def record_load(self, load: AdapterLoad) -> None:
        with self.engine.begin() as conn:
            conn.execute(adapter_loads.insert(), [{f: getattr(load, f)
                                                   for f in AdapterLoad.__dataclass_fields__}])

    def loads(self, adapter: str | None = None) -> list[AdapterLoad]:
        q = sa.select(*[adapter_loads.c[f] for f in AdapterLoad.__dataclass_fields__])
        if adapter is not None:
            q = q.where(adapter_loads.c.adapter_digest == adapter)
        with self.engine.connect() as conn:
            return [AdapterLoad(**dict(r._mapping))
                    for r in conn.execute(q.order_by(adapter_loads.c.id))]

    def get(self, request_id: str) -> LedgerEntry | None:
        with self.engine.connect() as conn:
            r = conn.execute(
                sa.select(request_ledger).where(request_ledger.c.request_id == request_id)
            ).first()
        return LedgerEntry(**dict(r._mapping)) if r else None


def _complete(conn: sa.Connection, completions: Sequence[Completion], t: float) -> None:
    stmt = (
        request_ledger.update()
        .where(request_ledger.c.request_id == sa.bindparam("rid"))
        .where(request_ledger.c.outcome == Outcome.RUNNING.value)
        .values(
            outcome=sa.bindparam("o"),
            tokens_in=sa.bindparam("ti"),
            tokens_out=sa.bindparam("to"),
            reason=sa.bindparam("r"),
            served_digest=sa.bindparam("sd"),
            finished_at=t,
        )
    )
    conn.execute(stmt, [
        {"rid": c.request_id, "o": str(c.outcome), "ti": c.tokens_in, "to": c.tokens_out,
         "r": c.reason, "sd": c.served_digest}
        for c in completions
    ])


def _row(e: LedgerEntry) -> dict[str, object]:
    if e.outcome not in OUTCOMES:
        raise ValueError(f"unknown ledger outcome {e.outcome!r}")
    row = {f: getattr(e, f) for f in LedgerEntry.__dataclass_fields__}
    row["outcome"] = str(e.outcome)
    return row
