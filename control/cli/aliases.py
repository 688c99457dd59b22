"""CLI verbs of what tenants address: aliases, and the release manifests they route to.

``loraplane alias point`` / ``canary`` / ``rollback`` / ``fallback`` / ``show``
``loraplane release show``
"""

# No `from __future__ import annotations`: typer reads every verb's annotations at each start
# and would eval each string (see control/cli/main.py).

from typing import Annotated

import typer

from control.cli.base import (
    alias_app,
    console,
    digest_arg,
    emit,
    errors,
    print_fields,
    registry,
    release_app,
    state,
)
from control.contracts.digests import short

# --- aliases ----------------------------------------------------------------------------------

@alias_app.command("point")
def alias_point(alias: str, target: str) -> None:
    """Make TARGET (release, adapter or base digest) the alias's stable release."""
    t = digest_arg(target)
    with errors():
        release = registry().point_alias(alias, t, actor=state.actor)
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
        reg = registry()
        if clear:
            reg.clear_canary(alias, actor=state.actor)
            emit({"alias": alias, "canary": None}, lambda: console.print(f"{alias}: no canary"))
            return
        if target is None:
            raise typer.BadParameter("give a TARGET digest, or --clear")
        release = reg.set_canary(alias, digest_arg(target), percent, actor=state.actor)
    emit({"alias": alias, "canary": release, "percent": percent},
         lambda: console.print(f"{alias}: {percent}% -> release {short(release)}"))


@alias_app.command("rollback")
def alias_rollback(alias: str) -> None:
    """Point the alias back at its previous stable release (one command, one event)."""
    with errors():
        release = registry().rollback(alias, actor=state.actor)
    emit({"alias": alias, "release": release},
         lambda: console.print(f"{alias} rolled back to release {short(release)}"))


@alias_app.command("fallback")
def alias_fallback(
    alias: str,
    policy: Annotated[str, typer.Argument(
        help="stable (its most recent servable earlier release), base (the base model alone) "
             "or none (refuse tickets).")],
) -> None:
    """What ALIAS serves once its stable release's adapter is revoked (default: none)."""
    with errors():
        chosen = registry().set_fallback(alias, policy, actor=state.actor)
    emit({"alias": alias, "fallback": chosen},
         lambda: console.print(f"{alias}: after a revocation, falls back to {chosen}"))


@alias_app.command("show")
def alias_show(alias: str) -> None:
    """An alias's stable and canary releases and its history (operators)."""
    with errors():
        a = registry(existing=True).alias(alias)
    data = {"alias": a.name, "owner": a.owner, "stable": a.stable, "canary": a.canary,
            "canary_percent": a.canary_percent, "history": list(a.history),
            "grants": list(a.grants), "fallback": a.fallback.value,
            "last_fallback": a.last_fallback}
    emit(data, lambda: print_fields(data))


# --- releases ---------------------------------------------------------------------------------

@release_app.command("show")
def release_show(digest: str) -> None:
    """A release manifest: adapter, base, tokenizer, chat template, defaults, evaluation."""
    # release documents (eventsourcing): only when a verb runs
    from control.app.releases import MANIFEST_FILE, get_document

    d = digest_arg(digest)
    with errors():
        reg = registry(existing=True)
        reg.release_manifest(d)  # NotFound for an unknown digest
        data = get_document(reg.store, MANIFEST_FILE, d)
    emit({"digest": d, **data}, lambda: print_fields({"digest": d, **data}))
