"""What the console pages show, read from the same places the CLI reads them.

Adapter timelines come from the event store per aggregate (the adapter's own events, then the
alias and rollout events that name its release), not from a scan of the whole history: a page
costs the same with a million other events recorded. Incident rows are the ones ``loraplane
incident requests --json`` prints (``projections.incidents.requests_for``, the same fields, the
same ``ledger_proof``); the audit status is ``AuditSeal.verify``, as ``audit verify`` runs it;
rollouts are read through the ``RolloutDesk`` the rollout verbs use.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any
from uuid import UUID

import sqlalchemy as sa
from eventsourcing.utils import get_topic

from control.app.integrity import AuditSeal, audit_checkpoints
from control.app.ledger_audit import coverage, sync
from control.contracts.db import make_engine
from control.contracts.event_log import page_after
from control.contracts.host_status import STALE_AFTER_S, HostStatus, HostStatusTable
from control.contracts.ledger import Ledger, LedgerEntry, adapter_loads, request_ledger
from control.contracts.ledger_log import ledger_verified
from control.domain import Rollout, event_fields
from control.domain.ids import adapter_id, alias_id
from control.domain.rollout import rollout_id
from projections.incidents import requests_for
from projections.routing import RoutingView
from projections.tables import adapters as adapter_rows
from projections.tables import tenants as tenant_rows

if TYPE_CHECKING:
    from control.app.registry import Registry
    from control.app.rollouts import RolloutDesk

# Fields never shown, whatever event carries them (as in the audit log).
_SECRET = ("api_key", "key_hash")
_STARTED = get_topic(Rollout.RolloutStarted)
# The console's buttons each status offers (``RolloutDesk``'s moves): none once it has ended.
ACTIONS_BY_STATUS = {"running": ("pause", "abort"), "paused": ("resume", "abort")}
# The health figures (``LoraService.health``) a host page flags when they are not zero.
_PROBLEMS = ("violations", "identity_mismatches", "ledger_backlog", "ledger_poisoned")


def iso(t: float | None) -> str:
    """Epoch seconds as ISO 8601 UTC with milliseconds ("" for None): the CLI's format."""
    if t is None:
        return ""
    return dt.datetime.fromtimestamp(t, dt.UTC).isoformat(timespec="milliseconds")


def _details(fields: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in fields.items()
            if k != "actor" and not any(s in k for s in _SECRET)}


def _mentions(fields: dict[str, Any], wanted: set[str]) -> bool:
    return any(isinstance(v, str) and v in wanted for v in fields.values())


def timeline(reg: Registry, digest: str) -> list[dict[str, Any]]:
    """The lifecycle of one adapter, oldest first: its own events (registered, evaluated, gate
    verdict, promoted, revoked, drained, purged, unloaded), the alias events that pointed to or
    canaried its release, and the rollouts of that release. Each: time, actor, event, details."""
    store = reg.repository.event_store
    own: list[Any] = list(store.get(adapter_id(digest)))  # aggregate events: timestamped
    out: list[tuple[Any, str, dict[str, Any]]] = [
        (e.timestamp, type(e).__name__, event_fields(e)) for e in own]
    routing = RoutingView(reg.follower.engine)
    row = routing.adapter(digest)
    wanted = {digest} | ({row.release_digest} if row and row.release_digest else set())
    for f in (event_fields(e) for e in own):
        if isinstance(f.get("release"), str):
            wanted.add(f["release"])
    if row is not None and row.alias:
        alias_events: list[Any] = list(store.get(alias_id(row.alias)))
        for e in alias_events:
            fields = event_fields(e)
            if _mentions(fields, wanted):
                out.append((e.timestamp, type(e).__name__, fields))
        for r in rollouts(reg, alias=row.alias):
            if r["target"] in wanted:
                for name, fields, stamp in _rollout_events(reg, r["id"]):
                    if name in ("RolloutStarted", "RolloutCompleted", "RolloutRolledBack",
                                "RolloutPaused", "RolloutResumed", "RolloutAborted",
                                "RolloutStepEntered"):
                        out.append((stamp, name, fields))
    out.sort(key=lambda x: x[0])
    return [{"time": t.isoformat(timespec="milliseconds"), "actor": str(f.get("actor", "")),
             "event": name, "details": _details(f)} for t, name, f in out]


def _rollout_events(reg: Registry, rid: UUID) -> list[tuple[str, dict[str, Any], Any]]:
    events: list[Any] = list(reg.repository.event_store.get(rid))
    return [(type(e).__name__, event_fields(e), e.timestamp) for e in events]


def rollouts(reg: Registry, alias: str | None = None) -> list[dict[str, Any]]:
    """Every rollout ever started (newest first), found by the topic of its first event."""
    found: list[UUID] = []
    after = 0
    while True:
        page = page_after(reg.recorder, after, 500, topics=(_STARTED,))
        if not page:
            break
        found += [UUID(str(n.originator_id)) for n in page]
        after = page[-1].id
    out = []
    for rid in reversed(found):
        r = reg.load(Rollout, rid, "rollout")
        if alias is not None and r.alias != alias:
            continue
        out.append({"id": rid, "alias": r.alias, "number": r.number, "status": r.status.value,
                    "target": r.target, "baseline": r.baseline, "percent": r.percent,
                    "steps": list(r.steps), "step": r.step + 1, "started_at": r.started_at,
                    "reasons": list(r.reasons)})
    return out


def rollout_detail(desk: RolloutDesk, alias: str, number: int | None = None) -> dict[str, Any]:
    """One rollout (the alias's latest unless ``number``): its state, steps, and every
    window's figures and decision, from its recorded events."""
    r = desk.current(alias) if number is None else desk.get(rollout_id(alias, number))
    windows: list[dict[str, Any]] = []
    moves: list[dict[str, Any]] = []
    for name, fields in desk.history(r.id):
        if name == "RolloutWindowEvaluated":
            windows.append(fields)
        elif name != "RolloutStarted":
            moves.append({"event": name, "actor": fields.get("actor", ""),
                          "details": _details({k: v for k, v in fields.items()
                                               if k not in ("alias", "evidence", "metrics")})})
    return {"alias": r.alias, "number": r.number, "status": r.status.value, "target": r.target,
            "baseline": r.baseline, "steps": list(r.steps), "step": r.step + 1,
            "percent": r.percent, "window_s": r.window_s, "reasons": list(r.reasons),
            "started_at": r.started_at, "windows": windows, "moves": moves,
            "live": r.status.value in ("running", "paused"),
            "actions": ACTIONS_BY_STATUS.get(r.status.value, ())}


def incident_rows(reg: Registry, *, adapter: str | None = None, base: str | None = None,
                  release: str | None = None, training_data_version: str | None = None,
                  since: float | None = None, until: float | None = None,
                  include_refused: bool = False) -> list[dict[str, Any]]:
    """The rows ``loraplane --json incident requests`` prints for the same question."""
    rows = requests_for(reg.settings, adapter=adapter, base=base, release=release,
                        training_data_version=training_data_version, since=since, until=until)
    if not include_refused:
        rows = [r for r in rows if r.outcome != "rejected"]
    # Shallow, as the CLI's ``as_dict``: ``dataclasses.asdict`` deep-copies every value, a
    # third of a second for a thousand rows.
    names = [f.name for f in dataclasses.fields(LedgerEntry)]
    data = [{k: getattr(r, k) for k in names} for r in rows]
    for d in data:
        d["admitted_at_iso"] = iso(d["admitted_at"])
    engine = make_engine(reg.settings.db_url)
    sync(reg, engine)
    cover = coverage(reg, engine, [r.request_id for r in rows])
    for d in data:
        d["ledger_proof"] = cover.status.get(d["request_id"], "unlogged")
    return data


def audit_status(reg: Registry, seal: AuditSeal) -> dict[str, Any]:
    """``audit verify``'s report, when it ran, and the latest signed checkpoints."""
    report = seal.verify()
    with seal.engine.connect() as conn:
        latest = [dict(r._mapping) for r in conn.execute(
            sa.select(audit_checkpoints.c.seq, audit_checkpoints.c.first_position,
                      audit_checkpoints.c.last_position, audit_checkpoints.c.chain_hash,
                      audit_checkpoints.c.created_at, audit_checkpoints.c.kid)
            .order_by(audit_checkpoints.c.seq.desc()).limit(10))]
    for c in latest:
        c["created_iso"] = iso(c["created_at"])
    return {"report": report.to_json(), "verified_at": time.time(), "checkpoints": latest,
            "ledger": ledger_checkpoints(seal.engine)}


def ledger_checkpoints(engine: sa.Engine) -> list[dict[str, Any]]:
    """Per host, the newest of its signed ledger checkpoints the control plane verified (the
    request ledger's tamper evidence); none before a host's first verified checkpoint."""
    if not sa.inspect(engine).has_table(ledger_verified.name):
        return []
    c = ledger_verified.c
    with engine.connect() as conn:
        rows = conn.execute(sa.select(c.host, sa.func.max(c.size).label("size"),
                                      sa.func.max(c.verified_at).label("at"))
                            .group_by(c.host).order_by(c.host)).all()
    return [{"host": r.host, "size": int(r.size), "verified": iso(r.at)} for r in rows]


def hosts(reg: Registry, window_s: float = 24 * 3600.0) -> list[dict[str, Any]]:
    """Each host that wrote ledger rows, load records or a status report in the last
    ``window_s``: its last request and its requests by outcome (one range over the admission-time
    index, never a scan of the whole ledger), its latest status report (``status``: slots, tiers,
    load queue, batch, health; None for a host that never reported) and its latest evictions."""
    c = request_ledger.c
    now = time.time()
    since = now - window_s
    engine = Ledger(make_engine(reg.settings.db_url)).engine  # the table made if still missing
    with engine.connect() as conn:
        recent = conn.execute(
            sa.select(c.host, c.outcome, sa.func.count().label("n"),
                      sa.func.max(c.admitted_at).label("last"))
            .where(c.admitted_at >= since).group_by(c.host, c.outcome)).all()
    out: dict[str, dict[str, Any]] = {}
    for r in recent:
        h = out.setdefault(r.host, {"host": r.host, "last_at": 0.0, "outcomes": {}})
        h["outcomes"][r.outcome] = int(r.n)
        h["last_at"] = max(h["last_at"], float(r.last))
    for h in out.values():
        h["last"] = iso(h["last_at"])
    reports = {st.host: st for st in HostStatusTable(engine).all(since)}
    owners = _Owners(reg)
    owners.fetch(e.digest for st in reports.values() for e in (*st.device, *st.host_tier))
    resident, evictions = residency(reg, since, owners=owners)
    for host in set(resident) | set(evictions) | set(reports):
        h = out.setdefault(host, {"host": host, "last_at": 0.0, "last": "", "outcomes": {}})
    for h in out.values():
        h["resident"] = resident.get(h["host"], [])
        h["evictions"] = evictions.get(h["host"], [])
        report = reports.get(h["host"])
        h["status"] = None if report is None else _status(report, h["resident"], owners, now)
    return sorted(out.values(), key=lambda h: h["host"])


def _status(st: HostStatus, loaded: list[dict[str, Any]], owners: _Owners, now: float
            ) -> dict[str, Any]:
    """A host's status report as the page shows it: healthy while it reports, stale once its
    last report is older than ``STALE_AFTER_S``; each digest with its owner; the health figures
    that are not zero (broken invariants, identity mismatches, ledger rows held back)."""
    since = {a["digest"]: a["since"] for a in loaded}
    problems = {k: v for k, v in st.health.items() if k in _PROBLEMS and v}
    return {
        "state": "stale" if now - st.reported_at > STALE_AFTER_S else "healthy",
        "reported": iso(st.reported_at), "started": iso(st.started_at),
        "slots_total": st.slots_total,
        "device": [{"digest": e.digest, "tenant": owners(e.digest), "bytes": e.bytes,
                    "active": e.active, "revoked": e.revoked, "since": since.get(e.digest, "")}
                   for e in st.device],
        "host_tier": [{"digest": e.digest, "tenant": owners(e.digest), "bytes": e.bytes,
                       "active": e.active} for e in st.host_tier],
        "pending_loads": st.pending_loads, "load_waiters": st.load_waiters,
        "load_queue_max": st.load_queue_max, "running": st.running, "waiting": st.waiting,
        "kv_reserved": st.kv_tokens_reserved, "kv_budget": st.kv_tokens_budget,
        "device_bytes": st.device_bytes, "device_budget": st.device_budget,
        "host_bytes": st.host_bytes, "host_budget": st.host_budget, "problems": problems,
    }


class _Owners:
    """Digest -> the owning tenant's name, from the routing projection ("?" when unknown).
    ``fetch`` reads many in one query: four hosts' reports name 160 digests, and one query
    each took 80 ms of the page."""

    def __init__(self, reg: Registry) -> None:
        self.engine = make_engine(reg.settings.db_url)
        self.known: dict[str, str] = {}

    def fetch(self, digests: Iterable[str]) -> None:
        wanted = sorted(set(digests) - set(self.known))
        for start in range(0, len(wanted), 500):  # bound the statement's parameters
            chunk = wanted[start:start + 500]
            with self.engine.connect() as conn:
                found = {str(r.digest): str(r.tenant) for r in conn.execute(
                    sa.select(adapter_rows.c.digest, adapter_rows.c.tenant)
                    .where(adapter_rows.c.digest.in_(chunk)))}
            self.known.update({d: found.get(d, "?") for d in chunk})

    def __call__(self, digest: str) -> str:
        if digest not in self.known:
            self.fetch([digest])
        return self.known[digest]


def residency(reg: Registry, since: float, evictions_kept: int = 10, *,
              owners: _Owners | None = None,
              ) -> tuple[dict[str, list[dict[str, Any]]], dict[str, list[dict[str, Any]]]]:
    """Per host, the adapters its device slots hold (their last load record says ``loaded``)
    and its latest evictions since ``since`` (``unloaded``, with the cache's reason), from the
    load records hosts write (``adapter_loads``), with each adapter's owner from the registry.
    A host's status report (``hosts``) says what its slots hold now; these records are what the
    page shows for a host that never reported, and when each adapter was loaded."""
    c = adapter_loads.c
    engine = Ledger(make_engine(reg.settings.db_url)).engine
    latest = sa.select(c.host, c.adapter_digest, sa.func.max(c.id).label("id")).group_by(
        c.host, c.adapter_digest).subquery()
    with engine.connect() as conn:
        last = conn.execute(sa.select(c.host, c.adapter_digest, c.outcome, c.started_at,
                                      c.resident_bytes).join(latest, c.id == latest.c.id)
                            .where(c.outcome == "loaded")).all()
        gone = conn.execute(sa.select(c.host, c.adapter_digest, c.started_at, c.reason)
                            .where(c.outcome == "unloaded", c.started_at >= since)
                            .order_by(c.id.desc()).limit(200)).all()
    owner = owners or _Owners(reg)
    owner.fetch(r.adapter_digest for r in (*last, *gone))
    resident: dict[str, list[dict[str, Any]]] = {}
    for r in sorted(last, key=lambda r: (r.host, -r.started_at)):
        resident.setdefault(r.host, []).append(
            {"digest": r.adapter_digest, "tenant": owner(r.adapter_digest),
             "bytes": r.resident_bytes, "since": iso(r.started_at)})
    evicted: dict[str, list[dict[str, Any]]] = {}
    for r in gone:
        kept = evicted.setdefault(r.host, [])
        if len(kept) < evictions_kept:
            kept.append({"digest": r.adapter_digest, "tenant": owner(r.adapter_digest),
                         "reason": r.reason or "", "at": iso(r.started_at)})
    return resident, evicted


def cache_status(reg: Registry, window_s: float = 3600.0, top: int = 10) -> dict[str, Any]:
    """``loraplane cache status``: each reporting host's tiers (adapters, bytes, budgets), its
    load queue, each tenant's use of its resident share (device bytes of the adapters it owns,
    over the host's device budget, beside the share its policy or the host's default gives),
    and the evictions of the last ``window_s`` by reason with the most evicted adapters."""
    now = time.time()
    engine = Ledger(make_engine(reg.settings.db_url)).engine
    reports = HostStatusTable(engine).all(now - window_s)
    owners = _Owners(reg)
    owners.fetch(e.digest for st in reports for e in (*st.device, *st.host_tier))
    with make_engine(reg.settings.db_url).connect() as conn:
        policy = {str(r.name): r.resident_share for r in conn.execute(
            sa.select(tenant_rows.c.name, tenant_rows.c.resident_share))}
    default_share = reg.settings.resident_share
    hosts: list[dict[str, Any]] = []
    for st in sorted(reports, key=lambda s: s.host):
        use: dict[str, int] = {}
        for e in st.device:
            use[owners(e.digest)] = use.get(owners(e.digest), 0) + e.bytes
        hosts.append({
            "host": st.host,
            "state": "stale" if now - st.reported_at > STALE_AFTER_S else "healthy",
            "tiers": {
                "device": {"adapters": len(st.device), "slots": st.slots_total,
                           "bytes": st.device_bytes, "budget": st.device_budget},
                "host": {"adapters": len(st.host_tier), "bytes": st.host_bytes,
                         "budget": st.host_budget}},
            "load_queue": {"pending_loads": st.pending_loads, "waiting_requests": st.load_waiters,
                           "max": st.load_queue_max},
            "tenants": [{"tenant": t, "device_bytes": b,
                         "share_used": b / st.device_budget if st.device_budget else 0.0,
                         "share": policy.get(t) or default_share}
                        for t, b in sorted(use.items(), key=lambda kv: -kv[1])],
        })
    c = adapter_loads.c
    with engine.connect() as conn:
        reasons = conn.execute(
            sa.select(c.reason, sa.func.count().label("n"))
            .where(c.outcome == "unloaded", c.started_at >= now - window_s)
            .group_by(c.reason)).all()
        most = conn.execute(
            sa.select(c.adapter_digest, sa.func.count().label("n"))
            .where(c.outcome == "unloaded", c.started_at >= now - window_s)
            .group_by(c.adapter_digest).order_by(sa.func.count().desc()).limit(top)).all()
    owners.fetch(r.adapter_digest for r in most)
    return {
        "hosts": hosts,
        "evictions": {
            "window_s": window_s,
            "by_reason": {str(r.reason or "unknown"): int(r.n)
                          for r in sorted(reasons, key=lambda r: -int(r.n))},
            "top": [{"digest": r.adapter_digest, "tenant": owners(r.adapter_digest),
                     "evictions": int(r.n)} for r in most],
        },
    }
