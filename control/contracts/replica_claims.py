"""Claims on an adapter's replicas: how many Triton hosts hold one adapter in a device slot.

A tenant's policy may bound it (``TenantPolicy.max_replicas``, issue 25): an adapter of that
tenant is then held by at most that many hosts at once, however the balancer places its
requests. Counting the hosts' load records cannot enforce it (two hosts that both read "one
holder" would both load), so each host *claims* a replica here before it places the adapter,
in one transaction that counts the live claims and writes its own:

- a claim is a row (adapter, host) with a lease: ``expires_at``, renewed by its host every third
  of the lease while the adapter is in its slot (``backend.serving.replicas``), deleted when it
  leaves. A host that dies stops renewing, and its claim lapses after at most one lease
  (:data:`DEFAULT_LEASE_S`, ``LORAPLANE_REPLICA_LEASE_S``); nobody needs to delete it;
- a new claim is granted when fewer than ``bound`` other hosts hold live claims; a renewal when
  fewer than ``bound`` live claims are older than the renewing host's (``claimed_at``, then the
  host's name): when the bound shrinks, the newest holders lose theirs, and the oldest keep
  serving. A claim that lapsed while its host was paused is a new claim;
- the transactions of one adapter are serialised: on PostgreSQL by a transaction-scoped advisory
  lock on the adapter's digest, on SQLite by taking the database's write lock first (a write
  before any read). Claims of different adapters never wait on each other on PostgreSQL.

Times are the hosts' wall clocks (``time.time``): a lease must be longer than the hosts' clock
skew, which NTP keeps to milliseconds. Rows name digests and hosts only, never a tenant. A
host's database role makes, renews and deletes its own rows and reads everyone's
(``control.app.db_roles``). Schema component ``adapter_replicas``, version 1; the rows are the
moment's state, not evidence (the load records in ``adapter_loads`` are that).
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Callable

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from control.contracts.schema import Component, declare, open_component

LEASE_ENV = "LORAPLANE_REPLICA_LEASE_S"
# Long enough that a host paused by a slow database write or a full garbage collection keeps its
# claims (it renews every third of this), short enough that a dead host's adapters are free to
# load elsewhere within seconds of its balancer health check taking it out.
DEFAULT_LEASE_S = 15.0

metadata = sa.MetaData()

adapter_replicas = sa.Table(
    "adapter_replicas", metadata,
    sa.Column("adapter_digest", sa.String(71), primary_key=True),
    sa.Column("host", sa.String(128), primary_key=True),
    sa.Column("claimed_at", sa.Float, nullable=False),  # when this run of the claim began
    sa.Column("expires_at", sa.Float, nullable=False),
)
ADAPTER_REPLICAS = declare(Component("adapter_replicas", 1, metadata, lambda _insp: 1))


def lease_from_env() -> float:
    """``LORAPLANE_REPLICA_LEASE_S`` (seconds above 0), or the default; a bad value raises
    ValueError naming the variable."""
    raw = os.environ.get(LEASE_ENV, "").strip()
    if not raw:
        return DEFAULT_LEASE_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0.0 < value <= 3600.0:
        raise ValueError(f"{LEASE_ENV} must be seconds above 0 and at most 3600, not {raw!r}")
    return value


def _lock_key(digest: str) -> int:
    """A signed 64-bit advisory-lock key of the digest (PostgreSQL's bigint)."""
    return int.from_bytes(hashlib.sha256(b"loraplane-replica\0" + digest.encode()).digest()[:8],
                          "big", signed=True)


class ReplicaTable:
    """One host's claims in ``adapter_replicas``. Opening it creates the table when absent (a
    host's own database role cannot: ``loraplane db upgrade`` creates it there)."""

    def __init__(self, engine: Engine, host: str, *, lease_s: float = DEFAULT_LEASE_S,
                 clock: Callable[[], float] = time.time) -> None:
        self.engine, self.host, self.lease_s, self.clock = engine, host, lease_s, clock
        open_component(engine, ADAPTER_REPLICAS)

    def claim(self, digest: str, bound: int) -> bool:
        """Make or renew this host's claim on one of ``digest``'s ``bound`` replicas; False, and
        nothing written, when the bound is taken (see the module notes for who keeps one)."""
        if bound < 1:
            raise ValueError("a replica bound is at least 1")
        t = adapter_replicas
        now = self.clock()
        mine = (t.c.adapter_digest == digest) & (t.c.host == self.host)
        with self.engine.begin() as conn:
            self._serialise(conn, digest, mine)
            row = conn.execute(sa.select(t.c.claimed_at, t.c.expires_at).where(mine)).first()
            fresh = row is None or float(row.expires_at) <= now
            ahead = (t.c.adapter_digest == digest) & (t.c.host != self.host) & (
                t.c.expires_at > now)
            if not fresh:
                assert row is not None
                ahead &= (t.c.claimed_at < row.claimed_at) | (
                    (t.c.claimed_at == row.claimed_at) & (t.c.host < self.host))
            if int(conn.execute(sa.select(sa.func.count()).select_from(t).where(ahead))
                   .scalar() or 0) >= bound:
                return False  # the transaction ends unwritten: a lost claim is left to lapse
            claimed_at = now if fresh else float(row.claimed_at)  # type: ignore[union-attr]
            values = {"claimed_at": claimed_at, "expires_at": now + self.lease_s}
            if row is None:
                conn.execute(t.insert().values(adapter_digest=digest, host=self.host, **values))
            else:
                conn.execute(t.update().where(mine).values(**values))
        return True

    def release(self, digest: str) -> None:
        """Give up this host's claim on ``digest`` (none held: nothing happens)."""
        t = adapter_replicas
        with self.engine.begin() as conn:
            conn.execute(t.delete().where((t.c.adapter_digest == digest)
                                          & (t.c.host == self.host)))

    def release_all(self) -> int:
        """Give up every claim of this host (a host starting holds nothing yet: what a previous
        process of it claimed would keep other hosts out until it lapsed); how many."""
        t = adapter_replicas
        with self.engine.begin() as conn:
            return int(conn.execute(t.delete().where(t.c.host == self.host)).rowcount)

    def holders(self, digest: str) -> list[str]:
        """The hosts holding live claims on ``digest``, oldest claim first."""
        t = adapter_replicas
        with self.engine.connect() as conn:
            return [str(h) for h in conn.execute(
                sa.select(t.c.host).where((t.c.adapter_digest == digest)
                                          & (t.c.expires_at > self.clock()))
                .order_by(t.c.claimed_at, t.c.host)).scalars()]

    def _serialise(self, conn: Connection, digest: str, mine: sa.ColumnElement[bool]) -> None:
        """Make this transaction the only one counting ``digest``'s claims until it ends."""
        if conn.dialect.name == "postgresql":
            conn.execute(sa.select(sa.func.pg_advisory_xact_lock(_lock_key(digest))))
        else:
            # SQLite: a write first takes the database's write lock for the whole transaction
            # (even when it matches no row), so no other claim commits between the count and
            # this one's write.
            t = adapter_replicas
            conn.execute(t.update().where(mine).values(expires_at=t.c.expires_at))
