"""What each event changes of the tables the gateway's route cache holds, as ``(kind, key)``
pairs written to ``routing_changes`` in the batch's transaction (``projections.tables``).

The cache (``projections.route_cache``) then reloads only those keys instead of every row of
the registry. Every event a writer folds into the tables has an entry here, ``[]`` when it
changes nothing the cache holds (session pins have their own counter, ``session_pins.changed``);
an event with no entry records ``("all", "")``, which makes every cache reload everything, so a
writer added without one costs a full reload, never a stale route (and
``tests/projections/test_route_changes.py`` fails until it has one).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Set
from typing import Any

from sqlalchemy.engine import Connection

from control.domain import Adapter, Alias, BaseModel, Release, SessionPin, SigningKey, Tenant
from projections.tables import routing_changes

ALL = ("all", "")
Change = tuple[str, str]


def _tenant(e: Any) -> list[Change]:
    return [("tenant", str(e.tenant))]


def _alias(e: Any) -> list[Change]:
    return [("alias", str(e.alias))]


def _adapter(e: Any) -> list[Change]:
    return [("adapter", str(e.digest))]


def _none(_e: Any) -> list[Change]:
    return []


CHANGES: dict[type, Callable[[Any], list[Change]]] = {
    # tenants: their API keys and placement
    Tenant.TenantCreated: lambda e: [("tenant", str(e.name))],
    Tenant.ApiKeyRotated: _tenant,
    Tenant.ApiKeysRevoked: _tenant,
    Tenant.TenantPolicySet: _tenant,
    # the catalogue: a release row, or the state of an adapter every release of it reads
    Release.ReleaseCreated: lambda e: [("release", str(e.digest))],
    Adapter.AdapterRegistered: _adapter,
    Adapter.AdapterPromoted: _adapter,
    Adapter.AdapterRevoked: _adapter,
    Adapter.EvaluationRecorded: _none,  # the report's digest: not routing
    Adapter.AdapterDrained: _none,  # serving steps
    Adapter.AdapterPurged: _none,
    Adapter.AdapterUnloaded: _none,
    BaseModel.BaseRegistered: _none,  # bases: the cache reads none
    # signing keys
    SigningKey.SigningKeyRecorded: lambda e: [("key", str(e.kid))],
    SigningKey.SigningKeyRetired: lambda e: [("key", str(e.kid))],
    # aliases: the route row and the alias's grants
    Alias.AliasCreated: lambda e: [("alias", str(e.name))],
    Alias.AliasGranted: _alias,
    Alias.AliasGrantRemoved: _alias,
    Alias.AliasPointed: _alias,
    Alias.AliasCanarySet: _alias,
    Alias.AliasCanaryCleared: _alias,
    Alias.AliasRolledBack: _alias,
    Alias.AliasFallbackSet: _alias,
    Alias.AliasFellBack: _alias,
    # session pins: read by their own counter
    Alias.AliasSessionsRepinned: _none,
    SessionPin.SessionPinned: _none,
    SessionPin.SessionRepinned: _none,
    SessionPin.SessionEnded: _none,
}


def changes_of(events: Iterable[Any], written: Set[type]) -> set[Change]:
    """The ``(kind, key)`` pairs ``events`` change; ``written``: the event types the writers
    fold into the tables (others change no row). An unlisted written type gives ``ALL``."""
    out: set[Change] = set()
    for event in events:
        kind = type(event)
        if kind not in written:
            continue
        of = CHANGES.get(kind)
        if of is None:
            out.add(ALL)
        else:
            out.update(of(event))
    return out


def record(conn: Connection, changes: set[Change], position: int) -> None:
    """Write ``changes`` as made by the batch that ends at ``position``."""
    if changes:
        conn.execute(routing_changes.insert(),
                     [{"position": position, "kind": k, "key": key}
                      for k, key in sorted(changes)])
