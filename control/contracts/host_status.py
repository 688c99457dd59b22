"""Each Triton host's status, as the host last reported it: its slots and tiers, its load queue,
its batch, and the health figures its service keeps.

A host holds these figures in memory and shows them on its metrics port; the operator console
needs them for every host at once, from the database it already reads. So each host upserts one
row of ``host_status`` every :data:`REPORT_INTERVAL_S` (``backend.serving.host_report``), and the
console reads the rows (``control.console.reads.hosts``). A row older than :data:`STALE_AFTER_S`
says the host stopped reporting: dead, hung, or cut off from the database.

The entries name adapter digests only, never a tenant: the console maps a digest to its owner
from the registry, and a host's database role may write its own row and nothing else
(``control.app.db_roles``). Schema component ``host_status``, version 1. The rows are a view of
the moment, not evidence: a report replaces the host's previous one.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from control.contracts.schema import Component, declare, open_component

REPORT_INTERVAL_S = 2.0  # as often as the console's pages refresh
# Three missed reports: one slow write or a long pause of the process is not yet an outage.
STALE_AFTER_S = 3 * REPORT_INTERVAL_S

metadata = sa.MetaData()

host_status = sa.Table(
    "host_status", metadata,
    sa.Column("host", sa.String(128), primary_key=True),
    sa.Column("reported_at", sa.Float, nullable=False),
    sa.Column("started_at", sa.Float, nullable=False),  # when this process began reporting
    sa.Column("slots_total", sa.Integer, nullable=False),  # the engine's adapter slots
    # JSON lists of SlotEntry: what the device slots hold, and what the host tier holds
    sa.Column("device", sa.Text, nullable=False),
    sa.Column("host_tier", sa.Text, nullable=False),
    sa.Column("pending_loads", sa.Integer, nullable=False),  # adapters waiting for their load
    sa.Column("load_waiters", sa.Integer, nullable=False),  # requests waiting for those loads
    sa.Column("load_queue_max", sa.Integer, nullable=False),
    sa.Column("running", sa.Integer, nullable=False),  # sequences in the decode batch
    sa.Column("waiting", sa.Integer, nullable=False),  # queued in the scheduler
    sa.Column("kv_tokens_reserved", sa.Integer, nullable=True),
    sa.Column("kv_tokens_budget", sa.Integer, nullable=True),  # None: no KV bound
    sa.Column("device_bytes", sa.BigInteger, nullable=False),
    sa.Column("device_budget", sa.BigInteger, nullable=False),
    sa.Column("host_bytes", sa.BigInteger, nullable=False),
    sa.Column("host_budget", sa.BigInteger, nullable=False),
    sa.Column("health", sa.Text, nullable=False),  # JSON: the service's health() figures
)
HOST_STATUS = declare(Component("host_status", 1, metadata, lambda _insp: 1))


@dataclass(frozen=True)
class SlotEntry:
    """One adapter in a tier: its digest, its bytes there, the requests holding it."""

    digest: str
    bytes: int
    active: int
    revoked: bool = False  # revoked, still in its slot until its last request ends


@dataclass(frozen=True)
class HostStatus:
    host: str
    reported_at: float
    started_at: float
    slots_total: int
    device: Sequence[SlotEntry] = ()
    host_tier: Sequence[SlotEntry] = ()
    pending_loads: int = 0
    load_waiters: int = 0
    load_queue_max: int = 0
    running: int = 0
    waiting: int = 0
    kv_tokens_reserved: int | None = None
    kv_tokens_budget: int | None = None
    device_bytes: int = 0
    device_budget: int = 0
    host_bytes: int = 0
    host_budget: int = 0
    health: Mapping[str, int] = field(default_factory=dict)

    def row(self) -> dict[str, Any]:
        out = asdict(self)
        out["device"] = json.dumps([asdict(e) for e in self.device])
        out["host_tier"] = json.dumps([asdict(e) for e in self.host_tier])
        out["health"] = json.dumps(dict(self.health), sort_keys=True)
        return out

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> HostStatus:
        values = dict(row)
        values["device"] = tuple(SlotEntry(**e) for e in json.loads(values["device"]))
        values["host_tier"] = tuple(SlotEntry(**e) for e in json.loads(values["host_tier"]))
        values["health"] = json.loads(values["health"])
        return cls(**values)


class HostStatusTable:
    """Writes a host's row and reads everyone's. Opening it creates the table when absent
    (a host's own database role cannot: ``loraplane db upgrade`` creates it there)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        open_component(engine, HOST_STATUS)

    def put(self, status: HostStatus) -> None:
        """Replace the host's row (insert it the first time). An UPDATE first, not an upsert
        statement: under PostgreSQL's row-level security a host's role may update and insert
        its own row only, and both dialects run this as it is."""
        t = host_status
        row = status.row()
        with self.engine.begin() as conn:
            changed = conn.execute(t.update().where(t.c.host == status.host).values(
                {k: v for k, v in row.items() if k != "host"})).rowcount
            if not changed:
                conn.execute(t.insert().values(row))

    def all(self, since: float = 0.0) -> list[HostStatus]:
        """Every host's row reported at or after ``since``, by host."""
        t = host_status
        with self.engine.connect() as conn:
            rows = conn.execute(sa.select(t).where(t.c.reported_at >= since)
                                .order_by(t.c.host)).mappings().all()
        return [HostStatus.from_row(dict(r)) for r in rows]
