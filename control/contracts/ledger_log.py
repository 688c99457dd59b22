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
import math
import os
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from json.encoder import encode_basestring
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from control.contracts.host_keys import key_path, load_or_create_signer
from control.contracts.ledger import Outcome, request_ledger
from control.contracts.schema import Component, declare, open_component
from control.contracts.tlog import (
    Checkpoint,
    Frontier,
    NoteSigner,
    TlogProof,
    b64,
    canonical,
    inclusion_proof,
    leaf_hash,
    root,
)

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
# The control plane's read model of the checkpoints it verified (``ledger_audit.sync`` writes a
# row with each ``CheckpointVerified`` event): what the gateway serves receipts from, since it
# may not read the event store. Neither hosts nor gateways may write it.
ledger_verified = sa.Table(
    "ledger_verified", metadata,
    sa.Column("host", _host, primary_key=True),
    sa.Column("size", sa.BigInteger, primary_key=True, autoincrement=False),
    sa.Column("root", sa.String(64), nullable=False),  # base64 of the tree's root hash
    sa.Column("note", sa.Text, nullable=False),  # the verified signed checkpoint
    sa.Column("verified_at", sa.Float, nullable=False),
)


def _ledger_log_version(insp: sa.Inspector) -> int:
    return 2 if insp.has_table("ledger_verified") else 1


def _ledger_log_1_to_2(conn: Connection) -> None:
    ledger_verified.create(conn, checkfirst=True)


LEDGER_LOG = declare(Component("ledger_log", 2, metadata, _ledger_log_version,
                               {1: _ledger_log_1_to_2}))


def origin_of(host: str) -> str:
    """The log's origin line (also its key name): no spaces or '+', which notes forbid."""
    return ORIGIN_PREFIX + re.sub(r"[\s+]", "_", host)


def output_sha256(text: str | bytes) -> str:
    return hashlib.sha256(text.encode() if isinstance(text, str) else text).hexdigest()


_COLUMNS = tuple(c.name for c in request_ledger.columns)
_OUTCOME = _COLUMNS.index("outcome")
_RUNNING = Outcome.RUNNING.value


def leaf_doc(row: Mapping[str, Any], index: int, output: str | None) -> dict[str, Any]:
    """The leaf of a final ledger row at ``index`` (``output``: output_sha256 or None)."""
    doc = {c: row[c] for c in _COLUMNS}
    doc.update(v=LEAF_VERSION, index=index, output_sha256=output)
    return doc


def leaf_text(doc: Mapping[str, Any]) -> str:
    return canonical(doc).decode()


# The leaf's keys in canonical (sorted) order, each with the text that precedes its value.
_LEAF_KEYS = tuple(sorted((*_COLUMNS, "v", "index", "output_sha256")))
_LEAF_PREFIXES = tuple(("{" if k == 0 else ",") + encode_basestring(key) + ":"
                       for k, key in enumerate(_LEAF_KEYS))
_LEAF_PLAN = tuple(zip(_LEAF_PREFIXES, _LEAF_KEYS, strict=True))


def _json_value(v: object) -> str:
    """One value as ``canonical`` writes it (json.dumps: repr for ints and finite floats)."""
    t = type(v)
    if t is str:
        return encode_basestring(v)  # type: ignore[arg-type]
    if v is None:
        return "null"
    if t is int or (t is float and math.isfinite(v)):  # type: ignore[arg-type]
        return repr(v)
    return json.dumps(v, ensure_ascii=False)  # bools, NaN, anything else: json's own text


def leaf(row: Mapping[str, Any], index: int, output: str | None) -> str:
    """``leaf_text(leaf_doc(row, index, output))``, without building the document: the one
    leaf function, used by ``audit verify`` (from the stored row) and, through
    :func:`leaf_of_values`, by the writer. Its keys are fixed, so their sorted order and the
    separators are computed once; per row only the values are encoded (half the cost of
    json.dumps with sort_keys, which the writer paid for every final row)."""
    return leaf_of_values(tuple(row[c] for c in _COLUMNS), index, output)


# Where each of the leaf's keys takes its value: a column's position, or an extra (negative).
_EXTRAS = ("v", "index", "output_sha256")
_LEAF_SOURCES = tuple((p, _COLUMNS.index(k) if k in _COLUMNS else -1 - _EXTRAS.index(k))
                      for p, k in _LEAF_PLAN)


def leaf_of_values(values: Sequence[Any], index: int, output: str | None) -> str:
    """:func:`leaf` of a row given as its values in column order (as the writer reads it)."""
    extra = (LEAF_VERSION, index, output)
    return "".join([p + _json_value(values[i] if i >= 0 else extra[-1 - i])
                    for p, i in _LEAF_SOURCES]) + "}"


@dataclass
class LogRead:
    """What :meth:`HostLog.read` found for a set of request ids."""

    ids: frozenset[str]
    rows: dict[str, tuple[Any, ...]] = field(default_factory=dict)  # whole rows, column order
    logged: set[str] = field(default_factory=set)  # those this host's log holds already

    def covers(self, ids: Sequence[str]) -> bool:
        return self.ids.issuperset(ids)


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
        quote = engine.dialect.identifier_preparer
        self._table = quote.format_table(ledger_log)
        self._heads = quote.format_table(ledger_log_heads)
        self._ledger = quote.format_table(request_ledger)
        self._columns = ", ".join("r." + quote.quote(c) for c in _COLUMNS)
        self._mark = "?" if engine.dialect.paramstyle == "qmark" else "%s"
        self._head: int | None = None  # where this writer left the head (None: unknown)
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
        self._head = f.size

    def append(self, conn: Connection, request_ids: Sequence[str],
               outputs: Mapping[str, str | None],
               known: LogRead | None = None) -> list[tuple[int, bytes]]:
        """Append the final rows of ``request_ids`` not yet in the log, inside the caller's
        transaction (after its ledger writes); returns (index, leaf hash) of each. ``known``:
        what :meth:`read` returned for these ids earlier in the same transaction (the ledger's
        own check reads them through it), so they are not read twice.

        Two or three statements whatever the batch's size, each through the driver itself
        (SQLAlchemy's per-row result and parameter handling cost as much as the rest of the
        append: ``loraplane bench ledger``): the read of the rows (unless ``known``), one move
        of the head, one insert of every leaf; on PostgreSQL the last two are one statement
        (one round trip fewer, which is most of what a one-row transaction pays for the
        log)."""
        ids = list(dict.fromkeys(request_ids))
        if not ids:
            return []
        got = known if known is not None and known.covers(ids) else self.read(conn, ids)
        final = [i for i in ids if i in got.rows and i not in got.logged
                 and got.rows[i][_OUTCOME] != _RUNNING]
        if not final:
            return []
        rows = got.rows
        if conn.dialect.name == "postgresql" and self._head is not None:
            made = self._leaves(rows, final, outputs, self._head)
            if self._put_at_head(conn, made):
                return [(idx, h) for _, idx, _, _, h in made]
        # Positions come from the head's row, moved and read in one statement under its row
        # lock (the write lock on SQLite): two writers of one host never get the same ones.
        size = conn.execute(ledger_log_heads.update().where(
            ledger_log_heads.c.host == self.host).values(
            size=ledger_log_heads.c.size + len(final)).returning(
            ledger_log_heads.c.size)).scalar_one()
        made = self._leaves(rows, final, outputs, int(size) - len(final))
        conn.exec_driver_sql(f"INSERT INTO {self._table} (host, idx, request_id, leaf) "
                             f"VALUES ({self._mark}, {self._mark}, {self._mark}, {self._mark})",
                             [(self.host, idx, rid, text) for _, idx, rid, text, _ in made])
        return [(idx, h) for _, idx, _, _, h in made]

    def read(self, conn: Connection, ids: list[str]) -> LogRead:
        """The ledger rows of ``ids`` (whole, in column order) and which of them this host's
        log holds already (a retried write finds its rows logged), in one read. Joined by
        request id alone, so the planner takes its index (with the host in the condition,
        SQLite walked the host's whole log)."""
        params: tuple[Any, ...]
        if conn.dialect.name == "postgresql":
            where, params = "r.request_id = ANY(%b)", (ids,)
        else:
            where, params = f"r.request_id IN ({', '.join('?' * len(ids))})", tuple(ids)
        got = LogRead(frozenset(ids))
        for r in conn.exec_driver_sql(
                f"SELECT {self._columns}, l.host FROM {self._ledger} r LEFT OUTER JOIN "
                f"{self._table} l ON l.request_id = r.request_id WHERE {where}", params):
            got.rows[r[0]] = tuple(r[:-1])
            if r[-1] == self.host:
                got.logged.add(r[0])
        return got

    def _leaves(self, rows: Mapping[str, tuple[Any, ...]], final: Sequence[str],
                outputs: Mapping[str, str | None],
                start: int) -> list[tuple[str, int, str, str, bytes]]:
        """(host, index, request id, leaf text, leaf hash) of each row from ``start`` on."""
        made = []
        for k, rid in enumerate(final):
            text = leaf_of_values(rows[rid], start + k, outputs.get(rid))
            made.append((self.host, start + k, rid, text, leaf_hash(text.encode())))
        return made

    def _put_at_head(self, conn: Connection, made: Sequence[tuple[str, int, str, str, bytes]]
                     ) -> bool:
        """PostgreSQL: move the head from where this writer last left it and insert the leaves,
        in one statement; False (nothing written) when the head is elsewhere (another writer
        of this host, or the table changed), and the caller claims positions under the lock.
        The arrays go in psycopg's binary format (``%b``): its text format quotes every element
        with a regular expression, which cost more than the rest of the append together."""
        start = made[0][1]
        result = conn.exec_driver_sql(
            f"WITH head AS (UPDATE {self._heads} SET size = size + %s WHERE host = %s AND "
            f"size = %s RETURNING size) INSERT INTO {self._table} (host, idx, request_id, leaf) "
            f"SELECT %s, t.idx, t.rid, t.leaf FROM head, unnest(%b::bigint[], %b::text[], "
            f"%b::text[]) AS t(idx, rid, leaf)",
            (len(made), self.host, start, self.host, [m[1] for m in made],
             [m[2] for m in made], [m[3] for m in made]))
        return bool(result.rowcount == len(made))

    def committed(self, appended: Sequence[tuple[int, bytes]]) -> None:
        """Take leaves whose transaction committed into the frontier."""
        if appended and appended[0][0] != self.frontier.size:
            log.warning("ledger log of %s: entries appended by another writer; re-reading",
                        self.host)
            self.resync()
            return
        for _idx, h in appended:
            self.frontier.append(h)
        if appended:
            self._head = appended[-1][0] + 1

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


# -- verified checkpoints and proofs (receipts: the CLI and the gateway) -----------------------

def publish_verified(conn: Connection, host: str,
                     verified: Sequence[tuple[int, str, str]], now: float | None = None) -> int:
    """Write the control plane's verified checkpoints of ``host`` ((size, base64 root, note)
    each) that ``ledger_verified`` lacks; returns how many were new."""
    have = set(conn.execute(sa.select(ledger_verified.c.size).where(
        ledger_verified.c.host == host)).scalars())
    new = [{"host": host, "size": size, "root": root_b64, "note": note,
            "verified_at": time.time() if now is None else now}
           for size, root_b64, note in verified if size not in have]
    if new:
        conn.execute(_insert_absent(conn, ledger_verified, ["host", "size"]), new)
    return len(new)


def first_verified(conn: Connection, host: str, index: int) -> tuple[int, str, str] | None:
    """(size, base64 root, note) of ``host``'s first verified checkpoint covering entry
    ``index``; None when none does (yet)."""
    r = conn.execute(sa.select(ledger_verified.c.size, ledger_verified.c.root,
                               ledger_verified.c.note).where(
        ledger_verified.c.host == host, ledger_verified.c.size > index).order_by(
        ledger_verified.c.size).limit(1)).first()
    return None if r is None else (int(r.size), r.root, r.note)


def prove(conn: Connection, host: str, index: int, size: int, root_b64: str,
          note: str) -> str | None:
    """The c2sp.org/tlog-proof of ``host``'s entry ``index`` against the verified checkpoint
    (``size``, ``root_b64``, ``note``), carrying the entry; None when the stored entries no
    longer give that root (the log was changed since: ``audit verify --ledger`` says where)."""
    entries = leaves(conn, host, 0, size)
    hashes = [leaf_hash(text.encode()) for _, _, text in entries]
    if len(hashes) != size or b64(root(hashes)) != root_b64:
        return None
    return TlogProof(index, tuple(inclusion_proof(index, hashes)), note,
                     entries[index][2].encode()).text()


def position(conn: Connection, request_id: str) -> tuple[str, int] | None:
    """(host, index) of ``request_id``'s entry, None when it is in no log."""
    r = conn.execute(sa.select(ledger_log.c.host, ledger_log.c.idx).where(
        ledger_log.c.request_id == request_id).order_by(ledger_log.c.idx).limit(1)).first()
    return None if r is None else (r.host, int(r.idx))
