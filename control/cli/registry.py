"""CLI verbs of the registry: lifecycle, releases, aliases, tenant policy, revocation steps,
audit integrity and the control-plane benchmark; registered on the typer apps of
control.cli.base."""

# No `from __future__ import annotations`: typer reads every verb's annotations at each start
# and would eval each string (see control/cli/main.py).

import json
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from control.cli.base import (
    _digest,
    _registry,
    _routing,
    _time,
    adapter_app,
    alias_app,
    app,
    audit_app,
    bench_app,
    console,
    emit,
    errors,
    settings,
    state,
    tenant_app,
)
from control.contracts.digests import short
from control.ops.views import cell

release_app = typer.Typer(no_args_is_help=True, help="Release manifests (what aliases route to).")
app.add_typer(release_app, name="release")


def _read_json_arg(value: str | None, what: str) -> dict[str, Any] | None:
    if value is None:
        return None
    try:
        data = json.loads(value)
    except ValueError:
        raise typer.BadParameter(f"{what} must be a JSON object") from None
    if not isinstance(data, dict):
        raise typer.BadParameter(f"{what} must be a JSON object")
    return data


# --- adapter lifecycle ------------------------------------------------------------------------

@adapter_app.command("evaluate")
def adapter_evaluate(digest: str, report: Path) -> None:
    """Record an evaluation report (JSON) for an adapter; canary needs one."""
    from control.app.releases import load_report

    d = _digest(digest)
    with errors():
        report_digest = _registry().record_evaluation(d, load_report(report), actor=state.actor)
    emit({"digest": d, "report_digest": report_digest},
         lambda: console.print(f"{short(d)}: evaluation report {report_digest}"))


@adapter_app.command("release")
def adapter_release(
    digest: str,
    evaluation: Annotated[Path | None, typer.Option(
        help="Evaluation report JSON to record first.")] = None,
    to: Annotated[str, typer.Option(help="canary or stable.")] = "stable",
    canary_percent: Annotated[int, typer.Option(
        help="Share of sessions the canary gets while the alias has a stable release.")] = 10,
    defaults: Annotated[str | None, typer.Option(
        help='Inference defaults, JSON, e.g. \'{"max_tokens": 64}\'.')] = None,
) -> None:
    """Walk an adapter candidate -> canary -> stable (each step its own event)."""
    from control.app.releases import load_report

    d = _digest(digest)
    with errors():
        report = load_report(evaluation) if evaluation is not None else None
        reg = _registry()
        final = reg.advance(d, actor=state.actor, evaluation=report, to=to,
                            canary_percent=canary_percent,
                            inference_defaults=_read_json_arg(defaults, "--defaults"))
        release = reg.adapter(d).release
    emit({"digest": d, "state": final, "release": release},
         lambda: console.print(f"{short(d)} -> {final} (release {release})"))


@adapter_app.command("show")
def adapter_show(digest: str) -> None:
    """One adapter: state, metadata, release, and serving steps after a revocation."""
    from control.domain import DomainError  # domain (eventsourcing): only when a verb runs

    d = _digest(digest)
    view = _routing()
    row = view.adapter(d)
    if row is None:
        with errors():
            raise DomainError("adapter not found")
    data = {k: getattr(row, k) for k in row.__dataclass_fields__}
    data["serving_steps"] = view.serving_steps(d)
    emit(data, lambda: _kv(data))


@adapter_app.command("serving-step")
def adapter_serving_step(
    digest: str,
    host: Annotated[str, typer.Option(help="The Triton host reporting.")],
    step: Annotated[str, typer.Option(help="drained, purged or unloaded (in that order).")],
) -> None:
    """Record a serving host's step after a revocation (called by the backend)."""
    d = _digest(digest)
    with errors():
        _registry().record_serving_step(d, host, step, actor=state.actor)
    emit({"digest": d, "host": host, "step": step},
         lambda: console.print(f"{short(d)}: {host} {step}"))


# --- aliases ----------------------------------------------------------------------------------

@alias_app.command("point")
def alias_point(alias: str, target: str) -> None:
    """Make TARGET (release, adapter or base digest) the alias's stable release."""
    t = _digest(target)
    with errors():
        release = _registry().point_alias(alias, t, actor=state.actor)
    emit({"alias": alias, "release": release},
         lambda: console.print(f"{alias} -> release {short(release)}"))


@alias_app.command("canary")
def alias_canary(
    alias: str,
    target: Annotated[str | None, typer.Argument(help="Release or adapter digest.")] = None,
    percent: Annotated[int, typer.Option(help="Share of sessions, 1-100.")] = 10,
    clear: Annotated[bool, typer.Option("--clear", help="End the canary split.")] = False,
) -> None:
    """Split an alias: PERCENT of sessions (hash of tenant and session id) go to TARGET."""
    with errors():
        reg = _registry()
        if clear:
            reg.clear_canary(alias, actor=state.actor)
            emit({"alias": alias, "canary": None}, lambda: console.print(f"{alias}: no canary"))
            return
        if target is None:
            raise typer.BadParameter("give a TARGET digest, or --clear")
        release = reg.set_canary(alias, _digest(target), percent, actor=state.actor)
    emit({"alias": alias, "canary": release, "percent": percent},
         lambda: console.print(f"{alias}: {percent}% -> release {short(release)}"))


@alias_app.command("rollback")
def alias_rollback(alias: str) -> None:
    """Point the alias back at its previous stable release (one command, one event)."""
    with errors():
        release = _registry().rollback(alias, actor=state.actor)
    emit({"alias": alias, "release": release},
         lambda: console.print(f"{alias} rolled back to release {short(release)}"))


@alias_app.command("show")
def alias_show(alias: str) -> None:
    """An alias's stable and canary releases and its history (operators)."""
    with errors():
        a = _registry(existing=True).alias(alias)
    data = {"alias": a.name, "owner": a.owner, "stable": a.stable, "canary": a.canary,
            "canary_percent": a.canary_percent, "history": list(a.history),
            "grants": list(a.grants)}
    emit(data, lambda: _kv(data))


@release_app.command("show")
def release_show(digest: str) -> None:
    """A release manifest: adapter, base, tokenizer, chat template, defaults, evaluation."""
    from control.app.releases import MANIFEST_FILE, get_document

    d = _digest(digest)
    with errors():
        reg = _registry(existing=True)
        reg.release_manifest(d)  # NotFound for an unknown digest
        data = get_document(reg.store, MANIFEST_FILE, d)
    emit({"digest": d, **data}, lambda: _kv({"digest": d, **data}))


# --- tenant policy ----------------------------------------------------------------------------

@tenant_app.command("policy")
def tenant_policy(
    tenant: str,
    require_signature: Annotated[bool, typer.Option(
        "--require-signature/--no-require-signature")] = False,
    max_adapters: Annotated[int | None, typer.Option()] = None,
    max_file_bytes: Annotated[int | None, typer.Option()] = None,
    max_rank: Annotated[int | None, typer.Option()] = None,
    allow_targets: Annotated[list[str] | None, typer.Option(
        help="BASE_DIGEST=mod1,mod2 (repeatable): target modules allowed on that base.")
    ] = None,
    trust_key: Annotated[list[Path] | None, typer.Option(
        help="PEM public key or CA certificate trusted to sign adapters (repeatable).")] = None,
) -> None:
    """Set a tenant's policy: limits, signature requirement, trusted signing keys."""
    from control.app.signatures import check_trusted_key
    from control.domain import TenantPolicy

    targets: dict[str, list[str]] = {}
    for item in allow_targets or []:
        base, _, mods = item.partition("=")
        targets[_digest(base)] = [m for m in mods.split(",") if m]
    with errors():
        keys = [check_trusted_key(p.read_text()) for p in (trust_key or [])]
        policy = TenantPolicy(require_signature=require_signature, max_adapters=max_adapters,
                              max_file_bytes=max_file_bytes, max_rank=max_rank,
                              allowed_target_modules=targets, trusted_keys=keys)
        _registry().set_policy(tenant, policy, actor=state.actor)
    data = {"tenant": tenant, **policy.to_json(), "trusted_keys": len(keys)}
    emit(data, lambda: _kv(data))


# --- audit ------------------------------------------------------------------------------------

def show_state_as_of(registry: Any, when: str) -> None:
    """Print the registry and routing state at ``when`` (used by ``audit log --as-of``)."""
    import datetime as dt

    from projections.as_of import state_as_of

    t = _time(when)
    assert t is not None
    data = state_as_of(registry, dt.datetime.fromtimestamp(t, dt.UTC))
    emit(data, lambda: _state_tables(data))


def _state_tables(data: dict[str, Any]) -> None:
    from rich.table import Table

    console.print(f"state as of {data['as_of']} (replayed through event #{data['position']})")
    for name in ("adapters", "aliases", "grants"):
        rows = data[name]
        t = Table(title=name)
        cols = list(rows[0]) if rows else []
        for c in cols:
            t.add_column(c)
        for r in rows:
            t.add_row(*[cell(r[c]) for c in cols])
        console.print(t)
    console.print("revoked: " + (", ".join(short(d) for d in data["revoked"]) or "none"))
    console.print("retired signing keys: " + (", ".join(data["retired_keys"]) or "none"))
    console.print("tenants without an API key: "
                  + (", ".join(data["tenants_without_key"]) or "none"))


@audit_app.command("verify")
def audit_verify(
    public_key: Annotated[Path | None, typer.Option(
        help="Audit public key PEM held by the auditor (default: the deployment's).")] = None,
) -> None:
    """Check the stored history against the signed checkpoints; name every change."""
    from control.app.integrity import AuditSeal, load_public_key

    with errors():
        seal = AuditSeal.for_registry(_registry(existing=True))
        report = seal.verify(load_public_key(public_key) if public_key else None)
    data = report.to_json()

    def human() -> None:
        verdict = "[green]intact[/green]" if report.ok else "[red]TAMPERED[/red]"
        console.print(f"{verdict}: {report.events} events, {report.sealed_events} sealed by "
                      f"{report.checkpoints} signed checkpoints, {report.unsealed_events} "
                      "unsealed")
        for p in report.problems:
            console.print(f"  {p.kind:<10} {p.detail}")

    emit(data, human)
    if not report.ok:
        raise typer.Exit(1)


@audit_app.command("checkpoint")
def audit_checkpoint() -> None:
    """Seal the events recorded since the last checkpoint (signed)."""
    from control.app.integrity import AuditSeal

    with errors():
        row = AuditSeal.for_registry(_registry()).seal()
    data = ({"seq": row["seq"], "first_position": row["first_position"],
             "last_position": row["last_position"], "chain_hash": row["chain_hash"]}
            if row else {"seq": None})
    emit(data, lambda: console.print(
        f"checkpoint #{row['seq']} seals events {row['first_position']}-{row['last_position']}"
        if row else "nothing to seal"))


@audit_app.command("export")
def audit_export(
    out: Annotated[Path | None, typer.Option(help="File to write (default: stdout).")] = None,
) -> None:
    """The whole history as JSON lines (with each event's sealed hash)."""
    from control.app.audit import export_lines

    reg = _registry(existing=True)
    if out is None:
        for line in export_lines(reg):
            sys.stdout.write(line + "\n")
        return
    n = 0
    with out.open("w", encoding="utf-8") as f:
        for line in export_lines(reg):
            f.write(line + "\n")
            n += 1
    emit({"events": n, "out": str(out)}, lambda: console.print(f"{n} events -> {out}"))


# --- bench ------------------------------------------------------------------------------------

@bench_app.command("control")
def bench_control(
    pg_url: Annotated[str | None, typer.Option(
        help="Also measure on this PostgreSQL URL (default $LORAPLANE_TEST_PG_URL).")] = None,
    commands: Annotated[int, typer.Option(help="Commands per measurement.")] = 300,
    tickets: Annotated[int, typer.Option(help="Ticket requests per measurement.")] = 2000,
) -> None:
    """Control plane ratios: command vs raw save, projection events/s, ticket p50 at c=16."""
    import os

    from control.ops.bench_control import run_all

    url = pg_url or os.environ.get("LORAPLANE_TEST_PG_URL")
    with errors():
        results = run_all(settings().home / "bench-control", pg_url=url, commands=commands,
                          tickets=tickets)
    emit(results, lambda: console.print_json(json.dumps(results)))


def _kv(data: dict[str, Any]) -> None:
    from rich.table import Table

    t = Table(show_header=False)
    t.add_column("field")
    t.add_column("value", overflow="fold")
    for k, v in data.items():
        t.add_row(k, v if isinstance(v, str) else json.dumps(v, default=str))
    console.print(t)
