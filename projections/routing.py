"""The routing projection's read API, used by the gateway, the CLI and the control plane's desks
(the writers, events in and rows out, are ``projections.writers``).

``RoutingView`` answers run-time questions
from those tables: which release a tenant's session gets for an alias (the release its session
pin holds, else the canary split by the hash of tenant and session id), who holds an API key,
which digests are revoked, which ticket-signing keys are retired.

Session pins (``control.domain.session``) are rows of ``session_pins``: a pin's own events
write its row; ``AliasSessionsRepinned`` moves every live pin of an alias on one release;
``AliasFellBack`` (a revocation's fallback, ``control.domain.fallback``) changes the alias's
row, and a pin on the revoked release simply stops holding (its release is not servable).
"""

from __future__ import annotations

import json
import secrets
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from control.app.sessions import Pin
from control.contracts import root_of_trust
from control.domain import (
    DEFAULT_FALLBACK,
    DEPRECATED,
    REVOKED,
    SERVABLE_STATES,
    canary_bucket,
    choose_release,
    hash_api_key,
)
from projections.tables import (
    adapters,
    api_keys,
    bases,
    create_tables,
    grants,
    releases,
    revocations,
    routes,
    serving_steps,
    session_pins,
    signing_keys,
    tenants,
)


@dataclass(frozen=True)
class Route:
    """Where a granted alias leads for one session. ``adapter_digest`` is None for the base
    alone; ``release`` is the release manifest digest that was resolved; ``pinned``: it is the
    release the session's pin holds (not a fresh resolution)."""

    alias: str
    base_digest: str
    adapter_digest: str | None
    tokenizer_digest: str
    release: str | None = None
    canary: bool = False
    pinned: bool = False
    owner: str | None = None  # the tenant that owns the release (None: the base alone)


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
    owner: str = ""
    training_data_version: str = ""
    licence: str = ""
    allowed_tasks: str = ""
    signature: str | None = None
    evaluation_report_digest: str | None = None
    release_digest: str | None = None


@dataclass(frozen=True)
class BaseRow:
    digest: str
    name: str
    tokenizer_digest: str


@dataclass(frozen=True)
class SigningKeyRow:
    kid: str
    created_at: datetime
    retired_at: datetime | None


@dataclass(frozen=True)
class Placement:
    """Where a tenant's requests may run (its policy, issue 25): its dedicated pool (None: the
    shared one) and regions (empty: any); ``max_replicas``: how many hosts may hold one of its
    adapters at once (None: no bound), which decides how its aliases are placed
    (``control.contracts.placement.affinity_of``)."""

    pool: str | None = None
    regions: tuple[str, ...] = ()
    max_replicas: int | None = None


def placement_of(row: Any) -> Placement:
    """A ``tenants`` row's placement (its ``pool``, ``regions`` and ``max_replicas``)."""
    return Placement(row.pool, tuple(x for x in str(row.regions).split(",") if x),
                     row.max_replicas)


PLACEMENT_COLUMNS = (tenants.c.pool, tenants.c.regions, tenants.c.max_replicas)


def placements_of(conn: Connection) -> dict[str, Placement]:
    """Every tenant's placement that differs from the default."""
    return {str(r.name): placement_of(r)
            for r in conn.execute(sa.select(tenants.c.name, *PLACEMENT_COLUMNS)
                                  .where(sa.or_(tenants.c.pool.is_not(None),
                                                tenants.c.regions != "",
                                                tenants.c.max_replicas.is_not(None))))}


@dataclass(frozen=True)
class AliasRow:
    alias: str
    owner: str | None
    stable_release: str | None
    canary_release: str | None
    canary_percent: int
    fallback: str = DEFAULT_FALLBACK.value


# ---------------------------------------------------------------------------------------------
# Read API


def _release_rows(conn: Connection, digests: list[str]) -> dict[str, Any]:
    """The release rows of ``digests``, each with its adapter's state, by digest."""
    return {r.digest: r for r in conn.execute(
        sa.select(releases.c.digest, releases.c.adapter_digest, releases.c.base_digest,
                  releases.c.tokenizer_digest, releases.c.tenant, adapters.c.state)
        .select_from(releases.outerjoin(adapters,
                                        adapters.c.digest == releases.c.adapter_digest))
        .where(releases.c.digest.in_(digests)))}


def _servable_route(alias: str, r: Any, canary: str | None, *,
                    pinned: bool = False) -> Route | None:
    """The route to release row ``r`` (from :func:`_release_rows`), or None when there is no
    row or its adapter is not servable."""
    if r is None or (r.adapter_digest is not None and r.state not in SERVABLE_STATES):
        return None
    return Route(alias=alias, base_digest=r.base_digest, adapter_digest=r.adapter_digest,
                 tokenizer_digest=r.tokenizer_digest, release=r.digest,
                 canary=r.digest == canary, pinned=pinned, owner=r.tenant)


def pin_from_row(r: Any) -> Pin:
    """A ``session_pins`` row as a :class:`control.app.sessions.Pin`."""
    return Pin(tenant=str(r.tenant), alias=str(r.alias), session=str(r.session),
               release=str(r.release), expires_at=float(r.expires_at), version=int(r.version),
               ended=bool(r.ended))


def _pin_row(conn: Connection, tenant: str, alias: str, session: str) -> Pin | None:
    r = conn.execute(sa.select(session_pins).where(
        session_pins.c.tenant == tenant, session_pins.c.alias == alias,
        session_pins.c.session == session)).first()
    return None if r is None else pin_from_row(r)


class RoutingView:
    """Read-only questions answered from the projection tables."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        create_tables(engine)

    def resolve(self, tenant: str, alias: str, session: str | None = None) -> Route | None:
        """The release ``tenant``'s ``session`` gets for ``alias``, or None.

        A session whose pin holds (not ended, not expired, its release still servable) gets
        the pinned release, wherever the alias points now (``Route.pinned``). Otherwise the
        canary split hashes (tenant, session id): one session always lands on the same
        release while the alias stays put; the gateway then pins what it got. Without a
        session id each call is its own session and nothing is pinned. Only releases of canary
        or stable adapters (or the base alone) resolve; if the release the split picks is no
        longer servable, the other one is used. None covers every refusal alike (unknown alias,
        not granted, nothing servable), so a caller cannot probe for other tenants' aliases.
        """
        q = (
            sa.select(routes.c.stable_release, routes.c.canary_release, routes.c.canary_percent)
            .select_from(routes.join(grants, grants.c.alias == routes.c.alias))
            .where(routes.c.alias == alias, grants.c.tenant == tenant)
        )
        with self.engine.connect() as conn:
            row = conn.execute(q).first()
            if row is None:
                return None
            pin = _pin_row(conn, tenant, alias, session) if session is not None else None
            if pin is not None and not pin.holds(time.time()):
                pin = None
            bucket = canary_bucket(tenant, session if session is not None
                                   else secrets.token_hex(8))
            order = choose_release(row.stable_release, row.canary_release,
                                   int(row.canary_percent), bucket)
            wanted = ([pin.release] if pin is not None else []) + order
            if not wanted:
                return None
            found = _release_rows(conn, wanted)
        if pin is not None:
            route = _servable_route(alias, found.get(pin.release), row.canary_release,
                                    pinned=True)
            if route is not None:
                return route
        for digest in order:
            route = _servable_route(alias, found.get(digest), row.canary_release)
            if route is not None:
                return route
        return None

    def route_to(self, tenant: str, alias: str, release: str) -> Route | None:
        """``release`` as a route of ``alias`` for ``tenant``, when the tenant is granted the
        alias and the release is servable; else None. For a session's pinned release (the
        pin itself was checked by the caller)."""
        q = (sa.select(routes.c.canary_release)
             .select_from(routes.join(grants, grants.c.alias == routes.c.alias))
             .where(routes.c.alias == alias, grants.c.tenant == tenant))
        with self.engine.connect() as conn:
            row = conn.execute(q).first()
            if row is None:
                return None
            found = _release_rows(conn, [release])
        return _servable_route(alias, found.get(release), row.canary_release, pinned=True)

    def session_pin(self, tenant: str, alias: str, session: str) -> Pin | None:
        """The row of ``tenant``'s ``session`` on ``alias`` (ended or expired ones included;
        see ``Pin.holds``), or None."""
        with self.engine.connect() as conn:
            return _pin_row(conn, tenant, alias, session)

    def remember_pin(self, pin: Pin) -> None:
        """A pin this process just recorded or read back (for views that answer from memory,
        ``projections.route_cache``); this view reads the tables every time."""

    def session_pins(self, alias: str) -> list[Pin]:
        """Every pin recorded on ``alias`` (operators: every tenant's), by tenant and
        session."""
        q = (sa.select(session_pins).where(session_pins.c.alias == alias)
             .order_by(session_pins.c.tenant, session_pins.c.session))
        with self.engine.connect() as conn:
            return [pin_from_row(r) for r in conn.execute(q)]

    def aliases_using_adapter(self, digest: str) -> list[str]:
        """Aliases whose stable or canary release is one of the adapter ``digest``'s."""
        used = sa.select(releases.c.digest).where(releases.c.adapter_digest == digest)
        q = sa.select(routes.c.alias).where(sa.or_(routes.c.stable_release.in_(used),
                                                   routes.c.canary_release.in_(used)))
        with self.engine.connect() as conn:
            return sorted(str(a) for a in conn.execute(q).scalars())

    def placement(self, tenant: str) -> Placement:
        """Where ``tenant``'s requests may run (the default for an unknown tenant)."""
        with self.engine.connect() as conn:
            r = conn.execute(sa.select(*PLACEMENT_COLUMNS)
                             .where(tenants.c.name == tenant)).first()
        return Placement() if r is None else placement_of(r)

    def alias_row(self, alias: str) -> AliasRow | None:
        """An alias's routing row (operators only: no grant check)."""
        with self.engine.connect() as conn:
            r = conn.execute(sa.select(routes).where(routes.c.alias == alias)).first()
        return AliasRow(**r._mapping) if r is not None else None

    def release(self, digest: str) -> dict[str, Any] | None:
        """A release manifest's row, or None."""
        with self.engine.connect() as conn:
            r = conn.execute(sa.select(releases).where(releases.c.digest == digest)).first()
        if r is None:
            return None
        out = dict(r._mapping)
        out["inference_defaults"] = json.loads(out["inference_defaults"])
        return out

    def live_adapter_count(self, tenant: str) -> int:
        """Adapters of ``tenant`` that are neither revoked nor deprecated."""
        q = (sa.select(sa.func.count()).select_from(adapters)
             .where(adapters.c.tenant == tenant,
                    adapters.c.state.not_in([REVOKED, DEPRECATED])))
        with self.engine.connect() as conn:
            return int(conn.execute(q).scalar() or 0)

    def adapters_by_training_data(self, version: str,
                                  tenant: str | None = None) -> list[str]:
        """Digests of the adapters trained on data version ``version``."""
        q = sa.select(adapters.c.digest).where(adapters.c.training_data_version == version)
        if tenant is not None:
            q = q.where(adapters.c.tenant == tenant)
        with self.engine.connect() as conn:
            return sorted(str(d) for d in conn.execute(q).scalars())

    def serving_steps(self, digest: str) -> dict[str, list[str]]:
        """``{host: [steps in order]}`` reported after ``digest`` was revoked."""
        q = (sa.select(serving_steps.c.host, serving_steps.c.step)
             .where(serving_steps.c.digest == digest).order_by(serving_steps.c.at))
        out: dict[str, list[str]] = {}
        with self.engine.connect() as conn:
            for host, step in conn.execute(q):
                out.setdefault(str(host), []).append(str(step))
        return out

    def tenant_for_api_key(self, api_key: str) -> str | None:
        """The tenant holding ``api_key`` (looked up by its hash), or None."""
        q = sa.select(api_keys.c.tenant).where(api_keys.c.key_hash == hash_api_key(api_key))
        with self.engine.connect() as conn:
            value = conn.execute(q).scalar()
        return str(value) if value is not None else None

    def api_key_count(self, tenant: str) -> int:
        """How many working API keys ``tenant`` holds (0 once they are revoked)."""
        q = sa.select(sa.func.count()).select_from(api_keys).where(api_keys.c.tenant == tenant)
        with self.engine.connect() as conn:
            return int(conn.execute(q).scalar() or 0)

    def is_granted(self, tenant: str, alias: str) -> bool:
        """Whether ``tenant`` holds a grant of ``alias`` (operators: says nothing of routes)."""
        q = sa.select(grants.c.tenant).where(grants.c.tenant == tenant, grants.c.alias == alias)
        with self.engine.connect() as conn:
            return conn.execute(q).first() is not None

    def revoked_digests(self) -> frozenset[str]:
        """Every revoked adapter digest."""
        with self.engine.connect() as conn:
            return frozenset(str(d) for d in conn.execute(sa.select(revocations.c.digest))
                             .scalars())

    def is_revoked(self, digest: str, *, immediate: bool = False) -> bool:
        """Whether ``digest`` is revoked (``immediate``: with the kill switch)."""
        q = sa.select(revocations.c.digest).where(revocations.c.digest == digest)
        if immediate:
            q = q.where(revocations.c.immediate.is_(True))
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
        """``{kid: base64 public key}`` for every recorded ticket-signing key, retired ones
        included (see :meth:`retired_key_ids`)."""
        with self.engine.connect() as conn:
            return {str(r.kid): str(r.public_key)
                    for r in conn.execute(sa.select(signing_keys.c.kid, signing_keys.c.public_key))}

    def vouched_signing_keys(self, keys_dir: Path | None) -> dict[str, str]:
        """:meth:`signing_keys` that the offline root vouches for: the root public key comes
        from configuration (``root_of_trust.root_public_key(keys_dir)``), never from here; a key
        recorded without the root's signature (forged through SQL) is not among them."""
        root = root_of_trust.root_public_key(keys_dir)
        if root is None:
            return {}
        q = sa.select(signing_keys.c.kid, signing_keys.c.public_key,
                      signing_keys.c.root_signature)
        with self.engine.connect() as conn:
            return {str(r.kid): str(r.public_key) for r in conn.execute(q)
                    if root_of_trust.vouches(root, r.root_signature, root_of_trust.RECORD,
                                             str(r.kid), str(r.public_key))}

    def signing_key_rows(self) -> list[SigningKeyRow]:
        """Every recorded ticket-signing key with when it was recorded and retired, oldest
        first."""
        q = (sa.select(signing_keys.c.kid, signing_keys.c.created_at, signing_keys.c.retired_at)
             .order_by(signing_keys.c.created_at, signing_keys.c.kid))
        with self.engine.connect() as conn:
            return [SigningKeyRow(**r._mapping) for r in conn.execute(q)]

    def retired_key_ids(self) -> frozenset[str]:
        """Key ids of the retired ticket-signing keys: never signed with, never trusted."""
        q = sa.select(signing_keys.c.kid).where(signing_keys.c.retired_at.is_not(None))
        with self.engine.connect() as conn:
            return frozenset(str(k) for k in conn.execute(q).scalars())
