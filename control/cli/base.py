"""What every verb of the ``loraplane`` command line (typer) shares: the command tree, the
global options, the consoles, settings, errors, the registry and the routing view, and the
argument parsers and renderers more than one verb module uses.

``--json`` before any verb prints machine-readable output.

Dependencies point one way: the verb modules (``adapters``, ``tenants``, ``aliases``,
``audit``, ``credentials``, ``database``, ``ops``, ``benches``, ``selftest``) import this
module and register their verbs on its typer apps; this module imports none of them, and
``control.cli.main`` imports them all.
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
from control.contracts.digests import DigestError, check_digest
from control.tools.views import cell

if TYPE_CHECKING:
    from rich.console import Console

    from control.app.registry import Registry
    from projections.routing import RoutingView

# The command tree. Every group is declared here, in the order `--help` lists them; the verb
# modules add their commands to these groups.
app = typer.Typer(no_args_is_help=True, add_completion=False,
                  help="Serve many LoRA adapters on one base model, per tenant, on Triton.")
kit_app = typer.Typer(no_args_is_help=True, help="The reference model kit.")
base_app = typer.Typer(no_args_is_help=True, help="Base models.")
upgrade_app = typer.Typer(no_args_is_help=True,
                          help="Base-model upgrades: the adapter x {old base, new base} matrix.")
adapter_app = typer.Typer(no_args_is_help=True, help="Adapters: register, promote, revoke.")
tenant_app = typer.Typer(no_args_is_help=True, help="Tenants and their API keys.")
ticket_app = typer.Typer(no_args_is_help=True, help="Routing tickets (operators).")
incident_app = typer.Typer(no_args_is_help=True, help="Incident queries on the request ledger.")
audit_app = typer.Typer(no_args_is_help=True, help="The event history.")
alias_app = typer.Typer(no_args_is_help=True,
                        help="Aliases: point, rollback, canary split, fallback.")
bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks (ratios measured side by side).")
selftest_app = typer.Typer(no_args_is_help=True, help="Self-tests against a running deployment.")
key_app = typer.Typer(no_args_is_help=True,
                      help="Ticket-signing keys: list, rotate, retire (operators).")
db_app = typer.Typer(no_args_is_help=True, help="Database schema versions: status, upgrade.")
release_app = typer.Typer(no_args_is_help=True, help="Release manifests (what aliases route to).")
rollout_app = typer.Typer(no_args_is_help=True,
                          help="Automatic canary rollouts: status, pause, resume, abort.")
for sub, name in ((kit_app, "kit"), (base_app, "base"), (adapter_app, "adapter"),
                  (tenant_app, "tenant"), (ticket_app, "ticket"), (incident_app, "incident"),
                  (audit_app, "audit"), (alias_app, "alias"), (bench_app, "bench"),
                  (selftest_app, "selftest"), (key_app, "key"), (db_app, "db"),
                  (release_app, "release"), (rollout_app, "rollout")):
    app.add_typer(sub, name=name)
base_app.add_typer(upgrade_app, name="upgrade")


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
    """The settings of the state folder, created if it does not exist yet."""
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
    """Print ``data`` as one JSON line under ``--json``, else call ``human`` to render it."""
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


# --- the registry and the routing view ----------------------------------------------------------

def registry(existing: bool = False) -> "Registry":
    """The registry; ``existing``: for read-only verbs, which never create a state folder."""
    # the registry (eventsourcing, SQLAlchemy, cryptography): only verbs that record or replay
    # events load it, never `--help`
    from projections.follower import open_registry

    return open_registry(existing_settings() if existing else settings())


def routing() -> "RoutingView":
    """The routing view (the projection tables) of an existing deployment's database."""
    from control.contracts.db import make_engine  # SQLAlchemy: only verbs that read views
    from projections.routing import RoutingView  # the projection tables: likewise

    return RoutingView(make_engine(existing_settings().db_url))


# --- arguments ----------------------------------------------------------------------------------

def digest_arg(value: str) -> str:
    """A digest argument, checked: a malformed one is a usage error (exit 2)."""
    try:
        return check_digest(value)
    except DigestError:
        raise typer.BadParameter("expected a digest like sha256:<64 hex>") from None


def parse_time(value: str | None) -> float | None:
    """An ISO 8601 time argument as a POSIX timestamp (UTC when it names no zone)."""
    if value is None:
        return None
    try:
        t = dt.datetime.fromisoformat(value)
    except ValueError:
        raise typer.BadParameter("expected an ISO 8601 time, e.g. 2026-11-29T10:00:00") from None
    if t.tzinfo is None:
        t = t.replace(tzinfo=dt.UTC)
    return t.timestamp()


# --- rendering ----------------------------------------------------------------------------------

def as_dict(obj: Any) -> dict[str, Any]:
    """A row (dict, dataclass or named tuple) as a plain dict, for ``--json``."""
    if isinstance(obj, dict):
        return dict(obj)
    if hasattr(obj, "__dataclass_fields__"):
        return {k: getattr(obj, k) for k in obj.__dataclass_fields__}
    if hasattr(obj, "_asdict"):
        return dict(obj._asdict())
    return {"value": obj}


def print_table(cols: list[str], rows: list[dict[str, Any]], title: str | None = None) -> None:
    """Print ``rows`` as a table of the columns ``cols``."""
    from rich.table import Table

    t = Table(title=title)
    for c in cols:
        t.add_column(c)
    for r in rows:
        t.add_row(*[cell(r.get(c)) for c in cols])
    console.print(t)


def print_fields(data: dict[str, Any]) -> None:
    """Print one record as a two-column table: field, value (JSON unless a string)."""
    from rich.table import Table

    t = Table(show_header=False)
    t.add_column("field")
    t.add_column("value", overflow="fold")
    for k, v in data.items():
        t.add_row(k, v if isinstance(v, str) else json.dumps(v, default=str))
    console.print(t)
