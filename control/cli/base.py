"""The ``loraplane`` command line (typer).

``--json`` before any verb prints machine-readable output.
"""

# No `from __future__ import annotations`: typer reads every verb's annotations at each start
# and would eval each string (see control/cli/main.py).

import datetime as dt
import getpass
import json
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from control.contracts.config import Settings
from control.contracts.digests import DigestError, check_digest, short
from control.ops.views import audit_table, cell, incident_table, iso

if TYPE_CHECKING:
    from rich.console import Console

app = typer.Typer(no_args_is_help=True, add_completion=False,
                  help="Serve many LoRA adapters on one base model, per tenant, on Triton.")
kit_app = typer.Typer(no_args_is_help=True, help="The reference model kit.")
base_app = typer.Typer(no_args_is_help=True, help="Base models.")
adapter_app = typer.Typer(no_args_is_help=True, help="Adapters: register, promote, revoke.")
tenant_app = typer.Typer(no_args_is_help=True, help="Tenants and their API keys.")
ticket_app = typer.Typer(no_args_is_help=True, help="Routing tickets (operators).")
incident_app = typer.Typer(no_args_is_help=True, help="Incident queries on the request ledger.")
audit_app = typer.Typer(no_args_is_help=True, help="The event history.")
alias_app = typer.Typer(no_args_is_help=True, help="Aliases: point, rollback, canary split.")
bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks (ratios measured side by side).")
selftest_app = typer.Typer(no_args_is_help=True, help="Self-tests against a running deployment.")
for sub, name in ((kit_app, "kit"), (base_app, "base"), (adapter_app, "adapter"),
                  (tenant_app, "tenant"), (ticket_app, "ticket"), (incident_app, "incident"),
                  (audit_app, "audit"), (alias_app, "alias"), (bench_app, "bench"),
                  (selftest_app, "selftest")):
    app.add_typer(sub, name=name)


class Printer:
    """Prints through a rich ``Console`` made at each call (stdout, or stderr), so that a verb
    that prints nothing through rich, every ``--json`` one, never imports rich: tens of
    milliseconds of each start. Making a Console is cheap, and one made at the call reads the
    terminal's width and colours then, as a long-lived Console does when it prints."""

    def __init__(self, *, stderr: bool = False) -> None:
        self.stderr = stderr

    def _console(self) -> "Console":
        from rich.console import Console

        return Console(stderr=self.stderr)

    def print(self, *objects: Any, **options: Any) -> None:
        """``rich.console.Console.print``."""
        self._console().print(*objects, **options)

    def print_json(self, json_str: str | None = None, **options: Any) -> None:
        """``rich.console.Console.print_json``."""
        self._console().print_json(json_str, **options)


console = Printer()
err_console = Printer(stderr=True)


class _State:
    json: bool = False
    home: Path | None = None
    actor: str = ""


state = _State()


@app.callback()
def main(
    json_out: Annotated[bool, typer.Option("--json", help="Machine-readable JSON output.")] = False,
    home: Annotated[Path | None, typer.Option(
        "--home", help="State folder (default $LORAPLANE_HOME or ./.loraplane).")] = None,
    actor: Annotated[str | None, typer.Option(
        "--actor", help="Who is acting, recorded on every event (default $LORAPLANE_ACTOR or "
        "the login name).")] = None,
) -> None:
    state.json = json_out
    state.home = home
    state.actor = actor or os.environ.get("LORAPLANE_ACTOR") or _login()
    with errors():
        Settings.from_env(home)  # a bad setting is one clear line before any verb runs


def _login() -> str:
    try:
        return getpass.getuser()
    except Exception:
        return "operator"


def settings() -> Settings:
    s = Settings.from_env(state.home)
    s.ensure_dirs()
    return s


class NoState(RuntimeError):
    """A read-only verb was pointed at a state folder that holds no deployment."""


def existing_settings() -> Settings:
    """Settings of a state folder that already holds a deployment: read-only verbs never create
    one, else a second shell without ``LORAPLANE_HOME`` reads a new empty state and answers
    "not available" or "0 requests", hiding the cause. (With ``LORAPLANE_DB_URL`` set, the
    database is wherever it points.)"""
    s = Settings.from_env(state.home)
    if s.db_url == f"sqlite:///{s.home / 'loraplane.db'}" and not (
            s.home / "loraplane.db").exists():
        with errors():
            raise NoState(
                f"no loraplane state in {s.home} (no database there): set LORAPLANE_HOME (or "
                "--home) to the folder your deployment uses; `loraplane base register` or "
                "`loraplane tenant create` start a new one")
    return s


def emit(data: Any, human: Callable[[], None]) -> None:
    if state.json:
        print(json.dumps(data, indent=None, default=str))
    else:
        human()


@contextmanager
def errors() -> Iterator[None]:
    """Known failures become one clear line on stderr and a non-zero exit."""
    try:
        yield
    except typer.Exit:  # already reported (typer's Exit is a RuntimeError): never twice
        raise
    except Exception as e:
        # domain (eventsourcing): imported only on a failure, so `--help` never pays for it
        from control.domain import DomainError

        if not isinstance(e, (DomainError, DigestError, ValueError, FileNotFoundError,
                              RuntimeError)):
            raise
        check = getattr(e, "check", None)
        msg = f"{type(e).__name__}: {e}"
        if state.json:
            print(json.dumps({"error": str(e), "kind": type(e).__name__, "check": check}))
        else:
            err_console.print(f"[red]error[/red] {msg}")
        raise typer.Exit(2) from None


def _registry(existing: bool = False) -> Any:
    """The registry; ``existing``: for read-only verbs, which never create a state folder."""
    from projections.follower import open_registry

    return open_registry(existing_settings() if existing else settings())


def _digest(value: str) -> str:
    try:
        return check_digest(value)
    except DigestError:
        raise typer.BadParameter("expected a digest like sha256:<64 hex>") from None


# --- kit --------------------------------------------------------------------------------------

@kit_app.command("build")
def kit_build(
    out_dir: Path,
    seed: Annotated[int, typer.Option(help="Seed: same seed, same digests.")] = 1234,
) -> None:
    """Build the reference kit: a small Llama base, a tokenizer, and LoRA adapters."""
    from control.ops.kit import build_kit

    with errors():
        manifest = build_kit(out_dir, seed=seed,
                             progress=None if state.json else lambda m: err_console.print(m))
    data = json.loads((out_dir / "kit.json").read_text())
    emit(data, lambda: console.print_json(json.dumps(data)) if manifest else None)


# --- base -------------------------------------------------------------------------------------

@base_app.command("register")
def base_register(
    base_dir: Path,
    tokenizer: Annotated[Path | None, typer.Option(
        help="Tokenizer folder (default: ../tokenizer beside the base, or the base itself).")
    ] = None,
    name: Annotated[str | None, typer.Option(help="Base name (default: folder name).")] = None,
    alias: Annotated[str | None, typer.Option(
        help="Also create an alias for base-only tickets.")] = None,
) -> None:
    """Register a base model (and its tokenizer) by digest."""
    tok = tokenizer or (base_dir.parent / "tokenizer"
                        if (base_dir.parent / "tokenizer").is_dir() else base_dir)
    base_name = name or base_dir.name
    with errors():
        digest = _registry().register_base(base_dir, tok, name=base_name,
                                           actor=state.actor, alias=alias)
    emit({"name": base_name, "digest": digest, "alias": alias}, lambda: console.print(
        f"registered base [bold]{base_name}[/bold] {digest}"))


@base_app.command("list")
def base_list() -> None:
    """Registered base models."""
    rows = [_as_dict(b) for b in _routing().bases()]
    emit(rows, lambda: _table(["name", "digest", "tokenizer_digest"], rows))


# --- adapters ---------------------------------------------------------------------------------

@adapter_app.command("register")
def adapter_register(
    adapter_dir: Path,
    tenant: Annotated[str, typer.Option(help="Owning tenant.")],
    alias: Annotated[str, typer.Option(help="Alias to point at this adapter.")],
    base: Annotated[str | None, typer.Option(
        help="Base digest or name (default: from adapter_config.json).")] = None,
    signature: Annotated[Path | None, typer.Option(
        help="model_signing signature bundle over the folder.")] = None,
    owner: Annotated[str, typer.Option(help="Owner (team or person).")] = "",
    training_data_version: Annotated[str, typer.Option(help="Training data version.")] = "",
    task: Annotated[list[str] | None, typer.Option(help="An allowed task (repeatable).")] = None,
    licence: Annotated[str, typer.Option(help="Licence.")] = "",
) -> None:
    """Validate and register a PEFT LoRA adapter (safetensors only); state: draft."""
    from control.domain import AdapterMetadata

    with errors():
        meta = AdapterMetadata(owner=owner, training_data_version=training_data_version,
                               allowed_tasks=list(task or []), licence=licence)
        digest = _registry().register_adapter(adapter_dir, tenant=tenant, alias=alias,
                                              actor=state.actor, base=base,
                                              signature=signature, metadata=meta)
    emit({"digest": digest, "tenant": tenant, "alias": alias, "state": "draft"},
         lambda: console.print(
             f"registered adapter {digest} for {tenant} as [bold]{alias}[/bold] (draft)"))


@adapter_app.command("promote")
def adapter_promote(
    digest: str,
    to: Annotated[str | None, typer.Option(
        "--to", help="Target state (default: the next one).")] = None,
    canary_percent: Annotated[int, typer.Option(
        help="Share of sessions a new canary gets.")] = 10,
) -> None:
    """One lifecycle step: draft -> candidate -> canary -> stable -> deprecated."""
    d = _digest(digest)
    with errors():
        to = _registry().promote(d, to=to, actor=state.actor, canary_percent=canary_percent)
    emit({"digest": d, "state": to}, lambda: console.print(f"{short(d)} -> {to}"))


@adapter_app.command("revoke")
def adapter_revoke(
    digest: str,
    reason: Annotated[str, typer.Option(help="Why (recorded in the audit log).")],
    wait: Annotated[float, typer.Option(
        "--wait", min=0.0,
        help="Seconds to wait for the revocation set hosts read to show it.")] = 5.0,
) -> None:
    """Revoke an adapter everywhere: no new tickets, Triton refuses it within a second.
    Succeeds only once the revocation set Triton hosts read holds the digest."""
    d = _digest(digest)
    with errors():
        _registry().revoke(d, reason=reason, actor=state.actor, wait_s=wait)
    emit({"digest": d, "state": "revoked"}, lambda: console.print(f"{short(d)} revoked"))


@adapter_app.command("list")
def adapter_list(tenant: Annotated[str | None, typer.Option()] = None) -> None:
    """The adapter catalogue."""
    rows = [_as_dict(a) for a in _routing().adapters(tenant)]
    emit(rows, lambda: _table(["tenant", "alias", "digest", "state", "rank"], rows))


# --- tenants, grants, tickets -----------------------------------------------------------------

@tenant_app.command("create")
def tenant_create(name: str) -> None:
    """Create a tenant; prints its API key once (only a hash is stored)."""
    with errors():
        key = _registry().create_tenant(name, actor=state.actor)
    emit({"tenant": name, "api_key": key}, lambda: console.print(
        f"tenant [bold]{name}[/bold] created. API key (shown once): {key}"))


@tenant_app.command("list")
def tenant_list() -> None:
    """Tenant names."""
    names = _routing().tenants()
    emit(names, lambda: console.print("\n".join(names)))


@app.command("grant")
def grant(tenant: str, alias: str) -> None:
    """Allow TENANT to resolve ALIAS."""
    with errors():
        _registry().grant(tenant, alias, actor=state.actor)
    emit({"tenant": tenant, "alias": alias}, lambda: console.print(
        f"granted {alias} to {tenant}"))


@ticket_app.command("issue")
def ticket_issue(
    tenant: Annotated[str, typer.Option()],
    alias: Annotated[str, typer.Option()],
) -> None:
    """Issue a routing ticket for TENANT and ALIAS, as the gateway would."""
    from control.domain import DomainError  # domain (eventsourcing): only when a verb runs
    from control.gateway.ticket_office import NotGranted, TicketOffice, why_not
    from control.ops.serve import open_signer

    s = existing_settings()
    with errors():
        routing = _routing()
        office = TicketOffice(s, routing, open_signer(s, _registry(), state.actor))
        try:
            issued = office.issue(tenant, alias)
        except NotGranted:
            # The operator's CLI says which cause; tenants only ever get the generic refusal.
            raise DomainError(f"no ticket: {why_not(routing, tenant, alias)}") from None
    data = {"ticket": issued.token, **issued.claims.to_json()}
    emit(data, lambda: print(issued.token))


# --- incident and audit -----------------------------------------------------------------------

def _time(value: str | None) -> float | None:
    if value is None:
        return None
    try:
        t = dt.datetime.fromisoformat(value)
    except ValueError:
        raise typer.BadParameter("expected an ISO 8601 time, e.g. 2026-11-29T10:00:00") from None
    if t.tzinfo is None:
        t = t.replace(tzinfo=dt.UTC)
    return t.timestamp()


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
    from projections.incidents import requests_for

    if sum(x is not None for x in (adapter, training_data_version, base, release)) != 1:
        raise typer.BadParameter(
            "give one of --adapter, --training-data-version, --base, --release")
    with errors():
        rows = requests_for(existing_settings(), adapter=adapter and _digest(adapter),
                            training_data_version=training_data_version,
                            base=base and _digest(base), release=release and _digest(release),
                            since=_time(since), until=_time(until))
    d = adapter or base or release or f"training data {training_data_version}"
    if not include_refused:
        rows = [r for r in rows if r.outcome != "rejected"]
    data = [_as_dict(r) for r in rows]
    for r in data:
        r["admitted_at_iso"] = iso(r["admitted_at"])

    emit(data, lambda: console.print(incident_table(rows, d)))


@audit_app.command("log")
def audit_log(
    as_of: Annotated[str | None, typer.Option(
        "--as-of", help="Show the registry and routing state at this ISO time, by replay.")
    ] = None,
) -> None:
    """The event history, in order, with time and actor (or the state --as-of a time)."""
    from control.app.audit import audit_log as read_log

    if as_of is not None:
        from control.cli.registry import show_state_as_of

        show_state_as_of(_registry(existing=True), as_of)
        return
    entries = read_log(_registry(existing=True))
    emit([_as_dict(e) for e in entries], lambda: console.print(audit_table(entries)))


# --- serve and demo ---------------------------------------------------------------------------

@app.command("serve")
def serve(
    base: Annotated[str | None, typer.Option(help="Base digest (default: the only one).")] = None,
    http_port: Annotated[int, typer.Option()] = 8000,
    grpc_port: Annotated[int, typer.Option()] = 8001,
    metrics_port: Annotated[int, typer.Option()] = 8002,
    gateway_port: Annotated[int, typer.Option()] = 8080,
    listen: Annotated[str, typer.Option(
        help="Address Triton and the gateway listen on: 127.0.0.1 serves this machine only; "
             "0.0.0.0 serves other machines too (put TLS and a firewall in front).")
    ] = "127.0.0.1",
) -> None:
    """Run the gateway, the projection follower and tritonserver until interrupted."""
    from control.cli.database import require_schema
    from control.ops.serve import Deployment, Ports

    with errors():
        require_schema(settings())  # before anything starts: "run `loraplane db upgrade`"
    dep = Deployment(settings(), Ports(http_port, grpc_port, metrics_port, gateway_port),
                     base=base, actor=state.actor, progress=lambda m: err_console.print(m),
                     bind=listen)
    run_until_stopped(dep)


def run_until_stopped(dep: Any) -> None:
    """Start a deployment and keep it up until SIGTERM or Ctrl-C; always stop it."""
    from control.contracts.signals import TerminationSignals

    with TerminationSignals() as term:
        try:
            with errors():
                dep.start()
            err_console.print("serving; Ctrl-C to stop")
            term.wait()
        finally:
            dep.stop()


@app.command("demo")
def demo(
    work_dir: Annotated[Path, typer.Option(help="Where the demo builds everything.")] = Path(
        ".loraplane/demo"),
    keep: Annotated[bool, typer.Option(help="Keep the demo's state from a previous run.")] = False,
) -> None:
    """Build the kit, register, serve, send mixed traffic, revoke, show incident and audit views."""
    from control.ops.demo import run_demo

    with errors():
        code = run_demo(work_dir, fresh=not keep, json_out=state.json)
    raise typer.Exit(code)


# --- rendering --------------------------------------------------------------------------------

def _routing() -> Any:
    from control.contracts.db import make_engine
    from projections.routing import RoutingView

    return RoutingView(make_engine(existing_settings().db_url))


def _as_dict(obj: Any) -> dict[str, Any]:
    if isinstance(obj, dict):
        return dict(obj)
    if hasattr(obj, "__dataclass_fields__"):
        return {k: getattr(obj, k) for k in obj.__dataclass_fields__}
    if hasattr(obj, "_asdict"):
        return dict(obj._asdict())
    return {"value": obj}


def _table(cols: list[str], rows: list[dict[str, Any]], title: str | None = None) -> None:
    from rich.table import Table

    t = Table(title=title)
    for c in cols:
        t.add_column(c)
    for r in rows:
        t.add_row(*[cell(r.get(c)) for c in cols])
    console.print(t)
