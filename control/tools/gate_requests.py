"""What the evaluation gate sends and what comes back: the deployment it runs against, the
routes its tickets name, one record per request, the finished result; and the plans of its
requests (the mixed burst, the mismatch cases), with the client helpers they are sent with.

Split from ``control.tools.gate`` (which runs the phases); ``control.tools.gate_evidence`` reads
the record the requests leave behind. The tickets the gate signs name the synthetic tenant
:data:`control.contracts.synthetic.GATE_TENANT`, never the adapter's tenant: its requests are
kept out of rollout windows and tenant statistics, and shown apart in the operator's.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from control.contracts.config import Settings
from control.contracts.golden import GoldenTask
from control.domain import DomainError, RuleVerdict
from control.domain.gate import failures

REPORT_KIND = "loraplane.gate-report/v1"
GATE_ACTOR = "gate"
REFUSED_STATUS = ("400", "StatusCode.INVALID_ARGUMENT")
PHASES = ("golden", "base", "stable", "mismatch", "mixed", "long_context")
BURST_WAIT_S = 60.0  # how long the mixed burst waits for all its senders to be ready
OLD_BASE_ROUTE = "old_base"  # a new-base candidate's old release, sent to the new base's host
# Mismatch routes refused before their ticket is verified (their rows carry no ticket id), by
# the refusal reason their ledger rows hold.
UNVERIFIED_ROUTES = {"wrong_base": "base", "wrong_tokenizer": "tokenizer",
                     OLD_BASE_ROUTE: "base"}


class GateUnavailable(DomainError):
    """The gate cannot run here (no golden set, another base served, no usable key, ...)."""


@dataclass(frozen=True)
class GateTarget:
    """A running deployment, as the operator sees it (what the hostile self-test needs too)."""

    settings: Settings
    http_url: str  # host:port
    grpc_url: str  # host:port
    metrics_url: str | None = None  # e.g. http://host:8002/metrics; without it: not measured
    base: str | None = None  # the served base digest (default: the only one registered)
    device: str | None = None  # the Triton host's device ("cpu", "cuda"); default: this one's
    # The ledger's host id of the Triton host at http_url; given, the figures read by host
    # (cold loads, refusals without a ticket id) count its rows only. A shadow host has one.
    host_id: str | None = None


@dataclass(frozen=True)
class OnNewBase:
    """A gate run of an adapter on a base other than its own (see the module notes)."""

    base: str  # the new base digest: the target (a shadow host) serves it
    replaces: str  # the adapter's release on its own base, the one a new release would replace
    reference: GateTarget  # the live deployment serving ``replaces``


@dataclass(frozen=True)
class Route:
    """What one of the gate's tickets names: a release (or the base alone) to be served."""

    label: str  # candidate, base, stable, or a mismatch case
    adapter: str | None
    release: str | None
    base: str
    tokenizer: str


@dataclass
class Sent:
    """One request the gate sent, and what came back."""

    phase: str
    route: str
    task: str | None
    protocol: str
    ticket_id: str
    expected: str | None  # the adapter digest the ticket names (None: the base)
    started_at: float
    ok: bool = False
    status: str = ""  # "ok", or Triton's status (HTTP code or gRPC code name)
    generic_refusal: bool = False
    text: str = ""
    request_id: str = ""
    answer_digest: str = ""
    passed: bool | None = None  # the task's checker on the answer
    ledger_outcome: str | None = None
    ledger_reason: str | None = None
    served_digest: str | None = None
    misattributed: bool = False
    why: str = ""

    def brief(self) -> dict[str, Any]:
        """What the report keeps of it (no prompt text: the tasks are in the golden set)."""
        return {k: v for k, v in asdict(self).items() if k not in ("why",) or v}


@dataclass
class GateResult:
    """A finished gate run: the stored report, its digest, and the verdict."""

    report: dict[str, Any]
    report_digest: str
    passed: bool
    verdicts: list[RuleVerdict] = field(default_factory=list)

    @property
    def failures(self) -> list[str]:
        return failures(self.verdicts)


def mismatch_routes(candidate: Route, old: Route | None = None) -> tuple[Route, ...]:
    """Tickets that must be refused: wrong base, wrong tokenizer, unbound release; on a new
    base also ``old``, the candidate's release on its old base (what a tenant's ticket names).
    """
    return (
        Route("wrong_base", candidate.adapter, candidate.release,
              made_up("base", candidate.base), candidate.tokenizer),
        Route("wrong_tokenizer", candidate.adapter, candidate.release, candidate.base,
              made_up("tokenizer", candidate.tokenizer)),
        Route("wrong_release", candidate.adapter, made_up("release", candidate.release),
              candidate.base, candidate.tokenizer),
        *([Route(OLD_BASE_ROUTE, old.adapter, old.release, old.base, old.tokenizer)]
          if old is not None else []),
    )


def burst_plan(tasks: Sequence[GoldenTask], answers: dict[str, dict[str, Sent]],
               candidate: Route, base: Route, stable: Route | None,
               n: int) -> list[tuple[Route, GoldenTask]]:
    """``n`` requests: candidate, stable (when there is one) and base in turn, each on the
    tasks whose solo answers tell the releases apart first (so most answers can be judged by
    their text, not only by the digests)."""
    routes = [candidate, *([stable] if stable is not None else []), base]

    def telling(label: str) -> list[GoldenTask]:
        def distinct(t: GoldenTask) -> bool:
            mine = answers[label].get(t.id)
            return mine is not None and mine.ok and all(
                answers[k][t.id].text != mine.text for k in answers
                if k != label and t.id in answers[k])
        return sorted(tasks, key=lambda t: not distinct(t))

    order = {r.label: telling(r.label) for r in routes}
    plan = []
    for i in range(n):
        route = routes[i % len(routes)]
        pool = order[route.label]
        plan.append((route, pool[(i // len(routes)) % len(pool)]))
    return plan


def task_table(tasks: Sequence[GoldenTask], answers: dict[str, dict[str, Sent]]
               ) -> list[dict[str, Any]]:
    rows = []
    for t in tasks:
        row: dict[str, Any] = {"id": t.id, "tags": list(t.tags), "checker": t.checker.kind}
        for label, by_task in answers.items():
            s = by_task.get(t.id)
            if s is not None:
                row[label] = {"passed": bool(s.passed), "text": s.text, "status": s.status}
        rows.append(row)
    return rows


def open_client(protocol: str, url: str) -> Any:
    """A stock tritonclient client, the way a tenant's application opens one."""
    if protocol == "grpc":
        import tritonclient.grpc as grpcclient  # a client library: only the gate's run needs it

        return grpcclient.InferenceServerClient(url)
    import tritonclient.http as httpclient

    return httpclient.InferenceServerClient(url)


def ready(http_url: str) -> bool:
    client = open_client("http", http_url)
    try:
        return bool(client.is_server_ready())
    except Exception:  # refused, reset, timed out: not ready, whatever the exception type
        return False
    finally:
        client.close()


def made_up(kind: str, real: str | None) -> str:
    """A digest no artifact has: what a forged or misbound ticket names instead of ``real``."""
    return "sha256:" + hashlib.sha256(f"loraplane-gate:wrong-{kind}:{real}".encode()).hexdigest()


__all__ = ["BURST_WAIT_S", "GATE_ACTOR", "OLD_BASE_ROUTE", "PHASES", "REFUSED_STATUS",
           "REPORT_KIND", "UNVERIFIED_ROUTES", "GateResult", "GateTarget", "GateUnavailable",
           "OnNewBase", "Route", "Sent", "burst_plan", "made_up", "mismatch_routes",
           "open_client", "ready", "task_table"]
