"""The projection writers: domain events in, rows of ``projections.tables`` out.

One module per table family (``catalogue``, ``credentials``, ``aliases``, ``sessions``), each
with its ``INSERTS`` (events whose whole effect is new rows) and ``HANDLERS`` (events that change
rows already there). ``apply(conn, event)`` folds one event into the tables on an open connection
(the follower owns the transaction); ``apply_all`` folds a run of them, and ``record_changes``
writes what a batch changed of the route cache's tables (``changes``). The readers the gateway,
the hosts and the CLI use live apart (``projections.routing``, ``projections.host_view``,
``projections.route_cache``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from projections.writers import aliases, catalogue, changes, credentials, sessions
from projections.writers.rows import Rows

INSERTS: dict[type, Callable[[Any], Rows]] = {
    **catalogue.INSERTS, **credentials.INSERTS, **aliases.INSERTS}
HANDLERS: dict[type, Callable[[Connection, Any], None]] = {
    **catalogue.HANDLERS, **credentials.HANDLERS, **aliases.HANDLERS, **sessions.HANDLERS}
WRITTEN: frozenset[type] = frozenset(INSERTS) | frozenset(HANDLERS)  # events that change rows


def apply(conn: Connection, domain_event: Any) -> None:
    """Fold one domain event into the view tables; events the views ignore are skipped."""
    rows = INSERTS.get(type(domain_event))
    if rows is not None:
        for table, row in rows(domain_event):
            conn.execute(table.insert(), row)
        return
    handler = HANDLERS.get(type(domain_event))
    if handler is not None:
        handler(conn, domain_event)


def apply_all(conn: Connection, domain_events: Iterable[Any]) -> None:
    """Fold events in order, as ``apply`` would one by one, but insert each run of row-only
    events with one executemany per table (flushed before any event that changes rows)."""
    pending: dict[sa.Table, list[dict[str, Any]]] = {}

    def flush() -> None:
        for table, rows in pending.items():
            conn.execute(table.insert(), rows)
        pending.clear()

    for event in domain_events:
        rows = INSERTS.get(type(event))
        if rows is None:
            flush()
            apply(conn, event)
            continue
        for table, row in rows(event):
            pending.setdefault(table, []).append(row)
    flush()


def record_changes(conn: Connection, domain_events: Iterable[Any], position: int) -> None:
    """Record in ``routing_changes`` what ``domain_events`` (a batch ending at ``position``)
    changed of the tables the gateway's route cache holds (``projections.writers.changes``)."""
    changes.record(conn, changes.changes_of(domain_events, WRITTEN), position)
