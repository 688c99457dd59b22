"""CLI verbs for running loraplane across hosts; registered on the typer app of control.cli.

``loraplane control-plane``  the gateway and the projection follower, no Triton (one or more).
``loraplane triton-host``    one Triton host, no gateway; waits for a registered base model.
``loraplane stats``          per-digest aggregates of the request ledger (operator view).

Every process reads the same ``LORAPLANE_DB_URL``; see ``control/serve.py`` for the roles.
"""

from __future__ import annotations

import time
from typing import Annotated

import typer

from control.cli import (
    _routing,
    app,
    console,
    emit,
    err_console,
    errors,
    run_until_stopped,
    settings,
    state,
)
from control.cli_db import require_schema
from control.observability import configure_logging, digest_stats
from control.serve import Deployment, Ports, pick_base
from control.views import cell


@app.command("control-plane")
def control_plane(
    gateway_port: Annotated[int, typer.Option(help="Gateway port.")] = 8080,
    bind: Annotated[str, typer.Option(help="Gateway listen address (0.0.0.0 in a container).")
                    ] = "127.0.0.1",
    triton: Annotated[list[str] | None, typer.Option(
        help="A Triton host (host:port of its HTTP endpoint) for the OpenAI-compatible routes; "
        "repeatable; added to $LORAPLANE_TRITON_URLS.")] = None,
) -> None:
    """Run the gateway and the projection follower (no Triton) until interrupted."""
    configure_logging()
    with errors():
        require_schema(settings())
    dep = Deployment.from_env(settings(), Ports(gateway=gateway_port), role="control",
                              bind=bind, actor=state.actor,
                              progress=lambda m: err_console.print(m))
    dep.triton_urls += list(triton or [])
    run_until_stopped(dep)


@app.command("triton-host")
def triton_host(
    http_port: Annotated[int, typer.Option()] = 8000,
    grpc_port: Annotated[int, typer.Option()] = 8001,
    metrics_port: Annotated[int, typer.Option()] = 8002,
    base: Annotated[str | None, typer.Option(help="Base digest (default: the only one).")] = None,
    host_id: Annotated[str | None, typer.Option(
        help="Name of this host in the ledger (default $LORAPLANE_HOST_ID, else hostname).")
    ] = None,
    wait: Annotated[float, typer.Option(
        help="Seconds to wait for a base model to be registered (0: fail at once).")] = 3600.0,
) -> None:
    """Run one Triton host (no gateway) until interrupted; labels its ledger rows."""
    configure_logging()
    s = settings()
    with errors():
        require_schema(s)  # fail now, not when the backend opens the ledger inside Triton
    deadline = time.monotonic() + wait
    while True:
        try:
            pick_base(_routing(), base)
            break
        except ValueError as e:
            if time.monotonic() >= deadline:
                with errors():
                    raise
            err_console.print(f"waiting: {e}")
            time.sleep(5)
    dep = Deployment.from_env(s, Ports(http_port, grpc_port, metrics_port), role="triton",
                              base=base, actor=state.actor,
                              progress=lambda m: err_console.print(m))
    if host_id:
        dep.host_id = host_id
    run_until_stopped(dep)


@app.command("stats")
def stats(
    tenant: Annotated[str | None, typer.Option(help="Only this tenant's requests.")] = None,
) -> None:
    """Per adapter digest: requests, outcomes, tokens, mean latency, from the request ledger."""
    from rich.table import Table

    from control.db import make_engine

    rows = digest_stats(make_engine(settings().db_url), tenant)
    data = [r.__dict__ for r in rows]

    def human() -> None:
        cols = ["tenant", "adapter_digest", "requests", "ok", "rejected", "failed",
                "tokens_in", "tokens_out", "mean_seconds"]
        t = Table()
        for c in cols:
            t.add_column(c)
        for r in data:
            t.add_row(*[cell(r.get(c)) if c != "tenant" else str(r.get(c) or tenant or "")
                        for c in cols])
        console.print(t)

    emit(data, human)
