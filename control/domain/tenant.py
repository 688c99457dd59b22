"""The ``Tenant`` aggregate: a name, the hash of its API key, and its policy.

Only the SHA-256 of a tenant's API key is ever recorded, never the key. A rotation records the
next key's hash (every earlier key stops working); a revocation leaves the tenant without a
working key until the next rotation. Its gate policy (``control.domain.gate``) is the default
every one of its adapters' gate reports is judged by, below each adapter's own overrides.
"""

from __future__ import annotations

import hashlib
from typing import Any
from uuid import UUID

from eventsourcing.domain import Aggregate, event

from control.domain.errors import IllegalTransition
from control.domain.gate import check_overrides
from control.domain.ids import tenant_id
from control.domain.names import check_actor, check_name
from control.domain.policy import TenantPolicy


def hash_api_key(api_key: str) -> str:
    """The only form in which an API key is ever stored: hex SHA-256."""
    return hashlib.sha256(api_key.encode("utf-8")).hexdigest()


class Tenant(Aggregate):
    class TenantCreated(Aggregate.Created):
        name: str
        api_key_hash: str
        actor: str

    class TenantPolicySet(Aggregate.Event):
        tenant: str
        policy: dict[str, Any]
        actor: str

    class GatePolicySet(Aggregate.Event):
        """The tenant's gate thresholds: fields of ``control.domain.gate.GatePolicy`` that
        differ from its defaults (the whole recorded set replaces the previous one)."""

        tenant: str
        policy: dict[str, Any]
        actor: str

    class ApiKeyRotated(Aggregate.Event):
        """The tenant's key is now the one hashed here; every earlier key stops working."""

        tenant: str
        api_key_hash: str
        actor: str

    class ApiKeysRevoked(Aggregate.Event):
        """Every key of the tenant stops working; a rotation issues the next one."""

        tenant: str
        reason: str
        actor: str

    @staticmethod
    def create_id(name: str) -> UUID:
        return tenant_id(name)

    @event(TenantCreated)
    def __init__(self, name: str, api_key_hash: str, actor: str) -> None:
        self.name = name
        self.api_key_hash: str | None = api_key_hash
        self.policy_json: dict[str, Any] = {}

    @classmethod
    def create(cls, name: str, api_key: str, actor: str) -> Tenant:
        """A new tenant; only the hash of ``api_key`` is recorded."""
        return cls(name=check_name("tenant", name), api_key_hash=hash_api_key(api_key),
                   actor=check_actor(actor))

    @property
    def policy(self) -> TenantPolicy:
        return TenantPolicy.from_json(getattr(self, "policy_json", {}))

    def set_policy(self, policy: TenantPolicy, actor: str) -> None:
        """Replace the tenant's policy (limits apply to later registrations)."""
        self._policy_set(tenant=self.name, policy=policy.to_json(), actor=check_actor(actor))

    @event(TenantPolicySet)
    def _policy_set(self, tenant: str, policy: dict[str, Any], actor: str) -> None:
        self.policy_json = policy

    @property
    def gate_policy(self) -> dict[str, Any]:
        """The tenant's recorded gate policy fields (``{}``: the defaults)."""
        return dict(getattr(self, "gate_policy_json", {}))

    def set_gate_policy(self, policy: dict[str, Any], actor: str) -> None:
        """Replace the tenant's gate thresholds (applies to gate runs from now on)."""
        self._gate_policy_set(tenant=self.name, policy=check_overrides(policy),
                              actor=check_actor(actor))

    @event(GatePolicySet)
    def _gate_policy_set(self, tenant: str, policy: dict[str, Any], actor: str) -> None:
        self.gate_policy_json = policy

    def rotate_api_key(self, api_key: str, actor: str) -> None:
        """Replace the tenant's key by ``api_key`` (only its hash is recorded); also after a
        revocation, which is how a tenant gets a working key again."""
        self._key_rotated(tenant=self.name, api_key_hash=hash_api_key(api_key),
                          actor=check_actor(actor))

    @event(ApiKeyRotated)
    def _key_rotated(self, tenant: str, api_key_hash: str, actor: str) -> None:
        self.api_key_hash = api_key_hash

    def revoke_api_keys(self, reason: str, actor: str) -> None:
        """Withdraw every key of the tenant; refused when it holds none (nothing to record)."""
        if self.api_key_hash is None:
            raise IllegalTransition("the tenant holds no API key (rotate to issue one)")
        self._keys_revoked(tenant=self.name, reason=reason.strip(), actor=check_actor(actor))

    @event(ApiKeysRevoked)
    def _keys_revoked(self, tenant: str, reason: str, actor: str) -> None:
        self.api_key_hash = None
