"""Ledger retention: archive old request-ledger rows without breaking the audit story.

``archive`` (``loraplane audit archive --before T --out FILE [--host H]``):

1. exports every row admitted before the cut-off that is finished (never a ``running`` one),
   with the position and text of its entry in its host's Merkle log where the log has one, as
   canonical JSON lines in a fixed order (host; logged rows by position, then the rest by
   admission time and request id), after a header line naming the cut-off and scope; the
   file's SHA-256 is its digest. A row whose log entry no longer matches it, or a final row
   missing from its host's log (what ``audit verify --ledger`` calls modified and inserted), is
   refused: archiving it would move the evidence out of the auditor's sight;
2. records ``LedgerArchive.LedgerArchived`` (cut-off, scope, rows, per host the rows, first
   and last log position and every archived position, the digest, the file, the actor) before
   anything is deleted: if the event cannot be recorded, nothing is;
3. deletes exactly the exported rows, by request id, in one transaction, then records
   ``ArchiveDeleted``. The log entries stay: checkpoints, ``audit verify`` and receipts
   (``loraplane receipt get``) still work for archived requests.

An archive whose delete was not recorded (a crash between the event and the delete) is
completed by the next run, from its file (checked against the recorded digest first). A second
run with the same cut-off finds nothing left to archive and says so.

``verify_archive`` (``loraplane audit archive-verify FILE``) checks a file against the record:
its digest is a recorded archive's, its header and counts match the event, each row is the one
its log entry binds (the one leaf function, ``control.contracts.ledger_log.leaf``) and each
entry is, byte for byte, the one the host's log holds at that position, so its leaf hash is
the one the signed checkpoints cover. ``archives_overlapping`` tells incident queries which
archives took rows of the time range they ask about.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import sqlalchemy as sa
from eventsourcing.application import AggregateNotFoundError, Application
from eventsourcing.persistence import IntegrityError as EventStoreIntegrityError
from sqlalchemy.engine import Engine

from control.app.ledger_audit import UNLOGGED_REASONS, load
from control.contracts.ledger import Outcome, request_ledger
from control.contracts.ledger_log import hosts, leaf, leaves, ledger_log, opened, parse_leaf
from control.contracts.tlog import canonical
from control.domain.ledger_archive import LedgerArchive, ledger_archive_id, runs_of

ACTOR = "loraplane:ledger-archive"
FORMAT = "loraplane.ledger-archive"
VERSION = 1
_CHUNK = 500
_RUNNING = Outcome.RUNNING.value
_COLUMNS = tuple(c.name for c in request_ledger.columns)


class ArchiveError(ValueError):
    """The archive cannot be made (or completed) as asked; the message says why and what to do.
    Nothing was deleted unless the message says so."""


def record(app: Application[Any]) -> LedgerArchive | None:
    """The deployment's archive record, None before the first archive."""
    try:
        agg: LedgerArchive = app.repository.get(ledger_archive_id())
    except AggregateNotFoundError:
        return None
    return agg


def iso(t: float) -> str:
    return dt.datetime.fromtimestamp(t, dt.UTC).isoformat()


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


@dataclass
class ArchiveResult:
    before: float
    sha256: str | None = None  # of the file written; None when nothing was archived
    rows: int = 0
    deleted: int = 0
    out: str | None = None
    hosts: dict[str, Any] = field(default_factory=dict)
    completed: list[tuple[str, int]] = field(default_factory=list)  # (sha256, rows deleted)

    def to_json(self) -> dict[str, Any]:
        return {"before": iso(self.before), "sha256": self.sha256, "rows": self.rows,
                "deleted": self.deleted, "out": self.out,
                "hosts": {h: {k: v for k, v in d.items() if k != "positions"}
                          for h, d in self.hosts.items()},
                "completed": [{"sha256": s, "deleted": n} for s, n in self.completed]}


# -- archive -----------------------------------------------------------------------------------

def archive(app: Application[Any], engine: Engine, before: float, out: Path, *,
            host: str | None = None, force: bool = False, actor: str = ACTOR,
            now: float | None = None) -> ArchiveResult:
    """Archive the finished rows admitted before ``before`` (of ``host`` alone, if given) into
    ``out`` (module notes). Raises :class:`ArchiveError` for a cut-off in the future, a file
    that exists (unless ``force``) or cannot be written, rows that fail the log's check, and an
    event that could not be recorded (then nothing was deleted)."""
    now = time.time() if now is None else now
    if before > now:
        raise ArchiveError(f"the cut-off {iso(before)} is in the future: only rows admitted "
                           "before a past time can be archived")
    out = out.absolute()
    if not out.parent.is_dir():
        raise ArchiveError(f"cannot write {out}: no folder {out.parent}")
    engine = opened(engine)
    result = ArchiveResult(before)
    agg = record(app)
    for pending in (agg.pending if agg is not None else []):
        assert agg is not None
        result.completed.append((pending["sha256"], _complete(app, engine, agg, pending, actor)))
    with engine.connect() as conn:
        count = conn.execute(sa.select(sa.func.count()).select_from(request_ledger).where(
            *_wanted(before, host))).scalar_one()
    if not count:
        return result
    _check_out(out, force, agg)
    sha, ids, per_host = _export(engine, before, host, out)
    if not ids:  # the rows counted were deleted meanwhile (another archiver)
        out.unlink(missing_ok=True)
        return result
    result.sha256, result.rows, result.out, result.hosts = sha, len(ids), str(out), per_host
    agg = record(app) or LedgerArchive(actor=actor)
    try:
        agg.archive(sha, before, iso(before), host or "", len(ids), per_host, str(out), actor)
        app.save(agg)
    except Exception as e:
        out.unlink(missing_ok=True)
        why = ("another archive was recorded meanwhile"
               if isinstance(e, (EventStoreIntegrityError, sa.exc.IntegrityError)) else str(e))
        raise ArchiveError(f"the archive could not be recorded ({why}): nothing was deleted "
                           f"and {out} was removed; run the command again") from e
    result.deleted = _finish(app, engine, agg, sha, ids, before, actor)
    return result


def _wanted(before: float, host: str | None) -> list[Any]:
    t = request_ledger
    where = [t.c.admitted_at < before, t.c.outcome != _RUNNING]
    if host is not None:
        where.append(t.c.host == host)
    return where


def _check_out(out: Path, force: bool, agg: LedgerArchive | None) -> None:
    if out.is_dir():
        raise ArchiveError(f"cannot write {out}: it is a folder")
    if not out.exists():
        return
    if not force:
        raise ArchiveError(f"{out} exists: choose another file, or pass --force to replace it")
    sha = sha256_of(out)
    if agg is not None and sha in agg.archives:
        raise ArchiveError(f"{out} is the recorded archive sha256:{sha} (cut-off "
                           f"{agg.archives[sha]['before_iso']}): keep it, and write the new "
                           "archive to another file")


def _export(engine: Engine, before: float, host: str | None,
            out: Path) -> tuple[str, list[str], dict[str, Any]]:
    """Write the archive to ``out`` (through a partial file renamed at the end); returns its
    SHA-256, the exported request ids and the per-host figures of the event."""
    partial = out.with_name(f".{out.name}.partial-{os.getpid()}")
    try:
        f = partial.open("wb")
    except OSError as e:
        raise ArchiveError(f"cannot write {out}: {e.strerror or e}") from None
    try:
        with f:
            digest, ids, per_host = _write(engine, before, host, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(partial, out)
    except BaseException as e:
        partial.unlink(missing_ok=True)
        if isinstance(e, OSError):
            raise ArchiveError(f"cannot write {out}: {e.strerror or e}") from None
        raise
    return digest, ids, per_host


def _write(engine: Engine, before: float, host: str | None,
           f: IO[bytes]) -> tuple[str, list[str], dict[str, Any]]:
    h = hashlib.sha256()

    def put(doc: dict[str, Any]) -> None:
        line = canonical(doc) + b"\n"
        h.update(line)
        f.write(line)

    put({"format": FORMAT, "v": VERSION, "before": before, "before_iso": iso(before),
         "scope": host or ""})
    ids: list[str] = []
    per_host: dict[str, Any] = {}
    positions: dict[str, list[int]] = {}
    refused: list[str] = []
    for rid, row, at, text, with_log in _rows(engine, before, host):
        s = per_host.setdefault(row["host"], {"rows": 0, "logged": 0, "first": None,
                                              "last": None})
        s["rows"] += 1
        if at is not None and text is not None:
            try:
                out_sha = parse_leaf(text).get("output_sha256")
            except ValueError:
                out_sha = None
            if leaf(row, at, out_sha) != text:
                refused.append(f"request {rid} differs from its entry at position {at} of "
                               f"host {row['host']}'s log (modified)")
            s["logged"] += 1
            s["first"] = at if s["first"] is None else min(s["first"], at)
            s["last"] = at if s["last"] is None else max(s["last"], at)
            positions.setdefault(row["host"], []).append(at)
        elif with_log and row["reason"] not in UNLOGGED_REASONS:
            refused.append(f"request {rid} is final but in no position of host "
                           f"{row['host']}'s log (inserted)")
        ids.append(rid)
        put({"host": row["host"], "index": at, "leaf": text, "row": row})
    if refused:
        raise ArchiveError(f"{len(refused)} rows fail the ledger log's check, and archiving "
                           "would hide them: " + "; ".join(refused[:5])
                           + ("; ..." if len(refused) > 5 else "")
                           + ". Nothing was archived: see `loraplane audit verify --ledger`")
    for name, idx in positions.items():
        per_host[name]["positions"] = runs_of(idx)
    return h.hexdigest(), ids, per_host


def _rows(engine: Engine, before: float, host: str | None
          ) -> Iterator[tuple[str, dict[str, Any], int | None, str | None, bool]]:
    """(request id, row, log position, entry text, whether the row's host keeps a log) of each
    row to archive, in the archive's order."""
    t, lg = request_ledger, ledger_log
    q = (sa.select(t, lg.c.idx.label("log_idx"), lg.c.leaf.label("log_leaf"))
         .select_from(t.outerjoin(lg, sa.and_(lg.c.request_id == t.c.request_id,
                                              lg.c.host == t.c.host)))
         .where(*_wanted(before, host))
         .order_by(t.c.host, sa.case((lg.c.idx.is_(None), 1), else_=0), lg.c.idx,
                   t.c.admitted_at, t.c.request_id))
    with engine.connect() as conn:
        with_log = set(hosts(conn))
        result = conn.execution_options(stream_results=True, yield_per=2000).execute(q)
        for r in result:
            m = r._mapping
            row = {c: m[c] for c in _COLUMNS}
            at = None if m["log_idx"] is None else int(m["log_idx"])
            yield row["request_id"], row, at, m["log_leaf"], row["host"] in with_log


def _delete(engine: Engine, ids: Sequence[str], before: float) -> int:
    """Delete the finished rows of ``ids`` admitted before ``before``, in one transaction."""
    t = request_ledger
    n = 0
    with engine.begin() as conn:
        for k in range(0, len(ids), _CHUNK):
            n += conn.execute(t.delete().where(t.c.request_id.in_(ids[k:k + _CHUNK]),
                                               *_wanted(before, None))).rowcount
    return n


def _finish(app: Application[Any], engine: Engine, agg: LedgerArchive, sha: str,
            ids: Sequence[str], before: float, actor: str) -> int:
    """Delete an archive's rows and record it; an archive whose delete failed stays pending
    (the next run completes it)."""
    try:
        n = _delete(engine, ids, before)
    except sa.exc.SQLAlchemyError as e:
        raise ArchiveError(f"archive sha256:{sha} is recorded but deleting its rows failed "
                           f"({e.__class__.__name__}): run the command again to complete it"
                           ) from e
    agg.mark_deleted(sha, n, actor)
    app.save(agg)
    return n


def _complete(app: Application[Any], engine: Engine, agg: LedgerArchive,
              pending: dict[str, Any], actor: str) -> int:
    """Finish the delete of a recorded archive, reading its ids from its file."""
    sha, path = pending["sha256"], Path(pending["file"])
    try:
        got = sha256_of(path)
    except OSError as e:
        raise ArchiveError(f"archive sha256:{sha} (cut-off {pending['before_iso']}) is "
                           f"recorded but its rows were not deleted, and its file {path} cannot "
                           f"be read ({e.strerror or e}): restore the file there and run again"
                           ) from None
    if got != sha:
        raise ArchiveError(f"archive sha256:{sha} is recorded but its rows were not deleted, "
                           f"and {path} is no longer that file (sha256:{got}): restore it and "
                           "run again")
    ids = [str(doc["row"]["request_id"]) for doc in _lines(path)[1]]
    return _finish(app, engine, agg, sha, ids, float(pending["before"]), actor)


def _lines(path: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The header and row lines of an archive file; ArchiveError if it is not one."""
    docs = []
    try:
        with path.open("rb") as f:
            for n, line in enumerate(f, 1):
                doc = json.loads(line)
                if not isinstance(doc, dict):
                    raise ValueError(f"line {n} is not a JSON object")
                docs.append(doc)
    except OSError as e:
        raise ArchiveError(f"cannot read {path}: {e.strerror or e}") from None
    except ValueError as e:
        raise ArchiveError(f"{path} is not a ledger archive: {e}") from None
    if not docs or docs[0].get("format") != FORMAT:
        raise ArchiveError(f"{path} is not a ledger archive (no {FORMAT} header line)")
    return docs[0], docs[1:]


# -- checking an archive file ------------------------------------------------------------------

@dataclass
class ArchiveCheck:
    sha256: str
    rows: int = 0
    recorded: dict[str, Any] | None = None  # the LedgerArchived fields, when the digest is one
    covered: int = 0  # entries a verified checkpoint of their host covers (receipts work)
    still_in_ledger: int = 0  # rows not deleted yet (the archive's delete is pending)
    problems: list[tuple[str, str]] = field(default_factory=list)  # (check, detail)

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_json(self) -> dict[str, Any]:
        rec = self.recorded or {}
        return {"ok": self.ok, "sha256": self.sha256, "rows": self.rows,
                "recorded": bool(self.recorded), "before": rec.get("before_iso"),
                "scope": rec.get("scope"), "covered": self.covered,
                "still_in_ledger": self.still_in_ledger,
                "problems": [{"check": c, "detail": d} for c, d in self.problems]}


def verify_archive(app: Application[Any], engine: Engine, path: Path) -> ArchiveCheck:
    """Check the archive file ``path`` against its recorded event and the hosts' logs (module
    notes); every failed check is a problem naming it: ``digest``, ``header``, ``rows``,
    ``entry``, ``log``, ``positions``."""
    try:
        check = ArchiveCheck(sha256_of(path))
    except OSError as e:
        raise ArchiveError(f"cannot read {path}: {e.strerror or e}") from None
    header, docs = _lines(path)
    agg = record(app)
    rec = agg.archives.get(check.sha256) if agg is not None else None
    check.recorded, check.rows = rec, len(docs)
    problems = check.problems
    if rec is None:
        problems.append(("digest", f"no recorded archive has the digest sha256:{check.sha256}: "
                         "the file was changed, or it was never recorded"))
    else:
        for key in ("before", "scope"):
            if header.get(key) != rec[key]:
                problems.append(("header", f"the file's {key} {header.get(key)!r} is not the "
                                 f"recorded {rec[key]!r}"))
        if len(docs) != rec["rows"]:
            problems.append(("rows", f"{len(docs)} rows, the event records {rec['rows']}"))
    before = float(header.get("before") or 0.0)
    positions: dict[str, list[int]] = {}
    with opened(engine).connect() as conn:
        logs: dict[str, dict[int, str]] = {}
        for n, doc in enumerate(docs, 2):
            _check_line(conn, n, doc, before, logs, positions, problems)
        ids = [str(d.get("row", {}).get("request_id")) for d in docs]
        for k in range(0, len(ids), _CHUNK):
            check.still_in_ledger += conn.execute(sa.select(sa.func.count()).select_from(
                request_ledger).where(request_ledger.c.request_id.in_(ids[k:k + _CHUNK]))
            ).scalar_one()
    if rec is not None:
        got = {h: runs_of(p) for h, p in positions.items()}
        want = {h: d.get("positions", []) for h, d in rec["hosts"].items() if d.get("positions")}
        if got != want:
            problems.append(("positions", "the file's log positions are not the ones the "
                             "event records"))
    for host, idx in positions.items():
        ledger = load(app, host)
        size = ledger.verified_size if ledger is not None else 0
        check.covered += sum(1 for i in idx if i < size)
    return check


def _check_line(conn: sa.Connection, n: int, doc: dict[str, Any], before: float,
                logs: dict[str, dict[int, str]], positions: dict[str, list[int]],
                problems: list[tuple[str, str]]) -> None:
    row, at, text = doc.get("row"), doc.get("index"), doc.get("leaf")
    if (not isinstance(row, dict) or set(row) != set(_COLUMNS)
            or not isinstance(row["host"], str) or row["host"] != doc.get("host")):
        problems.append(("entry", f"line {n} is not an archived ledger row"))
        return
    host: str = row["host"]
    rid = row["request_id"]
    if row["outcome"] == _RUNNING or not float(row["admitted_at"]) < before:
        problems.append(("entry", f"line {n}: request {rid} is running or admitted after the "
                         "cut-off"))
    if at is None:
        return
    if not isinstance(at, int) or not isinstance(text, str):
        problems.append(("entry", f"line {n}: request {rid}'s log position or entry is not "
                         "one"))
        return
    positions.setdefault(host, []).append(at)
    try:
        out_sha = parse_leaf(text).get("output_sha256")
    except ValueError:
        out_sha = None
    if leaf(row, at, out_sha) != text:
        problems.append(("entry", f"line {n}: request {rid}'s row is not the one its entry "
                         "binds"))
    if host not in logs:
        logs[host] = {i: t for i, _, t in leaves(conn, host)}
    held = logs[host].get(at)
    if held != text:
        problems.append(("log", f"line {n}: request {rid}'s entry is not the one host {host}'s "
                         f"log holds at position {at}"
                         + (" (none there)" if held is None else "")))


# -- incident queries --------------------------------------------------------------------------

def archives_overlapping(app: Application[Any], since: float | None) -> list[dict[str, Any]]:
    """The archives that may have taken rows admitted at or after ``since`` (None: the start
    of time): those whose cut-off is later, oldest cut-off first, for incident answers to say
    which rows are archived instead of returning fewer silently."""
    agg = record(app)
    if agg is None:
        return []
    found = [a for a in agg.archives.values() if since is None or since < a["before"]]
    return [{"before": a["before_iso"], "scope": a["scope"] or "every host",
             "rows": a["rows"], "sha256": a["sha256"], "file": a["file"],
             "deleted": a["sha256"] in agg.deleted}
            for a in sorted(found, key=lambda a: a["before"])]
