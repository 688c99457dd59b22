"""Reading what the evaluation gate's requests left behind, and the figures that are not
answers: split from ``control.tools.gate``, which runs the phases (see its module notes).

- :func:`read_ledger`: each request's ledger row (by ticket id; the mismatch refusals that
  leave rows without a ticket id, by reason within the phase's time window), compared with what
  its client got: a missing or disagreeing row is a ``ledger`` mismatch, another digest than
  the ticket's is a misattribution;
- :func:`judge_burst`: the mixed burst's answers against their release's solo answers;
- :func:`phase_figures`, :func:`by_tag`, :func:`ledger_counts`, :func:`authorization_errors`:
  the figures the report holds;
- :func:`memory_accounting`: the host's ``loraplane_backend_resident_bytes`` against the memory
  plan it admits adapters by; :func:`p95`: the cold-load percentile.
"""

from __future__ import annotations

import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from backend.serving.memory import (
    BaseShapes,
    default_device,
    element_size,
    plan_for_host,
    serving_dtype,
)
from control.contracts.golden import GoldenTask
from control.contracts.ledger import Ledger, LedgerEntry, Outcome
from control.tools.gate_requests import PHASES, UNVERIFIED_ROUTES, GateTarget, Sent

LEDGER_SLACK_S = 1.0  # host and gate clocks are one machine's, or NTP-close
METRICS_SETTLE_S = 1.5  # the host refreshes its memory gauges every second when idle
_SAMPLE = "loraplane_backend_resident_bytes"


def read_ledger(sent: Sequence[Sent], ledger: Ledger, started: float,
                mismatch_window: tuple[float, float], on_target: Callable[[str | None], bool]
                ) -> None:
    """Fill each request's ledger figures from its row, and mark the requests whose row is
    missing or disagrees with what their client got (``why`` starts with "ledger"), or that
    another digest than their ticket's answered (``misattributed``)."""
    rows = ledger.query(since=started - LEDGER_SLACK_S)
    by_ticket: dict[str, list[LedgerEntry]] = {}
    for r in rows:
        if r.ticket_id:
            by_ticket.setdefault(r.ticket_id, []).append(r)
    # Tickets that fail verification leave rows without a ticket id, so the wrong-base
    # and wrong-tokenizer rows are the refusals with those reasons within the phase.
    lo, hi = mismatch_window
    unverified = Counter(r.reason for r in rows
                         if r.ticket_id is None and lo - 0.2 <= r.admitted_at <= hi + 0.2
                         and r.reason in ("base", "tokenizer") and on_target(r.host))
    for s in sent:
        if s.route in UNVERIFIED_ROUTES:
            reason = UNVERIFIED_ROUTES[s.route]
            if unverified[reason] > 0:
                unverified[reason] -= 1
                s.ledger_outcome, s.ledger_reason = Outcome.REJECTED.value, reason
            else:
                s.why = "ledger: no refused row without a ticket for this request"
            continue
        found = by_ticket.get(s.ticket_id, [])
        if len(found) != 1:
            s.why = f"ledger: {len(found)} rows for this request's ticket"
            continue
        row = found[0]
        s.ledger_outcome, s.ledger_reason = row.outcome, row.reason
        s.served_digest = row.served_digest
        if s.ok != (row.outcome == Outcome.OK) or (s.ok and row.request_id != s.request_id):
            s.why = f"ledger: row says {row.outcome}, the client got {s.status}"
        elif s.ok and (s.answer_digest != (s.expected or "")
                       or row.served_digest != s.expected
                       or row.adapter_digest != s.expected):
            s.misattributed = True
            s.why = "attribution: answer or ledger names another digest than the ticket"
        elif row.outcome == Outcome.IDENTITY_MISMATCH:
            s.misattributed = True
            s.why = "attribution: identity mismatch"

def judge_burst(sent: Sequence[Sent], answers: dict[str, dict[str, Sent]]) -> None:
    """Mixed answers against their release's solo answer, where the prompt tells the
    releases in the burst apart (else the text proves nothing; the digests still count)."""
    labels = [k for k in answers if any(s.phase == "mixed" and s.route == k
                                        for s in sent)]
    for s in sent:
        if s.phase != "mixed" or not s.ok or s.misattributed or s.task is None:
            continue
        own = answers[s.route].get(s.task)
        others = [answers[k][s.task].text for k in labels if k != s.route
                  and s.task in answers[k] and answers[k][s.task].ok]
        if own is None or not own.ok or own.text in others:
            s.why = s.why or "indistinguishable: its release's solo answer equals another's"
            continue
        if s.text != own.text:
            s.misattributed = True
            s.why = "attribution: the text is not its release's solo answer"

def authorization_errors(sent: Sequence[Sent]) -> int:
    """Gate tickets refused, and tickets that should have been refused but were served."""
    wrong = sum(1 for s in sent if s.phase == "mismatch" and not s.generic_refusal)
    refused = sum(1 for s in sent if s.phase != "mismatch" and s.generic_refusal)
    return wrong + refused

def phase_figures(all_sent: Sequence[Sent]) -> dict[str, dict[str, Any]]:
    """Per phase: requests, outcomes, the checker's success rate and the attribution counts."""
    out: dict[str, dict[str, Any]] = {}
    for phase in PHASES:
        sent = [s for s in all_sent if s.phase == phase]
        judged = [s for s in sent if s.passed is not None]
        out[phase] = {
            "requests": len(sent),
            "ok": sum(s.ok for s in sent),
            "refused": sum(s.generic_refusal for s in sent),
            "other_errors": sum(not s.ok and not s.generic_refusal for s in sent),
            "passed": sum(bool(s.passed) for s in judged),
            # the share of answers its checker passed; the mixed burst mixes releases on
            # purpose, and mismatch tickets carry no task: no rate for those
            "success_rate": (round(sum(bool(s.passed) for s in judged) / len(judged), 6)
                             if judged and phase not in ("mixed", "mismatch") else None),
            "misattributions": sum(s.misattributed for s in sent),
            "indistinguishable": sum(s.why.startswith("indistinguishable") for s in sent),
            "ledger_mismatches": sum(s.why.startswith("ledger") for s in sent),
        }
    return out

def by_tag(sent: Sequence[Sent], tasks: Sequence[GoldenTask]) -> dict[str, dict[str, Any]]:
    """The candidate's golden success per task tag (in and out of distribution, ...)."""
    tags: dict[str, list[bool]] = {}
    results = {s.task: bool(s.passed) for s in sent if s.phase == "golden"}
    for t in tasks:
        for tag in t.tags:
            tags.setdefault(tag, []).append(results.get(t.id, False))
    return {tag: {"tasks": len(v), "passed": sum(v), "success_rate": round(sum(v) / len(v), 6)}
            for tag, v in sorted(tags.items())}

def ledger_counts(sent: Sequence[Sent]) -> dict[str, dict[str, int]]:
    """Ledger rows of the gate's requests by outcome, per phase (None: no row found)."""
    out: dict[str, dict[str, int]] = {}
    for s in sent:
        counts = out.setdefault(s.phase, {})
        key = s.ledger_outcome or "missing"
        counts[key] = counts.get(key, 0) + 1
    return out

def memory_accounting(target: GateTarget, base_dir: Path) -> dict[str, Any]:
    """The host's resident bytes against its memory plan (see the module notes), for the
    base stored at ``base_dir``."""
    if not target.metrics_url:
        return {"error": None, "why": "no metrics endpoint given (--metrics)"}
    time.sleep(METRICS_SETTLE_S)
    try:
        reported, resident = _scrape_resident(target.metrics_url)
    except OSError as e:
        return {"error": None, "why": f"metrics endpoint unreachable ({type(e).__name__})"}
    if not reported:
        return {"error": None, "why": "the metrics endpoint exports no resident bytes"}
    device = target.device or default_device()
    plan = plan_for_host(base_dir, target.settings, device)
    shapes = BaseShapes.from_dir(base_dir)
    size = element_size(serving_dtype(device.split(":")[0]))
    expected = {"base_weights": shapes.weight_count() * size,
                "adapter_banks": plan.bank_bytes,
                "adapter_weights": resident * plan.slot_bytes}
    errors = {k: (abs(reported.get(k, 0.0) - v) / v if v else
                  (0.0 if reported.get(k, 0.0) == 0 else 1.0))
              for k, v in expected.items()}
    summed = sum(v for k, v in reported.items() if k != "adapter_weights")
    return {"error": round(max(errors.values()), 6), "by_kind": errors,
            "reported": reported, "expected": expected, "resident_adapters": resident,
            "reported_sum": summed, "device": device,
            "why": "host's resident bytes (live tensor storages) against its memory plan"}


def p95(values: Sequence[float]) -> float | None:
    """Nearest-rank 95th percentile (None for no values)."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, -(-95 * len(ordered) // 100))  # ceil(0.95 n)
    return round(float(ordered[rank - 1]), 6)


def _scrape_resident(url: str) -> tuple[dict[str, float], int]:
    """``loraplane_backend_resident_bytes`` by kind, and the resident adapter count, summed over
    the engine instances the endpoint reports."""
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode("utf-8", "replace")
    by_kind: dict[str, float] = {}
    resident = 0.0
    for line in text.splitlines():
        if line.startswith(_SAMPLE + "{"):
            labels, _, value = line[len(_SAMPLE) + 1:].rpartition("} ")
            kind = next((p.split("=", 1)[1].strip('"') for p in labels.split(",")
                         if p.startswith("kind=")), None)
            if kind is not None:
                by_kind[kind] = by_kind.get(kind, 0.0) + float(value)
        elif line.startswith("loraplane_backend_resident_adapters"):
            resident += float(line.rpartition(" ")[2])
    return by_kind, int(resident)


__all__ = ["authorization_errors", "by_tag", "judge_burst", "ledger_counts",
           "memory_accounting", "p95", "phase_figures", "read_ledger"]
