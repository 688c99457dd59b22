"""CLI verbs of the evaluation gate (``control.tools.gate``), registered on the typer apps of
control.cli.base:

``loraplane adapter golden DIGEST FILE``      record the adapter's golden task set
``loraplane adapter gate DIGEST``             run the gate against a running deployment
``loraplane adapter gate-report REPORT``      show a stored gate report
``loraplane adapter gate-policy DIGEST``      show or override one adapter's thresholds
``loraplane tenant gate-policy TENANT``       show or set a tenant's default thresholds
"""

# No `from __future__ import annotations`: typer reads every verb's annotations at each start
# and would eval each string (see control/cli/main.py).

import json
from pathlib import Path
from typing import Annotated, Any

import typer

from control.cli.base import (
    adapter_app,
    console,
    digest_arg,
    emit,
    errors,
    print_fields,
    registry,
    settings,
    state,
    tenant_app,
)
from control.contracts.digests import short

EXIT_FAILED = 1  # the gate ran and the candidate failed (2: usage and other errors)

_SET_HELP = ("A threshold FIELD=VALUE (repeatable; VALUE as JSON: 0, 0.05, 8, true). "
             "Fields: max_authorization_errors, max_success_rate_drop, min_success_rate, "
             "min_gain_over_base, max_cold_load_p95_s, max_memory_accounting_error, "
             "max_misattributions, mixed_requests, min_golden_tasks, max_load_failures, "
             "require_long_context.")


@adapter_app.command("golden")
def adapter_golden(digest: str, file: Path) -> None:
    """Record the golden task set (JSON) the evaluation gate judges an adapter by."""
    # the registry and the desk (eventsourcing): only when a verb runs
    from control.app.gate_desk import GateDesk
    from control.contracts.golden import GoldenSet

    d = digest_arg(digest)
    with errors():
        golden = GoldenSet.load(file)
        golden_digest = GateDesk(registry()).record_golden_set(d, golden, actor=state.actor)
    emit({"digest": d, "golden_digest": golden_digest, "family": golden.family,
          "tasks": len(golden.tasks)},
         lambda: console.print(f"{short(d)}: golden task set {golden_digest} "
                               f"({len(golden.tasks)} tasks, family {golden.family})"))


@adapter_app.command("gate")
def adapter_gate(
    digest: str,
    http: Annotated[str, typer.Option(help="Triton HTTP host:port.")] = "127.0.0.1:8000",
    grpc: Annotated[str, typer.Option(help="Triton gRPC host:port.")] = "127.0.0.1:8001",
    metrics: Annotated[str | None, typer.Option(
        help="Triton metrics URL, for the memory accounting figure "
             "(e.g. http://127.0.0.1:8002/metrics); without it the figure is not measured "
             "and the gate fails.")] = "http://127.0.0.1:8002/metrics",
    base: Annotated[str | None, typer.Option(help="Served base digest (default: the only one).")
                    ] = None,
    device: Annotated[str | None, typer.Option(
        help="The Triton host's device, for its memory plan (default: this machine's).")
    ] = None,
) -> None:
    """Run the evaluation gate on a candidate through a running deployment, and record its
    report (content-addressed; GateReportRecorded). Exit 1 if the candidate failed.

    The candidate is served under a release of its own, pointed at by no alias, on tickets the
    gate signs with the home's key: no tenant can reach it. Needs the deployment's home and
    database (LORAPLANE_HOME, LORAPLANE_DB_URL)."""
    # the gate (registry, ledger, tritonclient): only this verb pays for it
    from control.tools.gate import GateTarget, run_gate

    d = digest_arg(digest)
    with errors():
        result = run_gate(GateTarget(settings(), http, grpc, metrics, base, device), d,
                          actor=state.actor)
    report = result.report
    data = {"digest": d, "passed": result.passed, "report_digest": result.report_digest,
            "failures": result.failures, "figures": report["figures"],
            "release": report["release"]}

    def human() -> None:
        from rich.table import Table

        t = Table(title=f"gate {short(d)}: {'passed' if result.passed else 'FAILED'}")
        for col in ("rule", "found", "limit", "passed", "why"):
            t.add_column(col)
        for v in report["verdicts"]:
            t.add_row(v["rule"], _cell(v["value"]), _cell(v["limit"]),
                      "yes" if v["passed"] else "[red]no[/red]", v["why"])
        console.print(t)
        console.print(f"report {result.report_digest}")

    emit(data, human)
    if not result.passed:
        raise typer.Exit(EXIT_FAILED)


@adapter_app.command("gate-report")
def adapter_gate_report(digest: str) -> None:
    """A stored gate report in full (JSON), by its digest; or, given an adapter's digest, its
    latest gate report on each base + tokenizer + chat template it was gated on."""
    # the registry and the domain (eventsourcing): only when a verb runs
    from control.app.gate_desk import GateDesk
    from control.domain import NotFound

    d = digest_arg(digest)
    with errors():
        desk = GateDesk(registry(existing=True))
        try:
            adapter = desk.registry.adapter(d)
        except NotFound:
            report = desk.gate_report(d)
            emit(report, lambda: console.print_json(json.dumps(report)))
            return
    rows = [{"base": base, "tokenizer": tokenizer, "template": None if t == "none" else t,
             "report_digest": r["report"], "passed": r["passed"]}
            for key, r in sorted(adapter.gate_reports.items())
            for base, tokenizer, t in [key.split("|")]]
    emit(rows, lambda: print_fields({f"{short(r['base'])}/{short(r['tokenizer'])}/"
                                     f"{short(r['template']) if r['template'] else 'none'}":
                                     f"{r['report_digest']} "
                                     f"{'passed' if r['passed'] else 'failed'}"
                                     for r in rows}))


@adapter_app.command("gate-policy")
def adapter_gate_policy(
    digest: str,
    set_: Annotated[list[str] | None, typer.Option("--set", help=_SET_HELP)] = None,
    clear: Annotated[bool, typer.Option(help="Drop the adapter's overrides.")] = False,
) -> None:
    """Show the gate policy an adapter is judged by; --set or --clear records its overrides
    (GatePolicyOverridden) over its tenant's policy."""
    from control.app.gate_desk import GateDesk  # eventsourcing: only when a verb runs

    d = digest_arg(digest)
    with errors():
        desk = GateDesk(registry())
        adapter = desk.registry.adapter(d)
        if set_ or clear:
            fields = {} if clear else {**adapter.gate_overrides, **_fields(set_ or [])}
            policy = desk.override_adapter_policy(d, fields, actor=state.actor)
            adapter = desk.registry.adapter(d)
        else:
            policy = desk.policy_for(adapter)
    overrides, shown = dict(adapter.gate_overrides), policy.to_json()
    data = {"digest": d, "overrides": overrides, "policy": shown}
    emit(data, lambda: print_fields({**shown, "overrides": overrides}))


@tenant_app.command("gate-policy")
def tenant_gate_policy(
    tenant: str,
    set_: Annotated[list[str] | None, typer.Option("--set", help=_SET_HELP)] = None,
    clear: Annotated[bool, typer.Option(help="Back to the defaults.")] = False,
) -> None:
    """Show a tenant's default gate policy; --set or --clear records it (GatePolicySet)."""
    # the registry and the domain (eventsourcing): only when a verb runs
    from control.app.gate_desk import GateDesk
    from control.domain import effective_policy

    with errors():
        desk = GateDesk(registry())
        t = desk.registry.tenant(tenant)
        if set_ or clear:
            fields = {} if clear else {**t.gate_policy, **_fields(set_ or [])}
            policy = desk.set_tenant_policy(tenant, fields, actor=state.actor)
            t = desk.registry.tenant(tenant)
        else:
            policy = effective_policy(t.gate_policy, None)
    recorded, shown = t.gate_policy, policy.to_json()
    data = {"tenant": tenant, "recorded": recorded, "policy": shown}
    emit(data, lambda: print_fields({**shown, "recorded": recorded}))


def _fields(pairs: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for pair in pairs:
        name, sep, raw = pair.partition("=")
        if not sep or not name:
            raise typer.BadParameter(f"--set takes FIELD=VALUE, found {pair!r}")
        try:
            out[name.strip()] = json.loads(raw)
        except ValueError:
            raise typer.BadParameter(f"--set {name}: VALUE must be JSON (0, 0.05, true, "
                                     f"null), found {raw!r}") from None
    return out


def _cell(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return "-" if v is None else str(v)
