"""Tamper evidence for the event history: a hash chain with signed periodic checkpoints.

Modelled on AWS CloudTrail's log file integrity validation: each stored event row (aggregate id,
version, topic and the stored bytes) has a SHA-256 ``event hash``; a ``checkpoint`` seals the
events recorded since the previous one by listing ``(position, event hash)`` for each, extending
one hash chain over the whole history, naming the previous checkpoint's hash, and carrying an
Ed25519 signature by the deployment's audit key (``<keys>/audit/``, private key 0600; auditors
may hold the public key elsewhere and pass it to ``audit verify``).

``verify`` re-reads the real stored rows and says, per position, what changed since sealing:
``modified`` (same position, other bytes), ``deleted`` (a sealed position is gone), ``inserted``
(a row at a position no checkpoint listed, inside the sealed range), ``reordered`` (a sealed
event now sits at another position); and, for the checkpoints themselves, a bad signature, a
broken link, a missing sequence number, or checkpoints removed after the last one this home
sealed (the ``anchor`` file). Events after the last checkpoint are reported as unsealed.

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

from control.contracts.config import Settings
from control.contracts.db import make_engine
from control.contracts.event_log import notifications
from control.contracts.keys import load_or_create_ed25519
from control.contracts.schema import Component, declare, open_component
from control.contracts.tickets import key_id

SEAL_EVERY = 100
MAX_PER_CHECKPOINT = 5000
GENESIS = "0" * 64
_PAGE = 1000

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


def event_hash(n: Notification) -> str:
    """SHA-256 of one stored event row: what it is about and the exact stored bytes."""
    h = hashlib.sha256()
    h.update(f"{n.originator_id}\n{n.originator_version}\n{n.topic}\n".encode())
    h.update(bytes(n.state))
    return h.hexdigest()


def _chain(start: str, entries: list[list[Any]]) -> str:
    c = start
    for position, eh in entries:
        c = hashlib.sha256(f"{c}{int(position)}:{eh}".encode()).hexdigest()
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
            before_publish=lambda k: (d / "public.pem").write_bytes(k.public_key().public_bytes(
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
    problems: list[Problem] = field(default_factory=list)

    def add(self, kind: str, position: int, detail: str) -> None:
        self.ok = False
        self.problems.append(Problem(kind, position, detail))

    def to_json(self) -> dict[str, Any]:
        return {"ok": self.ok, "events": self.events, "sealed_events": self.sealed_events,
                "unsealed_events": self.unsealed_events, "checkpoints": self.checkpoints,
                "problems": [p.__dict__ for p in self.problems]}


def _notifications(app: Application[Any], after: int | None, upto: int | None = None
                   ) -> list[Notification]:
    """Rows after position ``after`` (None: every row, even at a forged position <= 0)."""
    return list(notifications(app.recorder, after=after, stop=upto, page_size=_PAGE))


class AuditSeal:
    """Writes and checks checkpoints for one registry's event history."""

    def __init__(self, app: Application[Any], engine: Engine, settings: Settings) -> None:
        self.app = app
        self.engine = engine
        self.settings = settings
        self._sealed_upto: int | None = None  # last sealed position seen here (only grows)
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
        notes = _notifications(self.app, after)[:MAX_PER_CHECKPOINT]
        if not notes:
            return None
        entries = [[n.id, event_hash(n)] for n in notes]
        key = AuditKey.load_or_create(self.settings.keys_dir)
        row: dict[str, Any] = {
            "seq": (int(last["seq"]) + 1) if last else 1,
            "first_position": notes[0].id,
            "last_position": notes[-1].id,
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
        """Check every checkpoint, then every stored event against them."""
        if public_key is None:
            pub_path = self.settings.keys_dir / "audit" / "public.pem"
            public_key = load_public_key(pub_path) if pub_path.exists() else None
        report = Report()
        checkpoints = self._checkpoints()
        report.checkpoints = len(checkpoints)
        sealed: dict[int, str] = {}
        prev_hash, chain = GENESIS, GENESIS
        for expected_seq, row in enumerate(checkpoints, start=1):
            seq = int(row["seq"])
            if seq != expected_seq:
                report.add("checkpoint", expected_seq, f"checkpoint #{expected_seq} is missing")
            if public_key is None:
                report.add("checkpoint", seq, "no audit public key to check signatures with")
            else:
                try:
                    public_key.verify(base64.b64decode(row["signature"]), _payload(row))
                except (InvalidSignature, ValueError):
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
                report.add("checkpoint", seq, f"checkpoint #{seq} entries do not match its chain "
                                              "hash")
            for position, eh in entries:
                sealed[int(position)] = str(eh)
            prev_hash, chain = payload_hash(row), row["chain_hash"]
        self._check_anchor(checkpoints, report)
        last_sealed = max((int(r["last_position"]) for r in checkpoints), default=0)
        actual_all = {n.id: event_hash(n) for n in _notifications(self.app, None)}
        report.events = len(actual_all)
        actual = {p: h for p, h in actual_all.items() if p <= last_sealed}
        report.unsealed_events = len(actual_all) - len(actual)
        report.sealed_events = len(sealed)
        where_sealed = {h: p for p, h in sealed.items()}
        for position in sorted(set(sealed) | set(actual)):
            s, a = sealed.get(position), actual.get(position)
            if s == a:
                continue
            if a is not None and a in where_sealed and where_sealed[a] != position:
                report.add("reordered", position, f"event #{position} holds the event sealed "
                                                  f"at #{where_sealed[a]}")
            elif s is not None and a is not None:
                report.add("modified", position, f"event #{position} was modified after it was "
                                                  "sealed")
            elif s is not None:
                if s not in actual.values():
                    report.add("deleted", position, f"event #{position} was deleted")
                # else: it moved; reported where it now sits
            else:
                report.add("inserted", position, f"event #{position} was inserted: no "
                                                  "checkpoint lists it")
        return report

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
