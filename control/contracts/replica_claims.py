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
- claims are ranked: first those held for the adapter's *owner* (the host served or is loading
  a request of the tenant whose adapter it is), then those held for granted tenants only; within
  each, the oldest first (``claimed_at``, then the host's name). A claim, new or renewed, is
  granted when fewer than ``bound`` live claims rank before it, and a refused renewal deletes
  its own row. The holders are the first ``bound`` live claims. A host whose claim an owner's
  claim pushed beyond the bound learns it at its next renewal (a third of a lease at most) and
  sheds the adapter: no host writes another's row (each host's database role may write only
  its own). So a granted tenant's traffic, however it is placed (a forged affinity header, a
  host failing over), can never keep the owner's own requests from a place, and when the bound
  shrinks the newest holders go. A claim that lapsed while its host was paused is a new claim;
- a host's renewal tick is one transaction (:meth:`ReplicaTable.renew`): it renews the claims of
  the adapters still in its slots and gives up, in the same transaction, those of the adapters
  that left since the last tick (a release deletes only the host's own row; none held: nothing
  happens). One commit per tick, however many adapters came and went;
- the transactions of one adapter are serialised: on PostgreSQL by a transaction-scoped advisory
  lock on the adapter's digest, on SQLite by taking the database's write lock first (a write
  before any read). A transaction touching many adapters (a tick) takes their locks in digest
  order, renewed and released alike, so two hosts ticking at once never wait on each other in a
  cycle. Claims of different adapters never wait on each other on PostgreSQL.

Times are the hosts' wall clocks (``time.time``): a lease must be longer than the hosts' clock
skew, which NTP keeps to milliseconds. Rows name digests and hosts only, never a tenant. A
host's database role makes, renews and deletes its own rows and reads everyone's
(``control.app.db_roles``). Schema component ``adapter_replicas``, version 2 (version 1 had no
``for_owner``; its upgrade empties the table, which holds only the moment's leases: services
are stopped for an upgrade, and hosts claim afresh as they load); the rows are the moment's
state, not evidence (the load records in ``adapter_loads`` are that).
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Iterable, Mapping

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from control.contracts.config import ConfigError, env_number
from control.contracts.schema import Component, declare, open_component

LEASE_ENV = "LORAPLANE_REPLICA_LEASE_S"
IDLE_ENV = "LORAPLANE_REPLICA_IDLE_S"
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
    # held for the adapter's owner's requests (ranked first), or for granted tenants' only
    sa.Column("for_owner", sa.Boolean, nullable=False),
)


def _replicas_version(insp: sa.Inspector) -> int:
    return 2 if any(c["name"] == "for_owner" for c in insp.get_columns("adapter_replicas")) else 1


def _replicas_1_to_2(conn: Connection) -> None:
    adapter_replicas.drop(conn, checkfirst=True)  # leases only: created afresh after this step


ADAPTER_REPLICAS = declare(Component("adapter_replicas", 2, metadata, _replicas_version,
                                     {1: _replicas_1_to_2}))


def lease_from_env() -> float:
    """``LORAPLANE_REPLICA_LEASE_S`` (seconds above 0), or the default; a bad value raises
    ValueError naming the variable."""
    return env_number(LEASE_ENV, DEFAULT_LEASE_S, "seconds", above=0.0, at_most=3600.0)


def idle_from_env(lease_s: float) -> float:
    """``LORAPLANE_REPLICA_IDLE_S``: how long a bounded adapter may sit unused in a host's slot
    before the host gives its place up (default four leases; at least one lease: a shorter one
    would give places up between a client's requests); ValueError naming the variable."""
    value = env_number(IDLE_ENV, 4 * lease_s, "seconds", above=0.0, at_most=86400.0)
    if value < lease_s:
        raise ConfigError(f"{IDLE_ENV} must be at least the replica lease ({LEASE_ENV}, "
                          f"{lease_s:g} s), not {value:g}")
    return value


def _ranks_before(owner: bool, since: float | None, host: str) -> sa.ColumnElement[bool]:
    """Claims ranking before one held ``for_owner=owner`` by ``host`` since ``since`` (None: a
    new claim, which every live claim of its rank or better precedes, even one whose host's
    clock reads later)."""
    t = adapter_replicas
    if since is None:
        return t.c.for_owner if owner else sa.true()
    older = (t.c.claimed_at < since) | ((t.c.claimed_at == since) & (t.c.host < host))
    if owner:
        return t.c.for_owner & older
    return t.c.for_owner | older


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

    def claim(self, digest: str, bound: int, *, for_owner: bool = True) -> bool:
        """Make or renew this host's claim on one of ``digest``'s ``bound`` replicas; False, and
        its own row gone, when ``bound`` live claims rank before it (see the module notes).

        ``for_owner``: the host holds it for the owner's requests (a claim keeps that rank
        until it is given up or lapses)."""
        if bound < 1:
            raise ValueError("a replica bound is at least 1")
        with self.engine.begin() as conn:
            self._serialise(conn, [digest])
            return self._claim(conn, digest, bound, for_owner)

    def renew(self, needs: Mapping[str, tuple[int, bool]],
              release: Iterable[str] = ()) -> set[str]:
        """Renew (or make) this host's claims on many adapters and give up its claims on others,
        in one transaction: ``needs`` maps each digest to its bound and whether the owner's
        requests ask for it, as :meth:`claim` takes them; ``release`` names the digests whose
        claims go (this host's own rows only; a digest it holds no claim on is passed over).
        Returns the digests refused (their rows gone). One transaction per renewal tick, however
        many bounded adapters the host holds or gave up since the last one (before, each adapter
        that left its slot cost a transaction of its own)."""
        gone = set(release)
        if any(bound < 1 for bound, _ in needs.values()):
            raise ValueError("a replica bound is at least 1")
        if gone & needs.keys():
            raise ValueError("a claim is renewed or released in one call, not both")
        if not needs and not gone:
            return set()
        t = adapter_replicas
        with self.engine.begin() as conn:
            # one digest's lock after another, in one order on every host, released digests
            # among the renewed: two hosts ticking over overlapping sets never wait on each other
            # in a cycle. A released digest is locked too, so a claim counting it waits for
            # this commit and sees the place free (not a row about to go).
            self._serialise(conn, sorted(gone | needs.keys()))
            if gone:
                conn.execute(t.delete().where(t.c.adapter_digest.in_(sorted(gone))
                                              & (t.c.host == self.host)))
            return {d for d in sorted(needs) if not self._claim(conn, d, *needs[d])}

    def _claim(self, conn: Connection, digest: str, bound: int, for_owner: bool) -> bool:
        """:meth:`claim`'s work, in ``conn``'s transaction, ``digest`` serialised."""
        t = adapter_replicas
        mine = (t.c.adapter_digest == digest) & (t.c.host == self.host)
        now = self.clock()  # under the lock: claims are granted in the order of their times
        live = (t.c.adapter_digest == digest) & (t.c.expires_at > now)
        row = conn.execute(sa.select(t.c.claimed_at, t.c.expires_at, t.c.for_owner)
                           .where(mine)).first()
        # (owner's?, since): the claim as it would stand, tried in turn
        tries: list[tuple[bool, float | None]] = []
        if row is None or float(row.expires_at) <= now:
            tries.append((for_owner, None))  # a new claim
        else:
            if for_owner and not row.for_owner:
                # a grantee's claim that the owner's requests now need ranks as a new owner's
                # claim (after every live one), else stays a grantee's in its place
                tries.append((True, None))
            tries.append((bool(row.for_owner), float(row.claimed_at)))
        for owner, since in tries:
            ahead = live & (t.c.host != self.host) & _ranks_before(owner, since, self.host)
            if int(conn.execute(sa.select(sa.func.count()).select_from(t).where(ahead))
                   .scalar() or 0) < bound:
                break
        else:
            if row is not None:  # lost (or lapsed): it counts against nobody from now
                conn.execute(t.delete().where(mine))
            return False
        values = {"claimed_at": now if since is None else since,
                  "expires_at": now + self.lease_s, "for_owner": owner}
        if row is None:
            conn.execute(t.insert().values(adapter_digest=digest, host=self.host, **values))
        else:
            conn.execute(t.update().where(mine).values(**values))
        return True

    def release(self, digest: str) -> None:
        """Give up this host's claim on ``digest`` (none held: nothing happens); a renewal tick
        gives up many at once through :meth:`renew`."""
        self.renew({}, release=[digest])

    def release_all(self) -> int:
        """Give up every claim of this host (a host starting holds nothing yet: what a previous
        process of it claimed would keep other hosts out until it lapsed); how many."""
        t = adapter_replicas
        with self.engine.begin() as conn:
            return int(conn.execute(t.delete().where(t.c.host == self.host)).rowcount)

    def holders(self, digest: str) -> list[str]:
        """The hosts holding live claims on ``digest``, first in rank first (the owner's, then
        the oldest): the first ``bound`` of them hold its places."""
        t = adapter_replicas
        with self.engine.connect() as conn:
            return [str(h) for h in conn.execute(
                sa.select(t.c.host).where((t.c.adapter_digest == digest)
                                          & (t.c.expires_at > self.clock()))
                .order_by(t.c.for_owner.desc(), t.c.claimed_at, t.c.host)).scalars()]

    def _serialise(self, conn: Connection, digests: list[str]) -> None:
        """Make this transaction the only one counting ``digests``' claims until it ends."""
        if conn.dialect.name == "postgresql":
            for digest in digests:
                conn.execute(sa.select(sa.func.pg_advisory_xact_lock(_lock_key(digest))))
        else:
            # SQLite: a write first takes the database's write lock for the whole transaction
            # (even when it matches no row), so no other claim commits between the count and
            # this one's write.
            t = adapter_replicas
            conn.execute(t.update().where((t.c.adapter_digest == digests[0])
                                          & (t.c.host == self.host))
                         .values(expires_at=t.c.expires_at))
