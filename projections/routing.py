"""The routing projection: events in, rows out; and the read API the gateway and backend use.

``apply(conn, event)`` folds one domain event into the tables of ``projections.tables`` on an
open connection (the follower owns the transaction). ``RoutingView`` answers run-time questions
from those tables: which route a tenant may use for an alias, who holds an API key, which
digests are revoked.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from control.domain import (
    REVOKED,
    Adapter,
    Alias,
    BaseModel,
    SigningKey,
    Tenant,
    hash_api_key,
    is_servable,
)
from projections.tables import (
    adapters,
    api_keys,
    bases,
    create_tables,
    grants,
    revocations,
    routes,
    signing_keys,
    tenants,
)


@dataclass(frozen=True)
class Route:
    """Where a granted, servable alias leads. ``adapter_digest`` is None for the base alone."""

    alias: str
    base_digest: str
    adapter_digest: str | None
    tokenizer_digest: str


@dataclass(frozen=True)
class AdapterRow:
    digest: str
    tenant: str
    alias: str
    base_digest: str
    tokenizer_digest: str
    state: str
    rank: int
    registered_at: datetime


@dataclass(frozen=True)
class BaseRow:
    digest: str
    name: str
    tokenizer_digest: str


# ---------------------------------------------------------------------------------------------
# Event -> rows


def _adapter_state(conn: Connection, digest: str | None) -> str | None:
    if digest is None:
        return None
    state = conn.execute(sa.select(adapters.c.state).where(adapters.c.digest == digest)).scalar()
    # An alias is only ever pointed at a registered adapter; "unknown" keeps it unservable.
    return str(state) if state is not None else "unknown"


def _refresh_routes_for(conn: Connection, digest: str) -> None:
    state = _adapter_state(conn, digest)
    conn.execute(routes.update().where(routes.c.adapter_digest == digest)
                 .values(servable=is_servable(state)))


def _tenant_created(conn: Connection, e: Tenant.TenantCreated) -> None:
    conn.execute(tenants.insert().values(name=e.name, created_at=e.timestamp))
    conn.execute(api_keys.insert().values(key_hash=e.api_key_hash, tenant=e.name))


def _base_registered(conn: Connection, e: BaseModel.BaseRegistered) -> None:
    conn.execute(bases.insert().values(digest=e.digest, name=e.name,
                                       tokenizer_digest=e.tokenizer_digest))


def _adapter_registered(conn: Connection, e: Adapter.AdapterRegistered) -> None:
    conn.execute(adapters.insert().values(
        digest=e.digest, tenant=e.tenant, alias=e.alias, base_digest=e.base_digest,
        tokenizer_digest=e.tokenizer_digest, state="draft", rank=e.rank,
        registered_at=e.timestamp))


def _adapter_promoted(conn: Connection, e: Adapter.AdapterPromoted) -> None:
    digest = e.digest
    conn.execute(adapters.update().where(adapters.c.digest == digest).values(state=e.to))
    _refresh_routes_for(conn, digest)


def _adapter_revoked(conn: Connection, e: Adapter.AdapterRevoked) -> None:
    digest = e.digest
    conn.execute(adapters.update().where(adapters.c.digest == digest).values(state=REVOKED))
    conn.execute(revocations.insert().values(digest=digest, reason=e.reason,
                                             revoked_at=e.timestamp))
    _refresh_routes_for(conn, digest)


def _alias_created(conn: Connection, e: Alias.AliasCreated) -> None:
    conn.execute(routes.insert().values(
        alias=e.name, owner=e.owner, base_digest=e.base_digest,
        adapter_digest=e.adapter_digest, tokenizer_digest=e.tokenizer_digest,
        servable=is_servable(_adapter_state(conn, e.adapter_digest))))


def _alias_pointed(conn: Connection, e: Alias.AliasPointed) -> None:
    conn.execute(routes.update().where(routes.c.alias == e.alias).values(
        base_digest=e.base_digest, adapter_digest=e.adapter_digest,
        tokenizer_digest=e.tokenizer_digest,
        servable=is_servable(_adapter_state(conn, e.adapter_digest))))


def _alias_granted(conn: Connection, e: Alias.AliasGranted) -> None:
    conn.execute(grants.insert().values(tenant=e.tenant, alias=e.alias))


def _signing_key_recorded(conn: Connection, e: SigningKey.SigningKeyRecorded) -> None:
    conn.execute(signing_keys.insert().values(kid=e.kid, public_key=e.public_key_b64,
                                              created_at=e.timestamp))


HANDLERS: dict[type, Callable[[Connection, Any], None]] = {
    Tenant.TenantCreated: _tenant_created,
    BaseModel.BaseRegistered: _base_registered,
    Adapter.AdapterRegistered: _adapter_registered,
    Adapter.AdapterPromoted: _adapter_promoted,
    Adapter.AdapterRevoked: _adapter_revoked,
    Alias.AliasCreated: _alias_created,
    Alias.AliasPointed: _alias_pointed,
    Alias.AliasGranted: _alias_granted,
    SigningKey.SigningKeyRecorded: _signing_key_recorded,
}


def apply(conn: Connection, domain_event: Any) -> None:
    """Fold one domain event into the view tables; events the views ignore are skipped."""
    handler = HANDLERS.get(type(domain_event))
    if handler is not None:
        handler(conn, domain_event)


# ---------------------------------------------------------------------------------------------
# Read API


class RoutingView:
    """Read-only questions answered from the projection tables."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        create_tables(engine)

    def resolve(self, tenant: str, alias: str) -> Route | None:
        """The route ``tenant`` may use for ``alias``, or None.

        None covers every refusal alike (unknown alias, not granted, not servable, revoked), so
        a caller cannot probe for other tenants' aliases.
        """
        q = (
            sa.select(routes.c.alias, routes.c.base_digest, routes.c.adapter_digest,
                      routes.c.tokenizer_digest)
            .select_from(routes.join(grants, grants.c.alias == routes.c.alias))
            .where(routes.c.alias == alias, grants.c.tenant == tenant,
                   routes.c.servable.is_(True))
            .where(~sa.exists().where(revocations.c.digest == routes.c.adapter_digest))
        )
        with self.engine.connect() as conn:
            row = conn.execute(q).first()
        if row is None:
            return None
        return Route(alias=row.alias, base_digest=row.base_digest,
                     adapter_digest=row.adapter_digest, tokenizer_digest=row.tokenizer_digest)

    def tenant_for_api_key(self, api_key: str) -> str | None:
        """The tenant holding ``api_key`` (looked up by its hash), or None."""
        q = sa.select(api_keys.c.tenant).where(api_keys.c.key_hash == hash_api_key(api_key))
        with self.engine.connect() as conn:
            value = conn.execute(q).scalar()
        return str(value) if value is not None else None

    def revoked_digests(self) -> frozenset[str]:
        """Every revoked adapter digest."""
        with self.engine.connect() as conn:
            return frozenset(str(d) for d in conn.execute(sa.select(revocations.c.digest))
                             .scalars())

    def is_revoked(self, digest: str) -> bool:
        q = sa.select(revocations.c.digest).where(revocations.c.digest == digest)
        with self.engine.connect() as conn:
            return conn.execute(q).first() is not None

    def base_for_digest(self, digest: str) -> str | None:
        """The base digest an adapter digest applies to; a base digest maps to itself."""
        with self.engine.connect() as conn:
            value = conn.execute(sa.select(adapters.c.base_digest)
                                 .where(adapters.c.digest == digest)).scalar()
            if value is None:
                value = conn.execute(sa.select(bases.c.digest)
                                     .where(bases.c.digest == digest)).scalar()
        return str(value) if value is not None else None

    def adapter(self, digest: str) -> AdapterRow | None:
        """One adapter's catalogue row, or None."""
        with self.engine.connect() as conn:
            row = conn.execute(sa.select(adapters).where(adapters.c.digest == digest)).first()
        return AdapterRow(**row._mapping) if row is not None else None

    def adapters(self, tenant: str | None = None) -> list[AdapterRow]:
        """The adapter catalogue, optionally for one tenant, by registration time."""
        q = sa.select(adapters).order_by(adapters.c.registered_at, adapters.c.digest)
        if tenant is not None:
            q = q.where(adapters.c.tenant == tenant)
        with self.engine.connect() as conn:
            return [AdapterRow(**r._mapping) for r in conn.execute(q)]

    def bases(self) -> list[BaseRow]:
        with self.engine.connect() as conn:
            return [BaseRow(**r._mapping)
                    for r in conn.execute(sa.select(bases).order_by(bases.c.name))]

    def tenants(self) -> list[str]:
        with self.engine.connect() as conn:
            return [str(n) for n in conn.execute(sa.select(tenants.c.name)
                                                 .order_by(tenants.c.name)).scalars()]

    def signing_keys(self) -> dict[str, str]:
        """``{kid: base64 public key}`` for every recorded ticket-signing key."""
        with self.engine.connect() as conn:
            return {str(r.kid): str(r.public_key)
                    for r in conn.execute(sa.select(signing_keys.c.kid, signing_keys.c.public_key))}
