"""The registry and routing state at a moment in the past, rebuilt by replaying the event log
into a scratch database (``loraplane audit state --at``)."""

from __future__ import annotations

import datetime as dt
from typing import Any

import sqlalchemy as sa
from eventsourcing.application import Application
from sqlalchemy.pool import StaticPool

from control.app.audit import events_until
from projections import writers
from projections.tables import (
    adapters,
    api_keys,
    create_tables,
    grants,
    releases,
    revocations,
    routes,
    signing_keys,
    tenants,
)


def state_as_of(registry: Application[Any], when: dt.datetime) -> dict[str, Any]:
    """The registry and routing state at ``when`` (UTC if naive), rebuilt by replay."""
    if when.tzinfo is None:
        when = when.replace(tzinfo=dt.UTC)
    scratch = sa.create_engine("sqlite://", poolclass=StaticPool,
                               connect_args={"check_same_thread": False})
    create_tables(scratch)
    last = 0
    with scratch.begin() as conn:
        for n, domain_event in events_until(registry, when):
            writers.apply(conn, domain_event)
            last = n.id
    out: dict[str, Any] = {"as_of": when.isoformat(), "position": last}
    with scratch.connect() as conn:
        out["adapters"] = [
            dict(r._mapping) for r in conn.execute(
                sa.select(adapters.c.digest, adapters.c.tenant, adapters.c.alias,
                          adapters.c.state, adapters.c.release_digest)
                .order_by(adapters.c.registered_at, adapters.c.digest))]
        out["aliases"] = [dict(r._mapping) for r in conn.execute(
            sa.select(routes).order_by(routes.c.alias))]
        out["releases"] = [dict(r._mapping) for r in conn.execute(
            sa.select(releases.c.digest, releases.c.tenant, releases.c.adapter_digest,
                      releases.c.base_digest).order_by(releases.c.digest))]
        out["grants"] = [dict(r._mapping) for r in conn.execute(
            sa.select(grants).order_by(grants.c.alias, grants.c.tenant))]
        out["revoked"] = sorted(str(d) for d in conn.execute(
            sa.select(revocations.c.digest)).scalars())
        out["retired_keys"] = sorted(str(k) for k in conn.execute(
            sa.select(signing_keys.c.kid).where(signing_keys.c.retired_at.is_not(None)))
            .scalars())
        keyed = set(conn.execute(sa.select(api_keys.c.tenant)).scalars())
        out["tenants_without_key"] = sorted(str(t) for t in conn.execute(
            sa.select(tenants.c.name)).scalars() if t not in keyed)
    scratch.dispose()
    return out
