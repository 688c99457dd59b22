"""Tamper evidence for the event history: a hash chain with signed periodic checkpoints.

Modelled on AWS CloudTrail's log file integrity validation: each stored event row (aggregate id,
version, topic and the stored bytes) has a SHA-256 ``event hash``, taken and chained to its
predecessor in the transaction that records the event (``control.app.chain``); a ``checkpoint``
seals the events recorded since the previous one by listing ``(position, event hash)`` for each
AS THE CHAIN RECORDED IT (never re-read from the events, which may have been edited since),
extending the same hash chain (its chain hash is the chain table's head), naming the previous
checkpoint's hash, and carrying an Ed25519 signature by the deployment's audit key
(``<keys>/audit/``, private key 0600; auditors may hold the public key elsewhere and pass it to
``audit verify``).

``verify`` re-reads the real stored rows and says, per position, what changed since sealing:
``modified`` (same position, other bytes), ``deleted`` (a sealed position is gone), ``inserted``
(a row at a position no checkpoint listed, inside the sealed range), ``reordered`` (a sealed
event now sits at another position); and, for the checkpoints themselves, a bad signature, a
broken link, a missing sequence number, or checkpoints removed after the last one this home
sealed (the ``anchor`` file); and, for the chain table, a link that does not follow from its
predecessor or a row that disagrees with a checkpoint (``chain``). Events after the last
checkpoint are reported as unsealed, and checked against the chain all the same: an edit made at
any time after the write is located, sealed or not.

Checkpoints are written every ``SEAL_EVERY`` events by the registry after a command, and on
demand by ``loraplane audit checkpoint``.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from eventsourcing.application import Application
from eventsourcing.persistence import Notification
from sqlalchemy.engine import Engine

from control.app.chain import GENESIS, event_hash, link
from control.contracts import root_of_trust
from control.contracts.config import Settings
from control.contracts.db import make_engine
from control.contracts.keys import load_or_create_ed25519, write_atomically
from control.contracts.schema import Component, declare, open_component
from control.contracts.tickets import key_id

SEAL_EVERY = 100
MAX_PER_CHECKPOINT = 5000
# The stored topic's tail of a recorded signing key (any module path: topics moved before).
_KEY_RECORDED = ":SigningKey.SigningKeyRecorded"

metadata = sa.MetaData()

audit_checkpoints = sa.Table(
    "audit_checkpoints", metadata,
    sa.Column("seq", sa.Integer, primary_key=True, autoincrement=False),
    sa.Column("first_position", sa.BigInteger, nullable=False),
    sa.Column("last_position", sa.BigInteger, nullable=False),
    sa.Column("entries", sa.Text, nullable=False),  # JSON [[position, event hash], ...]
    sa.Column("chain_hash", sa.String(64), nullable=False),
    sa.Column("prev_hash", sa.String(64), nullable=False),  # previous checkpoint's payload hash
    sa.Column("created_at", sa.Float, nullable=False),
    sa.Column("kid", sa.String(64), nullable=False),
    sa.Column("signature", sa.Text, nullable=False),  # base64 Ed25519 over the payload
)
# The audit checkpoints' schema component (control.contracts.schema): evidence, version 1.
AUDIT = declare(Component("audit", 1, metadata, lambda _insp: 1))


def _chain(start: str, entries: list[list[Any]]) -> str:
    c = start
    for position, eh in entries:
        c = link(c, int(position), str(eh))
    return c


def _payload(row: dict[str, Any]) -> bytes:
    """The signed bytes of a checkpoint (entries by their hash)."""
    doc = {
        "seq": int(row["seq"]),
        "first_position": int(row["first_position"]),
        "last_position": int(row["last_position"]),
        "entries_sha256": hashlib.sha256(row["entries"].encode()).hexdigest(),
        "chain_hash": row["chain_hash"],
        "prev_hash": row["prev_hash"],
        "created_at": repr(float(row["created_at"])),
        "kid": row["kid"],
    }
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()


def payload_hash(row: dict[str, Any]) -> str:
    return hashlib.sha256(_payload(row)).hexdigest()


class AuditKey:
    """The deployment's audit signing key (Ed25519), created on first use."""

    def __init__(self, private: Ed25519PrivateKey) -> None:
        self.private = private
        raw = private.public_key().public_bytes(serialization.Encoding.Raw,
                                                serialization.PublicFormat.Raw)
        self.kid = key_id(raw)

    @classmethod
    def load_or_create(cls, keys_dir: Path) -> AuditKey:
        d = keys_dir / "audit"
        d.mkdir(parents=True, exist_ok=True)
        os.chmod(d, 0o700)
        key, _created = load_or_create_ed25519(
            d / "private.pem",
            "audit key",
            before_publish=lambda k: write_atomically(
                d / "public.pem", k.public_key().public_bytes(
                    serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)),
        )
        return cls(key)


def load_public_key(path: Path) -> Ed25519PublicKey:
    """An Ed25519 public key from a PEM file (the audit key's ``public.pem``)."""
    key = serialization.load_pem_public_key(path.read_bytes())
    if not isinstance(key, Ed25519PublicKey):
        raise ValueError("the audit public key must be an Ed25519 PEM key")
    return key


@dataclass(frozen=True)
class Problem:
    """One finding of ``verify``: ``kind`` is modified, deleted, inserted, reordered or
    checkpoint; ``position`` the event position (or checkpoint seq for checkpoint problems)."""

    kind: str
    position: int
    detail: str


@dataclass
class Report:
    ok: bool = True
    events: int = 0
    sealed_events: int = 0
    unsealed_events: int = 0
    checkpoints: int = 0
    chained_events: int = 0
    problems: list[Problem] = field(default_factory=list)

    def add(self, kind: str, position: int, detail: str) -> None:
        self.ok = False
        self.problems.append(Problem(kind, position, detail))

    def to_json(self) -> dict[str, Any]:
        return {"ok": self.ok, "events": self.events, "sealed_events": self.sealed_events,
                "unsealed_events": self.unsealed_events, "checkpoints": self.checkpoints,
                "chained_events": self.chained_events,
                "problems": [p.__dict__ for p in self.problems]}


@dataclass
class _Store:
    """One consistent read of the store: each event's current hash, and the chain rows."""

    actual: dict[int, str]
    chain: list[tuple[int, str, str]]  # (position, event hash, link), by position
    key_records: list[Notification] = field(default_factory=list)  # SigningKeyRecorded rows


class AuditSeal:
    """Writes and checks checkpoints for one registry's event history."""

    def __init__(self, app: Application[Any], engine: Engine, settings: Settings) -> None:
        self.app = app
        self.engine = engine
        self.settings = settings
        self._sealed_upto: int | None = None  # last sealed position seen here (only grows)
        chain = getattr(app.recorder, "chain", None)
        if not isinstance(chain, sa.Table):
            raise TypeError("audit seals need the chained event store (control.app.chain)")
        self.chain = chain
        open_component(engine, AUDIT)  # created at, or refused unless at, the current version

    @classmethod
    def for_registry(cls, registry: Any) -> AuditSeal:
        settings: Settings = registry.settings
        return cls(registry, make_engine(settings.db_url), settings)

    @property
    def anchor_path(self) -> Path:
        return self.settings.home / "audit" / "anchor.json"

    def _checkpoints(self) -> list[dict[str, Any]]:
        with self.engine.connect() as conn:
            return [dict(r._mapping) for r in conn.execute(
                sa.select(audit_checkpoints).order_by(audit_checkpoints.c.seq))]

    def _last(self) -> dict[str, Any] | None:
        with self.engine.connect() as conn:
            r = conn.execute(sa.select(audit_checkpoints)
                             .order_by(audit_checkpoints.c.seq.desc()).limit(1)).first()
        return dict(r._mapping) if r is not None else None

    def pending(self) -> int:
        """How many recorded positions lie after the last checkpoint (an upper bound)."""
        last = self._last()
        top = int(self.app.recorder.max_notification_id() or 0)
        self._sealed_upto = int(last["last_position"]) if last else 0
        return top - self._sealed_upto

    def seal_if_due(self, every: int = SEAL_EVERY, *, upto: int | None = None
                    ) -> dict[str, Any] | None:
        """Seal when at least ``every`` events are unsealed.

        ``upto``: the newest position the caller knows of (its own last event). The last sealed
        position seen by this object only grows, so while ``upto`` is within ``every`` of it no
        query is needed: after each command the check costs nothing until a seal may be due.
        """
        if upto is not None and self._sealed_upto is not None \
                and upto - self._sealed_upto < every:
            return None
        return self.seal() if self.pending() >= every else None

    def seal(self) -> dict[str, Any] | None:
        """Write one checkpoint over the events since the last one; None if there are none
        (or another process sealed the same span first)."""
        last = self._last()
        after = int(last["last_position"]) if last else 0
        c = self.chain.c
        with self.engine.connect() as conn:
            # The hashes recorded with each event, not the events as they read now.
            entries = [[int(p), str(eh)] for p, eh in conn.execute(
                sa.select(c.position, c.event_hash).where(c.position > after)
                .order_by(c.position).limit(MAX_PER_CHECKPOINT))]
        if not entries:
            return None
        key = AuditKey.load_or_create(self.settings.keys_dir)
        row: dict[str, Any] = {
            "seq": (int(last["seq"]) + 1) if last else 1,
            "first_position": entries[0][0],
            "last_position": entries[-1][0],
            "entries": json.dumps(entries, separators=(",", ":")),
            "chain_hash": _chain(last["chain_hash"] if last else GENESIS, entries),
            "prev_hash": payload_hash(last) if last else GENESIS,
            "created_at": time.time(),
            "kid": key.kid,
        }
        row["signature"] = base64.b64encode(key.private.sign(_payload(row))).decode()
        try:
            with self.engine.begin() as conn:
                conn.execute(audit_checkpoints.insert().values(**row))
        except sa.exc.IntegrityError:
            return None  # a concurrent sealer wrote this seq first
        self._sealed_upto = int(row["last_position"])
        self._write_anchor(row)
        return row

    def _write_anchor(self, row: dict[str, Any]) -> None:
        self.anchor_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.anchor_path.with_suffix(f".{secrets.token_hex(4)}")
        tmp.write_text(json.dumps({"seq": row["seq"], "payload_hash": payload_hash(row)}))
        os.replace(tmp, self.anchor_path)

    def verify(self, public_key: Ed25519PublicKey | None = None) -> Report:
        """Check every checkpoint and the chain, then every stored event against them."""
        if public_key is None:
            pub_path = self.settings.keys_dir / "audit" / "public.pem"
            public_key = load_public_key(pub_path) if pub_path.exists() else None
        report = Report()
        checkpoints = self._checkpoints()
        report.checkpoints = len(checkpoints)
        sealed = self._check_checkpoints(checkpoints, public_key, report)
        self._check_anchor(checkpoints, report)
        store = self._read_store()
        reference = self._check_chain(store.chain, sealed, report)
        last_sealed = max((int(r["last_position"]) for r in checkpoints), default=0)
        report.events = len(store.actual)
        report.unsealed_events = sum(1 for p in store.actual if p > last_sealed)
        report.sealed_events = len(sealed)
        report.chained_events = len(store.chain)
        _locate(reference, store.actual, report)
        self._check_keys(store.key_records, report)
        return report

    def _check_checkpoints(self, checkpoints: list[dict[str, Any]],
                           public_key: Ed25519PublicKey | None, report: Report
                           ) -> dict[int, str]:
        """Report what is wrong with the checkpoints; return the hashes sealed by those whose
        signature and entries hold (a forged or altered checkpoint vouches for nothing)."""
        sealed: dict[int, str] = {}
        prev_hash, chain = GENESIS, GENESIS
        for expected_seq, row in enumerate(checkpoints, start=1):
            seq = int(row["seq"])
            trusted = public_key is not None
            if seq != expected_seq:
                report.add("checkpoint", expected_seq, f"checkpoint #{expected_seq} is missing")
            if public_key is None:
                report.add("checkpoint", seq, "no audit public key to check signatures with")
            else:
                try:
                    public_key.verify(base64.b64decode(row["signature"]), _payload(row))
                except (InvalidSignature, ValueError):
                    trusted = False
                    report.add("checkpoint", seq,
                               f"checkpoint #{seq} signature does not verify (altered or forged)")
            if row["prev_hash"] != prev_hash:
                report.add("checkpoint", seq, f"checkpoint #{seq} does not follow the previous "
                                              "checkpoint (one was removed or replaced)")
            try:
                entries = json.loads(row["entries"])
            except ValueError:
                entries = []
            if _chain(chain, entries) != row["chain_hash"]:
                trusted = False
                report.add("checkpoint", seq, f"checkpoint #{seq} entries do not match its chain "
                                              "hash")
            if trusted:
                for position, eh in entries:
                    sealed[int(position)] = str(eh)
            prev_hash, chain = payload_hash(row), row["chain_hash"]
        return sealed

    def _read_store(self) -> _Store:
        """Every event's current hash and every chain row, in one snapshot: an event recorded
        meanwhile is in both or in neither (it and its chain row commit together)."""
        events = getattr(self.app.recorder, "events_record_cls").__table__  # noqa: B009
        with self.engine.connect() as conn:
            if self.engine.dialect.name == "sqlite":
                conn.exec_driver_sql("BEGIN")  # the driver opens none for reads by itself
            else:
                conn = conn.execution_options(isolation_level="REPEATABLE READ")
            try:
                chain = [(int(p), str(eh), str(ch)) for p, eh, ch in conn.execute(
                    sa.select(self.chain.c.position, self.chain.c.event_hash,
                              self.chain.c.chain_hash).order_by(self.chain.c.position))]
                actual: dict[int, str] = {}
                keys: list[Notification] = []
                for r in conn.execute(sa.select(events.c.id, events.c.originator_id,
                                                events.c.originator_version, events.c.topic,
                                                events.c.state).order_by(events.c.id)):
                    actual[int(r.id)] = event_hash(r)
                    if str(r.topic).endswith(_KEY_RECORDED):
                        keys.append(Notification(id=int(r.id), originator_id=r.originator_id,
                                                 originator_version=int(r.originator_version),
                                                 topic=str(r.topic), state=bytes(r.state)))
            finally:
                conn.rollback()
        return _Store(actual, chain, keys)

    def _check_keys(self, records: list[Notification], report: Report) -> None:
        """Name every recorded signing key the root does not vouch for: hosts and gateways
        ignore it (``control.contracts.root_of_trust``), and it is evidence of a forged write
        unless it was recorded before the root existed."""
        if not records:
            return
        try:
            root = root_of_trust.root_public_key(self.settings.keys_dir)
        except root_of_trust.RootError as err:
            report.add("key", 0, f"the root public key is unreadable: {err}")
            return
        for n in records:
            try:
                e = self.app.mapper.to_domain_event(n)
            except ValueError:
                continue  # undecodable: reported as modified or inserted above
            kid, pub = getattr(e, "kid", ""), getattr(e, "public_key_b64", "")
            if root_of_trust.vouches(root, getattr(e, "root_signature", ""),
                                     root_of_trust.RECORD, kid, pub):
                continue
            why = "no root public key is configured" if root is None else \
                "the root key did not sign it (forged, or recorded before the root existed)"
            report.add("key", n.id, f"signing key {kid} recorded at #{n.id} is not vouched "
                                    f"for: {why}; hosts and gateways ignore it")

    @staticmethod
    def _check_chain(chain: list[tuple[int, str, str]], sealed: dict[int, str],
                     report: Report) -> dict[int, str]:
        """Report chain rows that were rewritten; return the hash each position was recorded
        with (a signed checkpoint's where one sealed it, else the chain's)."""
        reference: dict[int, str] = {}
        prev = GENESIS
        for position, eh, ch in chain:
            if link(prev, position, eh) != ch:
                report.add("chain", position, f"the chain link of event #{position} does not "
                                              "follow from the one before it (the chain table "
                                              "was rewritten)")
            prev = ch
            reference[position] = eh
        for position, eh in sorted(sealed.items()):
            if reference.get(position, eh) != eh:
                report.add("chain", position, f"the chain row of event #{position} differs from "
                                              "the hash a signed checkpoint sealed (the chain "
                                              "table was rewritten)")
            reference[position] = eh  # the signed hash wins
        return reference

    def _check_anchor(self, checkpoints: list[dict[str, Any]], report: Report) -> None:
        if not self.anchor_path.exists():
            return
        try:
            anchor = json.loads(self.anchor_path.read_text())
            seq, want = int(anchor["seq"]), str(anchor["payload_hash"])
        except (ValueError, KeyError, TypeError):
            report.add("checkpoint", 0, "the local checkpoint anchor is unreadable")
            return
        by_seq = {int(r["seq"]): r for r in checkpoints}
        if seq not in by_seq:
            report.add("checkpoint", seq, f"checkpoint #{seq}, sealed by this deployment, is "
                                          "missing (checkpoints were deleted)")
        elif payload_hash(by_seq[seq]) != want:
            report.add("checkpoint", seq, f"checkpoint #{seq} differs from the one this "
                                          "deployment sealed")


def _locate(reference: dict[int, str], actual: dict[int, str], report: Report) -> None:
    """Name each position whose stored event is not the one recorded there."""
    where = {h: p for p, h in reference.items()}
    present = set(actual.values())
    for position in sorted(set(reference) | set(actual)):
        r, a = reference.get(position), actual.get(position)
        if r == a:
            continue
        if a is not None and a in where and where[a] != position:
            report.add("reordered", position, f"event #{position} holds the event recorded "
                                              f"at #{where[a]}")
        elif r is not None and a is not None:
            report.add("modified", position, f"event #{position} was modified after it was "
                                              "recorded")
        elif r is not None:
            if r not in present:
                report.add("deleted", position, f"event #{position} was deleted")
            # else: it moved; reported where it now sits
        else:
            report.add("inserted", position, f"event #{position} was inserted: neither the "
                                              "chain nor a checkpoint lists it")
