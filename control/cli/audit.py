"""CLI verbs that read the history: the event log (and the state it gives at any past time),
its integrity against signed checkpoints, and incident queries on the request ledger.

``loraplane audit log`` / ``verify [--ledger]`` / ``checkpoint`` / ``export`` / ``ledger-sync``
``loraplane audit archive --before T --out FILE`` / ``archive-verify FILE`` (ledger retention)
``loraplane incident requests`` (with whether verified ledger checkpoints cover the rows, and
which archives took rows of the range)
"""

# No `from __future__ import annotations`: typer reads every verb's annotations at each start
# and would eval each string (see control/cli/main.py).

import datetime as dt
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from control.cli.base import (
    as_dict,
    audit_app,
    console,
    digest_arg,
    emit,
    errors,
    existing_settings,
    incident_app,
    parse_time,
    registry,
    state,
)
from control.contracts.digests import short
from control.tools.views import audit_table, cell, incident_table, iso

if TYPE_CHECKING:
    from control.app.ledger_audit import Coverage, LedgerReport
    from control.app.registry import Registry

# --- audit ------------------------------------------------------------------------------------

@audit_app.command("log")
def audit_log(
    as_of: Annotated[str | None, typer.Option(
        "--as-of", help="Show the registry and routing state at this ISO time, by replay.")
    ] = None,
) -> None:
    """The event history, in order, with time and actor (or the state --as-of a time)."""
    # the event log (eventsourcing, SQLAlchemy): only when a verb runs
    from control.app.audit import audit_log as read_log

    # errors(): an event the store cannot decode is named, with the advice to run verify
    with errors():
        if as_of is not None:
            show_state_as_of(registry(existing=True), as_of)
            return
        entries = read_log(registry(existing=True))
    emit([as_dict(e) for e in entries], lambda: console.print(audit_table(entries)))


def show_state_as_of(reg: "Registry", when: str) -> None:
    """Print the registry and routing state at ``when`` (``audit log --as-of``)."""
    # the replay (eventsourcing, SQLAlchemy): only `audit log --as-of` replays
    from projections.as_of import state_as_of

    t = parse_time(when)
    assert t is not None
    data = state_as_of(reg, dt.datetime.fromtimestamp(t, dt.UTC))
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
    ledger: Annotated[bool, typer.Option(
        "--ledger", help="Also check every host's request-ledger log, by host and position "
                         "(after verifying the checkpoints hosts signed since the last check).")
    ] = False,
) -> None:
    """Check the stored history against the signed checkpoints; name every change."""
    # the audit seal (cryptography, SQLAlchemy): only the audit verbs
    from control.app.integrity import AuditSeal, load_public_key

    with errors():
        reg = registry(existing=True)
        seal = AuditSeal.for_registry(reg)
        ledger_report = _ledger_report(reg) if ledger else None
        report = seal.verify(load_public_key(public_key) if public_key else None)
    data = report.to_json()
    if ledger_report is not None:
        data["ledger"] = ledger_report.to_json()

    def human() -> None:
        verdict = "[green]intact[/green]" if report.ok else "[red]TAMPERED[/red]"
        console.print(f"{verdict}: {report.events} events, {report.sealed_events} sealed by "
                      f"{report.checkpoints} signed checkpoints, {report.unsealed_events} "
                      "unsealed")
        for p in report.problems:
            console.print(f"  {p.kind:<10} {p.detail}")
        if ledger_report is not None:
            _print_ledger(ledger_report)

    emit(data, human)
    if not report.ok or (ledger_report is not None and not ledger_report.ok):
        raise typer.Exit(1)


def _ledger_report(reg: "Registry") -> "LedgerReport":
    # the hosts' logs (SQLAlchemy, cryptography): only `audit verify --ledger`
    from control.app.ledger_audit import sync, verify
    from control.contracts.db import make_engine

    engine = make_engine(reg.settings.db_url)
    sync(reg, engine)
    return verify(reg, engine)


def _print_ledger(r: "LedgerReport") -> None:
    verdict = "[green]intact[/green]" if r.ok else "[red]TAMPERED[/red]"
    console.print(f"ledger {verdict}: {r.hosts} hosts, {r.entries} log entries, {r.verified} "
                  f"covered by verified checkpoints, {r.unlogged} rows outside the logs "
                  f"(front failures, restarts), {r.archived} rows archived")
    for f in r.findings:
        at = "" if f.position is None else f" position {f.position}"
        console.print(f"  {f.kind:<10} host {f.host}{at}: {f.detail}")


@audit_app.command("ledger-sync")
def audit_ledger_sync() -> None:
    """Record new host checkpoint keys and verify the checkpoints hosts signed since."""
    # the hosts' logs (SQLAlchemy, cryptography): only the ledger verbs
    from control.app.ledger_audit import sync
    from control.contracts.db import make_engine

    with errors():
        reg = registry(existing=True)
        r = sync(reg, make_engine(reg.settings.db_url))
    data = {"keys_recorded": r.keys_recorded, "verified": r.verified, "refused": r.refused}

    def human() -> None:
        console.print(f"{r.keys_recorded} host keys recorded, {len(r.verified)} checkpoints "
                      f"verified, {len(r.refused)} refused")
        for host, size, why in r.refused:
            console.print(f"  [red]refused[/red] host {host} size {size}: {why}")

    emit(data, human)
    if r.refused:
        raise typer.Exit(1)


@audit_app.command("archive")
def audit_archive(
    before: Annotated[str, typer.Option(
        "--before", help="ISO time: archive the finished rows admitted before it.")],
    out: Annotated[Path, typer.Option(
        "--out", help="The archive file to write (JSON lines; its SHA-256 is recorded).")],
    host: Annotated[str | None, typer.Option(
        "--host", help="Archive this host's rows only (default: every host's).")] = None,
    force: Annotated[bool, typer.Option(
        "--force", help="Replace FILE if it exists (never a recorded archive's file).")] = False,
) -> None:
    """Move old ledger rows to an archive file: export, record the archive, then delete."""
    # the ledger, the hosts' logs and the event store: only this verb
    from control.app.ledger_archive import archive
    from control.app.ledger_audit import sync
    from control.contracts.db import make_engine

    cut = parse_time(before)
    assert cut is not None
    with errors():
        reg = registry(existing=True)
        engine = make_engine(reg.settings.db_url)
        sync(reg, engine)  # checkpoints signed so far verified first: the archived rows' proofs
        r = archive(reg, engine, cut, out, host=host, force=force, actor=state.actor)
    data = r.to_json()

    def human() -> None:
        for sha, n in r.completed:
            console.print(f"completed archive sha256:{sha}: {n} rows deleted")
        if r.sha256 is None:
            console.print(f"nothing to archive: no finished rows admitted before "
                          f"{data['before']}" + (f" on host {host}" if host else "")
                          + " (archived already, or none)")
            return
        console.print(f"{r.rows} rows admitted before {data['before']} -> {r.out}\n"
                      f"  sha256:{r.sha256} (recorded), {r.deleted} rows deleted")
        for h, d in sorted(data["hosts"].items()):
            at = "" if d["first"] is None else f", log positions from {d['first']} to {d['last']}"
            console.print(f"  host {h}: {d['rows']} rows, {d['logged']} logged{at}")

    emit(data, human)


@audit_app.command("archive-verify")
def audit_archive_verify(
    file: Annotated[Path, typer.Argument(help="An archive file `audit archive` wrote.")],
) -> None:
    """Check an archive file against its recorded event and the hosts' logs."""
    # the ledger, the hosts' logs and the event store: only this verb
    from control.app.ledger_archive import verify_archive
    from control.app.ledger_audit import sync
    from control.contracts.db import make_engine

    with errors():
        reg = registry(existing=True)
        engine = make_engine(reg.settings.db_url)
        sync(reg, engine)
        c = verify_archive(reg, engine, file)
    data = c.to_json()

    def human() -> None:
        verdict = "[green]archive verified[/green]" if c.ok else "[red]ARCHIVE FAILS[/red]"
        console.print(f"{verdict}: sha256:{c.sha256}, {c.rows} rows admitted before "
                      f"{data['before'] or '?'}; {c.covered} log entries covered by verified "
                      f"checkpoints; {c.still_in_ledger} rows still in the ledger")
        for check, detail in c.problems[:20]:
            console.print(f"  {check:<10} {detail}")
        if len(c.problems) > 20:
            console.print(f"  ... {len(c.problems) - 20} more")

    emit(data, human)
    if not c.ok:
        raise typer.Exit(1)


@audit_app.command("checkpoint")
def audit_checkpoint() -> None:
    """Seal the events recorded since the last checkpoint (signed)."""
    # the audit seal (cryptography, SQLAlchemy): only the audit verbs
    from control.app.integrity import AuditSeal

    with errors():
        row = AuditSeal.for_registry(registry()).seal()
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
    # the event log (eventsourcing, SQLAlchemy): only when a verb runs
    from control.app.audit import export_lines

    reg = registry(existing=True)
    n = 0
    with errors():  # an event the store cannot decode is named, with the advice to run verify
        if out is None:
            for line in export_lines(reg):
                sys.stdout.write(line + "\n")
            return
        with out.open("w", encoding="utf-8") as f:
            for line in export_lines(reg):
                f.write(line + "\n")
                n += 1
    emit({"events": n, "out": str(out)}, lambda: console.print(f"{n} events -> {out}"))


# --- incidents --------------------------------------------------------------------------------

@incident_app.command("requests")
def incident_requests(
    adapter: Annotated[str | None, typer.Option(help="Adapter digest.")] = None,
    training_data_version: Annotated[str | None, typer.Option(
        help="Every adapter trained on this data version.")] = None,
    base: Annotated[str | None, typer.Option(help="Base model digest.")] = None,
    release: Annotated[str | None, typer.Option(
        help="Release manifest digest (the release the ticket named).")] = None,
    since: Annotated[str | None, typer.Option(help="ISO time, inclusive.")] = None,
    until: Annotated[str | None, typer.Option(help="ISO time, exclusive.")] = None,
    include_refused: Annotated[bool, typer.Option(
        "--include-refused", help="Also list requests refused for this digest.")] = False,
) -> None:
    """Every request an adapter, a training data version, a base or a release served (who,
    when, outcome)."""
    # the request ledger and the views (SQLAlchemy): only when a verb runs
    from projections.incidents import requests_for

    if sum(x is not None for x in (adapter, training_data_version, base, release)) != 1:
        raise typer.BadParameter(
            "give one of --adapter, --training-data-version, --base, --release")
    with errors():
        rows = requests_for(existing_settings(), adapter=adapter and digest_arg(adapter),
                            training_data_version=training_data_version,
                            base=base and digest_arg(base),
                            release=release and digest_arg(release),
                            since=parse_time(since), until=parse_time(until))
    d = adapter or base or release or f"training data {training_data_version}"
    if not include_refused:
        rows = [r for r in rows if r.outcome != "rejected"]
    data = [as_dict(r) for r in rows]
    for r in data:
        r["admitted_at_iso"] = iso(r["admitted_at"])
    with errors():
        cover, archived = _coverage([r.request_id for r in rows], parse_time(since))
    gaps = cover.gaps()

    def human() -> None:
        console.print(incident_table(rows, d))
        console.print(f"ledger proof: {cover.covered} of {cover.rows} rows covered by verified "
                      "checkpoints" + ("" if gaps else " (no gaps)"))
        for g in gaps:
            console.print(f"  [yellow]gap[/yellow] {g}")

    for r in data:  # each row says whether a verified checkpoint of its host's log covers it
        r["ledger_proof"] = cover.status.get(r["request_id"], "unlogged")

    def human_and_archives() -> None:
        human()
        for a in archived:
            console.print(f"  [yellow]archived[/yellow] rows admitted before {a['before']} "
                          f"({a['scope']}) are not listed here: archive sha256:{a['sha256']} "
                          f"({a['rows']} rows of every subject, {a['file']})")

    if archived and state.json:  # stdout stays the rows (one shape); the note goes beside it
        print(json.dumps({"archived": archived}), file=sys.stderr)
    emit(data, human_and_archives)


def _coverage(request_ids: list[str], since: float | None
              ) -> tuple["Coverage", list[dict[str, Any]]]:
    """The rows' coverage by verified checkpoints, and the archives that took rows admitted
    since ``since`` (so an answer never reads as complete when rows were archived)."""
    # the registry's ledger records and the hosts' logs: only when rows are listed
    from control.app.ledger_archive import archives_overlapping
    from control.app.ledger_audit import coverage, sync
    from control.contracts.db import make_engine

    reg = registry(existing=True)
    engine = make_engine(reg.settings.db_url)
    sync(reg, engine)
    return coverage(reg, engine, request_ids), archives_overlapping(reg, since)
