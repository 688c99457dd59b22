"""The ``HostLedger`` aggregate: what the control plane has verified of one host's ledger log.

A host publishes its checkpoint key and signs checkpoints of its Merkle log
(``control.contracts.ledger_log``); none of that is trusted until the control plane records it
here. Recording a presented key is its own event (``KeyRecorded``); a key counts only once the
root of trust enrolled it (``KeyEnrolled``, carrying the root's signature, which readers check
against the root public key from their configuration: ``control.contracts.host_keys``). Each
checkpoint the control plane verified (signed by an enrolled key, its tree extending the
previous verified one) is a ``CheckpointVerified`` event
carrying the tree's frontier, so the next check hashes only the entries appended since; a
checkpoint that failed is a ``CheckpointRefused`` event naming the check. Being events, they are
covered by the event store's own chain and seals.
"""

from __future__ import annotations

from uuid import UUID, uuid5

from eventsourcing.domain import Aggregate, event

from control.domain.ids import NAMESPACE
from control.domain.names import check_actor


def host_ledger_id(host: str) -> UUID:
    """The id of ``host``'s ledger log record."""
    return uuid5(NAMESPACE, f"host-ledger:{host}")


class HostLedger(Aggregate):
    class Opened(Aggregate.Created):
        host: str
        actor: str

    class KeyRecorded(Aggregate.Event):
        vkey: str  # signed-note verifier key: <name>+<hex key id>+<base64 key>
        actor: str

    class KeyEnrolled(Aggregate.Event):
        vkey: str
        root_signature: str  # base64: the root's signature of host_keys.statement(host, vkey)
        actor: str

    class CheckpointVerified(Aggregate.Event):
        size: int
        root_b64: str
        note: str  # the signed checkpoint as the host stored it
        frontier: str  # JSON (tlog.Frontier.to_json) of the tree at ``size``
        actor: str

    class CheckpointRefused(Aggregate.Event):
        size: int
        check: str  # which check failed: signature, unknown key, consistency, entries
        detail: str
        actor: str

    @staticmethod
    def create_id(host: str) -> UUID:
        return host_ledger_id(host)

    @event(Opened)
    def __init__(self, host: str, actor: str) -> None:
        self.host = host
        self.vkeys: list[str] = []
        self.verified: list[tuple[int, str]] = []  # (size, root_b64), in order
        self.notes: dict[int, str] = {}  # size -> the verified signed checkpoint
        self.frontier = '{"size": 0, "nodes": []}'
        self.refused: list[tuple[int, str, str]] = []  # (size, check, detail)
        self.enrolled: dict[str, str] = {}  # vkey -> the root's enrolment signature

    @property
    def verified_size(self) -> int:
        return self.verified[-1][0] if self.verified else 0

    def record_key(self, vkey: str, actor: str) -> None:
        if vkey not in self.vkeys:
            self._key(vkey=vkey, actor=check_actor(actor))

    @event(KeyRecorded)
    def _key(self, vkey: str, actor: str) -> None:
        self.vkeys.append(vkey)

    def enroll(self, vkey: str, root_signature: str, actor: str) -> None:
        """Record the root's enrolment of ``vkey``; whether the signature is the configured
        root's is checked by every reader (the event store is not trusted for that)."""
        if self.enrolled.get(vkey) != root_signature:
            self._enrolled(vkey=vkey, root_signature=root_signature, actor=check_actor(actor))

    @event(KeyEnrolled)
    def _enrolled(self, vkey: str, root_signature: str, actor: str) -> None:
        self.enrolled[vkey] = root_signature

    @property
    def open_refusals(self) -> list[tuple[int, str, str]]:
        """Refusals not since resolved: a checkpoint refused for an unknown key counts as
        resolved once a later check verified the log past it (its key was enrolled since)."""
        return [r for r in self.refused
                if not (r[1] == "unknown key" and r[0] <= self.verified_size)]

    def verify(self, size: int, root_b64: str, note: str, frontier: str, actor: str) -> None:
        self._verified(size=size, root_b64=root_b64, note=note, frontier=frontier,
                       actor=check_actor(actor))

    @event(CheckpointVerified)
    def _verified(self, size: int, root_b64: str, note: str, frontier: str,
                  actor: str) -> None:
        self.verified.append((size, root_b64))
        self.notes[size] = note
        self.frontier = frontier

    def refuse(self, size: int, check: str, detail: str, actor: str) -> None:
        if (size, check, detail) not in self.refused:
            self._refused(size=size, check=check, detail=detail, actor=check_actor(actor))

    @event(CheckpointRefused)
    def _refused(self, size: int, check: str, detail: str, actor: str) -> None:
        self.refused.append((size, check, detail))
