"""CLI verbs for running loraplane across hosts; registered on the typer app of control.cli.base.

``loraplane control-plane``  the gateway and the projection follower, no Triton (one or more).
``loraplane triton-host``    one Triton host, no gateway; waits for a registered base model.
``loraplane stats``          per-digest aggregates of the request ledger (operator view).

Every process reads the same ``LORAPLANE_DB_URL``; see ``control/ops/serve.py`` for the roles.
"""

# No `from __future__ import annotations`: typer reads every verb's annotations at each start
# and would eval each string (see control/cli/main.py).

import time
from typing import Annotated

import typer

from control.cli.base import (
    _routing,
    app,
    console,
    emit,
    err_console,
    errors,
    existing_settings,
    run_until_stopped,
    settings,
    state,
)
from control.cli.database import require_schema
from control.contracts.telemetry import configure_logging
from control.ops.views import cell


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
    # the deployment (gateway, follower, Triton process): only the serving verbs pay for it
    from control.ops.serve import Deployment, Ports

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
    listen: Annotated[str, typer.Option(
        help="Address Triton listens on (0.0.0.0 in a container or to serve other machines).")
    ] = "127.0.0.1",
) -> None:
    """Run one Triton host (no gateway) until interrupted; labels its ledger rows."""
    # the deployment (gateway, follower, Triton process): only the serving verbs pay for it
    from control.ops.serve import Deployment, Ports, pick_base

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
                              base=base, actor=state.actor, bind=listen,
                              progress=lambda m: err_console.print(m))
    if host_id:
        dep.host_id = host_id
    run_until_stopped(dep)


@app.command("stats")
def stats(
    tenant: Annotated[str | None, typer.Option(help="Only this tenant's requests.")] = None,
) -> None:
    """Per adapter digest: requests, outcomes, tokens, mean latency, from the request ledger.

    Without --tenant, requests that no verified ticket names (missing or forged tickets, busy
    refusals) are counted on their own line, "(unverified)"."""
    from rich.table import Table

    from control.contracts.db import make_engine
    from control.gateway.observability import digest_stats  # prometheus_client: this verb only

    rows = digest_stats(make_engine(existing_settings().db_url), tenant,
                        unattributed=tenant is None)
    data = [r.__dict__ for r in rows]

    def human() -> None:
        # Short headers: the table fits 80 columns; --json has every value in full.
        cols = [("tenant", "tenant"), ("adapter_digest", "digest"), ("requests", "reqs"),
                ("ok", "ok"), ("rejected", "rej"), ("failed", "fail"), ("tokens_in", "in"),
                ("tokens_out", "out"), ("mean_seconds", "secs")]
        t = Table()
        for _key, header in cols:
            t.add_column(header)
        for r in data:
            if r.get("tenant") is None and r.get("adapter_digest") is None and tenant is None:
                first = ["(unverified)", ""]  # requests no verified ticket names
            else:
                first = [str(r.get("tenant") or tenant or ""), cell(r.get("adapter_digest"))]
            t.add_row(*first, *[cell(r.get(key)) for key, _h in cols[2:]])
        console.print(t)

    emit(data, human)
