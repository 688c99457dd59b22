"""Follows the event store's notification log and keeps the projection tables current.

Each batch of notifications is applied and its tracking position written in ONE database
transaction: a follower killed at any point has either applied a batch and recorded it, or
neither, so no event is ever applied twice. Several followers (a ``serve`` thread, a CLI
process catching up after a command) may run at once against one database: the tracking row is
locked (PostgreSQL ``SELECT ... FOR UPDATE``; SQLite ``BEGIN IMMEDIATE``) and written with a
compare-and-set, and a loser of any race rolls back and tries again from the new position.

``python -m projections.follower`` runs forever, until SIGTERM or SIGINT.

Why not eventsourcing's ``ProjectionRunner``: it needs ``subscribe()``, which the SQLAlchemy
recorder implements for PostgreSQL only. This loop reads ``select_notifications`` on every
backend, and its own tracking table lives beside the view rows so one transaction covers both.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa
from eventsourcing.persistence import OperationalError as EventStoreOperationalError
from sqlalchemy.engine import Connection, Engine

from control.app.registry import Registry
from control.contracts.config import Settings
from control.contracts.db import make_engine
from control.contracts.event_log import page_after
from control.contracts.signals import TerminationSignals
from projections import writers
from projections.routing import RoutingView
from projections.tables import (
    CHANGE_CHANNEL,
    CHANGES_PRUNED,
    TRACKING_NAME,
    VIEW_TABLES,
    create_tables,
    projection_tracking,
    routing_changes,
)
from projections.writers.sessions import prune_pins

if TYPE_CHECKING:
    from eventsourcing.application import Application
    from eventsourcing.persistence import Recording

log = logging.getLogger("loraplane.follower")

DEFAULT_NAME = TRACKING_NAME
# Session pins' rows go a day after their pin expired (a pin lasts LORAPLANE_SESSION_TTL_S, at
# most 7 days, from its last use): the events stay, the table stays the size of live traffic.
PIN_KEEP_S = 86400
PIN_PRUNE_EVERY_S = 60.0
# ``routing_changes`` keeps the rows of the last CHANGES_KEEP positions (pruned with the pins): a
# route cache further behind than that reloads everything instead.
CHANGES_KEEP = 100_000
_RETRIES = 8


def _next_in_log(recorded: Sequence[Recording[Any]], position: int) -> bool:
    """True when ``recorded`` are the notifications right after ``position``, with no gap.

    The event store assigns positions in commit order (eventsourcing locks the table to insert),
    so nothing can later appear between ``position`` and the first of them.
    """
    ids = [r.notification.id for r in recorded]
    return bool(ids) and ids == list(range(position + 1, position + 1 + len(ids)))


class _LostRace(Exception):
    """Another follower moved the tracking position under us."""


class ProjectionFollower:
    """Applies new events from ``app``'s notification log to the tables on ``engine``."""

    def __init__(
        self,
        app: Application[Any],
        engine: Engine,
        *,
        name: str = DEFAULT_NAME,
        batch_size: int = 200,
    ) -> None:
        if len(name) > 32:
            raise ValueError("tracking names are at most 32 characters")
        self.app = app
        self.engine = engine
        self.name = name
        self.batch_size = batch_size
        self._lock = threading.Lock()
        create_tables(engine)
        # Read-only and stateless beyond its engine: one serves every caller. A new one per call
        # checked the schema's version again each time (a read of the version table and the
        # database's catalogue), which was 6 % of every adapter registration.
        self._routing: RoutingView | None = None

    @classmethod
    def from_settings(cls, settings: Settings) -> ProjectionFollower:
        """A follower for the deployment configured by ``settings``."""
        return cls(Registry(settings, follow=False), make_engine(settings.db_url))

    def routing(self) -> RoutingView:
        """The routing tables this follower writes, for reading (their schema was checked when
        this follower started)."""
        if self._routing is None:
            self._routing = RoutingView(self.engine)
        return self._routing

    # -- position ---------------------------------------------------------------------------

    def position(self, engine: Engine | None = None) -> int:
        """The last notification id applied (0 before any)."""
        with (engine or self.engine).connect() as conn:
            value = conn.execute(sa.select(projection_tracking.c.position)
                                 .where(projection_tracking.c.name == self.name)).scalar()
        return int(value or 0)

    def _read_position(self, conn: Connection) -> int | None:
        q = (sa.select(projection_tracking.c.position)
             .where(projection_tracking.c.name == self.name).with_for_update())
        value = conn.execute(q).scalar()
        return None if value is None else int(value)

    def _write_position(self, conn: Connection, old: int | None, new: int) -> None:
        if old is None:
            conn.execute(projection_tracking.insert().values(name=self.name, position=new))
            return
        result = conn.execute(
            projection_tracking.update()
            .where(projection_tracking.c.name == self.name,
                   projection_tracking.c.position == old)
            .values(position=new))
        if result.rowcount != 1:
            raise _LostRace

    # -- applying ---------------------------------------------------------------------------

    def _apply_batch(self, engine: Engine, recorded: Sequence[Recording[Any]] = ()) -> int:
        """Apply one batch in one transaction; return how many notifications it covered.

        ``recorded``: events this process just saved. When they are exactly the next positions
        of the log, they are applied as they are, without reading the log back.

        The transaction is atomic but not fsynced (SQLite ``synchronous=NORMAL`` under WAL,
        PostgreSQL ``synchronous_commit=off``): view rows and the tracking position commit or
        vanish together, and one lost to a power cut is simply applied again from the durable
        event store. That halves what a command pays to leave fresh tables behind.
        """
        with engine.connect() as conn:
            sqlite = engine.dialect.name == "sqlite"
            if sqlite:
                conn.exec_driver_sql("PRAGMA synchronous=NORMAL")
                # Take the write lock first: a deferred transaction that read and then writes
                # fails outright (SQLITE_BUSY_SNAPSHOT) when another writer got in between.
                conn.exec_driver_sql("BEGIN IMMEDIATE")
            else:
                conn.exec_driver_sql("SET LOCAL synchronous_commit TO OFF")
            try:
                old = self._read_position(conn)
                if _next_in_log(recorded, old or 0):
                    events = [r.domain_event for r in recorded]
                    last = recorded[-1].notification.id
                else:
                    # One page per transaction: the position it starts after was read
                    # under the tracking lock above.
                    notifications = page_after(self.app.recorder, old or 0, self.batch_size)
                    events = [self.app.mapper.to_domain_event(n) for n in notifications]
                    last = notifications[-1].id if notifications else 0
                if not events:
                    conn.rollback()
                    return 0
                writers.apply_all(conn, events)
                if self.name == TRACKING_NAME:  # what the route caches read (their position)
                    writers.record_changes(conn, events, last)
                self._write_position(conn, old, last)
                if not sqlite:
                    # Delivered at commit to every listening Triton host (projections.host_view):
                    # a revocation reaches an idle host without waiting for its next poll.
                    conn.execute(sa.select(sa.func.pg_notify(CHANGE_CHANNEL, str(last))))
                conn.commit()
            except BaseException:
                conn.rollback()
                raise
            finally:
                if sqlite:  # the pooled connection goes back as every other user expects it
                    conn.exec_driver_sql("PRAGMA synchronous=FULL")
        return len(events)

    def _catch_up(self, engine: Engine, recorded: Sequence[Recording[Any]] = ()) -> int:
        total = 0
        attempts = 0
        while True:
            try:
                n = self._apply_batch(engine, recorded)
            except (_LostRace, sa.exc.IntegrityError, sa.exc.OperationalError,
                    EventStoreOperationalError) as exc:
                # Another follower applied these events first (or held the lock too long):
                # our transaction rolled back; start again from the position it recorded.
                attempts += 1
                if attempts > _RETRIES:
                    raise
                log.debug("projection race (%s), retrying", type(exc).__name__)
                time.sleep(0.02 * attempts)
                continue
            total += n
            attempts = 0
            recorded = ()  # applied, or not next in the log: read the log from here on
            if n < self.batch_size:
                # A short batch reached the end of the log as it stood; a later event is the
                # next catch-up's (or the running follower's) to apply.
                return total

    def catch_up(self, recorded: Sequence[Recording[Any]] = ()) -> int:
        """Apply every notification not yet applied; return how many were applied.

        ``recorded``: what a command in this process just saved (see :meth:`_apply_batch`).
        """
        with self._lock:
            return self._catch_up(self.engine, recorded)

    def run(self, stop: threading.Event, interval: float = 0.1) -> None:
        """Catch up every ``interval`` seconds until ``stop`` is set. Errors are logged, not
        fatal: the next round retries from the recorded position."""
        pruned_at = 0.0
        while not stop.is_set():
            try:
                n = self.catch_up()
                if n:
                    log.info("applied %d events (position %d)", n, self.position())
                if time.monotonic() - pruned_at >= PIN_PRUNE_EVERY_S:
                    pruned_at = time.monotonic()
                    self.prune_pins()
                    self.prune_changes()
            except Exception:
                log.exception("projection catch-up failed; retrying")
                stop.wait(min(5.0, interval * 20))
            stop.wait(interval)

    def prune_pins(self, engine: Engine | None = None, now: float | None = None) -> int:
        """Delete session pins that expired more than :data:`PIN_KEEP_S` ago
        (``projections.writers.sessions.prune_pins``); the running follower does it every
        :data:`PIN_PRUNE_EVERY_S`."""
        with self._lock, (engine or self.engine).begin() as conn:
            n = prune_pins(conn, time.time() if now is None else now, PIN_KEEP_S)
        if n:
            log.info("pruned %d session pins expired over %d s ago", n, PIN_KEEP_S)
        return n

    def prune_changes(self, engine: Engine | None = None, keep: int = CHANGES_KEEP) -> int:
        """Delete the ``routing_changes`` rows more than ``keep`` positions old, and record
        in the same transaction that the log is complete only above that position (a route
        cache at or below it reloads everything). Returns how many rows went."""
        if self.name != TRACKING_NAME:
            return 0
        with self._lock, (engine or self.engine).begin() as conn:
            # The write first (SQLite: the write lock before any read, as _apply_batch takes it)
            tracked = (sa.select(projection_tracking.c.position)
                       .where(projection_tracking.c.name == self.name).scalar_subquery())
            n = int(conn.execute(routing_changes.delete().where(
                routing_changes.c.position <= tracked - keep)).rowcount or 0)
            position = self._read_position(conn)
            if position is None or position - keep <= 0:
                return n
            # Read after the delete, the position can only be higher than the one it used: the
            # horizon recorded is never below what went.
            horizon = position - keep
            moved = conn.execute(projection_tracking.update()
                                 .where(projection_tracking.c.name == CHANGES_PRUNED,
                                        projection_tracking.c.position < horizon)
                                 .values(position=horizon)).rowcount
            if not moved and conn.execute(
                    sa.select(projection_tracking.c.position)
                    .where(projection_tracking.c.name == CHANGES_PRUNED)).first() is None:
                conn.execute(projection_tracking.insert().values(name=CHANGES_PRUNED,
                                                                 position=horizon))
        return n

    def rebuild_into(self, engine: Engine) -> int:
        """Replay the whole event history into the projection tables on ``engine``.

        The target's view rows and tracking row are cleared first. Returns the events applied.
        """
        create_tables(engine)
        with engine.begin() as conn:
            for table in VIEW_TABLES:
                conn.execute(table.delete())
            if self.name == TRACKING_NAME:  # the change log starts again with the positions
                conn.execute(routing_changes.delete())
                conn.execute(projection_tracking.delete()
                             .where(projection_tracking.c.name == CHANGES_PRUNED))
            conn.execute(projection_tracking.delete()
                         .where(projection_tracking.c.name == self.name))
        with self._lock:
            n = self._catch_up(engine)
        self.prune_pins(engine)  # as the live tables are pruned: a rebuild equals them
        return n


def _row_key(row: tuple[Any, ...]) -> list[tuple[bool, str]]:
    return [(v is None, str(v)) for v in row]


def _portable(value: Any) -> Any:
    # SQLite hands back naive datetimes, PostgreSQL aware ones; the values are UTC either way.
    if isinstance(value, datetime):
        return value.replace(tzinfo=UTC) if value.tzinfo is None else (
            value.astimezone(UTC))
    return value


def snapshot(engine: Engine) -> dict[str, list[tuple[Any, ...]]]:
    """Every view table's rows, sorted, datetimes in UTC: compare a live database with a
    rebuilt one, also across SQLite and PostgreSQL."""
    out: dict[str, list[tuple[Any, ...]]] = {}
    with engine.connect() as conn:
        for table in VIEW_TABLES:
            rows = [tuple(_portable(v) for v in r) for r in conn.execute(sa.select(table))]
            out[table.name] = sorted(rows, key=_row_key)
    return out


def open_registry(settings: Settings | None = None, *, follow: bool = True) -> Registry:
    """The registry with this process's projection follower as its read model: every command
    catches the tables up (``follow``) and a revoking command returns once hosts and gateways
    can see it. What the CLI, the services and the tools open."""
    s = settings or Settings.from_env()
    return Registry(s, follow=follow,
                    read_model=lambda reg: ProjectionFollower(reg, make_engine(s.db_url)))


def main(argv: list[str] | None = None) -> int:
    """Run the follower for the configured deployment until SIGTERM/SIGINT."""
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    settings = Settings.from_env()
    settings.ensure_dirs()
    follower = ProjectionFollower.from_settings(settings)
    stop = threading.Event()
    with TerminationSignals() as term:
        log.info("following the event store from position %d", follower.position())
        # The loop runs in a thread; this one only waits for the signal and then stops it
        # (setting the event from a signal handler can deadlock: see control.contracts.signals).
        worker = threading.Thread(target=follower.run, args=(stop,), name="follower")
        worker.start()
        log.info("signal %d: stopping", term.wait())
        stop.set()
        worker.join()
    log.info("stopped at position %d", follower.position())
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
