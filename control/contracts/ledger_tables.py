"""The request ledger's tables, row types and schema versions (``control.contracts.ledger``
reads and writes them; its notes say what the rows and ratings mean).

``request_ledger`` (one row per request), ``adapter_loads`` (one row per attempt to make an
adapter resident) and ``request_feedback`` (one rating per request), the dataclasses their rows
are read into, and the schema component ``ledger`` with every step from version 1 on: opening a
ledger creates a fresh one at the latest version and refuses an older one.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from control.contracts.schema import Component, add_column, declare, index_named

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
    # Running when its adapter was revoked with the kill switch (``adapter revoke --immediate``):
    # ended there; ``tokens_out`` counts the tokens the client had received.
    REVOKED = "revoked"


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
    # Schema version 6: the sampling values the engine generated with, after the release's
    # inference defaults filled what the request left out (None: the row was refused before its
    # values were checked, or was written before version 6; ``seed`` None: a random seed).
    sa.Column("max_tokens", sa.Integer, nullable=True),
    sa.Column("temperature", sa.Float, nullable=True),
    sa.Column("top_p", sa.Float, nullable=True),
    sa.Column("seed", sa.BigInteger, nullable=True),
    sa.Index("ix_ledger_adapter_time", "adapter_digest", "admitted_at"),
    sa.Index("ix_ledger_time", "admitted_at"),
    sa.Index("ix_ledger_release_time", "release_digest", "admitted_at"),
    sa.Index("ix_ledger_served_time", "served_digest", "admitted_at"),
    # Schema version 7: ``incident requests --base`` scanned the whole table without it.
    sa.Index("ix_ledger_base_time", "base_digest", "admitted_at"),
)

OUTCOMES = tuple(o.value for o in Outcome)

# Reasons the serving side writes on ``rejected`` rows that a rollout window counts apart
# (backend/serving writes them; tests/control/contracts/test_ledger_feedback.py holds these
# names to that source). ``busy``: the host's bound on requests in flight or its scheduler queue was
# full; a busy refusal before the ticket was read has no tenant and no release, and is counted
# host-wide only; ``tenant_busy``: the tenant held its part of the host's in-flight bound
# (``backend.serving.in_flight``), on a row with its tenant and release. The memory refusals are
# ``adapter_`` + the adapter cache's reason: no slot or device budget was free for the adapter (the
# host's out-of-memory answer).
BUSY_REASON = "busy"
TENANT_BUSY_REASON = "tenant_busy"
BUSY_REASONS = frozenset({BUSY_REASON, TENANT_BUSY_REASON})
MEMORY_REFUSALS = frozenset({"adapter_no_room", "adapter_device_budget", "adapter_tenant_share"})
LOAD_FAILED = "failed"  # adapter_loads.outcome of an attempt that did not make it resident

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


# Schema version 4: tenant feedback, one rating per request (the primary key), never changed.
# ``tenant`` repeats the row's tenant so a rating reads on its own; only that tenant may rate.
request_feedback = sa.Table(
    "request_feedback",
    metadata,
    sa.Column("request_id", sa.String(36), primary_key=True),
    sa.Column("tenant", sa.String(128), nullable=False),
    sa.Column("success", sa.Boolean, nullable=False),
    sa.Column("rated_at", sa.Float, nullable=False),
    # Schema version 5: the release the rated request was served under (its arm), copied from
    # the row when the rating is recorded. None: a rating recorded before version 5, which no
    # window counts (whose release it rated, and whether its owner gave it, was never checked).
    sa.Column("release_digest", sa.String(71), nullable=True),
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
    max_tokens: int | None = None  # the sampling values used (schema version 6)
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None


if [c.name for c in request_ledger.columns] != list(LedgerEntry.__dataclass_fields__):
    # Readers build entries from rows by position (projections.incidents): one order for both.
    raise ImportError("request_ledger's columns and LedgerEntry's fields differ in order")


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
    # Versions 2 and 3 each added one column, version 4 a table; the newest of them present
    # tells the version. Without a request_ledger (only adapter_loads) nothing needs altering:
    # the missing tables are created at the latest version.
    if not insp.has_table(request_ledger.name):
        return LEDGER_VERSION
    if insp.has_table(request_feedback.name):
        rated = {c["name"] for c in insp.get_columns(request_feedback.name)}
        if "release_digest" not in rated:
            return 4
        columns = {c["name"] for c in insp.get_columns(request_ledger.name)}
        if "max_tokens" not in columns:
            return 5
        indexes = {i["name"] for i in insp.get_indexes(request_ledger.name)}
        return 7 if "ix_ledger_base_time" in indexes else 6
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


def _ledger_3_to_4(conn: Connection) -> None:
    # The table as version 4 made it: version 5's column is added by the next step, so a
    # ledger upgraded from 3 ends exactly like one upgraded from 4.
    sa.Table(request_feedback.name, sa.MetaData(),
             sa.Column("request_id", sa.String(36), primary_key=True),
             sa.Column("tenant", sa.String(128), nullable=False),
             sa.Column("success", sa.Boolean, nullable=False),
             sa.Column("rated_at", sa.Float, nullable=False)).create(conn)


def _ledger_4_to_5(conn: Connection) -> None:
    # Ratings already held keep a NULL release: no window counts them (see the table).
    add_column(conn, request_feedback.c.release_digest)


def _ledger_5_to_6(conn: Connection) -> None:
    # Rows already held keep NULL: what they were sampled with was not recorded.
    for column in ("max_tokens", "temperature", "top_p", "seed"):
        add_column(conn, request_ledger.c[column])


def _ledger_6_to_7(conn: Connection) -> None:
    # checkfirst: a ledger written by a build that declared the index but not yet the version
    # has it already
    index_named(request_ledger, "ix_ledger_base_time").create(conn, checkfirst=True)


LEDGER_VERSION = 7
LEDGER = declare(Component("ledger", LEDGER_VERSION, metadata, _ledger_version,
                           steps={1: _ledger_1_to_2, 2: _ledger_2_to_3, 3: _ledger_3_to_4,
                                  4: _ledger_4_to_5, 5: _ledger_5_to_6, 6: _ledger_6_to_7}))
