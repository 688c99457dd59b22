"""CLI verbs of the credential lifecycle; registered on the typer apps of control.cli.base.

``tenant rotate-key`` / ``tenant revoke-keys``   a tenant's API key: replace it, or withdraw it
``ungrant TENANT ALIAS``                          remove a grant
``key list`` / ``key rotate`` / ``key retire``    ticket-signing keys

Each verb that takes something away returns once gateways and hosts read the change (within
``--wait`` seconds); otherwise it says the change is recorded but not yet in force, and exits 2.
"""

# No `from __future__ import annotations`: typer reads every verb's annotations at each start
# and would eval each string (see control/cli/main.py).

from pathlib import Path
from typing import Annotated, Any

import typer

from control.cli.base import (
    app,
    console,
    emit,
    err_console,
    errors,
    existing_settings,
    key_app,
    registry,
    routing,
    state,
    tenant_app,
)
from control.tools.views import cell

RootKeyOption = Annotated[Path | None, typer.Option(
    "--root-key", help="The offline root key file (`loraplane key root init`) that vouches "
    "for signing keys; needed once the root lives offline.")]
WaitOption = Annotated[float, typer.Option(
    "--wait", min=0.0, help="Seconds to wait for gateways and hosts to see the change.")]
ReasonOption = Annotated[str, typer.Option(help="Why (recorded in the audit log).")]
DEFAULT_WAIT_S = 5.0


# --- API keys -----------------------------------------------------------------------------------

@tenant_app.command("rotate-key")
def tenant_rotate_key(tenant: str, wait: WaitOption = DEFAULT_WAIT_S) -> None:
    """Give TENANT a new API key, printed once (only its hash is kept); the old one stops
    working."""
    # the registry's error (eventsourcing, SQLAlchemy): the verb opens the registry anyway
    from control.app.registry import NotYetVisible

    late: NotYetVisible | None = None
    with errors():
        try:
            key = registry().rotate_api_key(tenant, actor=state.actor, wait_s=wait)
        except NotYetVisible as e:
            late, key = e, str(e.result)
    data: dict[str, Any] = {"tenant": tenant, "api_key": key, "visible": late is None}
    if late is not None:
        # The new key is recorded and exists nowhere else: show it, and fail.
        data |= {"error": str(late), "kind": type(late).__name__}
    emit(data, lambda: console.print(
        f"tenant [bold]{tenant}[/bold]: new API key (shown once): {key}"))
    if late is not None:
        if not state.json:
            err_console.print(f"[red]error[/red] NotYetVisible: {late}")
        raise typer.Exit(2)


@tenant_app.command("revoke-keys")
def tenant_revoke_keys(tenant: str, reason: ReasonOption = "",
                       wait: WaitOption = DEFAULT_WAIT_S) -> None:
    """Withdraw TENANT's API key(s): it holds no working key until `tenant rotate-key`."""
    with errors():
        registry().revoke_api_keys(tenant, actor=state.actor, reason=reason, wait_s=wait)
    emit({"tenant": tenant, "api_keys": 0}, lambda: console.print(
        f"tenant {tenant}: API keys revoked"))


# --- grants -------------------------------------------------------------------------------------

@app.command("ungrant")
def ungrant(tenant: str, alias: str, wait: WaitOption = DEFAULT_WAIT_S) -> None:
    """Remove TENANT's grant of ALIAS (tickets already issued run out within their lifetime)."""
    with errors():
        registry().remove_grant(tenant, alias, actor=state.actor, wait_s=wait)
    emit({"tenant": tenant, "alias": alias, "granted": False}, lambda: console.print(
        f"removed {tenant}'s grant of {alias}"))


# --- signing keys -------------------------------------------------------------------------------

@key_app.command("list")
def key_list() -> None:
    """Recorded ticket-signing keys: when recorded, when retired, which one signs here."""
    from control.app.key_ring import active_signer  # cryptography, pyseto: only this verb

    with errors():
        active = active_signer(existing_settings().keys_dir)
    rows: list[dict[str, Any]] = [
        {"kid": k.kid, "created_at": k.created_at, "retired_at": k.retired_at,
         "active_here": active is not None and k.kid == active.kid}
        for k in routing().signing_key_rows()]

    def human() -> None:
        from rich.table import Table

        t = Table()
        for c in ("kid", "created_at", "retired_at", "active_here"):
            t.add_column(c)
        for r in rows:
            t.add_row(r["kid"], cell(r["created_at"]), cell(r["retired_at"]),
                      "yes" if r["active_here"] else "")
        console.print(t)

    emit(rows, human)


@key_app.command("rotate")
def key_rotate(wait: WaitOption = DEFAULT_WAIT_S, root_key: RootKeyOption = None) -> None:
    """Make a new signing key the active one here, once hosts can see its public half; retire
    the old one next."""
    with errors():
        kid, previous = registry().rotate_signing_key(actor=state.actor, wait_s=wait,
                                                      root_key=root_key)
    emit({"kid": kid, "previous": previous}, lambda: console.print(
        f"signing key {kid} is active" + (f"; retire {previous} with `loraplane key retire "
                                          f"{previous}`" if previous else "")))


@key_app.command("retire")
def key_retire(
    kid: str,
    reason: ReasonOption = "",
    force: Annotated[bool, typer.Option(
        "--force", help="Retire even the active or the last unretired key (gateways then "
        "answer 503 until a key is rotated in).")] = False,
    wait: WaitOption = DEFAULT_WAIT_S,
    root_key: RootKeyOption = None,
) -> None:
    """Retire a signing key: gateways stop signing with it, hosts stop accepting its tickets."""
    with errors():
        registry().retire_signing_key(kid, actor=state.actor, reason=reason, force=force,
                                      wait_s=wait, root_key=root_key)
    emit({"kid": kid, "retired": True}, lambda: console.print(f"signing key {kid} retired"))
