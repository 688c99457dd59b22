"""The ``SigningKey`` aggregate: a ticket-signing public key, by key id.

A rotation is a new key; a key id is never reused. Once retired, no gateway signs with the key
and no host trusts tickets it signed.
"""

from __future__ import annotations

from uuid import UUID

from eventsourcing.domain import Aggregate, event

from control.domain.errors import IllegalTransition
from control.domain.ids import signing_key_id
from control.domain.names import check_actor


class SigningKey(Aggregate):
    class SigningKeyRecorded(Aggregate.Created):
        kid: str
        public_key_b64: str
        actor: str

    class SigningKeyRetired(Aggregate.Event):
        """No gateway signs with this key any more, and no host accepts tickets it signed."""

        kid: str
        reason: str
        actor: str

    @staticmethod
    def create_id(kid: str) -> UUID:
        return signing_key_id(kid)

    @event(SigningKeyRecorded)
    def __init__(self, kid: str, public_key_b64: str, actor: str) -> None:
        self.kid = kid
        self.public_key_b64 = public_key_b64
        self.retired = False

    def retire(self, reason: str, actor: str) -> None:
        """Retire the key for good (a key id is never reused); retiring twice is refused."""
        if self.retired:
            raise IllegalTransition(f"signing key {self.kid!r} is already retired")
        self._retired(kid=self.kid, reason=reason.strip(), actor=check_actor(actor))

    @event(SigningKeyRetired)
    def _retired(self, kid: str, reason: str, actor: str) -> None:
        self.retired = True
