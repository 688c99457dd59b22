"""The signing-keys desk: the ticket-signing keys' public halves as events (``SigningKey``).

Gateways sign routing tickets with this home's active key (``control.app.key_ring`` keeps the
private halves on disk); Triton hosts trust every recorded, unretired public key they read from
the projection tables. So a rotation makes its new key active only once the public half is
recorded AND visible to hosts, and a retirement returns only once hosts see it; otherwise
:class:`~control.app.unit_of_work.NotYetVisible`.

Trust comes from the offline root key (``control.contracts.root_of_trust``), not from the event
store: each record and retirement carries the root's signature over what is done to which key,
made here with the root key file the operator passes (``root_key``; a demo or test home's
development root when none is configured), or handed in already made (``root_signature``, from
an air-gapped signer). A signature the configured root does not verify is refused before
anything is recorded; readers check it again on every load.

Every command goes through the registry's unit of work (``Registry.load``/``exists``/
``commit``/``confirm_visible``), as every desk does.
"""

from __future__ import annotations

import base64
import binascii
from pathlib import Path
from typing import TYPE_CHECKING

from control.app import key_ring
from control.app.unit_of_work import VISIBLE_WITHIN_S, NotYetVisible, UnitOfWork
from control.contracts import root_of_trust
from control.contracts.db import make_engine
from control.contracts.ticket_seals import publish_seal
from control.domain import (
    AlreadyExists,
    DomainError,
    IllegalTransition,
    SigningKey,
    check_actor,
    check_name,
    signing_key_id,
)

if TYPE_CHECKING:
    from control.contracts.tickets import TicketSigner


class SigningKeyDesk:
    """Records, rotates and retires ticket-signing keys on ``registry``."""

    def __init__(self, registry: UnitOfWork) -> None:
        self.registry = registry

    def record_signing_key(self, kid: str, public_key_b64: str, *, actor: str,
                           root_signature: str | None = None,
                           root_key: Path | None = None) -> int:
        """Record a ticket-signing public key (raw Ed25519, base64); a rotation adds a key.
        Returns the event's position in the notification log. ``root_signature``: the root's
        signature over the record, else one is made with ``root_key`` (see the module notes);
        RootError when the configured root does not vouch for it."""
        check_name("key id", kid)
        check_actor(actor)
        try:
            raw = base64.b64decode(public_key_b64, validate=True)
        except (binascii.Error, ValueError):
            raise DomainError("public key must be base64") from None
        if len(raw) != 32:
            raise DomainError("public key must be a raw 32-byte Ed25519 key")
        if self.registry.exists(signing_key_id(kid)):
            raise AlreadyExists(f"signing key {kid!r} is already recorded")
        signature = self._vouched(root_of_trust.RECORD, kid, public_key_b64, root_signature,
                                  root_key)
        return self.registry.commit(SigningKey(kid=kid, public_key_b64=public_key_b64,
                                               actor=actor, root_signature=signature),
                                    what="signing key")

    def _vouched(self, action: str, kid: str, public_key_b64: str, signature: str | None,
                 root_key: Path | None) -> str:
        """The root's signature over ``action`` on the key, made or checked (RootError)."""
        keys_dir = self.registry.settings.keys_dir
        if signature is None:
            root = root_of_trust.signing_root(keys_dir, root_key)
            signature = root_of_trust.sign(root, action, kid, public_key_b64)
        if not root_of_trust.vouches(root_of_trust.root_public_key(keys_dir), signature, action,
                                     kid, public_key_b64):
            raise root_of_trust.RootError(
                f"the root signature does not vouch for {action} of signing key {kid!r}: it "
                f"must verify against the configured root ({root_of_trust.ROOT_ENV} or "
                f"{root_of_trust.root_pub_path(keys_dir)})")
        return signature

    def rotate_signing_key(self, *, actor: str, wait_s: float = VISIBLE_WITHIN_S,
                           root_key: Path | None = None) -> tuple[str, str | None]:
        """Make a new ticket-signing key this home's active one; returns (new kid, previous
        kid). Retire the previous one afterwards.

        The key becomes active only once its public half is recorded and visible in the
        tables hosts copy their trusted keys from; else NotYetVisible, and the active key
        stays as it was (the recorded key is never used: retire it).
        """
        check_actor(actor)
        reg = self.registry
        root = root_of_trust.signing_root(reg.settings.keys_dir, root_key)  # before any file

        def record(signer: TicketSigner) -> None:
            signature = root_of_trust.sign(root, root_of_trust.RECORD, signer.kid,
                                           signer.public_b64)
            position = self.record_signing_key(signer.kid, signer.public_b64, actor=actor,
                                               root_signature=signature)
            reg.confirm_visible(position, lambda v: signer.kid in v.signing_keys(),
                                "the new signing key", wait_s)
            # hosts can open its tickets' arms before any gateway signs with it
            publish_seal(make_engine(reg.settings.db_url), signer)

        try:
            signer, previous = key_ring.rotate(reg.settings.keys_dir, record)
        except NotYetVisible as e:
            raise NotYetVisible(f"{e}. The new key was NOT made active here (the active key "
                                "is unchanged): rotate again once it has caught up") from None
        return signer.kid, previous

    def retire_signing_key(self, kid: str, *, actor: str, reason: str = "",
                           force: bool = False, wait_s: float = VISIBLE_WITHIN_S,
                           root_signature: str | None = None,
                           root_key: Path | None = None) -> None:
        """Retire a ticket-signing key: gateways stop signing with it, hosts stop trusting it.

        Refused, unless ``force``, for this home's active key and for the last unretired key
        (either leaves gateways nothing to sign with: rotate first). Returns once the
        retirement shows in the tables gateways and hosts read.
        """
        reg = self.registry
        key = reg.load(SigningKey, signing_key_id(check_name("key id", kid)), "signing key")
        if not force and not key.retired:
            self._check_retirable(kid)
        signature = self._vouched(root_of_trust.RETIRE, kid, key.public_key_b64, root_signature,
                                  root_key)
        key.retire(reason, actor, root_signature=signature)
        position = reg.commit(key, what="signing key")
        reg.confirm_visible(position, lambda v: kid in v.retired_key_ids(),
                            "the signing key retirement", wait_s)

    def _check_retirable(self, kid: str) -> None:
        active = key_ring.active_signer(self.registry.settings.keys_dir)
        if active is not None and active.kid == kid:
            raise IllegalTransition(
                f"{kid!r} is the active signing key here: run `loraplane key rotate` first, "
                "then retire it (or pass --force: gateways answer 503 until a new key exists)")
        view = self.registry.follower.routing()
        unretired = set(view.signing_keys()) - view.retired_key_ids()
        if unretired <= {kid}:
            raise IllegalTransition(
                f"{kid!r} is the last unretired signing key: run `loraplane key rotate` first "
                "(or pass --force: no gateway can issue tickets until a new key exists)")


__all__ = ["SigningKeyDesk"]
