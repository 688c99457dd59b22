"""The event store's write-time hash chain, and a mapper that names the event it cannot read.

Every stored event is chained to its predecessor IN THE TRANSACTION THAT RECORDS IT: beside the
events table (``registry_events``) a chain table (``registry_events_chain``) holds, per position
(notification id), the event's hash (:func:`event_hash`: aggregate id, version, topic and the
exact stored bytes) and ``link(previous link, position, event hash)``. The link is the very step
the signed audit checkpoints use (``control.app.integrity``), so a checkpoint's chain hash is
the chain table's head at its last position: a checkpoint only adds the signature.

Why at write time: checkpoints are written in batches, and before this chain an event edited in
the database before its batch was sealed got sealed as edited and then verified as intact. Now
the hash sealed is the one taken when the event was written, so an edit made at any later time is
located by ``loraplane audit verify``. What the chain alone cannot stop: a writer that rewrites
both an event and every chain row after it, before the next checkpoint, leaves a consistent
chain; the signed checkpoint (and its anchor file kept outside the database) bounds that window,
and role separation (the hosts' database role may not write events) closes it for hosts.

The chain belongs to the event store, as the events table does: the recorder creates it, and a
store recorded before the chain existed is chained once, when a recorder first opens it (sealed
positions take their sealed hashes, so an edit made before the chain existed stays located).

:class:`ChainedFactory` is the eventsourcing persistence module the registry names
(``PERSISTENCE_MODULE``); it also gives the application :class:`NamingMapper`.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Sequence
from typing import Any, Protocol
from uuid import UUID

import sqlalchemy as sa
from eventsourcing.persistence import (
    ApplicationRecorder,
    Mapper,
    MapperDeserialisationError,
    Notification,
    StoredEvent,
)
from eventsourcing.utils import TopicError
from eventsourcing_sqlalchemy.factory import SQLAlchemyFactory
from eventsourcing_sqlalchemy.recorders import SQLAlchemyApplicationRecorder
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.orm import Session

from control.contracts.event_log import notifications

GENESIS = "0" * 64
CHECKPOINTS = "audit_checkpoints"  # control.app.integrity's table, read here by name only
_PAGE = 1000


class Hashable(Protocol):
    """A stored event row as the recorder writes it or a reader reads it back."""

    @property
    def originator_id(self) -> Any: ...
    @property
    def originator_version(self) -> int: ...
    @property
    def topic(self) -> str: ...
    @property
    def state(self) -> Any: ...  # bytes, or a memoryview from some drivers


def event_hash(e: Hashable) -> str:
    """SHA-256 of one stored event row: what it is about and the exact stored bytes."""
    h = hashlib.sha256()
    h.update(f"{e.originator_id}\n{e.originator_version}\n{e.topic}\n".encode())
    h.update(bytes(e.state))
    return h.hexdigest()


def link(prev: str, position: int, eh: str) -> str:
    """One step of the chain (and of the checkpoints' chain): the link of ``position``."""
    return hashlib.sha256(f"{prev}{int(position)}:{eh}".encode()).hexdigest()


def chain_table(events_table: str, metadata: sa.MetaData | None = None) -> sa.Table:
    """The chain table beside ``events_table``: one row per recorded position."""
    return sa.Table(
        f"{events_table}_chain", metadata or sa.MetaData(),
        sa.Column("position", sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
                  primary_key=True, autoincrement=False),
        sa.Column("event_hash", sa.String(64), nullable=False),
        sa.Column("chain_hash", sa.String(64), nullable=False),
    )


def chain_head(conn: Connection | Session, table: sa.Table) -> tuple[int, str]:
    """(position, link) of the newest chain row, or (0, GENESIS) before any."""
    row = conn.execute(sa.select(table.c.position, table.c.chain_hash)
                       .order_by(table.c.position.desc()).limit(1)).first()
    return (int(row[0]), str(row[1])) if row is not None else (0, GENESIS)


class ChainBroken(RuntimeError):
    """The store no longer matches its chain in a way that forbids recording after it."""


class ChainedRecorder(SQLAlchemyApplicationRecorder):
    """eventsourcing-sqlalchemy's application recorder, chaining each event as it is stored."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.chain = chain_table(self.events_table_name)
        # The head this recorder itself last COMMITTED (position, link): when the next save's
        # first position directly follows it, no other writer can have chained in between
        # (positions are handed out in commit order under the write lock), so the head need not
        # be read back. Anything else (another writer, a rollback, a gap) reads it.
        self._committed_head: tuple[int, str] | None = None
        self._written = threading.local()

    def insert_events(self, stored_events: Sequence[StoredEvent], *,
                      session: Session | None = None, **kwargs: Any) -> Sequence[int] | None:
        self._written.head = None
        ids = super().insert_events(stored_events, session=session, **kwargs)
        head = self._written.head
        if session is None and head is not None:  # committed by the call above
            self._committed_head = head
        return ids

    def _insert_stored_events(self, session: Session, stored_events: Sequence[StoredEvent],
                              **kwargs: Any) -> Sequence[int]:
        ids = super()._insert_stored_events(session, stored_events, **kwargs)
        if not ids:
            return ids
        # The insert above holds the store's write lock until commit (PostgreSQL: LOCK TABLE
        # ... EXCLUSIVE; SQLite: the database write lock), so no other writer can chain between
        # reading the head and writing after it: positions and links commit in one order.
        known = self._committed_head
        if known is not None and known[0] == min(ids) - 1:
            head, prev = known
        else:
            head, prev = chain_head(session, self.chain)
        if head >= min(ids):
            # SQLite reuses the highest position once its row is gone: the newest events were
            # deleted from the store. Say so, rather than fail on the chain's primary key as
            # if two commands had raced.
            raise ChainBroken(f"position #{min(ids)} is already chained: events were deleted "
                              "from the event store; run `loraplane audit verify` to locate "
                              "them")
        rows = []
        for position, e in sorted(zip(ids, stored_events, strict=True), key=lambda p: p[0]):
            eh = event_hash(e)
            prev = link(prev, position, eh)
            rows.append({"position": position, "event_hash": eh, "chain_hash": prev})
        session.execute(self.chain.insert(), rows)
        self._written.head = (max(ids), prev)
        return ids

    def create_table(self) -> None:
        super().create_table()
        engine = self.datastore.engine
        if not isinstance(engine, Engine):
            raise TypeError("the chained recorder needs an engine (SQLALCHEMY_URL)")
        self.chain.create(engine, checkfirst=True)
        chain_existing(self, engine, self.chain)


def _sealed_hashes(conn: Connection) -> dict[int, str]:
    """Each sealed position's hash, from the checkpoints (none before the first checkpoint)."""
    if not sa.inspect(conn).has_table(CHECKPOINTS):
        return {}
    out: dict[int, str] = {}
    for (entries,) in conn.execute(sa.text(f"SELECT entries FROM {CHECKPOINTS} ORDER BY seq")):
        try:
            for position, eh in json.loads(entries):
                out[int(position)] = str(eh)
        except (ValueError, TypeError):
            continue  # a damaged checkpoint: audit verify reports it
    return out


def chain_existing(recorder: ApplicationRecorder, engine: Engine, table: sa.Table) -> int:
    """Chain a store recorded before the chain existed; returns how many rows were chained.

    Runs once: when the chain is empty and events exist, under the store's write lock (no event
    is recorded meanwhile). A sealed position takes its sealed hash, not its current bytes'.
    """
    with engine.connect() as conn:
        if conn.execute(sa.select(table.c.position).limit(1)).first() is not None:
            return 0
    if recorder.max_notification_id() is None:
        return 0
    with engine.connect() as conn:
        if engine.dialect.name == "sqlite":
            conn.exec_driver_sql("BEGIN IMMEDIATE")
        else:
            events = getattr(recorder, "events_table_name", "")
            conn.exec_driver_sql(f"LOCK TABLE {events} IN EXCLUSIVE MODE")
        try:
            if conn.execute(sa.select(table.c.position).limit(1)).first() is not None:
                conn.rollback()
                return 0  # another process chained it first
            sealed = _sealed_hashes(conn)
            prev, rows = GENESIS, []
            for n in notifications(recorder, after=None, page_size=_PAGE):
                eh = sealed.get(n.id, event_hash(n))
                prev = link(prev, n.id, eh)
                rows.append({"position": n.id, "event_hash": eh, "chain_hash": prev})
                if len(rows) >= _PAGE:
                    conn.execute(table.insert(), rows)
                    rows = []
            if rows:
                conn.execute(table.insert(), rows)
            conn.commit()
        except BaseException:
            conn.rollback()
            raise
    with engine.connect() as conn:
        return int(conn.execute(sa.select(sa.func.count()).select_from(table)).scalar() or 0)


# -- reading damaged events -------------------------------------------------------------------

VERIFY_ADVICE = ("the event store was damaged or altered: run `loraplane audit verify` to "
                 "locate every changed event")


class DamagedEvent(MapperDeserialisationError):
    """A stored event that cannot be decoded, named (aggregate id, version, position).

    A ``MapperDeserialisationError`` (and so a ``ValueError``), so every reader that handled
    that still does; the message names no tenant: aggregate ids are UUIDs."""

    def __init__(self, originator_id: object, version: int, position: int | None,
                 cause: BaseException) -> None:
        where = f"event #{position}" if position is not None else "an event"
        super().__init__(f"{where} of the event store (aggregate {originator_id}, version "
                         f"{version}) cannot be decoded ({type(cause).__name__}): "
                         f"{VERIFY_ADVICE}")
        self.originator_id = originator_id
        self.originator_version = version
        self.position = position


class NamingMapper(Mapper[UUID]):
    """eventsourcing's mapper, raising :class:`DamagedEvent` for an event it cannot decode.

    ``locate`` finds the position of an event read by aggregate (``StoredEvent`` carries none;
    a ``Notification`` does); the factory sets it once the recorder exists."""

    locate: Any = None

    def to_domain_event(self, stored_event: StoredEvent) -> Any:
        try:
            return super().to_domain_event(stored_event)
        except (MapperDeserialisationError, TopicError, KeyError, TypeError, ValueError,
                AttributeError) as e:
            if isinstance(e, DamagedEvent):
                raise
            # eventsourcing wraps the decoder's error: name the decoder's (its text may quote
            # the stored bytes, so only its type is shown)
            cause = e.__cause__ if isinstance(e, MapperDeserialisationError) and \
                e.__cause__ is not None else e
            position = stored_event.id if isinstance(stored_event, Notification) else None
            if position is None and self.locate is not None:
                try:
                    position = self.locate(stored_event.originator_id,
                                           stored_event.originator_version)
                except Exception:  # naming it is best effort: the damage is the news
                    position = None
            raise DamagedEvent(stored_event.originator_id, stored_event.originator_version,
                               position, cause) from e


class ChainedFactory(SQLAlchemyFactory):
    """eventsourcing-sqlalchemy with the chained recorder and the naming mapper."""

    application_recorder_class = ChainedRecorder

    def mapper(self, transcoder: Any = None, mapper_class: Any = None) -> Mapper[Any]:
        m = super().mapper(transcoder=transcoder, mapper_class=mapper_class or NamingMapper)
        if isinstance(m, NamingMapper):
            m.locate = self._locate
        return m

    def application_recorder(self) -> ApplicationRecorder:
        self._recorder = super().application_recorder()
        return self._recorder

    def _locate(self, originator_id: object, version: int) -> int | None:
        recorder = getattr(self, "_recorder", None)
        if not isinstance(recorder, SQLAlchemyApplicationRecorder):
            return None
        cls = recorder.events_record_cls
        with recorder.transaction(commit=False) as session:
            found = session.query(cls.id).filter(cls.originator_id == originator_id,
                                                 cls.originator_version == version).first()
        return int(found[0]) if found is not None else None


PERSISTENCE_TOPIC = f"{__name__}:{ChainedFactory.__name__}"
