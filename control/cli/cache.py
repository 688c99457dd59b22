"""``loraplane cache status``: what the Triton hosts' adapter caches hold, for operators.

Read from the hosts' status reports (``host_status``, every few seconds) and load records
(``adapter_loads``), with each adapter's owner from the registry: the same reads as the console's
Hosts page (``control.console.reads``). The metrics port carries the host's own figures with
bounded labels (``backend.triton.metrics``).
"""

# No `from __future__ import annotations`: typer reads every verb's annotations at each start
# and would eval each string (see control/cli/main.py).

from typing import Annotated, Any

import typer

from control.cli.base import app, console, emit, errors, registry

cache_app = typer.Typer(no_args_is_help=True, help="The Triton hosts' adapter caches.")
app.add_typer(cache_app, name="cache")


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


@cache_app.command("status")
def cache_status(
    window: Annotated[float, typer.Option(
        help="Hosts that reported, and evictions, within this many seconds.", min=1.0)
    ] = 3600.0,
    top: Annotated[int, typer.Option(help="How many of the most evicted adapters.", min=1)] = 10,
) -> None:
    """Per host: adapters and bytes in each tier against its budget, the load queue, each
    tenant's use of its resident share; the evictions by reason and the most evicted adapters."""
    from control.console.reads import cache_status as read  # the registry: only this verb

    with errors():
        data = read(registry(existing=True), window, top)

    def human() -> None:
        from rich.table import Table

        t = Table(title="adapter caches by host")
        for col in ("host", "state", "device", "host tier", "load queue", "tenants' share use"):
            t.add_column(col)
        for h in data["hosts"]:
            d, ht, q = h["tiers"]["device"], h["tiers"]["host"], h["load_queue"]
            t.add_row(h["host"], h["state"],
                      f"{d['adapters']}/{d['slots']} slots, {_mib(d['bytes'])} of "
                      f"{_mib(d['budget'])}",
                      f"{ht['adapters']}, {_mib(ht['bytes'])} of {_mib(ht['budget'])}",
                      f"{q['pending_loads']} loads, {q['waiting_requests']} waiting "
                      f"(max {q['max']})",
                      ", ".join(f"{x['tenant']} {x['share_used']:.0%}/{x['share']:.0%}"
                                for x in h["tenants"]) or "-")
        console.print(t)
        ev: dict[str, Any] = data["evictions"]
        console.print(f"evictions in the last {ev['window_s']:g} s: " + (", ".join(
            f"{r} {n}" for r, n in ev["by_reason"].items()) or "none"))
        for x in ev["top"]:
            console.print(f"  {x['digest']}  {x['tenant']}  {x['evictions']}")

    emit(data, human)
