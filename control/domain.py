"""The control plane's domain: aggregates, their events and the rules between them. No I/O.

Every change is an event on one aggregate, and every event names the ``actor`` who caused it.
Aggregate ids are uuid5 of a natural key (tenant name, alias name, digest, key id), so two
processes that try to create the same thing collide on the event store's unique index instead of
creating two; only a rejected registration gets a random id (each rejection is its own record).

Aggregates:

- ``Tenant``: a name and the SHA-256 of its API key (never the key).
- ``BaseModel``: a registered base model: digest, tokenizer digest and the shapes of its Linear
  layers (what an adapter must fit). ``BaseName`` maps a base's name to its digest.
- ``Adapter``: a registered LoRA adapter and its lifecycle state.
- ``Alias``: a global route name, owned by a tenant (or by the operator for base-only routes),
  pointing at a base alone or at an adapter, with the tenants granted to resolve it.
- ``SigningKey``: a ticket-signing public key, by key id (a rotation is a new key).
- ``RegistrationRejection``: one refused registration, kept for the audit.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any
from uuid import UUID, uuid5

from eventsourcing.domain import Aggregate, event

# Fixed namespace for deterministic aggregate ids. Never change it: ids derive from it.
NAMESPACE = UUID("6f1c1b2e-4d0a-5c57-9a3e-7c1f0e3b9d42")

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")

# Adapter lifecycle. Issue 2 knows draft -> stable; later states (canary, retired, ...) extend the
# table, not the code. "revoked" is reachable from every state and is final.
DRAFT = "draft"
STABLE = "stable"
REVOKED = "revoked"
TRANSITIONS: dict[str, frozenset[str]] = {
    DRAFT: frozenset({STABLE}),
    STABLE: frozenset(),
    REVOKED: frozenset(),
}
SERVABLE_STATES = frozenset({STABLE})


class DomainError(Exception):
    """A command broke a rule; nothing was recorded."""


class NotFound(DomainError):
    """The named tenant, alias, base or adapter does not exist."""


class AlreadyExists(DomainError):
    """A tenant, base, adapter, alias or key with that identity exists already."""


class IllegalTransition(DomainError):
    """The adapter's lifecycle does not allow that move."""


class ValidationFailed(DomainError):
    """An adapter failed the named validation ``check``.

    ``message`` is safe to show the registering tenant: it names the check and what was
    expected, never a store path or another tenant.
    """

    def __init__(self, check: str, message: str) -> None:
        super().__init__(f"{check}: {message}")
        self.check = check
        self.message = message


# ---------------------------------------------------------------------------------------------
# Pure rules


def check_name(kind: str, value: str) -> str:
    """Return ``value`` if it is a valid tenant/alias/base/key name, else raise DomainError."""
    if not isinstance(value, str) or not NAME_RE.match(value):
        raise DomainError(
            f"invalid {kind} name: use 1-64 characters from A-Z a-z 0-9 . _ -, "
            "starting with a letter or digit"
        )
    return value


def check_actor(actor: str) -> str:
    """Every event names who caused it; an empty actor is refused."""
    if not isinstance(actor, str) or not actor.strip():
        raise DomainError("actor is required")
    return actor


def hash_api_key(api_key: str) -> str:
    """The only form in which an API key is ever stored: hex SHA-256."""
    return hashlib.sha256(api_key.encode("utf-8")).hexdigest()


def check_transition(current: str, to: str) -> None:
    """Raise IllegalTransition unless the lifecycle allows ``current`` -> ``to``."""
    if to not in TRANSITIONS:
        raise IllegalTransition(f"unknown state {to!r}")
    if to not in TRANSITIONS.get(current, frozenset()):
        raise IllegalTransition(f"cannot move an adapter from {current!r} to {to!r}")


def is_servable(adapter_state: str | None) -> bool:
    """A route is servable when it points at the base alone (``None``) or a stable adapter."""
    return adapter_state is None or adapter_state in SERVABLE_STATES


def _id(kind: str, key: str) -> UUID:
    return uuid5(NAMESPACE, f"{kind}:{key}")


def tenant_id(name: str) -> UUID:
    return _id("tenant", name)


def base_id(digest: str) -> UUID:
    return _id("base", digest)


def base_name_id(name: str) -> UUID:
    return _id("base-name", name)


def adapter_id(digest: str) -> UUID:
    return _id("adapter", digest)


def alias_id(name: str) -> UUID:
    return _id("alias", name)


def signing_key_id(kid: str) -> UUID:
    return _id("signing-key", kid)


# ---------------------------------------------------------------------------------------------
# Aggregates


class Tenant(Aggregate):
    class TenantCreated(Aggregate.Created):
        name: str
        api_key_hash: str
        actor: str

    @staticmethod
    def create_id(name: str) -> UUID:
        return tenant_id(name)

    @event(TenantCreated)
    def __init__(self, name: str, api_key_hash: str, actor: str) -> None:
        self.name = name
        self.api_key_hash = api_key_hash

    @classmethod
    def create(cls, name: str, api_key: str, actor: str) -> Tenant:
        """A new tenant; only the hash of ``api_key`` is recorded."""
        return cls(name=check_name("tenant", name), api_key_hash=hash_api_key(api_key),
                   actor=check_actor(actor))


class BaseModel(Aggregate):
    class BaseRegistered(Aggregate.Created):
        name: str
        digest: str
        tokenizer_digest: str
        linear_shapes: dict[str, list[int]]
        actor: str

    @staticmethod
    def create_id(digest: str) -> UUID:
        return base_id(digest)

    @event(BaseRegistered)
    def __init__(
        self,
        name: str,
        digest: str,
        tokenizer_digest: str,
        linear_shapes: dict[str, list[int]],
        actor: str,
    ) -> None:
        self.name = name
        self.digest = digest
        self.tokenizer_digest = tokenizer_digest
        self.linear_shapes = linear_shapes

    @classmethod
    def register(
        cls,
        name: str,
        digest: str,
        tokenizer_digest: str,
        linear_shapes: dict[str, list[int]],
        actor: str,
    ) -> BaseModel:
        if not linear_shapes:
            raise DomainError("base model has no Linear weights")
        return cls(name=check_name("base", name), digest=digest,
                   tokenizer_digest=tokenizer_digest, linear_shapes=linear_shapes,
                   actor=check_actor(actor))


class BaseName(Aggregate):
    """Name -> digest index for base models (a name is taken once)."""

    class BaseNamed(Aggregate.Created):
        name: str
        digest: str
        actor: str

    @staticmethod
    def create_id(name: str) -> UUID:
        return base_name_id(name)

    @event(BaseNamed)
    def __init__(self, name: str, digest: str, actor: str) -> None:
        self.name = name
        self.digest = digest


class Adapter(Aggregate):
    class AdapterRegistered(Aggregate.Created):
        tenant: str
        digest: str
        base_digest: str
        tokenizer_digest: str
        rank: int
        target_modules: list[str]
        alias: str
        actor: str

    # Later events repeat the natural key (digest, alias name) so that each event reads on its
    # own in the audit log and in projections.
    class AdapterPromoted(Aggregate.Event):
        digest: str
        from_state: str
        to: str
        actor: str

    class AdapterRevoked(Aggregate.Event):
        digest: str
        reason: str
        actor: str

    @staticmethod
    def create_id(digest: str) -> UUID:
        return adapter_id(digest)

    @event(AdapterRegistered)
    def __init__(
        self,
        tenant: str,
        digest: str,
        base_digest: str,
        tokenizer_digest: str,
        rank: int,
        target_modules: list[str],
        alias: str,
        actor: str,
    ) -> None:
        self.tenant = tenant
        self.digest = digest
        self.base_digest = base_digest
        self.tokenizer_digest = tokenizer_digest
        self.rank = rank
        self.target_modules = target_modules
        self.alias = alias
        self.state = DRAFT
        self.revoke_reason: str | None = None

    @property
    def revoked(self) -> bool:
        return self.state == REVOKED

    def promote(self, to: str, actor: str) -> None:
        """Move along the lifecycle; raise IllegalTransition (recording nothing) if not allowed."""
        check_transition(self.state, to)
        self._promoted(digest=self.digest, from_state=self.state, to=to, actor=check_actor(actor))

    @event(AdapterPromoted)
    def _promoted(self, digest: str, from_state: str, to: str, actor: str) -> None:
        self.state = to

    def revoke(self, reason: str, actor: str) -> None:
        """Revoke from any state; revoking twice is refused."""
        if self.state == REVOKED:
            raise IllegalTransition("adapter is already revoked")
        if not reason.strip():
            raise DomainError("a revocation needs a reason")
        self._revoked(digest=self.digest, reason=reason, actor=check_actor(actor))

    @event(AdapterRevoked)
    def _revoked(self, digest: str, reason: str, actor: str) -> None:
        self.state = REVOKED
        self.revoke_reason = reason


class Alias(Aggregate):
    """A route name. ``owner`` is a tenant, or ``None`` for an operator's base-only alias."""

    class AliasCreated(Aggregate.Created):
        name: str
        owner: str | None
        base_digest: str
        adapter_digest: str | None
        tokenizer_digest: str
        actor: str

    class AliasPointed(Aggregate.Event):
        alias: str
        base_digest: str
        adapter_digest: str | None
        tokenizer_digest: str
        actor: str

    class AliasGranted(Aggregate.Event):
        alias: str
        tenant: str
        actor: str

    @staticmethod
    def create_id(name: str) -> UUID:
        return alias_id(name)

    @event(AliasCreated)
    def __init__(
        self,
        name: str,
        owner: str | None,
        base_digest: str,
        adapter_digest: str | None,
        tokenizer_digest: str,
        actor: str,
    ) -> None:
        self.name = name
        self.owner = owner
        self.base_digest = base_digest
        self.adapter_digest = adapter_digest
        self.tokenizer_digest = tokenizer_digest
        self.grants: list[str] = []

    @classmethod
    def create(
        cls,
        name: str,
        owner: str | None,
        base_digest: str,
        adapter_digest: str | None,
        tokenizer_digest: str,
        actor: str,
    ) -> Alias:
        return cls(name=check_name("alias", name), owner=owner, base_digest=base_digest,
                   adapter_digest=adapter_digest, tokenizer_digest=tokenizer_digest,
                   actor=check_actor(actor))

    def point_to_adapter(self, adapter: Adapter, actor: str) -> None:
        """Point at ``adapter``: it must belong to the alias owner and not be revoked."""
        # The same message for "someone else's" and "revoked" would hide too much from an
        # operator; "not owned" is phrased without naming the adapter's tenant.
        if adapter.tenant != self.owner:
            raise DomainError("adapter does not belong to the alias owner")
        if adapter.revoked:
            raise IllegalTransition("cannot point an alias at a revoked adapter")
        self._pointed(alias=self.name, base_digest=adapter.base_digest,
                      adapter_digest=adapter.digest,
                      tokenizer_digest=adapter.tokenizer_digest, actor=check_actor(actor))

    def point_to_base(self, base: BaseModel, actor: str) -> None:
        """Point at the base model alone (no adapter)."""
        self._pointed(alias=self.name, base_digest=base.digest, adapter_digest=None,
                      tokenizer_digest=base.tokenizer_digest, actor=check_actor(actor))

    @event(AliasPointed)
    def _pointed(
        self,
        alias: str,
        base_digest: str,
        adapter_digest: str | None,
        tokenizer_digest: str,
        actor: str,
    ) -> None:
        self.base_digest = base_digest
        self.adapter_digest = adapter_digest
        self.tokenizer_digest = tokenizer_digest

    def grant(self, tenant: str, actor: str) -> None:
        """Let ``tenant`` resolve this alias. The owner is not granted implicitly."""
        if tenant in self.grants:
            raise AlreadyExists("tenant is already granted this alias")
        self._granted(alias=self.name, tenant=tenant, actor=check_actor(actor))

    @event(AliasGranted)
    def _granted(self, alias: str, tenant: str, actor: str) -> None:
        self.grants.append(tenant)

    def may_resolve(self, tenant: str) -> bool:
        return tenant in self.grants


class SigningKey(Aggregate):
    class SigningKeyRecorded(Aggregate.Created):
        kid: str
        public_key_b64: str
        actor: str

    @staticmethod
    def create_id(kid: str) -> UUID:
        return signing_key_id(kid)

    @event(SigningKeyRecorded)
    def __init__(self, kid: str, public_key_b64: str, actor: str) -> None:
        self.kid = kid
        self.public_key_b64 = public_key_b64


class RegistrationRejection(Aggregate):
    """One refused adapter registration (random id: every refusal is its own record)."""

    class RegistrationRejected(Aggregate.Created):
        check: str
        message: str
        tenant: str
        actor: str

    @event(RegistrationRejected)
    def __init__(self, check: str, message: str, tenant: str, actor: str) -> None:
        self.check = check
        self.message = message
        self.tenant = tenant


def event_fields(domain_event: Any) -> dict[str, Any]:
    """The payload of a domain event: its fields minus the library's bookkeeping."""
    skip = {"originator_id", "originator_version", "timestamp", "originator_topic"}
    return {k: v for k, v in domain_event.__dict__.items() if k not in skip}
