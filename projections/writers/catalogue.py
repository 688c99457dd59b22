"""Writers of the catalogue tables: tenants, bases, adapters, releases, revocations and the
serving steps hosts report after a revocation (``projections.tables``)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from sqlalchemy.engine import Connection

from control.domain import DRAFT, REVOKED, Adapter, BaseModel, Release, ReleaseManifest, Tenant
from projections.tables import (
    adapters,
    api_keys,
    bases,
    releases,
    revocations,
    serving_steps,
    tenants,
)
from projections.writers.rows import Rows


def _tenant_created(e: Tenant.TenantCreated) -> Rows:
    return [(tenants, {"name": e.name, "created_at": e.timestamp, "pool": None, "regions": ""}),
            (api_keys, {"key_hash": e.api_key_hash, "tenant": e.name})]


def _base_registered(e: BaseModel.BaseRegistered) -> Rows:
    return [(bases, {"digest": e.digest, "name": e.name,
                     "tokenizer_digest": e.tokenizer_digest})]


def _adapter_registered(e: Adapter.AdapterRegistered) -> Rows:
    meta = e.metadata or {}
    return [(adapters, {
        "digest": e.digest, "tenant": e.tenant, "alias": e.alias, "base_digest": e.base_digest,
        "tokenizer_digest": e.tokenizer_digest, "state": DRAFT, "rank": e.rank,
        "registered_at": e.timestamp, "owner": str(meta.get("owner", "")),
        "training_data_version": str(meta.get("training_data_version", "")),
        "licence": str(meta.get("licence", "")),
        "allowed_tasks": ",".join(meta.get("allowed_tasks", [])),
        "signature": (e.signature or {}).get("method"),
        "evaluation_report_digest": None, "release_digest": None})]


def _serving_step(step: str) -> Callable[[Any], Rows]:
    def rows(e: Any) -> Rows:
        return [(serving_steps, {"digest": e.digest, "host": e.host, "step": step,
                                 "at": e.timestamp})]
    return rows


def _release_created(e: Release.ReleaseCreated) -> Rows:
    row = ReleaseManifest.of(e).as_dict()  # one column per manifest field, by the same name
    row["inference_defaults"] = json.dumps(row["inference_defaults"], sort_keys=True)
    return [(releases, {"digest": e.digest, **row, "created_at": e.timestamp})]


def _evaluation_recorded(conn: Connection, e: Adapter.EvaluationRecorded) -> None:
    conn.execute(adapters.update().where(adapters.c.digest == e.digest)
                 .values(evaluation_report_digest=e.report_digest))


def _adapter_promoted(conn: Connection, e: Adapter.AdapterPromoted) -> None:
    values: dict[str, Any] = {"state": e.to}
    if e.release is not None:
        values["release_digest"] = e.release
    conn.execute(adapters.update().where(adapters.c.digest == e.digest).values(**values))


def _adapter_revoked(conn: Connection, e: Adapter.AdapterRevoked) -> None:
    conn.execute(adapters.update().where(adapters.c.digest == e.digest).values(state=REVOKED))
    escalated = conn.execute(revocations.update().where(revocations.c.digest == e.digest)
                             .values(immediate=revocations.c.immediate | e.immediate))
    if not escalated.rowcount:  # the first revocation of the digest
        conn.execute(revocations.insert().values(digest=e.digest, reason=e.reason,
                                                 revoked_at=e.timestamp,
                                                 immediate=e.immediate))


INSERTS: dict[type, Callable[[Any], Rows]] = {
    Tenant.TenantCreated: _tenant_created,
    BaseModel.BaseRegistered: _base_registered,
    Adapter.AdapterRegistered: _adapter_registered,
    Adapter.AdapterDrained: _serving_step("drained"),
    Adapter.AdapterPurged: _serving_step("purged"),
    Adapter.AdapterUnloaded: _serving_step("unloaded"),
    Release.ReleaseCreated: _release_created,
}
HANDLERS: dict[type, Callable[[Connection, Any], None]] = {
    Adapter.EvaluationRecorded: _evaluation_recorded,
    Adapter.AdapterPromoted: _adapter_promoted,
    Adapter.AdapterRevoked: _adapter_revoked,
}
