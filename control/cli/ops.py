"""CLI verbs that run loraplane: on one machine, or across hosts; and the ledger's totals.

``loraplane serve``          the gateway, the projection follower and Triton, on this machine
                             (``--hosts N``: N Triton hosts behind the local balancer).
``loraplane demo``           the whole story end to end, in a folder of its own.
``loraplane control-plane``  the gateway and the projection follower, no Triton (one or more).
``loraplane triton-host``    one Triton host, no gateway; waits for a registered base model.
``loraplane stats``          per-digest aggregates of the request ledger (operator view).

Every process reads the same ``LORAPLANE_DB_URL``; see ``control/ops/serve.py`` for the roles.
"""

# No `from __future__ import annotations`: typer reads every verb's annotations at each start
# and would eval each string (see control/cli/main.py).

import os
import time
from pathlib import Path
from typing import Annotated, Protocol

import typer

from control.cli.base import (
    app,
    console,
    emit,
    err_console,
    errors,
    existing_settings,
    routing,
    settings,
    state,
)
from control.cli.database import require_schema
from control.contracts.signals import TerminationSignals
from control.contracts.telemetry import configure_logging
from control.tools.views import cell

FRONT_DOOR_HELP = (
    "auto: tenants reach Triton through HAProxy (the front door) whenever haproxy is installed, "
    "and without it only on loopback; haproxy: require it; external: no door here, Triton "
    "listens on the tenant ports itself (another proxy is the only way in, as in "
    "docker/compose.yaml).")
TRITON_USER_ENV = "LORAPLANE_TRITON_USER"
TRITON_USER_HELP = (
    "Run as root: the user tritonserver runs as (default loraplane-triton, created if absent; "
    "root keeps Triton as root).")
# The options serve and triton-host share (both run a Triton host behind a front door).
FrontDoorOption = Annotated[str, typer.Option(help=FRONT_DOOR_HELP)]
TritonHttpPortOption = Annotated[int, typer.Option(
    help="Triton's own HTTP port behind the front door (loopback; 0: any free port).")]
TritonGrpcPortOption = Annotated[int, typer.Option(
    help="Triton's own gRPC port behind the front door (loopback; 0: any free port).")]
OpenAIPortOption = Annotated[int, typer.Option(
    help="The host's OpenAI-compatible route (model = the ticket's affinity, the ticket in the "
         "x-loraplane-ticket header), on loopback; the front door sends /v1/completions and "
         "/v1/chat/completions there (0: any free port).")]
TritonUserOption = Annotated[str | None, typer.Option(help=TRITON_USER_HELP,
                                                       envvar=TRITON_USER_ENV)]


def default_triton_user(given: str | None) -> str | None:
    """``--triton-user``, defaulting to ``loraplane-triton`` when this runs as root."""
    # the Triton user's module: only the verbs that launch Triton pay for it
    from control.ops.triton_user import DEFAULT_TRITON_USER

    if given is None and os.geteuid() == 0:
        return DEFAULT_TRITON_USER
    return given


@app.command("serve")
def serve(
    base: Annotated[str | None, typer.Option(help="Base digest (default: the only one).")] = None,
    http_port: Annotated[int, typer.Option()] = 8000,
    grpc_port: Annotated[int, typer.Option()] = 8001,
    metrics_port: Annotated[int, typer.Option()] = 8002,
    gateway_port: Annotated[int, typer.Option()] = 8080,
    listen: Annotated[str, typer.Option(
        help="Address the gateway and the front door listen on: 127.0.0.1 serves this machine "
             "only; 0.0.0.0 serves other machines too (needs haproxy; put TLS and a firewall "
             "in front).")
    ] = "127.0.0.1",
    front_door: FrontDoorOption = "auto",
    triton_http_port: TritonHttpPortOption = 18000,
    triton_grpc_port: TritonGrpcPortOption = 18001,
    openai_port: OpenAIPortOption = 18002,
    triton_user: TritonUserOption = None,
    console_port: Annotated[int, typer.Option(
        help="Also serve the operator console on 127.0.0.1:PORT (0: not at all); never on the "
             "gateway's port. Log in with `loraplane console token`.")] = 0,
    hosts: Annotated[int, typer.Option(
        help="Scale-out: run this many Triton hosts (homes under <home>/hosts/) behind the "
             "local balancer (HAProxy) on --http-port and --grpc-port; host i's Triton on "
             "loopback at --triton-http-port + 2i and --triton-grpc-port + 2i, its metrics on "
             "--metrics-port + i. 0: one host behind its front door.")] = 0,
    pool: Annotated[list[str] | None, typer.Option(
        help="With --hosts: NAME=COUNT puts COUNT of the hosts in the dedicated pool NAME "
             "(repeatable); the rest are in the shared pool. Requests go to the pool their "
             "x-loraplane-pool header names, else to the shared pool.")] = None,
) -> None:
    """Run the gateway, the projection follower and tritonserver until interrupted."""
    # the deployment (gateway, follower, Triton process): only the serving verbs pay for it
    from control.ops.serve import Deployment, Ports

    with errors():
        require_schema(settings())  # before anything starts: "run `loraplane db upgrade`"
    ports = Ports(http_port, grpc_port, metrics_port, gateway_port, triton_http_port,
                  triton_grpc_port, openai_port)
    dep: Runnable
    if hosts or pool:
        from control.ops.scale_out import ScaleOut, parse_pools, plan_hosts  # serve only

        with errors():
            pools = parse_pools(pool or [])
            plan_hosts(hosts, pools)  # a wrong count is refused before anything starts
        dep = ScaleOut(settings(), hosts, pools, ports, base=base, actor=state.actor,
                       progress=lambda m: err_console.print(m), bind=listen,
                       triton_user=default_triton_user(triton_user))
    else:
        dep = Deployment(settings(), ports, base=base, actor=state.actor,
                         progress=lambda m: err_console.print(m), bind=listen,
                         front_door=front_door, triton_user=default_triton_user(triton_user))
    if console_port:
        # the console (aiohttp, Jinja2): only a serve that asks for it loads it
        from control.console.background import serve_in_thread

        with errors():
            serve_in_thread(settings(), port=console_port, actor=state.actor)
        err_console.print(f"operator console on http://127.0.0.1:{console_port}/")
    run_until_stopped(dep)



@app.command("demo")
def demo(
    work_dir: Annotated[Path, typer.Option(help="Where the demo builds everything.")] = Path(
        ".loraplane/demo"),
    keep: Annotated[bool, typer.Option(help="Keep the demo's state from a previous run.")] = False,
) -> None:
    """Build the kit, register, serve, send mixed traffic, revoke, show incident and audit views."""
    # the demo starts a deployment and sends traffic: only this verb pays for it
    from control.tools.demo import run_demo

    with errors():
        code = run_demo(work_dir, fresh=not keep, json_out=state.json)
    raise typer.Exit(code)


class Runnable(Protocol):
    """A deployment or a scale-out: started, then stopped."""

    def start(self) -> None: ...

    def stop(self) -> None: ...


def run_until_stopped(dep: Runnable) -> None:
    """Start a deployment and keep it up until SIGTERM or Ctrl-C; always stop it."""
    with TerminationSignals() as term:
        try:
            with errors():
                dep.start()
            err_console.print("serving; Ctrl-C to stop")
            term.wait()
        finally:
            dep.stop()


@app.command("control-plane")
def control_plane(
    gateway_port: Annotated[int, typer.Option(help="Gateway port.")] = 8080,
    bind: Annotated[str, typer.Option(help="Gateway listen address (0.0.0.0 in a container).")
                    ] = "127.0.0.1",
    triton: Annotated[list[str] | None, typer.Option(
        help="A Triton host (host:port of its HTTP endpoint; POOL=host:port for a host of a "
        "dedicated pool) for the OpenAI-compatible routes and rollout probes; repeatable; added "
        "to $LORAPLANE_TRITON_URLS.")] = None,
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
        help="Address the front door (or, with --front-door external, Triton) listens on "
             "(0.0.0.0 in a container or to serve other machines).")
    ] = "127.0.0.1",
    front_door: FrontDoorOption = "auto",
    triton_http_port: TritonHttpPortOption = 18000,
    triton_grpc_port: TritonGrpcPortOption = 18001,
    openai_port: OpenAIPortOption = 18002,
    triton_user: TritonUserOption = None,
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
            pick_base(routing(), base)
            break
        except ValueError as e:
            if time.monotonic() >= deadline:
                with errors():
                    raise
            err_console.print(f"waiting: {e}")
            time.sleep(5)
    dep = Deployment.from_env(s, Ports(http_port, grpc_port, metrics_port,
                                       triton_http=triton_http_port,
                                       triton_grpc=triton_grpc_port, openai=openai_port),
                              role="triton",
                              base=base, actor=state.actor, bind=listen,
                              front_door=front_door,
                              triton_user=default_triton_user(triton_user),
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

    from control.contracts.db import make_engine  # SQLAlchemy: only verbs that read a database
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
