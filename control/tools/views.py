"""Tables for people: the audit log and the incident view, as the CLI and the demo print them."""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from control.contracts.digests import short

# Types only, and rich where a table is made: every CLI verb imports this module for ``cell``,
# and few print a table (none with --json) or read the audit log or the ledger.
if TYPE_CHECKING:
    from rich.table import Table

    from control.app.audit import AuditEntry
    from control.contracts.ledger import LedgerEntry

SUMMARY_WIDTH = 90


def iso(t: float | None) -> str:
    """Epoch seconds as ISO 8601 UTC with milliseconds ("" for None)."""
    if t is None:
        return ""
    return dt.datetime.fromtimestamp(t, dt.UTC).isoformat(timespec="milliseconds")


def cell(v: Any) -> str:
    """A value as a short cell: digests shortened, lists joined."""
    if isinstance(v, str) and v.startswith("sha256:"):
        return short(v)
    if isinstance(v, (list, tuple)):
        return ",".join(cell(x) for x in v)
    if isinstance(v, dict):
        return " ".join(f"{k}={cell(x)}" for k, x in v.items())
    return "" if v is None else str(v)


def audit_table(entries: Sequence[AuditEntry]) -> Table:
    """The audit log for a terminal: one ``key=value`` per line in details, digests shortened and
    keys without their ``_digest`` suffix, so rows wrap between pairs, never inside a value, at
    80 columns; ``--json`` has every value in full."""
    from rich.table import Table

    t = Table(title=f"audit log: {len(entries)} events, in recorded order")
    for c in ("#", "time (UTC)", "actor", "event", "details"):
        # Position, time and event never wrap; a details line too long is cut, not folded.
        t.add_column(c, overflow="ellipsis", no_wrap=c in ("#", "time (UTC)", "event"))
    for e in entries:
        pairs = [f"{k.removesuffix('_digest')}={cell(v)}" for k, v in e.summary.items()]
        details = "\n".join(p if len(p) <= SUMMARY_WIDTH else p[: SUMMARY_WIDTH - 1] + "…"
                            for p in pairs)
        t.add_row(str(e.position), e.time[11:23], e.actor, e.event_type, details)
    return t


def incident_table(rows: Sequence[LedgerEntry], digest: str) -> Table:
    """The requests a digest served, for a terminal of 80 columns: request ids and releases
    shortened, times to the second (``--json`` has every value in full)."""
    from rich.table import Table

    # The full digest: a short prefix could belong to another adapter (or to none at all).
    # At least as wide as the digest, so the title never splits it (78 columns: fits 80).
    t = Table(title=f"requests served by {digest}: {len(rows)}", min_width=len(digest) + 7)
    for c in ("request", "tenant", "release", "admitted", "outcome", "in/out", "host"):
        t.add_column(c, overflow="ellipsis")
    for r in rows:
        t.add_row(r.request_id[:8], r.tenant or "", cell(r.release_digest),
                  iso(r.admitted_at)[11:19], r.outcome + (f": {r.reason}" if r.reason else ""),
                  f"{r.tokens_in or 0}/{r.tokens_out or 0}", r.host)
    return t
