"""The audit view: the whole event history, in the order it was recorded.

Read straight from the event store's notification log (not from a projection), so what an
auditor sees is what was recorded. Summaries never carry API keys or their hashes (a rotation
shows the tenant only); a base's Linear shapes are summarised as a count.

``projections.as_of.state_as_of`` replays the history up to a time (``events_until``) into a
scratch database with the same projection code the deployment runs. ``export_lines`` writes the
history as JSON lines, each with its event hash (the one
``control.app.integrity`` seals), so an export can be checked against the signed checkpoints.
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any, cast

from eventsourcing.application import Application
from eventsourcing.domain import AggregateEvent

from control.app.integrity import event_hash
from control.contracts.event_log import notifications
from control.domain import event_fields

# Fields never shown in the audit, whatever event carries them.
_SECRET_FIELDS = frozenset({"api_key", "api_key_hash", "key_hash"})
_PAGE = 500


@dataclass(frozen=True)
class AuditEntry:
    """One recorded event, for people and for JSON."""

    position: int  # notification id: the global order of the history
    time: str  # ISO 8601, UTC
    actor: str
    event_type: str  # e.g. "AdapterRegistered"
    aggregate: str  # aggregate kind, e.g. "Adapter"
    aggregate_id: str
    summary: dict[str, Any] = field(default_factory=dict)


def _summary(fields: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in fields.items():
        if key == "actor" or key in _SECRET_FIELDS or "key_hash" in key:
            continue
        if key == "reason" and value == "":
            continue  # an optional reason left out (key retirement, API key revocation)
        if key == "linear_shapes" and isinstance(value, dict):
            out["linear_modules"] = len(value)
            continue
        out[key] = value
    return out


def audit_log(
    registry: Application[Any], *, since: int = 0, limit: int | None = None
) -> list[AuditEntry]:
    """Events after position ``since`` in recorded order (at most ``limit`` of them)."""
    entries: list[AuditEntry] = []
    for n in notifications(registry.recorder, after=since, page_size=_PAGE, limit=limit):
        domain_event = cast(AggregateEvent, registry.mapper.to_domain_event(n))
        kind, _, event_type = type(domain_event).__qualname__.rpartition(".")
        fields = event_fields(domain_event)
        entries.append(AuditEntry(
            position=n.id,
            time=domain_event.timestamp.isoformat(),
            actor=str(fields.get("actor", "")),
            event_type=event_type,
            aggregate=kind or event_type,
            aggregate_id=str(domain_event.originator_id),
            summary=_summary(fields),
        ))
    return entries


def events_until(registry: Application[Any], until: dt.datetime | None
                  ) -> Iterator[tuple[Any, AggregateEvent]]:
    """Every recorded event stamped at or before ``until`` (None: all), with its notification,
    in recorded order."""
    for n in notifications(registry.recorder, after=0, page_size=_PAGE):
        domain_event = cast(AggregateEvent, registry.mapper.to_domain_event(n))
        # Filter rather than stop: positions and timestamps need not agree exactly (the
        # events of one command are stamped as they are made, then saved together).
        if until is None or domain_event.timestamp <= until:
            yield n, domain_event


def export_lines(registry: Application[Any]) -> Iterator[str]:
    """The whole history as JSON lines: position, time, actor, event, aggregate, version,
    summary and the event hash that the audit checkpoints seal."""
    for n, domain_event in events_until(registry, None):
        kind, _, event_type = type(domain_event).__qualname__.rpartition(".")
        fields = event_fields(domain_event)
        entry = AuditEntry(position=n.id, time=domain_event.timestamp.isoformat(),
                           actor=str(fields.get("actor", "")), event_type=event_type,
                           aggregate=kind or event_type,
                           aggregate_id=str(domain_event.originator_id),
                           summary=_summary(fields))
        yield json.dumps({**asdict(entry), "version": n.originator_version,
                          "event_hash": event_hash(n)}, sort_keys=True, default=str)
