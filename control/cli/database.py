"""``loraplane db status`` and ``loraplane db upgrade``: the schema versions of the database;
``loraplane db roles``: one PostgreSQL role per part of a deployment (``control.app.db_roles``).

Registered on the typer apps of control.cli.base. See ``control/contracts/schema.py`` for the
components and why opening a database never upgrades it by itself. :func:`require_schema` is
the start-up check of the long-running verbs (``control.cli.ops``).
"""

# No `from __future__ import annotations`: typer reads every verb's annotations at each start
# and would eval each string (see control/cli/main.py).

import os
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from control.cli.base import as_dict, db_app, emit, errors, print_table, settings
from control.contracts.config import Settings

if TYPE_CHECKING:
    from sqlalchemy.engine import Engine

_NOTES = {
    "absent": "created at the latest version on first use (or by `db upgrade`)",
    "current": "",
    "outdated": "run `loraplane db upgrade`",
    "newer": "this loraplane is older than the database: upgrade loraplane",
}


def _declare_components() -> None:
    """Import every schema component's owner, so :func:`all_components` knows them all.

    Here, not at the top: the owners bring sqlalchemy, eventsourcing and cryptography, and only
    the verbs that read or check the whole schema need them (``--help`` does not)."""
    from control.app import integrity  # noqa: F401  (declares the audit schema component)
    from control.contracts import (
        host_status,  # noqa: F401  (the hosts' status reports, for the console)
        ledger,  # noqa: F401  (declares the ledger schema component)
        ledger_log,  # noqa: F401  (declares the ledger_log component)
        replica_claims,  # noqa: F401  (the hosts' claims on adapters' replicas)
        serving_reports,  # noqa: F401  (the hosts' revocation steps)
        ticket_seals,  # noqa: F401  (the keys that open tickets' sealed arms)
    )
    from projections import tables  # noqa: F401  (declares the projections schema component)


def require_schema(s: Settings) -> None:
    """Start-up check for long-running commands: refuse a database this code cannot use."""
    from control.contracts.db import make_engine  # sqlalchemy: only when a database is opened
    from control.contracts.schema import require_current  # sqlalchemy: likewise

    _declare_components()
    require_current(make_engine(s.db_url))


@db_app.command("status")
def db_status() -> None:
    """Each component's schema version: found, expected, and what to do. Exit 1 if any needs
    an upgrade or is newer than this loraplane."""
    from control.contracts.db import make_engine  # sqlalchemy: only when a database is opened
    from control.contracts.schema import status  # sqlalchemy: likewise

    _declare_components()
    s = settings()
    with errors():
        found = status(make_engine(s.db_url))
    rows = [{**as_dict(f), "state": f.state, "note": _NOTES[f.state]} for f in found]
    emit(rows, lambda: print_table(["component", "found", "expected", "state", "note"], rows,
                                   title="database schema"))
    if any(f.state in ("outdated", "newer") for f in found):
        raise typer.Exit(1)


@db_app.command("upgrade")
def db_upgrade() -> None:
    """Bring every component to this loraplane's version (stop the services first).

    The ledger and audit tables are altered in place, keeping every row; the projection tables
    are dropped and rebuilt from the event store. Running it again changes nothing.
    """
    from control.contracts.db import make_engine  # sqlalchemy: only when a database is opened
    from control.contracts.schema import upgrade  # sqlalchemy: likewise
    from projections.follower import ProjectionFollower  # the registry: only `db upgrade` replays

    _declare_components()
    s = settings()

    def rebuild(engine: "Engine") -> int:
        # Only called after the projection tables were dropped and created afresh.
        return ProjectionFollower.from_settings(s).rebuild_into(engine)

    with errors():
        changes = upgrade(make_engine(s.db_url), rebuild=rebuild)
    rows = [as_dict(c) for c in changes]
    emit(rows, lambda: print_table(["component", "before", "after", "action", "detail"], rows,
                                   title="database schema upgrade"))


@db_app.command("roles")
def db_roles(
    hosts: Annotated[list[str] | None, typer.Option(
        "--host", help="A Triton host's id (LORAPLANE_HOST_ID): its own login role, which "
        "writes only its own ledger rows. Repeat for each host.")] = None,
    prefix: Annotated[str, typer.Option(
        help="Roles are <prefix>_control, <prefix>_gateway and <prefix>_host.")] = "loraplane",
    new_passwords: Annotated[bool, typer.Option(
        "--new-passwords", help="Give every login role a new random password, printed once "
        "here (with each role's database URL) and nowhere else.")] = False,
    password_file: Annotated[Path | None, typer.Option(
        "--password-file", help="JSON object: role name -> password to set (also read from "
        "LORAPLANE_DB_ROLE_PASSWORDS).")] = None,
) -> None:
    """Create the PostgreSQL roles of the control plane, the gateways and each Triton host, and
    grant each exactly what it needs (idempotent; run it again after `db upgrade` or to add a
    host). Needs PostgreSQL and a user allowed to create roles (LORAPLANE_DB_URL)."""
    # the roles module and sqlalchemy: only this verb needs them
    from control.app.db_roles import (
        PASSWORDS_ENV,
        RoleNames,
        apply_roles,
        new_password,
        parse_passwords,
        role_url,
    )
    from control.contracts.db import make_engine  # sqlalchemy: only when a database is opened

    s = settings()
    with errors():
        names = RoleNames(prefix)
        passwords: dict[str, str] = {}
        if os.environ.get(PASSWORDS_ENV):
            passwords.update(parse_passwords(os.environ[PASSWORDS_ENV], PASSWORDS_ENV))
        if password_file is not None:
            passwords.update(parse_passwords(password_file.read_text(), str(password_file)))
        if new_passwords:
            for role in (names.control, names.gateway, *(hosts or [])):
                passwords.setdefault(role, new_password())
        engine = make_engine(s.db_url)
        report = apply_roles(engine, names=names, hosts=hosts or [], passwords=passwords)
    logins = [r.role for r in report.roles if r.kind != "host group"]
    # Printed, never logged: the only copy of a generated password is this output.
    urls = {role: role_url(engine.url, role, passwords.get(role)) for role in logins}
    roles = [{**as_dict(r), "url": urls.get(r.role, "")} for r in report.roles]
    tables = [as_dict(t) for t in report.tables]

    def human() -> None:
        print_table(["role", "kind", "action", "password", "url"], roles, title="database roles")
        print_table(["table", "gateway", "host"], tables,
                    title="grants (the control plane owns every table)")
        if report.unmapped:
            print_table(["table"], [{"table": t} for t in report.unmapped],
                        title="tables in no grant map entry: the control plane's alone")

    emit({"roles": roles, "tables": tables, "unmapped": report.unmapped}, human)
