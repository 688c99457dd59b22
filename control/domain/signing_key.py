"""The ``SigningKey`` aggregate: a ticket-signing public key, by key id.

A rotation is a new key; a key id is never reused. Once retired, no gateway signs with the key
and no host trusts tickets it signed.

Each record and retirement carries ``root_signature``: the offline root key's signature over what
is done to which key (``control.contracts.root_of_trust``). Hosts and gateways trust a recorded
key only if it verifies against the root public key of their configuration; events stored before
the root existed read back with an empty one (trusted by nobody until vouched for again).
"""

from __future__ import annotations

from typing import Any
from uuid import UUID

from eventsourcing.domain import Aggregate, event

from control.domain.errors import IllegalTransition
from control.domain.ids import signing_key_id
from control.domain.names import check_actor


class SigningKey(Aggregate):
    class SigningKeyRecorded(Aggregate.Created):
        class_version = 2  # 2: root_signature
        kid: str
        public_key_b64: str
        actor: str
        root_signature: str

        @staticmethod
        def upcast_v1_v2(state: dict[str, Any]) -> None:
            state["root_signature"] = ""

    class SigningKeyRetired(Aggregate.Event):
        """No gateway signs with this key any more, and no host accepts tickets it signed."""

        class_version = 2  # 2: root_signature
        kid: str
        reason: str
        actor: str
        root_signature: str

        @staticmethod
        def upcast_v1_v2(state: dict[str, Any]) -> None:
            state["root_signature"] = ""

    @staticmethod
    def create_id(kid: str) -> UUID:
        return signing_key_id(kid)

    @event(SigningKeyRecorded)
    def __init__(self, kid: str, public_key_b64: str, actor: str,
                 root_signature: str = "") -> None:
        self.kid = kid
        self.public_key_b64 = public_key_b64
        self.root_signature = root_signature
        self.retired = False

    def retire(self, reason: str, actor: str, root_signature: str = "") -> None:
        """Retire the key for good (a key id is never reused); retiring twice is refused."""
        if self.retired:
            raise IllegalTransition(f"signing key {self.kid!r} is already retired")
        self._retired(kid=self.kid, reason=reason.strip(), actor=check_actor(actor),
                      root_signature=root_signature)

    @event(SigningKeyRetired)
    def _retired(self, kid: str, reason: str, actor: str, root_signature: str) -> None:
        self.retired = True
