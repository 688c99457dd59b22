"""The route cache's copy of the routing tables (``projections.route_cache``), loaded whole once
and then kept current from ``routing_changes``: after a projection batch only the keys it
changed are read again, so a refresh costs what changed, not what the registry holds.

What it holds: API key hashes by tenant, grants, routes, releases joined with their adapter's
state, placements that differ from the default, and the ids of retired signing keys. Kinds of
change (``projections.writers.changes``) and what each reloads:

- ``tenant``: its API key hashes and its placement;
- ``alias``: its route row and every grant of it;
- ``release``: the release row; ``adapter``: every release of the adapter (its state);
- ``key``: whether the signing key is retired;
- ``all``: everything (an event the change kinds do not describe).

One refresher at a time changes a :class:`RouteTables` in place (the cache's lock); readers on
other threads read single entries (one dictionary or set operation each, atomic under the
interpreter lock). A reader during a refresh sees each key either as it was or as the tables
now hold it: never a row older than before the refresh, and a change withdrawn by governance
is never put back. The position is moved last, once every change up to it is applied.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from control.domain import SERVABLE_STATES
from projections.routing import PLACEMENT_COLUMNS, Placement, placement_of, placements_of
from projections.tables import (
    CHANGES_PRUNED,
    adapters,
    api_keys,
    grants,
    projection_tracking,
    releases,
    routes,
    routing_changes,
    signing_keys,
    tenants,
)

CHUNK = 500  # keys per IN (...) list
KINDS = frozenset({"tenant", "alias", "release", "adapter", "key"})  # what apply reloads


@dataclass(frozen=True)
class Release:
    adapter_digest: str | None
    base_digest: str
    tokenizer_digest: str
    servable: bool
    owner: str | None = None


RouteRow = tuple[str | None, str | None, int]  # stable, canary, canary percent


@dataclass
class RouteTables:
    """The routing tables as of ``position`` (see the module notes on concurrent readers)."""

    position: int
    tenant_by_key_hash: dict[str, str] = field(default_factory=dict)
    granted: set[tuple[str, str]] = field(default_factory=set)
    routes: dict[str, RouteRow] = field(default_factory=dict)
    releases: dict[str, Release] = field(default_factory=dict)
    retired_kids: frozenset[str] = frozenset()
    placements: dict[str, Placement] = field(default_factory=dict)
    # reverse indexes, for changes that remove rows
    keys_of: dict[str, set[str]] = field(default_factory=dict)  # tenant -> its key hashes
    grantees: dict[str, set[str]] = field(default_factory=dict)  # alias -> granted tenants
    rows_read: int = 0  # rows read by the last load or change (tests, benchmarks)

    def apply(self, conn: Connection, changes: Iterable[tuple[str, str]]) -> None:
        """Reload the keys ``changes`` names (no ``all`` among them: see :func:`changes_since`)."""
        by_kind: dict[str, set[str]] = defaultdict(set)
        for kind, key in changes:
            by_kind[kind].add(key)
        self.rows_read = 0
        self._tenants(conn, sorted(by_kind.pop("tenant", ())))
        self._aliases(conn, sorted(by_kind.pop("alias", ())))
        self._releases(conn, releases.c.digest, sorted(by_kind.pop("release", ())))
        self._releases(conn, releases.c.adapter_digest, sorted(by_kind.pop("adapter", ())))
        self._keys(conn, sorted(by_kind.pop("key", ())))
        if by_kind:
            raise ValueError(f"unknown routing change kinds: {sorted(by_kind)}")

    def _read(self, conn: Connection, q: Any) -> list[Any]:
        rows = list(conn.execute(q))
        self.rows_read += len(rows)
        return rows

    def _tenants(self, conn: Connection, names: list[str]) -> None:
        for part in _chunks(names):
            found: dict[str, set[str]] = {t: set() for t in part}
            for h, t in self._read(conn, sa.select(api_keys.c.key_hash, api_keys.c.tenant)
                                   .where(api_keys.c.tenant.in_(part))):
                found[str(t)].add(str(h))
            for t, hashes in found.items():
                for gone in self.keys_of.get(t, set()) - hashes:
                    self.tenant_by_key_hash.pop(gone, None)
                for h in hashes:
                    self.tenant_by_key_hash[h] = t
                if hashes:
                    self.keys_of[t] = hashes
                else:
                    self.keys_of.pop(t, None)
            placed = {str(r.name): placement_of(r)
                      for r in self._read(conn, sa.select(tenants.c.name, *PLACEMENT_COLUMNS)
                                          .where(tenants.c.name.in_(part)))}
            for t in part:
                p = placed.get(t)
                if p is None or p == Placement():
                    self.placements.pop(t, None)
                else:
                    self.placements[t] = p

    def _aliases(self, conn: Connection, names: list[str]) -> None:
        for part in _chunks(names):
            rows = {str(r.alias): (r.stable_release, r.canary_release, int(r.canary_percent))
                    for r in self._read(conn, sa.select(routes.c.alias, routes.c.stable_release,
                                                        routes.c.canary_release,
                                                        routes.c.canary_percent)
                                        .where(routes.c.alias.in_(part)))}
            found: dict[str, set[str]] = {a: set() for a in part}
            for t, a in self._read(conn, sa.select(grants.c.tenant, grants.c.alias)
                                   .where(grants.c.alias.in_(part))):
                found[str(a)].add(str(t))
            for a in part:
                # withdrawals first: a grant removed, then the route as it is now
                for gone in self.grantees.get(a, set()) - found[a]:
                    self.granted.discard((gone, a))
                row = rows.get(a)
                if row is None:
                    self.routes.pop(a, None)
                else:
                    self.routes[a] = row
                for t in found[a]:
                    self.granted.add((t, a))
                if found[a]:
                    self.grantees[a] = found[a]
                else:
                    self.grantees.pop(a, None)

    def _releases(self, conn: Connection, column: Any, keys: list[str]) -> None:
        for part in _chunks(keys):
            for r in self._read(conn, _release_query().where(column.in_(part))):
                self.releases[str(r.digest)] = _release(r)
            # release rows are never deleted: a key with no row is a release not yet projected

    def _keys(self, conn: Connection, kids: list[str]) -> None:
        retired = set(self.retired_kids)
        for part in _chunks(kids):
            retired.difference_update(part)
            retired.update(str(k) for k, in self._read(
                conn, sa.select(signing_keys.c.kid).where(signing_keys.c.kid.in_(part),
                                                          signing_keys.c.retired_at.is_not(None))))
        self.retired_kids = frozenset(retired)


def load_all(conn: Connection, position: int) -> RouteTables:
    """Every row the cache holds, as a fresh :class:`RouteTables` at ``position``."""
    t = RouteTables(position=position)
    for h, tenant in t._read(conn, sa.select(api_keys.c.key_hash, api_keys.c.tenant)):
        t.tenant_by_key_hash[str(h)] = str(tenant)
        t.keys_of.setdefault(str(tenant), set()).add(str(h))
    for tenant, a in t._read(conn, sa.select(grants.c.tenant, grants.c.alias)):
        t.granted.add((str(tenant), str(a)))
        t.grantees.setdefault(str(a), set()).add(str(tenant))
    t.routes = {str(r.alias): (r.stable_release, r.canary_release, int(r.canary_percent))
                for r in t._read(conn, sa.select(routes.c.alias, routes.c.stable_release,
                                                 routes.c.canary_release,
                                                 routes.c.canary_percent))}
    t.releases = {str(r.digest): _release(r) for r in t._read(conn, _release_query())}
    t.retired_kids = frozenset(str(k) for k, in t._read(
        conn, sa.select(signing_keys.c.kid).where(signing_keys.c.retired_at.is_not(None))))
    t.placements = placements_of(conn)
    t.rows_read += len(t.placements)
    return t


def changes_since(conn: Connection, after: int, upto: int) -> set[tuple[str, str]] | None:
    """What the batches in positions (``after``, ``upto``] changed; None when that cannot be
    told (the log was pruned above ``after``, a change of kind ``all`` or of a kind this
    version does not know): reload all."""
    found = {(str(k), str(key)) for k, key in conn.execute(
        sa.select(routing_changes.c.kind, routing_changes.c.key).distinct()
        .where(routing_changes.c.position > after, routing_changes.c.position <= upto))}
    # Read after the rows: pruning deletes rows and raises this in one transaction, so a
    # horizon still at or below ``after`` now means none of the rows above it had gone.
    pruned = conn.execute(sa.select(projection_tracking.c.position)
                          .where(projection_tracking.c.name == CHANGES_PRUNED)).scalar()
    if (pruned is not None and int(pruned) > after) or any(k not in KINDS for k, _ in found):
        return None
    return found


def _release_query() -> Any:
    return (sa.select(releases.c.digest, releases.c.adapter_digest, releases.c.base_digest,
                      releases.c.tokenizer_digest, releases.c.tenant, adapters.c.state)
            .select_from(releases.outerjoin(adapters,
                                            adapters.c.digest == releases.c.adapter_digest)))


def _release(r: Any) -> Release:
    return Release(r.adapter_digest, str(r.base_digest), str(r.tokenizer_digest),
                   servable=r.adapter_digest is None or r.state in SERVABLE_STATES,
                   owner=r.tenant)


def _chunks(keys: list[str]) -> Iterator[list[str]]:
    for i in range(0, len(keys), CHUNK):
        yield keys[i:i + CHUNK]
