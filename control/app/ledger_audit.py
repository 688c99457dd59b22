"""The control plane's side of the hosts' ledger logs (``control.contracts.ledger_log``).

``sync`` records each host's published checkpoint key (``HostLedger.KeyRecorded``) and verifies
each new checkpoint against the last one it verified: the note must be signed by a key *enrolled*
for that host (``HostLedger.KeyEnrolled``, the root of trust's signature over it checked against
the root public key of this home's configuration, ``control.contracts.host_keys``: ``loraplane
host enroll``, or, in a development home, the development root enrolling each presented key, as
it vouches for signing keys), and the entries appended since
must extend the verified tree's frontier to the signed root (consistency by recomputation, which
hashes only the new entries). A verified checkpoint becomes a ``CheckpointVerified`` event, a
failed one a ``CheckpointRefused`` event naming the check; later checkpoints of that host wait
until it is resolved.

``verify`` (``loraplane audit verify --ledger``) re-reads every host's log and ledger rows and
names, by host and position, each row or entry modified, deleted, inserted or reordered, and each
verified checkpoint whose root the stored entries no longer give. An entry whose row an archive
recorded in the event store took (``control.app.ledger_archive``: ``LedgerArchive``, recorded
before the delete) is counted as archived, not deleted; a row deleted without one is still
reported deleted. ``coverage`` says which ledger
rows verified checkpoints cover (``loraplane incident requests``); ``receipt`` builds one
request's c2sp.org/tlog-proof (``loraplane receipt get``).
"""

from __future__ import annotations

import bisect
import json
import logging
import threading
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from eventsourcing.application import AggregateNotFoundError, Application
from sqlalchemy.engine import Connection, Engine

from control.contracts.host_keys import enrolled, read_vkey, sign_enrollment, vkey_path
from control.contracts.ledger import Outcome, request_ledger
from control.contracts.ledger_log import (
    hosts,
    leaf,
    leaves,
    ledger_checkpoints,
    ledger_host_keys,
    ledger_log,
    ledger_log_heads,
    opened,
    origin_of,
    parse_leaf,
    prove,
    publish_verified,
)
from control.contracts.root_of_trust import RootError, root_public_key, signing_root
from control.contracts.tlog import (
    Checkpoint,
    Frontier,
    ProofError,
    Verifier,
    b64,
    leaf_hash,
    open_note,
)
from control.domain.host_ledger import HostLedger, host_ledger_id
from control.domain.ledger_archive import LedgerArchive, ledger_archive_id

log = logging.getLogger("loraplane.ledger_audit")

ACTOR = "loraplane:ledger-audit"
VERIFY_S = 15.0  # how often the control plane's serve loop verifies new host checkpoints
# Rows that reach the ledger without passing the engine's log writer: the front model's record
# of a request the engine never answered, and rows a restart (or the engine watcher) marked
# failed. Listed apart as "unlogged", never as inserted.
UNLOGGED_REASONS = frozenset({"engine_unavailable", "host_restart", "engine_crashed"})
_CHUNK = 500


def load(app: Application[Any], host: str) -> HostLedger | None:
    try:
        agg: HostLedger = app.repository.get(host_ledger_id(host))
    except AggregateNotFoundError:
        return None
    return agg


@dataclass
class SyncReport:
    keys_recorded: int = 0
    verified: list[tuple[str, int]] = field(default_factory=list)
    refused: list[tuple[str, int, str]] = field(default_factory=list)


def keys_dir_of(app: Application[Any], keys_dir: Path | None = None) -> Path | None:
    """``keys_dir``, else the keys folder of ``app``'s settings (a Registry has them)."""
    if keys_dir is not None:
        return keys_dir
    settings = getattr(app, "settings", None)
    return getattr(settings, "keys_dir", None)


def trusted_keys_of(agg: HostLedger, root: Any) -> list[str]:
    """The verifier keys of ``agg``'s host that ``root`` (an Ed25519 public key, or None)
    enrolled: the only keys its checkpoints are verified with."""
    return [v for v, sig in agg.enrolled.items() if enrolled(root, sig, agg.host, v)]


def _dev_root(keys_dir: Path | None) -> Any:
    """The development root that enrols presented keys, or None: a home whose root was moved
    offline (``root.pub`` or LORAPLANE_ROOT_PUBKEY, no development root) enrols by hand."""
    if keys_dir is None:
        return None
    try:
        return signing_root(keys_dir)
    except RootError:
        return None


def sync(app: Application[Any], engine: Engine, actor: str = ACTOR,
         keys_dir: Path | None = None) -> SyncReport:
    """Record new host keys and verify new checkpoints (module notes); ``keys_dir``: this
    home's (default: ``app.settings``'), where the root of trust is configured."""
    report = SyncReport()
    engine = opened(engine)
    keys_dir = keys_dir_of(app, keys_dir)
    dev = _dev_root(keys_dir)
    root = root_public_key(keys_dir)
    with engine.connect() as conn:
        for host in hosts(conn):
            agg = load(app, host) or HostLedger(host=host, actor=actor)
            before = len(agg.vkeys)
            for vkey in conn.execute(sa.select(ledger_host_keys.c.vkey).where(
                    ledger_host_keys.c.host == host).order_by(
                    ledger_host_keys.c.published_at)).scalars():
                agg.record_key(vkey, actor)
                if dev is not None and vkey not in agg.enrolled:
                    agg.enroll(vkey, sign_enrollment(dev, host, vkey), actor)
            report.keys_recorded += len(agg.vkeys) - before
            _verify_new(conn, agg, actor, report, trusted_keys_of(agg, root))
            if agg.pending_events:
                app.save(agg)
            if agg.verified:  # after the events: the gateway's read model for receipts
                with engine.begin() as out:
                    publish_verified(out, host, [(size, r, agg.notes[size])
                                                 for size, r in agg.verified])
    return report


def enroll(app: Application[Any], host: str, key_file: Path, root_key: Path | None = None,
           keys_dir: Path | None = None, actor: str = ACTOR) -> str:
    """Enrol the checkpoint key in ``key_file`` (the host's ``keys/ledger/<host>.vkey``) for
    ``host``, signed by the root key file ``root_key`` (else a development home's root);
    returns the verifier key. ValueError or RootError, saying what to do, otherwise."""
    keys_dir = keys_dir_of(app, keys_dir)
    if keys_dir is None:
        raise ValueError("enrolling a host key needs this home's keys folder (the root of trust)")
    try:
        text = key_file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read the host key file {key_file}: {e}") from None
    vkey = read_vkey(text, origin_of(host), str(key_file))
    root = signing_root(keys_dir, root_key)
    agg = load(app, host) or HostLedger(host=host, actor=actor)
    agg.enroll(vkey, sign_enrollment(root, host, vkey), actor)
    if agg.pending_events:
        app.save(agg)
    return vkey


def keep_verifying(app: Application[Any], engine: Engine, stop: threading.Event,
                   interval: float = VERIFY_S) -> None:
    """:func:`sync` every ``interval`` seconds until ``stop`` (a thread of the control plane);
    a refused checkpoint is logged at ERROR, a database away retried next time."""
    while not stop.wait(interval):
        try:
            for host, size, why in sync(app, engine).refused:
                log.error("ledger checkpoint of host %s at size %d refused: %s", host, size, why)
        except Exception:
            log.warning("verifying host ledger checkpoints failed; retrying", exc_info=True)


def _verify_new(conn: Connection, agg: HostLedger, actor: str, report: SyncReport,
                vkeys: Sequence[str]) -> None:
    trusted = [Verifier.parse(v) for v in vkeys]
    frontier = Frontier.from_json(json.loads(agg.frontier))
    notes = conn.execute(sa.select(ledger_checkpoints.c.size, ledger_checkpoints.c.note).where(
        ledger_checkpoints.c.host == agg.host, ledger_checkpoints.c.size > frontier.size)
        .order_by(ledger_checkpoints.c.size)).all()
    for size, note in notes:
        try:
            cp = Checkpoint.parse(open_note(note, trusted)[0])
            if (cp.origin, cp.size) != (origin_of(agg.host), size):
                raise ProofError("origin", "the checkpoint names another log or size")
            new = frontier.copy()
            entries = leaves(conn, agg.host, frontier.size, size)
            if [i for i, _, _ in entries] != list(range(frontier.size, size)):
                raise ProofError("entries", f"the log lacks entries in {frontier.size}..{size}")
            new.extend([leaf_hash(text.encode()) for _, _, text in entries])
            if new.root() != cp.root:
                raise ProofError("consistency", f"entries {frontier.size}..{size - 1} do not "
                                 f"extend the verified tree of {frontier.size} to the signed root")
        except ProofError as e:
            why = str(e)
            if e.check == "unknown key":
                why = (f"unknown key: no key enrolled for host {agg.host} signed this "
                       f"checkpoint (enrol the host's key: loraplane host enroll "
                        f"{agg.host} --key-file keys/ledger/{vkey_path(Path(), agg.host).name} "
                        "--root-key ROOT)")
            agg.refuse(size, e.check, why, actor)
            report.refused.append((agg.host, size, why))
            return
        agg.verify(size, b64(cp.root), note, json.dumps(new.to_json()), actor)
        report.verified.append((agg.host, size))
        frontier = new


# -- verify ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Finding:
    # modified | deleted | inserted | reordered | root | refused | unenrolled | unvouched
    kind: str
    host: str
    position: int | None
    detail: str


@dataclass
class LedgerReport:
    hosts: int = 0
    entries: int = 0
    verified: int = 0  # entries covered by verified checkpoints
    unlogged: int = 0
    archived: int = 0  # entries whose row a recorded archive took
    findings: list[Finding] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.findings

    def to_json(self) -> dict[str, Any]:
        return {"ok": self.ok, "hosts": self.hosts, "entries": self.entries,
                "verified": self.verified, "unlogged": self.unlogged,
                "archived": self.archived, "findings": [asdict(f) for f in self.findings]}


def _rows(conn: Connection, host: str, ids: Iterable[str]) -> dict[str, dict[str, Any]]:
    """The ledger rows of ``host`` and of every id in ``ids``, by request id."""
    t = request_ledger
    found = {r.request_id: dict(r._mapping) for r in conn.execute(
        sa.select(t).where(t.c.host == host))}
    wanted = sorted(set(ids) - set(found))
    for k in range(0, len(wanted), _CHUNK):
        found.update({r.request_id: dict(r._mapping) for r in conn.execute(
            sa.select(t).where(t.c.request_id.in_(wanted[k:k + _CHUNK])))})
    return found


def verify(app: Application[Any], engine: Engine, keys_dir: Path | None = None) -> LedgerReport:
    """Every host's log against its rows and its verified checkpoints, and its checkpoint
    keys against the root of trust (module notes)."""
    report = LedgerReport()
    engine = opened(engine)
    root = root_public_key(keys_dir_of(app, keys_dir))
    try:
        archives: LedgerArchive | None = app.repository.get(ledger_archive_id())
    except AggregateNotFoundError:
        archives = None
    with engine.connect() as conn:
        logged = set(hosts(conn))
        every = logged | set(conn.execute(sa.select(request_ledger.c.host).distinct()).scalars())
        for host in sorted(every):
            report.hosts += 1
            _verify_host(conn, app, host, report, archives)
            _check_keys(conn, host, load(app, host), root, report)
    return report


def _check_keys(conn: Connection, host: str, agg: HostLedger | None, root: Any,
                report: LedgerReport) -> None:
    """Keys a host presented that no root enrolled (their checkpoints are refused), and
    enrolments whose signature the configured root does not verify (forged in the store)."""
    trusted = set(trusted_keys_of(agg, root)) if agg is not None else set()
    for vkey in sorted(set(conn.execute(sa.select(ledger_host_keys.c.vkey).where(
            ledger_host_keys.c.host == host)).scalars()) - trusted):
        named = "+".join(vkey.split("+", 2)[:2])  # name and key id: enough to tell keys apart
        report.findings.append(Finding(
            "unenrolled", host, None, f"checkpoint key {named} is not enrolled: checkpoints it "
            f"signs are refused (if it is the host's key: loraplane host enroll {host} "
            "--key-file <its keys/ledger/*.vkey> --root-key ROOT)"))
    for vkey in sorted(set(agg.enrolled if agg is not None else ()) - trusted):
        report.findings.append(Finding(
            "unvouched", host, None, f"an enrolment of key {vkey[:60]} carries no signature "
            "of the configured root: forged, or made under a former root (enrol again)"))


def _verify_host(conn: Connection, app: Application[Any], host: str,
                 report: LedgerReport, archives: LedgerArchive | None = None) -> None:
    out = report.findings
    entries = leaves(conn, host)
    head = conn.execute(sa.select(ledger_log_heads.c.size).where(
        ledger_log_heads.c.host == host)).scalar() or 0
    rows = _rows(conn, host, (rid for _, rid, _ in entries))
    report.entries += len(entries)
    expected = 0
    seen: set[str] = set()
    finished: list[float] = []  # by position: when each entry's row finished (for insertions)
    for idx, rid, text in entries:
        out += [Finding("deleted", host, p, "no entry at this position")
                for p in range(expected, idx)]
        expected = idx + 1
        try:
            doc = parse_leaf(text)
        except ValueError:
            out.append(Finding("modified", host, idx, "the entry is not a ledger leaf"))
            continue
        if doc.get("index") != idx:
            out.append(Finding("reordered", host, idx,
                               f"holds the entry logged at position {doc.get('index')}"))
        logged_id = str(doc.get("request_id"))
        seen.add(logged_id)
        finished.append(float(doc.get("finished_at") or 0.0))
        row = rows.get(logged_id)
        if row is None and archives is not None and archives.archived_at(host, idx):
            report.archived += 1  # the archive file holds it: `audit archive-verify`
            continue
        if row is None:
            out.append(Finding("deleted", host, idx, f"request {logged_id}'s ledger row is gone"))
            continue
        changed = [c for c in row if doc.get(c) != row[c]]
        # The entry must also be, byte for byte, the leaf the writer makes of this row (the
        # one leaf function): an entry with a key added, or its text re-encoded, is modified.
        at = doc.get("index")
        if not changed and text != leaf(row, at if isinstance(at, int) else idx,
                                        doc.get("output_sha256")):
            changed = ["the entry's text"]
        if changed or logged_id != rid:
            out.append(Finding("modified", host, idx, f"request {logged_id}: "
                               f"{', '.join(changed) or 'request_id'} differ from the log"))
    out += [Finding("deleted", host, p, "no entry at this position")
            for p in range(expected, int(head))]
    for rid, row in rows.items():
        if rid in seen or row["host"] != host or row["outcome"] == Outcome.RUNNING.value:
            continue
        if row["reason"] in UNLOGGED_REASONS:
            report.unlogged += 1
            continue
        at = bisect.bisect_right(finished, float(row["finished_at"] or 0.0))
        out.append(Finding("inserted", host, at, f"request {rid} is in no log position "
                           f"(it would sit before position {at})"))
    _check_roots(host, [leaf_hash(t.encode()) for _, _, t in entries], load(app, host), report)


def _check_roots(host: str, hashes: Sequence[bytes], agg: HostLedger | None,
                 report: LedgerReport) -> None:
    if agg is None:
        return
    f = Frontier()
    start = 0
    for size, root_b64 in agg.verified:
        f.extend(hashes[f.size:size])
        if f.size != size or b64(f.root()) != root_b64:
            report.findings.append(Finding(
                "root", host, start, f"entries {start}..{size - 1} no longer give the root of "
                f"the checkpoint verified at size {size}"))
            break
        start = size
    report.verified += agg.verified_size
    report.findings += [Finding("refused", host, size, detail)
                        for size, _check, detail in agg.open_refusals]


# -- coverage and receipts -------------------------------------------------------------------

@dataclass
class Coverage:
    rows: int = 0
    covered: int = 0
    past_checkpoint: dict[str, int] = field(default_factory=dict)  # host -> rows
    unlogged: int = 0  # running, or never entered a log
    failed_hosts: dict[str, str] = field(default_factory=dict)  # host -> what failed
    # request id -> covered | past checkpoint | unlogged | log failed
    status: dict[str, str] = field(default_factory=dict)

    def gaps(self) -> list[str]:
        out = [f"{n} rows past host {h}'s last verified checkpoint"
               for h, n in sorted(self.past_checkpoint.items())]
        if self.unlogged:
            out.append(f"{self.unlogged} rows in no host log (running, or written outside "
                       "the engine's log)")
        out += [f"host {h}'s log failed verification: {d}"
                for h, d in sorted(self.failed_hosts.items())]
        return out


def positions(conn: Connection, request_ids: Sequence[str]) -> dict[str, tuple[str, int]]:
    """request id -> (host, position) of the logged ones."""
    found: dict[str, tuple[str, int]] = {}
    ids = sorted(set(request_ids))
    for k in range(0, len(ids), _CHUNK):
        for r in conn.execute(sa.select(ledger_log.c.request_id, ledger_log.c.host,
                                        ledger_log.c.idx).where(
                ledger_log.c.request_id.in_(ids[k:k + _CHUNK]))):
            found[r.request_id] = (r.host, int(r.idx))
    return found


def coverage(app: Application[Any], engine: Engine, request_ids: Sequence[str]) -> Coverage:
    """Which of ``request_ids`` verified checkpoints cover, and the gaps."""
    c = Coverage(rows=len(request_ids))
    with opened(engine).connect() as conn:
        at = positions(conn, request_ids)
    ledgers: dict[str, HostLedger | None] = {}
    for rid in request_ids:
        if rid not in at:
            c.unlogged += 1
            c.status[rid] = "unlogged"
            continue
        host, idx = at[rid]
        if host not in ledgers:
            ledgers[host] = agg = load(app, host)
            if agg is not None and agg.open_refusals:
                c.failed_hosts[host] = agg.open_refusals[-1][2]
        agg = ledgers[host]
        if host in c.failed_hosts:  # what the failure touched only `audit verify` tells
            c.status[rid] = "log failed"
        elif agg is not None and idx < agg.verified_size:
            c.covered += 1
            c.status[rid] = "covered"
        else:
            c.past_checkpoint[host] = c.past_checkpoint.get(host, 0) + 1
            c.status[rid] = "past checkpoint"
    return c


class NoReceipt(LookupError):
    """No receipt can be made for that request (yet); the message says why."""


def receipt(app: Application[Any], engine: Engine, request_id: str) -> str:
    """The c2sp.org/tlog-proof of ``request_id``'s entry against the first verified checkpoint
    that covers it; NoReceipt when there is none (yet) or the log no longer matches it."""
    with opened(engine).connect() as conn:
        found = positions(conn, [request_id]).get(request_id)
        if found is None:
            raise NoReceipt(f"request {request_id} is in no host log (unknown, still running, "
                            "or written outside the engine's log)")
        host, idx = found
        agg = load(app, host)
        cover = next(((s, r) for s, r in (agg.verified if agg else []) if s > idx), None)
        if agg is None or cover is None:
            raise NoReceipt(f"request {request_id} is not yet covered by a verified checkpoint "
                            "of its host: retry after the next checkpoint and `loraplane audit "
                            "ledger-sync`")
        size = cover[0]
        proof = prove(conn, host, idx, size, cover[1], agg.notes[size])  # as the gateway does
    if proof is None:
        raise NoReceipt(f"host {host}'s log no longer gives its verified checkpoint at size "
                        f"{size}: run `loraplane audit verify --ledger`")
    return proof
