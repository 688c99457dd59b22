"""Ticket seal keys: how Triton hosts learn the keys that open a ticket's sealed arm.

A ticket names the adapter and the release it routes to, and whether the client may be told the
adapter that served it. Those three are the *arm*: a tenant granted another tenant's alias must not
learn which release of the owner's rollout it landed on (it could re-draw sessions until it lands
where it wants, and it would learn the owner's rollout and adapter digests). So the arm travels
sealed, AES-256-GCM inside the signed ticket (``control.contracts.tickets``), under a key derived
from the signing key (HKDF-SHA256): each gateway key has its own seal key, rotated and retired with
it, and a gateway needs nothing beyond the signing key it already holds.

A host must open the seal, so every gateway publishes the seal key of each signing key it signs
with into ``ticket_seals``, a table the gateway and host database roles may read, never the event
store (auditors read events; the seal key is a secret). Each row carries a proof: the Ed25519
signature, by the signing key itself, of the seal key under its key id. A host keeps only rows
whose proof verifies under a public key it already trusts (its ``keys/public``, which the key sync
fills with root-vouched keys only), so a role that can insert rows cannot make a host accept a seal
key of its choosing; at worst a bogus row is ignored.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import time
from collections.abc import Mapping
from typing import Protocol

import sqlalchemy as sa
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from sqlalchemy.engine import Engine

from control.contracts.schema import Component, declare, open_component

SEAL_PROOF_CONTEXT = b"loraplane-ticket-seal-v1\x00"

metadata = sa.MetaData()

ticket_seals = sa.Table(
    "ticket_seals", metadata,
    # (kid, seal) and not kid alone: a bogus row inserted first must not block the real one
    sa.Column("kid", sa.String(16), primary_key=True),
    sa.Column("seal", sa.String(44), primary_key=True),  # base64 of the 32-byte key
    sa.Column("proof", sa.String(88), nullable=False),  # base64 Ed25519 signature
    sa.Column("published_at", sa.Float, nullable=False),
)
TICKET_SEALS = declare(Component("ticket_seals", 1, metadata, lambda _insp: 1))


def proof_message(kid: str, seal: bytes) -> bytes:
    """What a signing key signs to vouch for its seal key."""
    return SEAL_PROOF_CONTEXT + kid.encode("ascii") + b"\x00" + seal


def publish(engine: Engine, kid: str, seal: bytes, proof: bytes) -> None:
    """Record ``kid``'s seal key (idempotent: a row already there is kept)."""
    open_component(engine, TICKET_SEALS)
    row = {"kid": kid, "seal": base64.b64encode(seal).decode("ascii"),
           "proof": base64.b64encode(proof).decode("ascii"), "published_at": time.time()}
    with engine.begin() as conn:
        exists = conn.execute(sa.select(ticket_seals.c.kid).where(
            ticket_seals.c.kid == kid, ticket_seals.c.seal == row["seal"])).first()
        if exists is None:
            with contextlib.suppress(sa.exc.IntegrityError):  # a racing gateway published it
                conn.execute(ticket_seals.insert().values(**row))


class SealSource(Protocol):
    """What publishes a seal: a ``control.contracts.tickets.TicketSigner``."""

    kid: str
    seal_key: bytes

    def seal_proof(self) -> bytes: ...


def publish_seal(engine: Engine, signer: SealSource) -> None:
    """Publish the seal key of ``signer``'s signing key, so hosts can open its tickets."""
    publish(engine, signer.kid, signer.seal_key, signer.seal_proof())


def load(engine: Engine, public_keys: Mapping[str, bytes]) -> dict[str, bytes]:
    """kid -> seal key, for the keys in ``public_keys`` (kid -> raw Ed25519 public key) whose
    recorded seal carries a valid proof by that key; every other row is ignored."""
    open_component(engine, TICKET_SEALS)
    wanted = sorted(public_keys)
    if not wanted:
        return {}
    with engine.connect() as conn:
        rows = conn.execute(sa.select(ticket_seals.c.kid, ticket_seals.c.seal,
                                      ticket_seals.c.proof)
                            .where(ticket_seals.c.kid.in_(wanted))).all()
    seals: dict[str, bytes] = {}
    for r in rows:
        try:
            seal = base64.b64decode(r.seal, validate=True)
            proof = base64.b64decode(r.proof, validate=True)
            Ed25519PublicKey.from_public_bytes(public_keys[r.kid]).verify(
                proof, proof_message(r.kid, seal))
        except (binascii.Error, ValueError, InvalidSignature):
            continue
        if len(seal) == 32:
            seals[str(r.kid)] = seal
    return seals
