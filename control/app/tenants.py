"""The tenants desk: tenants, their policies and their API keys (``Tenant``).

Only an API key's SHA-256 is recorded; the key itself is returned once. Rotating or revoking
keys takes something away, so those commands return only once gateways refuse the old keys
(else :class:`~control.app.unit_of_work.NotYetVisible`, the change recorded but not in force).
"""

from __future__ import annotations

import secrets

from control.app.unit_of_work import VISIBLE_WITHIN_S, NotYetVisible, UnitOfWork
from control.domain import Tenant, TenantPolicy, check_actor, check_name

API_KEY_PREFIX = "lp_"


class TenantDesk:
    """Creates tenants and manages their policies and API keys on ``registry``."""

    def __init__(self, registry: UnitOfWork) -> None:
        self.registry = registry

    def create_tenant(self, name: str, *, actor: str,
                      policy: TenantPolicy | None = None) -> str:
        """Create a tenant (with ``policy``, in the same transaction) and return its API key;
        only the key's SHA-256 is recorded. The key is shown once."""
        check_name("tenant", name)
        check_actor(actor)
        # No existence read first: the event store's unique (id, version 1) index refuses a
        # second tenant of the same name in the same transaction that would record it.
        api_key = API_KEY_PREFIX + secrets.token_urlsafe(32)
        tenant = Tenant.create(name, api_key, actor)
        if policy is not None:
            tenant.set_policy(policy, actor)
        self.registry.commit(tenant, what="tenant", already=f"tenant {name!r} already exists")
        return api_key

    def set_policy(self, tenant: str, policy: TenantPolicy, *, actor: str) -> None:
        """Replace a tenant's policy (limits, signature requirement, trusted keys)."""
        t = self.registry.tenant(tenant)
        t.set_policy(policy, actor)
        self.registry.commit(t, what="tenant policy")

    def rotate_api_key(self, tenant: str, *, actor: str,
                       wait_s: float = VISIBLE_WITHIN_S) -> str:
        """Give ``tenant`` a new API key and return it (shown once; only its hash is kept).
        Every earlier key stops working: this returns once gateways refuse them."""
        reg = self.registry
        t = reg.tenant(tenant)
        api_key = API_KEY_PREFIX + secrets.token_urlsafe(32)
        t.rotate_api_key(api_key, actor)
        position = reg.commit(t, what="tenant")
        try:
            reg.confirm_visible(position, lambda v: v.tenant_for_api_key(api_key) == tenant,
                                "the API key rotation", wait_s)
        except NotYetVisible as e:
            raise NotYetVisible(str(e), result=api_key) from None
        return api_key

    def revoke_api_keys(self, tenant: str, *, actor: str, reason: str = "",
                        wait_s: float = VISIBLE_WITHIN_S) -> None:
        """Withdraw every API key of ``tenant``; it holds no working key until a rotation.
        Returns once gateways refuse them."""
        reg = self.registry
        t = reg.tenant(tenant)
        t.revoke_api_keys(reason, actor)
        position = reg.commit(t, what="tenant")
        reg.confirm_visible(position, lambda v: v.api_key_count(tenant) == 0,
                            "the API key revocation", wait_s)


__all__ = ["API_KEY_PREFIX", "TenantDesk"]
