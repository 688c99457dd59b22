"""CLI verbs of tenants and what they may use: creating them, their policy, grants of aliases,
and the routing tickets an operator issues as the gateway would.

``loraplane tenant create`` / ``list`` / ``policy``
``loraplane grant TENANT ALIAS``
``loraplane ticket issue``

A tenant's API keys and the removal of a grant, verbs that take something away and wait until
it is in force, are in ``control.cli.credentials``.
"""

# No `from __future__ import annotations`: typer reads every verb's annotations at each start
# and would eval each string (see control/cli/main.py).

from pathlib import Path
from typing import Annotated

import typer

from control.cli.base import (
    app,
    console,
    digest_arg,
    emit,
    errors,
    existing_settings,
    print_fields,
    registry,
    routing,
    state,
    tenant_app,
    ticket_app,
)

# --- tenants ----------------------------------------------------------------------------------

@tenant_app.command("create")
def tenant_create(name: str) -> None:
    """Create a tenant; prints its API key once (only a hash is stored)."""
    with errors():
        key = registry().create_tenant(name, actor=state.actor)
    emit({"tenant": name, "api_key": key}, lambda: console.print(
        f"tenant [bold]{name}[/bold] created. API key (shown once): {key}"))


@tenant_app.command("list")
def tenant_list() -> None:
    """Tenant names."""
    names = routing().tenants()
    emit(names, lambda: console.print("\n".join(names)))


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
    isolation: Annotated[str, typer.Option(
        help="shared, or dedicated:POOL: the tenant's adapters and prompts run only on hosts "
             "of that pool (LORAPLANE_HOST_POOL).")] = "shared",
    region: Annotated[list[str] | None, typer.Option(
        help="A region its requests may run in (repeatable; none: any region).")] = None,
    resident_share: Annotated[float | None, typer.Option(
        help="The part of each host's adapter memory its adapters may hold, counted by owner "
             "(above 0, at most 1; default: the host's LORAPLANE_TENANT_RESIDENT_SHARE).")
    ] = None,
    loads_per_minute: Annotated[float | None, typer.Option(
        help="Cold adapter loads a minute its requests may start on one host (default 120).")
    ] = None,
    max_replicas: Annotated[int | None, typer.Option(
        help="Hosts that may hold one of its adapters in a device slot at once (default: no "
             "bound); a host past it refuses the adapter's requests as unavailable.")] = None,
) -> None:
    """Set a tenant's policy: limits, signature requirement, trusted signing keys."""
    from control.app.signatures import check_trusted_key  # cryptography: only this verb
    from control.domain import TenantPolicy  # domain (eventsourcing): only when a verb runs

    targets: dict[str, list[str]] = {}
    for item in allow_targets or []:
        base, _, mods = item.partition("=")
        targets[digest_arg(base)] = [m for m in mods.split(",") if m]
    with errors():
        keys = [check_trusted_key(p.read_text()) for p in (trust_key or [])]
        policy = TenantPolicy(require_signature=require_signature, max_adapters=max_adapters,
                              max_file_bytes=max_file_bytes, max_rank=max_rank,
                              allowed_target_modules=targets, trusted_keys=keys,
                              isolation=isolation, regions=sorted(set(region or [])),
                              resident_share=resident_share, loads_per_minute=loads_per_minute,
                              max_replicas=max_replicas)
        registry().set_policy(tenant, policy, actor=state.actor)
    data = {"tenant": tenant, **policy.to_json(), "trusted_keys": len(keys)}
    emit(data, lambda: print_fields(data))


# --- grants -----------------------------------------------------------------------------------

@app.command("grant")
def grant(tenant: str, alias: str) -> None:
    """Allow TENANT to resolve ALIAS."""
    with errors():
        registry().grant(tenant, alias, actor=state.actor)
    emit({"tenant": tenant, "alias": alias}, lambda: console.print(
        f"granted {alias} to {tenant}"))


# --- tickets ----------------------------------------------------------------------------------

@ticket_app.command("issue")
def ticket_issue(
    tenant: Annotated[str, typer.Option()],
    alias: Annotated[str, typer.Option()],
) -> None:
    """Issue a routing ticket for TENANT and ALIAS, as the gateway would."""
    from control.domain import DomainError  # domain (eventsourcing): only when a verb runs

    # the ticket office and the deployment's signer (SQLAlchemy, pyseto): only this verb
    from control.gateway.ticket_office import NotGranted, TicketOffice, why_not
    from control.ops.serve import open_signer  # likewise

    s = existing_settings()
    with errors():
        view = routing()
        office = TicketOffice(s, view, open_signer(s, registry(), state.actor))
        try:
            issued = office.issue(tenant, alias)
        except NotGranted:
            # The operator's CLI says which cause; tenants only ever get the generic refusal.
            raise DomainError(f"no ticket: {why_not(view, tenant, alias)}") from None
    data = {"ticket": issued.token, **issued.claims.to_json()}
    emit(data, lambda: print(issued.token))
