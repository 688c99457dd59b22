"""The ``LedgerArchive`` aggregate: the request-ledger rows the control plane archived.

Retention moves old, finished ledger rows out of ``request_ledger`` into an archive file
(``control.app.ledger_archive``); the hosts' Merkle logs keep their entries, so checkpoints and
receipts still verify. Each archive is recorded here *before* any row is deleted
(``LedgerArchived``: the cut-off, the file's SHA-256, how many rows, and per host which log
positions the archived rows hold), and its delete after (``ArchiveDeleted``). An auditor who
finds a log entry without its row (``audit verify --ledger``) asks this record whether an
archive took it; a row deleted without one is still reported deleted.

One aggregate for the whole deployment (archives are rare, and one stream makes two archivers
collide on its version instead of both deleting).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from typing import Any
from uuid import UUID, uuid5

from eventsourcing.domain import Aggregate, event

from control.domain.errors import AlreadyExists, NotFound
from control.domain.ids import NAMESPACE
from control.domain.names import check_actor


def ledger_archive_id() -> UUID:
    """The id of the deployment's one archive record."""
    return uuid5(NAMESPACE, "ledger-archive:all")


def runs_of(indices: Iterable[int]) -> list[list[int]]:
    """Sorted log positions as inclusive runs ``[[first, last], ...]`` (compact in an event:
    the positions of rows admitted before a cut-off are mostly one run per host)."""
    out: list[list[int]] = []
    for i in sorted(set(indices)):
        if out and out[-1][1] == i - 1:
            out[-1][1] = i
        else:
            out.append([i, i])
    return out


def in_runs(runs: list[list[int]], index: int) -> bool:
    """Whether ``index`` lies in one of ``runs`` (sorted, disjoint, as :func:`runs_of`)."""
    k = bisect.bisect_right(runs, index, key=lambda r: r[0]) - 1
    return k >= 0 and runs[k][0] <= index <= runs[k][1]


class LedgerArchive(Aggregate):
    class Opened(Aggregate.Created):
        actor: str

    class LedgerArchived(Aggregate.Event):
        sha256: str  # of the archive file's bytes (hex)
        before: float  # the cut-off: rows admitted before it (POSIX seconds)
        before_iso: str  # the same, for people (UTC)
        scope: str  # the one host archived, or "" for every host
        rows: int
        # host -> {"rows": n, "logged": n, "first": idx|None, "last": idx|None,
        #          "positions": runs_of(the logged rows' positions)}
        hosts: dict[str, Any]
        file: str  # where it was written (absolute path)
        actor: str

    class ArchiveDeleted(Aggregate.Event):
        sha256: str
        deleted: int  # rows this delete removed (fewer than archived: some were gone already)
        actor: str

    @staticmethod
    def create_id(actor: str) -> UUID:
        return ledger_archive_id()

    @event(Opened)
    def __init__(self, actor: str) -> None:
        self.archives: dict[str, dict[str, Any]] = {}  # sha256 -> the LedgerArchived fields
        self.deleted: dict[str, int] = {}  # sha256 -> rows its delete removed
        self._positions: dict[str, list[tuple[list[list[int]], str]]] = {}

    def archive(self, sha256: str, before: float, before_iso: str, scope: str, rows: int,
                hosts: dict[str, Any], file: str, actor: str) -> None:
        if sha256 in self.archives:
            raise AlreadyExists(f"archive sha256:{sha256} is recorded already")
        self._archived(sha256=sha256, before=before, before_iso=before_iso, scope=scope,
                       rows=rows, hosts=hosts, file=file, actor=check_actor(actor))

    @event(LedgerArchived)
    def _archived(self, sha256: str, before: float, before_iso: str, scope: str, rows: int,
                  hosts: dict[str, Any], file: str, actor: str) -> None:
        self.archives[sha256] = {"sha256": sha256, "before": before, "before_iso": before_iso,
                                 "scope": scope, "rows": rows, "hosts": hosts, "file": file,
                                 "actor": actor}
        for host, h in hosts.items():
            self._positions.setdefault(host, []).append((h.get("positions") or [], sha256))

    def mark_deleted(self, sha256: str, deleted: int, actor: str) -> None:
        if sha256 not in self.archives:
            raise NotFound(f"no archive sha256:{sha256} is recorded")
        if sha256 not in self.deleted:
            self._deleted(sha256=sha256, deleted=deleted, actor=check_actor(actor))

    @event(ArchiveDeleted)
    def _deleted(self, sha256: str, deleted: int, actor: str) -> None:
        self.deleted[sha256] = deleted

    @property
    def pending(self) -> list[dict[str, Any]]:
        """Archives recorded whose delete was not (yet) recorded, oldest first."""
        return [a for sha, a in self.archives.items() if sha not in self.deleted]

    def archived_at(self, host: str, index: int) -> str | None:
        """The SHA-256 of the archive that took ``host``'s row at log position ``index``, or
        None when no archive did."""
        for runs, sha in self._positions.get(host, ()):
            if in_runs(runs, index):
                return sha
        return None
