"""Writers of the alias tables: routes (stable, canary, fallback) and grants."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sqlalchemy.engine import Connection

from control.domain import DEFAULT_FALLBACK, Alias
from projections.tables import grants, routes
from projections.writers.credentials import tickets_not_before
from projections.writers.rows import Rows


def _alias_created(e: Alias.AliasCreated) -> Rows:
    return [(routes, {"alias": e.name, "owner": e.owner, "stable_release": e.release,
                      "canary_release": None, "canary_percent": 0,
                      "fallback": DEFAULT_FALLBACK.value})]


def _alias_granted(e: Alias.AliasGranted) -> Rows:
    return [(grants, {"tenant": e.tenant, "alias": e.alias})]


def _alias_pointed(conn: Connection, e: Alias.AliasPointed) -> None:
    conn.execute(routes.update().where(routes.c.alias == e.alias)
                 .values(stable_release=e.release))
    # A canary that became the stable release ends its split (as the aggregate does).
    conn.execute(routes.update().where(routes.c.alias == e.alias,
                                       routes.c.canary_release == e.release)
                 .values(canary_release=None, canary_percent=0))


def _alias_canary_set(conn: Connection, e: Alias.AliasCanarySet) -> None:
    conn.execute(routes.update().where(routes.c.alias == e.alias)
                 .values(canary_release=e.release, canary_percent=e.percent))


def _alias_canary_cleared(conn: Connection, e: Alias.AliasCanaryCleared) -> None:
    conn.execute(routes.update().where(routes.c.alias == e.alias)
                 .values(canary_release=None, canary_percent=0))


def _alias_rolled_back(conn: Connection, e: Alias.AliasRolledBack) -> None:
    conn.execute(routes.update().where(routes.c.alias == e.alias)
                 .values(stable_release=e.to_release))


def _alias_fallback_set(conn: Connection, e: Alias.AliasFallbackSet) -> None:
    conn.execute(routes.update().where(routes.c.alias == e.alias).values(fallback=e.policy))


def _alias_fell_back(conn: Connection, e: Alias.AliasFellBack) -> None:
    # As the aggregate does: the stable slot changes only if it held the revoked release.
    conn.execute(routes.update().where(routes.c.alias == e.alias,
                                       routes.c.stable_release == e.revoked_release)
                 .values(stable_release=e.to_release))
    if e.canary_cleared:
        conn.execute(routes.update().where(routes.c.alias == e.alias)
                     .values(canary_release=None, canary_percent=0))


def _alias_grant_removed(conn: Connection, e: Alias.AliasGrantRemoved) -> None:
    conn.execute(grants.delete().where(grants.c.tenant == e.tenant, grants.c.alias == e.alias))
    # A ticket does not name the alias it was issued through, so every earlier ticket of the
    # tenant goes: its clients get new ones at once for what is still granted.
    tickets_not_before(conn, e.tenant, e.timestamp)


INSERTS: dict[type, Callable[[Any], Rows]] = {
    Alias.AliasCreated: _alias_created,
    Alias.AliasGranted: _alias_granted,
}
HANDLERS: dict[type, Callable[[Connection, Any], None]] = {
    Alias.AliasPointed: _alias_pointed,
    Alias.AliasCanarySet: _alias_canary_set,
    Alias.AliasCanaryCleared: _alias_canary_cleared,
    Alias.AliasRolledBack: _alias_rolled_back,
    Alias.AliasGrantRemoved: _alias_grant_removed,
    Alias.AliasFallbackSet: _alias_fallback_set,
    Alias.AliasFellBack: _alias_fell_back,
}
