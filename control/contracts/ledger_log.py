"""Each host's request ledger as an append-only Merkle log (``control.contracts.tlog``).

A row enters its host's log once it is final (refused, or completed), in the transaction that
writes it (``HostLog.append``, called by ``backend.serving.recorder``), as a *leaf*: the row as
the database holds it after the write, every column, plus ``index`` (its position in the log),
``output_sha256`` (of the exact output text the client got; None without one) and ``v``, in
canonical JSON (:func:`leaf_doc`). One log per host, so hosts never wait on each other: the
host's head row (``ledger_log_heads``) hands out positions, and its lock serialises only that
host's own writers. At a fixed interval and on shutdown, the host signs a checkpoint of what it
appended itself (origin ``loraplane.ledger/<host>``, size, root) with its kept key
(``control.contracts.host_keys``: stable across restarts), whose public half it publishes in
``ledger_host_keys``; the control plane trusts it only once enrolled through the root of trust,
and verifies each checkpoint against the previous one (``control.app.ledger_audit``).

Tables (schema component ``ledger_log``): ``ledger_log`` (host, idx, request_id, leaf),
``ledger_log_heads`` (host, size), ``ledger_checkpoints`` (host, size, note, signed_at),
``ledger_host_keys`` (host, vkey, published_at). A host inserts into all four and updates only
its own head row; nothing else writes them.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from control.contracts.host_keys import key_path, load_or_create_signer
from control.contracts.ledger import Outcome, request_ledger
from control.contracts.schema import Component, declare, open_component
from control.contracts.tlog import Checkpoint, Frontier, NoteSigner, canonical, leaf_hash

log = logging.getLogger("loraplane.ledger_log")

LEAF_VERSION = 1
HOME_ENV = "LORAPLANE_HOME"
ORIGIN_PREFIX = "loraplane.ledger/"

metadata = sa.MetaData()
_host = sa.String(128)

ledger_log = sa.Table(
    "ledger_log", metadata,
    sa.Column("host", _host, primary_key=True),
    sa.Column("idx", sa.BigInteger, primary_key=True, autoincrement=False),
    sa.Column("request_id", sa.String(36), nullable=False),
    sa.Column("leaf", sa.Text, nullable=False),  # canonical JSON (leaf_doc)
    sa.Index("ix_ledger_log_request", "request_id"),
)
ledger_log_heads = sa.Table(
    "ledger_log_heads", metadata,
    sa.Column("host", _host, primary_key=True),
    sa.Column("size", sa.BigInteger, nullable=False),
)
ledger_checkpoints = sa.Table(
    "ledger_checkpoints", metadata,
    sa.Column("host", _host, primary_key=True),
    sa.Column("size", sa.BigInteger, primary_key=True, autoincrement=False),
    sa.Column("note", sa.Text, nullable=False),  # the signed note (tlog-checkpoint)
    sa.Column("signed_at", sa.Float, nullable=False),
)
ledger_host_keys = sa.Table(
    "ledger_host_keys", metadata,
    sa.Column("host", _host, primary_key=True),
    sa.Column("vkey", sa.String(256), primary_key=True),  # <name>+<hex id>+<base64 key>
    sa.Column("published_at", sa.Float, nullable=False),
)
LEDGER_LOG = declare(Component("ledger_log", 1, metadata, lambda _insp: 1))


def origin_of(host: str) -> str:
    """The log's origin line (also its key name): no spaces or '+', which notes forbid."""
    return ORIGIN_PREFIX + re.sub(r"[\s+]", "_", host)


def output_sha256(text: str | bytes) -> str:
    return hashlib.sha256(text.encode() if isinstance(text, str) else text).hexdigest()


_COLUMNS = tuple(c.name for c in request_ledger.columns)


def leaf_doc(row: Mapping[str, Any], index: int, output: str | None) -> dict[str, Any]:
    """The leaf of a final ledger row at ``index`` (``output``: output_sha256 or None)."""
    doc = {c: row[c] for c in _COLUMNS}
    doc.update(v=LEAF_VERSION, index=index, output_sha256=output)
    return doc


def leaf_text(doc: Mapping[str, Any]) -> str:
    return canonical(doc).decode()


def opened(engine: Engine) -> Engine:
    """``engine`` with the log's tables created (or checked) at this code's version."""
    open_component(engine, LEDGER_LOG)
    return engine


class HostLog:
    """One host's side of its log: appends leaves, signs checkpoints (module notes).

    The writer thread of ``backend.serving.recorder`` is its only user; the frontier holds
    what this process appended and saw committed, so a checkpoint signs the host's own hashes,
    not whatever the table holds when it is signed.
    """

    def __init__(self, engine: Engine, host: str, signer: NoteSigner | None = None,
                 keys_dir: Path | None = None) -> None:
        """``signer``, else the host's kept key in ``keys_dir`` (default: ``<LORAPLANE_HOME>/keys``
        when that is set, as in every Triton process ``serve`` starts), else a key for this
        process alone, which the control plane trusts only in a development home."""
        self.engine = opened(engine)
        self.host = host
        self.origin = origin_of(host)
        self.signer = signer or _host_signer(host, self.origin, keys_dir)
        self.frontier = Frontier()
        self.signed_size = -1
        self._table = engine.dialect.identifier_preparer.format_table(ledger_log)
        with self.engine.begin() as conn:
            conn.execute(_insert_absent(conn, ledger_log_heads, ["host"]),
                         [{"host": host, "size": 0}])
            conn.execute(_insert_absent(conn, ledger_host_keys, ["host", "vkey"]),
                         [{"host": host, "vkey": self.signer.verifier.vkey(),
                           "published_at": time.time()}])
        self.resync()

    def resync(self) -> None:
        """The frontier over every leaf the table holds for this host (at start, or when
        another writer with this host's id appended too)."""
        f = Frontier()
        with self.engine.connect() as conn:
            for r in conn.execute(sa.select(ledger_log.c.idx, ledger_log.c.leaf)
                                  .where(ledger_log.c.host == self.host)
                                  .order_by(ledger_log.c.idx)):
                if r.idx != f.size:
                    log.error("ledger log of %s has no entry at %d", self.host, f.size)
                    break
                f.append(leaf_hash(r.leaf.encode()))
        self.frontier = f

    def append(self, conn: Connection, request_ids: Sequence[str],
               outputs: Mapping[str, str | None]) -> list[tuple[int, bytes]]:
        """Append the final rows of ``request_ids`` not yet in the log, inside the caller's
        transaction (after its ledger writes); returns (index, leaf hash) of each."""
        ids = list(dict.fromkeys(request_ids))
        if not ids:
            return []
        # The rows and whether they are logged already (a retried write), in one round trip;
        # joined by request id alone, so the planner takes its index (with the host in the
        # condition, SQLite walked the host's whole log by the primary key).
        rows: dict[str, dict[str, Any]] = {}
        have: set[str] = set()
        for r in conn.execute(sa.select(*[request_ledger.c[c] for c in _COLUMNS],
                                        ledger_log.c.host).select_from(request_ledger.outerjoin(
                ledger_log, ledger_log.c.request_id == request_ledger.c.request_id)).where(
                request_ledger.c.request_id.in_(ids))).tuples():
            rows[r[0]] = dict(zip(_COLUMNS, r[:-1], strict=True))
            if r[-1] == self.host:
                have.add(r[0])
        final = [i for i in ids if i not in have and i in rows
                 and rows[i]["outcome"] != Outcome.RUNNING.value]
        if not final:
            return []
        # Positions come from the head's row, moved and read in one statement under its row
        # lock (the write lock on SQLite): two writers of one host never get the same ones.
        size = conn.execute(ledger_log_heads.update().where(
            ledger_log_heads.c.host == self.host).values(
            size=ledger_log_heads.c.size + len(final)).returning(
            ledger_log_heads.c.size)).scalar_one()
        start = int(size) - len(final)
        values = []
        appended = []
        for k, rid in enumerate(final):
            text = leaf_text(leaf_doc(rows[rid], start + k, outputs.get(rid)))
            values.append((self.host, start + k, rid, text))
            appended.append((start + k, leaf_hash(text.encode())))
        # The driver's own executemany: SQLAlchemy's per-row parameter handling cost as much
        # as the rest of the append (``loraplane bench ledger``).
        mark = "?" if conn.dialect.paramstyle == "qmark" else "%s"
        conn.exec_driver_sql(f"INSERT INTO {self._table} (host, idx, request_id, leaf) "
                             f"VALUES ({mark}, {mark}, {mark}, {mark})", values)
        return appended

    def committed(self, appended: Sequence[tuple[int, bytes]]) -> None:
        """Take leaves whose transaction committed into the frontier."""
        if appended and appended[0][0] != self.frontier.size:
            log.warning("ledger log of %s: entries appended by another writer; re-reading",
                        self.host)
            self.resync()
            return
        for _idx, h in appended:
            self.frontier.append(h)

    def checkpoint(self, now: float | None = None) -> str | None:
        """Sign and store a checkpoint of the frontier if it grew since the last one; returns
        the note (None when nothing new)."""
        if self.frontier.size == self.signed_size:
            return None
        cp = Checkpoint(self.origin, self.frontier.size, self.frontier.root())
        note = self.signer.sign(cp.text())
        with self.engine.begin() as conn:
            conn.execute(_insert_absent(conn, ledger_checkpoints, ["host", "size"]),
                         [{"host": self.host, "size": cp.size, "note": note,
                           "signed_at": time.time() if now is None else now}])
        self.signed_size = cp.size
        return note


def _host_signer(host: str, origin: str, keys_dir: Path | None) -> NoteSigner:
    """The host's checkpoint key, kept across restarts (``control.contracts.host_keys``)."""
    if keys_dir is None and os.environ.get(HOME_ENV):
        keys_dir = Path(os.environ[HOME_ENV]).resolve() / "keys"
    if keys_dir is None:
        return NoteSigner.generate(origin)
    try:
        return load_or_create_signer(keys_dir, host, origin)
    except OSError as e:
        # Serving goes on; the control plane refuses this key's checkpoints (not enrolled), so
        # the gap is loud there rather than a backend that fails to load.
        log.error("cannot keep the ledger checkpoint key of %s in %s (%s): signing with a key "
                  "for this process only, which must be enrolled to count", host,
                  key_path(keys_dir, host).parent, e)
        return NoteSigner.generate(origin)


def _insert_absent(conn: Connection, table: sa.Table, keys: list[str]) -> sa.Insert:
    """INSERT that leaves an existing row (same key) alone, on both dialects."""
    if conn.dialect.name == "postgresql":
        from sqlalchemy.dialects.postgresql import insert as pg_insert

        return pg_insert(table).on_conflict_do_nothing(index_elements=keys)
    from sqlalchemy.dialects.sqlite import insert as sqlite_insert

    return sqlite_insert(table).on_conflict_do_nothing(index_elements=keys)


# -- reading (the control plane, auditors, receipts) ------------------------------------------

def leaves(conn: Connection, host: str, start: int = 0,
           stop: int | None = None) -> list[tuple[int, str, str]]:
    """(idx, request_id, leaf text) of ``host``'s entries with start <= idx < stop, in order."""
    q = sa.select(ledger_log.c.idx, ledger_log.c.request_id, ledger_log.c.leaf).where(
        ledger_log.c.host == host, ledger_log.c.idx >= start)
    if stop is not None:
        q = q.where(ledger_log.c.idx < stop)
    return [(int(r.idx), r.request_id, r.leaf) for r in conn.execute(q.order_by(
        ledger_log.c.idx))]


def hosts(conn: Connection) -> list[str]:
    """Every host with a log."""
    return sorted(conn.execute(sa.select(ledger_log_heads.c.host)).scalars())


def parse_leaf(text: str) -> dict[str, Any]:
    doc = json.loads(text)
    if not isinstance(doc, dict):
        raise ValueError("a leaf is a JSON object")
    return doc
