"""The gateway's in-memory copy of the routing projection, refreshed when the projection moves.

Issuing a ticket asks two questions (who holds this API key; which release does this tenant's
session get for this alias). Answered with SQL they cost about 1.5 ms of CPU per ticket on this
platform (statement building dominates, not the database), which capped the gateway near 600
tickets per second. Here they are dictionary lookups on an immutable snapshot of the tables that
routing reads: api keys, grants, routes, releases joined with their adapter's state, and the ids
of retired signing keys (asked before every signature).

Freshness: every projection write moves the follower's tracking position in the same transaction
as the view rows, so the position is a change stamp. A request finds out whether the snapshot is
stale by reading that one row, at most once every ``refresh_s`` (default 20 ms,
``LORAPLANE_ROUTE_REFRESH_MS``); when it moved, the snapshot is reloaded. A refusal (unknown
key, alias not resolvable) re-reads the position first, so a tenant, grant or release just
recorded is served at once. A revocation stops new tickets within ``refresh_s`` of the
projection recording it, and the Triton hosts, which check the revocation set on every
request, refuse tickets already issued. The same holds for a revoked or rotated-out API key, a
removed grant and a retired signing key: a hit in a stale snapshot lasts at most ``refresh_s``.

If the database cannot be read, the last snapshot keeps serving for ``max_stale_s`` (default
5 s); after that, resolution fails closed with :class:`RoutingUnavailable` (the gateway answers
503) rather than issuing tickets from a view that may have missed a revocation.
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time
from dataclasses import dataclass, field

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from control.domain import SERVABLE_STATES, canary_bucket, choose_release, hash_api_key
from projections.follower import DEFAULT_NAME as TRACKING_NAME
from projections.routing import Route, RoutingView
from projections.tables import (
    adapters,
    api_keys,
    grants,
    projection_tracking,
    releases,
    routes,
    signing_keys,
)

log = logging.getLogger("loraplane.route_cache")

REFRESH_ENV = "LORAPLANE_ROUTE_REFRESH_MS"
DEFAULT_REFRESH_S = 0.02
DEFAULT_MAX_STALE_S = 5.0
MISS_RECHECK_S = 0.001


class RoutingUnavailable(Exception):
    """The routing tables could not be read for longer than the staleness allowed."""


@dataclass(frozen=True)
class _Release:
    adapter_digest: str | None
    base_digest: str
    tokenizer_digest: str
    servable: bool


@dataclass(frozen=True)
class _Snapshot:
    position: int
    tenant_by_key_hash: dict[str, str] = field(default_factory=dict)
    granted: frozenset[tuple[str, str]] = frozenset()
    routes: dict[str, tuple[str | None, str | None, int]] = field(default_factory=dict)
    releases: dict[str, _Release] = field(default_factory=dict)
    retired_kids: frozenset[str] = frozenset()


def refresh_s_from_env() -> float:
    """``LORAPLANE_ROUTE_REFRESH_MS`` in seconds (default 20 ms)."""
    raw = os.environ.get(REFRESH_ENV)
    if raw is None or not raw.strip():
        return DEFAULT_REFRESH_S
    try:
        ms = float(raw)
    except ValueError:
        raise ValueError(f"{REFRESH_ENV} must be a number of milliseconds, not {raw!r}") from None
    if not 0 <= ms <= 10_000:
        raise ValueError(f"{REFRESH_ENV} must be between 0 and 10000 ms, not {raw}")
    return ms / 1000


def _position(conn: Connection) -> int:
    value = conn.execute(sa.select(projection_tracking.c.position)
                         .where(projection_tracking.c.name == TRACKING_NAME)).scalar()
    return int(value or 0)


def _load(conn: Connection, position: int) -> _Snapshot:
    release_rows = conn.execute(
        sa.select(releases.c.digest, releases.c.adapter_digest, releases.c.base_digest,
                  releases.c.tokenizer_digest, adapters.c.state)
        .select_from(releases.outerjoin(adapters,
                                        adapters.c.digest == releases.c.adapter_digest)))
    return _Snapshot(
        position=position,
        tenant_by_key_hash={str(h): str(t) for h, t in
                            conn.execute(sa.select(api_keys.c.key_hash, api_keys.c.tenant))},
        granted=frozenset((str(t), str(a)) for t, a in
                          conn.execute(sa.select(grants.c.tenant, grants.c.alias))),
        routes={str(r.alias): (r.stable_release, r.canary_release, int(r.canary_percent))
                for r in conn.execute(sa.select(routes.c.alias, routes.c.stable_release,
                                                routes.c.canary_release,
                                                routes.c.canary_percent))},
        releases={str(r.digest): _Release(
            r.adapter_digest, str(r.base_digest), str(r.tokenizer_digest),
            servable=r.adapter_digest is None or r.state in SERVABLE_STATES)
            for r in release_rows},
        retired_kids=frozenset(str(k) for k in conn.execute(
            sa.select(signing_keys.c.kid).where(signing_keys.c.retired_at.is_not(None)))
            .scalars()),
    )


class CachedRoutingView(RoutingView):
    """A :class:`RoutingView` whose ticket-path questions are answered from memory.

    ``resolve``, ``tenant_for_api_key`` and ``retired_key_ids`` follow exactly the rules of the
    SQL versions (the contract tests run both); every other question still reads the tables.
    """

    def __init__(self, engine: Engine, *, refresh_s: float | None = None,
                 max_stale_s: float = DEFAULT_MAX_STALE_S) -> None:
        super().__init__(engine)
        self.refresh_s = refresh_s_from_env() if refresh_s is None else refresh_s
        self.max_stale_s = max_stale_s
        self._snapshot: _Snapshot | None = None
        self._checked_at = float("-inf")  # last time the position was read
        self._confirmed_at = float("-inf")  # last time the snapshot was known current
        self._lock = threading.Lock()  # one refresher at a time
        self._failing = False
        self.reloads = 0

    def _current(self) -> _Snapshot:
        now = time.monotonic()
        if now - self._checked_at >= self.refresh_s:
            with self._lock:
                if now - self._checked_at >= self.refresh_s:  # else refreshed while we waited
                    try:
                        self._refresh()
                        self._failing = False
                    except sa.exc.SQLAlchemyError:
                        self._checked_at = now  # retry after refresh_s, not on every request
                        if not self._failing:  # log the change, not every retry
                            log.warning("routing tables unreadable; serving the last snapshot "
                                        "for up to %.1f s", self.max_stale_s, exc_info=True)
                        self._failing = True
        snap = self._snapshot
        if snap is None or time.monotonic() - self._confirmed_at > self.max_stale_s:
            raise RoutingUnavailable("routing tables unreadable")
        return snap

    def _refresh(self) -> None:
        with self.engine.connect() as conn:
            position = _position(conn)
            if self._snapshot is None or position != self._snapshot.position:
                # Reload until the position read before the tables equals the one read after,
                # so the snapshot is the projection as of one position (never half a batch).
                for _ in range(5):
                    snap = _load(conn, position)
                    after = _position(conn)
                    if after == position:
                        break
                    position = after
                self._snapshot = snap
                self.reloads += 1
        self._checked_at = self._confirmed_at = time.monotonic()

    def invalidate(self) -> None:
        """Read the position on the next question (after a command in this process)."""
        self._checked_at = float("-inf")

    # -- the ticket path ----------------------------------------------------------------------

    def tenant_for_api_key(self, api_key: str) -> str | None:
        key_hash = hash_api_key(api_key)
        tenant = self._current().tenant_by_key_hash.get(key_hash)
        if tenant is None and self._confirm_miss():
            tenant = self._current().tenant_by_key_hash.get(key_hash)
        return tenant

    def retired_key_ids(self) -> frozenset[str]:
        return self._current().retired_kids

    def resolve(self, tenant: str, alias: str, session: str | None = None) -> Route | None:
        route = self._resolve(self._current(), tenant, alias, session)
        if route is None and self._confirm_miss():
            route = self._resolve(self._current(), tenant, alias, session)
        return route

    def _confirm_miss(self) -> bool:
        """Before a refusal, make sure the snapshot is current: a tenant just created or
        granted is served at once; only a revocation can take up to ``refresh_s`` to show."""
        if time.monotonic() - self._checked_at < MISS_RECHECK_S:
            return False  # checked a moment ago (a flood of bad keys costs one read per ms)
        self.invalidate()
        return True

    @staticmethod
    def _resolve(snap: _Snapshot, tenant: str, alias: str, session: str | None) -> Route | None:
        row = snap.routes.get(alias)
        if row is None or (tenant, alias) not in snap.granted:
            return None
        stable, canary, percent = row
        bucket = canary_bucket(tenant, session if session is not None else secrets.token_hex(8))
        for digest in choose_release(stable, canary, percent, bucket):
            r = snap.releases.get(digest)
            if r is None or not r.servable:
                continue
            return Route(alias=alias, base_digest=r.base_digest, adapter_digest=r.adapter_digest,
                         tokenizer_digest=r.tokenizer_digest, release=digest,
                         canary=digest == canary)
        return None
