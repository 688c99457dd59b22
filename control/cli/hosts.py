"""``loraplane host enroll``: the root of trust enrols a Triton host's ledger checkpoint key
(``control.contracts.host_keys``). The control plane verifies a host's checkpoints only with an
enrolled key; a development home enrols presented keys itself, a deployment whose root is
offline enrols each host once (its key is kept across restarts).
"""

# No `from __future__ import annotations`: typer reads every verb's annotations at each start
# and would eval each string (see control/cli/main.py).

from pathlib import Path
from typing import Annotated

import typer

from control.cli.base import app, console, emit, errors, registry, state

host_app = typer.Typer(no_args_is_help=True,
                       help="Triton hosts' ledger checkpoint keys, enrolled by the root key.")
app.add_typer(host_app, name="host")


@host_app.command("enroll")
def host_enroll(
    host_id: Annotated[str, typer.Argument(help="The host's id (LORAPLANE_HOST_ID).")],
    key_file: Annotated[Path, typer.Option(
        "--key-file", help="The host's public checkpoint key: <home>/keys/ledger/<host>.vkey "
        "on that host.")],
    root_key: Annotated[Path | None, typer.Option(
        "--root-key", help="The offline root PRIVATE key file (`key root init --out`); a "
        "development home may omit it.")] = None,
) -> None:
    """Enrol HOST_ID's checkpoint key: the root signs it, and the control plane then verifies
    that host's ledger checkpoints with it (and refuses checkpoints signed by any other key)."""
    # the registry (eventsourcing) and the key files (cryptography): only this verb
    from control.app.ledger_audit import enroll

    with errors():
        vkey = enroll(registry(existing=True), host_id, key_file, root_key, actor=state.actor)
    emit({"host": host_id, "vkey": vkey},
         lambda: console.print(f"host {host_id}: checkpoint key enrolled ({vkey})"))
