"""What a Triton host must know before it serves a verified ticket, read from the projections.

Five questions, asked on every request: is the ticket's adapter revoked; was the key that signed it
recorded in the event store WITH the offline root's signature over its record (checked here
against the root public key of the host's configuration, ``control.contracts.root_of_trust``: a
``SigningKeyRecorded`` forged through SQL carries none), and is it not retired (a key file on the
host proves nothing by itself); was it issued before its tenant's credentials last lost something
(an API key rotated or revoked, a grant removed); does its ``release`` claim name a known
release whose adapter, base and tokenizer are the ticket's own. The snapshot also says which
revocations are the kill switch (``adapter revoke --immediate``): the host ends running work on
those digests too.

Asked with SQL each time they would cost five queries per request; here they are answered from an
immutable snapshot of the ``revocations``, ``signing_keys``, ``tenants`` and ``releases`` tables,
and each request first reads the projection's tracking position (one row), reloading the snapshot
when it moved. Every projection write moves that position in the same transaction as the view
rows, so a request never sees a snapshot older than the last committed projection write: the same
guarantee as reading the revocation set itself on every request, which is what the host did
before.

The host's governance watcher (``backend.serving.service``) reads the same snapshot on a short
timer, and on PostgreSQL also wakes on the follower's ``NOTIFY``, so an idle host drains and
unloads a revoked adapter without waiting for a request.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from sqlalchemy.engine import Connection, Engine

from control.contracts import root_of_trust
from projections.tables import (
    CHANGE_CHANNEL,
    TRACKING_NAME,
    bases,
    projection_tracking,
    releases,
    revocations,
    signing_keys,
    tenants,
)

log = logging.getLogger("loraplane.host_view")


@dataclass(frozen=True)
class ReleaseBinding:
    """The digests a release manifest binds together, and its inference defaults (what a request
    on it that omits a sampling parameter gets: ``control.contracts.sampling.with_defaults``)."""

    adapter_digest: str | None
    base_digest: str
    tokenizer_digest: str
    defaults: dict[str, Any] = field(default_factory=dict)
    # The release's owner: whose resident share its adapter counts against on the host (None:
    # a base-only release).
    tenant: str | None = None


@dataclass(frozen=True)
class HeldWhere:
    """A tenant's placement from its policy: its dedicated pool (None: the shared one) and
    regions (empty: any). The gateway's own reading is ``projections.routing.Placement``; the
    host keeps this one so that it imports nothing of the routing view."""

    pool: str | None = None
    regions: tuple[str, ...] = ()


@dataclass(frozen=True)
class CacheLimits:
    """A tenant's limits on a host's adapter cache, from its policy (None: the host's own)."""

    resident_share: float | None = None
    loads_per_minute: float | None = None
    max_replicas: int | None = None  # hosts that may hold one of its adapters in a slot at once


@dataclass(frozen=True)
class GovernanceState:
    """The host's view of revocations, retired keys and releases at one projection position."""

    position: int
    revoked: frozenset[str] = frozenset()
    # The revoked digests whose running requests end now, not when they finish (kill switch).
    killed: frozenset[str] = frozenset()
    # Every ticket-signing key id recorded in the event store with a record the root vouches
    # for, retired ones included.
    recorded_kids: frozenset[str] = frozenset()
    retired_kids: frozenset[str] = frozenset()
    releases: dict[str, ReleaseBinding] = field(default_factory=dict)
    # tenant -> epoch seconds: its tickets issued at or before are no longer honoured
    tickets_not_before: dict[str, float] = field(default_factory=dict)
    # tenant -> its cache limits, for the tenants whose policy sets any
    cache_limits: dict[str, CacheLimits] = field(default_factory=dict)
    # tenant -> where its adapters may be held, for the tenants whose policy says (the warm-up
    # preloads an adapter only on a host its owner's placement allows)
    placements: dict[str, HeldWhere] = field(default_factory=dict)

    def owner_of(self, adapter: str) -> str | None:
        """The owner of a release naming ``adapter`` (None: no release names it)."""
        return next((b.tenant for b in self.releases.values()
                     if b.adapter_digest == adapter and b.tenant is not None), None)


def _position(conn: Connection) -> int:
    value = conn.execute(sa.select(projection_tracking.c.position)
                         .where(projection_tracking.c.name == TRACKING_NAME)).scalar()
    return int(value or 0)


def vouched_kids(conn: Connection, root: Ed25519PublicKey | None) -> frozenset[str]:
    """The recorded signing keys whose record the root signed (none without a root)."""
    if root is None:
        return frozenset()
    rows = conn.execute(sa.select(signing_keys.c.kid, signing_keys.c.public_key,
                                  signing_keys.c.root_signature))
    return frozenset(str(r.kid) for r in rows if root_of_trust.vouches(
        root, r.root_signature, root_of_trust.RECORD, str(r.kid), str(r.public_key)))


def _load(conn: Connection, position: int, root: Ed25519PublicKey | None) -> GovernanceState:
    revoked = {str(r.digest): bool(r.immediate) for r in conn.execute(
        sa.select(revocations.c.digest, revocations.c.immediate))}
    return GovernanceState(
        position=position,
        revoked=frozenset(revoked),
        killed=frozenset(d for d, immediate in revoked.items() if immediate),
        recorded_kids=vouched_kids(conn, root),
        retired_kids=frozenset(str(k) for k in conn.execute(
            sa.select(signing_keys.c.kid).where(signing_keys.c.retired_at.is_not(None)))
            .scalars()),
        releases={str(r.digest): ReleaseBinding(r.adapter_digest, str(r.base_digest),
                                                str(r.tokenizer_digest),
                                                dict(json.loads(r.inference_defaults or "{}")),
                                                r.tenant)
                  for r in conn.execute(sa.select(releases.c.digest, releases.c.adapter_digest,
                                                  releases.c.base_digest,
                                                  releases.c.tokenizer_digest,
                                                  releases.c.inference_defaults,
                                                  releases.c.tenant))},
        tickets_not_before={str(r.name): float(r.tickets_not_before) for r in conn.execute(
            sa.select(tenants.c.name, tenants.c.tickets_not_before)
            .where(tenants.c.tickets_not_before.is_not(None)))},
        cache_limits={str(r.name): CacheLimits(r.resident_share, r.loads_per_minute,
                                               r.max_replicas)
                      for r in conn.execute(
                          sa.select(tenants.c.name, tenants.c.resident_share,
                                    tenants.c.loads_per_minute, tenants.c.max_replicas)
                          .where(sa.or_(tenants.c.resident_share.is_not(None),
                                        tenants.c.loads_per_minute.is_not(None),
                                        tenants.c.max_replicas.is_not(None))))},
        placements={str(r.name): HeldWhere(r.pool, tuple(x for x in str(r.regions).split(",")
                                                        if x))
                    for r in conn.execute(sa.select(tenants.c.name, tenants.c.pool,
                                                    tenants.c.regions)
                                          .where(sa.or_(tenants.c.pool.is_not(None),
                                                        tenants.c.regions != "")))},
    )


class HostGovernance:
    """The snapshot, current as of the last committed projection write; thread-safe."""

    def __init__(self, engine: Engine, keys_dir: Path | None = None) -> None:
        """``keys_dir``: where the root public key may be configured (``root.pub``), besides
        the environment (``root_of_trust.ROOT_ENV``); read at each reload, never from the
        database."""
        self.engine = engine
        self.keys_dir = keys_dir
        self._lock = threading.Lock()
        self._state: GovernanceState | None = None

    def current(self) -> GovernanceState:
        """The state as the projections hold it now (one position read; a reload if moved).

        Raises what the database raises: a host that cannot read governance refuses requests
        rather than serving on a view that may have missed a revocation.
        """
        with self.engine.connect() as conn:
            position = _position(conn)
            state = self._state
            if state is not None and state.position == position:
                return state
            with self._lock:
                if self._state is None or self._state.position != position:
                    root = root_of_trust.root_public_key(self.keys_dir)
                    self._state = _load(conn, position, root)
                return self._state


def tokenizer_of(engine: Engine, base_digest: str) -> str | None:
    """The tokenizer digest registered with base ``base_digest`` (None: no such base). The one
    fact a host needs from the catalogue at start, read here so that the serving side imports no
    reader that reaches into the control plane's application code."""
    with engine.connect() as conn:
        value = conn.execute(sa.select(bases.c.tokenizer_digest)
                             .where(bases.c.digest == base_digest)).scalar()
    return None if value is None else str(value)


class ChangeListener:
    """Waits for the projections to move: a PostgreSQL ``LISTEN`` where there is one.

    Without PostgreSQL (SQLite), or when the listening connection breaks, :meth:`wait` simply
    sleeps for its timeout and the caller polls; the watcher's short timer is the floor either
    way, the notification only makes it sooner.
    """

    def __init__(self, engine: Engine | None) -> None:
        self._engine = engine
        self._conn: Any = None

    @classmethod
    def for_engine(cls, engine: Engine) -> ChangeListener:
        return cls(engine if engine.dialect.name == "postgresql" else None)

    def _connect(self) -> Any:
        if self._conn is None and self._engine is not None:
            import psycopg  # only on PostgreSQL, where the postgres extra installed it

            url = self._engine.url.set(drivername="postgresql")
            conn = psycopg.connect(url.render_as_string(hide_password=False), autocommit=True)
            conn.execute(f"LISTEN {CHANGE_CHANNEL}")
            self._conn = conn
        return self._conn

    def wait(self, timeout_s: float, stop: threading.Event) -> None:
        """Return after a change notification, ``timeout_s``, or ``stop``, whichever first."""
        try:
            conn = self._connect()
        except Exception:
            log.warning("cannot LISTEN for projection changes; polling", exc_info=True)
            self._engine, conn = None, None
        if conn is None:
            stop.wait(timeout_s)
            return
        try:
            for _ in conn.notifies(timeout=timeout_s, stop_after=1):
                pass
        except Exception:
            log.warning("projection change listener lost; reconnecting", exc_info=True)
            self.close()
            stop.wait(timeout_s)

    def close(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(Exception):
                self._conn.close()
            self._conn = None
