"""The audit view: the whole event history, in the order it was recorded.

Read straight from the event store's notification log (not from a projection), so what an
auditor sees is what was recorded. Summaries never carry API keys or their hashes; a base's
Linear shapes are summarised as a count.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, cast

from eventsourcing.application import Application
from eventsourcing.domain import AggregateEvent

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
    position = since
    while limit is None or len(entries) < limit:
        page = _PAGE if limit is None else min(_PAGE, limit - len(entries))
        notifications = registry.recorder.select_notifications(
            start=position, limit=page, inclusive_of_start=False)
        if not notifications:
            break
        for n in notifications:
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
        position = notifications[-1].id
    return entries
