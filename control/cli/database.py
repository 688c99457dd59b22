"""``loraplane db status`` and ``loraplane db upgrade``: the schema versions of the database.

Registered on the typer apps of control.cli.base. See ``control/contracts/schema.py`` for the
components and why opening a database never upgrades it by itself. :func:`require_schema` is
the start-up check of the long-running verbs (``control.cli.ops``).
"""

# No `from __future__ import annotations`: typer reads every verb's annotations at each start
# and would eval each string (see control/cli/main.py).

from typing import TYPE_CHECKING

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
        ledger,  # noqa: F401  (declares the ledger schema component)
        ledger_log,  # noqa: F401  (declares the ledger_log component)
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
