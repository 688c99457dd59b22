"""Writers of ``session_pins``: a pin's own events, and an alias moving its pins at once."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from control.domain import Alias, SessionPin
from projections.tables import session_pins


def _next_changed(conn: Connection) -> int:
    """The next value of ``session_pins.changed``: above every row's, this batch's included."""
    top = conn.execute(sa.select(sa.func.max(session_pins.c.changed))).scalar()
    return int(top or 0) + 1


def _pin_key(e: Any) -> Any:
    return sa.and_(session_pins.c.tenant == e.tenant, session_pins.c.alias == e.alias,
                   session_pins.c.session == e.session)


def _session_pinned(conn: Connection, e: SessionPin.SessionPinned) -> None:
    conn.execute(session_pins.insert().values(
        tenant=e.tenant, alias=e.alias, session=e.session, release=e.release,
        expires_at=e.expires_at.timestamp(), ended=False, version=e.originator_version,
        pinned_at=e.timestamp, changed=_next_changed(conn)))


def _session_repinned(conn: Connection, e: SessionPin.SessionRepinned) -> None:
    values = {"release": e.release, "expires_at": e.expires_at.timestamp(), "ended": False,
              "version": e.originator_version, "pinned_at": e.timestamp,
              "changed": _next_changed(conn)}
    if conn.execute(session_pins.update().where(_pin_key(e)).values(**values)).rowcount == 0:
        # its row was pruned (long expired, see prune_pins): the session is back, so is its row
        conn.execute(session_pins.insert().values(tenant=e.tenant, alias=e.alias,
                                                  session=e.session, **values))


def prune_pins(conn: Connection, now: float, keep_s: float) -> int:
    """Delete the rows of pins that expired more than ``keep_s`` ago (ended ones included);
    returns how many. A million sessions must not grow the table forever, and such a pin
    already reads as none everywhere (it expired). The row holding the highest ``changed`` is
    kept whatever its age: ``_next_changed`` counts from it, and a reader asking for rows
    changed since a value must never see that counter go back."""
    top = sa.select(sa.func.max(session_pins.c.changed)).scalar_subquery()
    return int(conn.execute(session_pins.delete().where(
        session_pins.c.expires_at < now - keep_s, session_pins.c.changed < top)).rowcount or 0)


def _session_ended(conn: Connection, e: SessionPin.SessionEnded) -> None:
    conn.execute(session_pins.update().where(_pin_key(e)).values(
        ended=True, version=e.originator_version, changed=_next_changed(conn)))


def _alias_sessions_repinned(conn: Connection, e: Alias.AliasSessionsRepinned) -> None:
    # ``version`` stays: it counts the pin's own events (control.domain.session).
    conn.execute(session_pins.update().where(
        session_pins.c.alias == e.alias, session_pins.c.release == e.from_release,
        session_pins.c.ended.is_(False)).values(release=e.to_release,
                                                changed=_next_changed(conn)))


HANDLERS: dict[type, Callable[[Connection, Any], None]] = {
    Alias.AliasSessionsRepinned: _alias_sessions_repinned,
    SessionPin.SessionPinned: _session_pinned,
    SessionPin.SessionRepinned: _session_repinned,
    SessionPin.SessionEnded: _session_ended,
}
