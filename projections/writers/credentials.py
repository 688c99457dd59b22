"""Writers of the credential tables: API keys, the tickets a tenant's credential changes
retire (``tenants.tickets_not_before``), and ticket-signing keys."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from typing import Any

from sqlalchemy.engine import Connection

from control.domain import SigningKey, Tenant, TenantPolicy
from projections.tables import api_keys, signing_keys, tenants
from projections.writers.rows import Rows


def tickets_not_before(conn: Connection, tenant: str, when: datetime) -> None:
    """The tenant's tickets issued until ``when`` are no longer honoured by hosts."""
    conn.execute(tenants.update().where(tenants.c.name == tenant)
                 .values(tickets_not_before=when.timestamp()))


def _api_key_rotated(conn: Connection, e: Tenant.ApiKeyRotated) -> None:
    # One working key per tenant: the rotation withdraws every earlier one in the same write.
    conn.execute(api_keys.delete().where(api_keys.c.tenant == e.tenant))
    conn.execute(api_keys.insert().values(key_hash=e.api_key_hash, tenant=e.tenant))
    tickets_not_before(conn, e.tenant, e.timestamp)


def _api_keys_revoked(conn: Connection, e: Tenant.ApiKeysRevoked) -> None:
    conn.execute(api_keys.delete().where(api_keys.c.tenant == e.tenant))
    tickets_not_before(conn, e.tenant, e.timestamp)


def _policy_set(conn: Connection, e: Tenant.TenantPolicySet) -> None:
    # placement and cache limits only: the other rules are checked by the registry, on the aggregate
    policy = TenantPolicy.from_json(e.policy)
    conn.execute(tenants.update().where(tenants.c.name == e.tenant)
                 .values(pool=policy.pool, regions=",".join(policy.regions),
                         resident_share=policy.resident_share,
                         loads_per_minute=policy.loads_per_minute,
                         max_replicas=policy.max_replicas))


def _signing_key_retired(conn: Connection, e: SigningKey.SigningKeyRetired) -> None:
    conn.execute(signing_keys.update().where(signing_keys.c.kid == e.kid)
                 .values(retired_at=e.timestamp))


def _signing_key_recorded(e: SigningKey.SigningKeyRecorded) -> Rows:
    return [(signing_keys, {"kid": e.kid, "public_key": e.public_key_b64,
                            "created_at": e.timestamp, "retired_at": None,
                            "root_signature": e.root_signature or None})]


INSERTS: dict[type, Callable[[Any], Rows]] = {
    SigningKey.SigningKeyRecorded: _signing_key_recorded,
}
HANDLERS: dict[type, Callable[[Connection, Any], None]] = {
    Tenant.ApiKeyRotated: _api_key_rotated,
    Tenant.ApiKeysRevoked: _api_keys_revoked,
    Tenant.TenantPolicySet: _policy_set,
    SigningKey.SigningKeyRetired: _signing_key_retired,
}
