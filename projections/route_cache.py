"""The gateway's in-memory copy of the routing projection, refreshed when the projection moves.

Issuing a ticket asks two questions (who holds this API key; which release does this tenant's
session get for this alias). Answered with SQL they cost about 1.5 ms of CPU per ticket on this
platform (statement building dominates, not the database), which capped the gateway near 600
tickets per second. Here they are dictionary lookups on a copy of the tables that routing reads
(``projections.route_snapshot``): api keys, grants, routes, releases joined with their adapter's
state, placements, and the ids of retired signing keys (asked before every signature).

Freshness: every projection write moves the follower's tracking position in the same transaction
as the view rows, so the position is a change stamp. A request finds out whether the snapshot is
stale by reading that one row, at most once every ``refresh_s`` (default 20 ms, at most 500 ms,
``LORAPLANE_ROUTE_REFRESH_MS``); when it moved, the snapshot catches up: it reads which keys
the batches since its position changed (``routing_changes``, written by the follower in each
batch's transaction) and reloads only those rows, so a refresh costs what changed, not the size
of the registry (at 3,000 adapters one command costs a handful of rows, against some 9,000 for
a whole reload; ``tests/projections/test_route_changes.py``). It reloads everything the first
time, when the position went back (a rebuild), when the log was pruned past its position, or
for a change no kind describes. The refresh runs on the request that found the position moved,
as the whole reload did, so nothing is served from an older snapshot than before. A refusal
(unknown key, alias not resolvable) re-reads the position first, so a tenant, grant or release
just recorded is served at once. A revocation stops new tickets within ``refresh_s`` of the
projection recording it, and the Triton hosts, which check the revocation set on every
request, refuse tickets already issued. The same holds for a revoked or rotated-out API key, a
removed grant and a retired signing key: a hit in a stale snapshot lasts at most ``refresh_s``.

Session pins are too many to reload with the rest: the view keeps them in a dictionary of its own
and, when the position moves, reads only the ``session_pins`` rows whose ``changed`` counter is
above the highest it has seen (ended pins stay as rows, so their end arrives the same way;
expired ones are dropped from memory once a minute). A pin this gateway records is remembered
at once (:meth:`CachedRoutingView.remember_pin`, write-through) and wins over the tables until
the snapshot has passed the pin's position in the log: a reconnect a millisecond later already
gets the pinned release, before any follower has projected it. Pins recorded by other gateways
come through the projection.

If the database cannot be read, the last snapshot keeps serving for ``max_stale_s`` (default
700 ms, ``LORAPLANE_ROUTE_MAX_STALE_MS``); after that, resolution fails closed with
:class:`RoutingUnavailable` (the gateway answers 503) rather than issuing tickets from a view
that may have missed a revocation.

Both settings are bounded by the promise that those changes are in force at every gateway
within 1 s, and the staleness allowed must exceed the refresh interval (a snapshot is confirmed
only when the position is read, so a shorter allowance would fail a healthy gateway between two
reads): :func:`control.contracts.config.route_timing_from_env` refuses anything else with a
ConfigError when the view reads the environment.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from control.contracts.config import (
    ROUTE_REFRESH_ENV,
    RouteTiming,
    check_route_timing,
    route_timing_from_env,
)
from control.domain import canary_bucket, choose_release, hash_api_key
from control.domain.session import Pin
from projections.route_snapshot import Release, RouteTables, changes_since, load_all
from projections.routing import Placement, Route, RoutingView, pin_from_row
from projections.tables import TRACKING_NAME, projection_tracking, session_pins

log = logging.getLogger("loraplane.route_cache")

REFRESH_ENV = ROUTE_REFRESH_ENV
DEFAULT_REFRESH_S = RouteTiming().refresh_s
DEFAULT_MAX_STALE_S = RouteTiming().max_stale_s
MISS_RECHECK_S = 0.001
PIN_PRUNE_S = 60.0  # how often expired pins leave memory


class RoutingUnavailable(Exception):
    """The routing tables could not be read for longer than the staleness allowed."""


MAX_ROUNDS = 5  # reads of the changes while the position keeps moving under a refresh


def refresh_s_from_env() -> float:
    """``LORAPLANE_ROUTE_REFRESH_MS`` in seconds (default 20 ms), checked with the staleness
    setting against the 1 s promises (ConfigError, a ValueError, naming the variable)."""
    return route_timing_from_env().refresh_s


def _position(conn: Connection) -> int:
    value = conn.execute(sa.select(projection_tracking.c.position)
                         .where(projection_tracking.c.name == TRACKING_NAME)).scalar()
    return int(value or 0)


PinKey = tuple[str, str, str]  # (tenant, alias, session id)


class CachedRoutingView(RoutingView):
    """A :class:`RoutingView` whose ticket-path questions are answered from memory.

    ``resolve``, ``route_to``, ``tenant_for_api_key`` and ``retired_key_ids`` follow exactly
    the rules of the SQL versions (the contract tests run both); ``session_pin`` answers for
    live pins only (memory keeps no ended or expired one); every other question still reads
    the tables.
    """

    def __init__(self, engine: Engine, *, refresh_s: float | None = None,
                 max_stale_s: float | None = None) -> None:
        """``refresh_s``/``max_stale_s``: None reads them from the environment, checked against
        the 1 s promises (a ConfigError stops the gateway from starting); given ones (tests,
        benchmarks) must only keep the staleness allowed above the refresh interval."""
        super().__init__(engine)
        if refresh_s is None or max_stale_s is None:
            env = route_timing_from_env()
            refresh_s = env.refresh_s if refresh_s is None else refresh_s
            max_stale_s = env.max_stale_s if max_stale_s is None else max_stale_s
        check_route_timing(refresh_s, max_stale_s)
        self.refresh_s: float = refresh_s
        self.max_stale_s: float = max_stale_s
        self._snapshot: RouteTables | None = None
        self._checked_at = float("-inf")  # last time the position was read
        self._confirmed_at = float("-inf")  # last time the snapshot was known current
        self._lock = threading.Lock()  # one refresher at a time
        self._failing = False
        self.reloads = 0  # refreshes that found the projection moved
        self.full_reloads = 0  # of which read every row
        self.rows_read = 0  # rows of the routing tables the last refresh read (pins aside)
        self._pins: dict[PinKey, Pin] = {}  # from the tables, as of the snapshot or later
        self._pins_changed = -1  # highest session_pins.changed read (-1: none read yet)
        self._pins_pruned_at = time.monotonic()
        self._remembered: dict[PinKey, Pin] = {}  # recorded here, maybe not yet projected

    def _current(self) -> RouteTables:
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
            snap = self._snapshot
            if snap is None or position != snap.position:
                if snap is None or position < snap.position or not self._catch_up(
                        conn, snap, position):
                    self._reload(conn, position)
                self.reloads += 1
                assert self._snapshot is not None
                self._forget_projected(self._snapshot.position)
        self._checked_at = self._confirmed_at = time.monotonic()

    def _reload(self, conn: Connection, position: int) -> None:
        """Load every row afresh (the first time, after a rebuild, or when the change log
        cannot say what changed)."""
        # Reload until the position read before the tables equals the one read after,
        # so the snapshot is the projection as of one position (never half a batch).
        for _ in range(MAX_ROUNDS):
            snap = load_all(conn, position)
            self._load_pins(conn)
            after = _position(conn)
            if after == position:
                break
            position = after
        self._snapshot = snap
        self.full_reloads += 1
        self.rows_read = snap.rows_read

    def _catch_up(self, conn: Connection, snap: RouteTables, position: int) -> bool:
        """Bring ``snap`` (in place) from its position to ``position`` by reloading only the
        keys the batches in between changed (``routing_changes``); False when the log cannot
        say (pruned, or a change of every kind): the caller reloads everything.

        Every change up to ``position`` is committed before ``position`` can be read, so the
        keys reloaded here are read as of ``position`` or later, never earlier. Rows of a later
        batch (committed meanwhile) may show too; the next round reads that batch's changes
        and reloads its keys, until the position stands still.
        """
        rows = 0
        for _ in range(MAX_ROUNDS):
            changes = changes_since(conn, snap.position, position)
            if changes is None:
                return False
            snap.apply(conn, changes)
            rows += snap.rows_read
            self._load_pins(conn)
            snap.position = position  # last: every change up to it is in
            after = _position(conn)
            if after == position:
                break
            if after < position:  # rebuilt under us
                return False
            position = after
        self.rows_read = rows
        return True

    def _load_pins(self, conn: Connection) -> None:
        """Bring ``_pins`` up to the tables: every live pin the first time, then only the rows
        changed since (ended or expired ones leave memory)."""
        now = time.time()
        top = int(conn.execute(sa.select(sa.func.max(session_pins.c.changed))).scalar() or 0)
        if top <= self._pins_changed:
            return
        q = sa.select(session_pins).where(session_pins.c.changed <= top)
        if self._pins_changed < 0:
            q = q.where(session_pins.c.ended.is_(False), session_pins.c.expires_at > now)
        else:
            q = q.where(session_pins.c.changed > self._pins_changed)
        for r in conn.execute(q):
            pin = pin_from_row(r)
            if pin.holds(now):
                self._pins[pin.key] = pin
            else:
                self._pins.pop(pin.key, None)
        self._pins_changed = top
        if time.monotonic() - self._pins_pruned_at >= PIN_PRUNE_S:
            self._pins_pruned_at = time.monotonic()
            for key, pin in list(self._pins.items()):
                if not pin.holds(now):
                    self._pins.pop(key, None)

    def _forget_projected(self, position: int) -> None:
        """Drop remembered pins the snapshot at ``position`` holds (or has moved past)."""
        for key, pin in list(self._remembered.items()):
            if pin.position <= position and self._remembered.get(key) is pin:
                self._remembered.pop(key, None)

    def remember_pin(self, pin: Pin) -> None:
        """Honour ``pin`` (recorded or read back by this process) at once, until the snapshot
        has passed its position: the projection then holds it, or something newer."""
        self._remembered[pin.key] = pin

    def _pin(self, snap: RouteTables, key: PinKey) -> Pin | None:
        mem = self._remembered.get(key)
        if mem is not None and mem.position > snap.position:
            return mem
        return self._pins.get(key)

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

    def placement(self, tenant: str) -> Placement:
        found = self._current().placements.get(tenant)
        return found if found is not None else Placement()

    def resolve(self, tenant: str, alias: str, session: str | None = None) -> Route | None:
        route = self._resolve(self._current(), tenant, alias, session)
        if route is None and self._confirm_miss():
            route = self._resolve(self._current(), tenant, alias, session)
        return route

    def route_to(self, tenant: str, alias: str, release: str) -> Route | None:
        snap = self._current()
        row = snap.routes.get(alias)
        if row is None or (tenant, alias) not in snap.granted:
            return None
        r = snap.releases.get(release)
        if r is None:  # a release newer than the snapshot: ask the tables
            return super().route_to(tenant, alias, release)
        return _route(alias, release, r, row[1], pinned=True)

    def session_pin(self, tenant: str, alias: str, session: str) -> Pin | None:
        # Memory holds live pins only: an expired or ended one reads as none, which a caller
        # treats alike (pin afresh), and the record decides the reason.
        return self._pin(self._current(), (tenant, alias, session))

    def _confirm_miss(self) -> bool:
        """Before a refusal, make sure the snapshot is current: a tenant just created or
        granted is served at once; only a revocation can take up to ``refresh_s`` to show."""
        if time.monotonic() - self._checked_at < MISS_RECHECK_S:
            return False  # checked a moment ago (a flood of bad keys costs one read per ms)
        self.invalidate()
        return True

    def _resolve(self, snap: RouteTables, tenant: str, alias: str,
                 session: str | None) -> Route | None:
        row = snap.routes.get(alias)
        if row is None or (tenant, alias) not in snap.granted:
            return None
        stable, canary, percent = row
        if session is not None:
            pin = self._pin(snap, (tenant, alias, session))
            if pin is not None and pin.holds(time.time()):
                r = snap.releases.get(pin.release)
                if r is not None and r.servable:
                    return _route(alias, pin.release, r, canary, pinned=True)
        bucket = canary_bucket(tenant, session if session is not None else secrets.token_hex(8))
        for digest in choose_release(stable, canary, percent, bucket):
            r = snap.releases.get(digest)
            if r is None or not r.servable:
                continue
            return _route(alias, digest, r, canary)
        return None


def _route(alias: str, digest: str, r: Release, canary: str | None, *,
           pinned: bool = False) -> Route | None:
    if not r.servable:
        return None
    return Route(alias=alias, base_digest=r.base_digest, adapter_digest=r.adapter_digest,
                 tokenizer_digest=r.tokenizer_digest, release=digest, canary=digest == canary,
                 pinned=pinned, owner=r.owner)
