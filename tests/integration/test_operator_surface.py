"""What an operator meets starting and stopping `serve`, on the real tritonserver.

- a second deployment on ports another one holds is refused before anything starts, naming the
  port, and never mistakes the first one's Triton for its own or writes into its log;
- Triton listens on loopback unless told otherwise (`--listen`);
- stopping says what it stops and what was in flight, and does not run into Triton's exit
  timeout (Triton's log would say "Exit timeout expired").
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from control.cli.main import app
from control.ops.clients import generate
from control.ops.serve import Deployment, Ports
from control.ops.triton_server import PortInUse, free_ports
from tests.integration.conftest import ACTOR, Stack

pytestmark = pytest.mark.triton


def _listening(port: int) -> set[str]:
    """Local addresses with a listening TCP socket on ``port`` (Linux /proc/net)."""
    found: set[str] = set()
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            local, state = line.split()[1], line.split()[3]
            addr, hexport = local.split(":")
            if state == "0A" and int(hexport, 16) == port and len(addr) == width:
                found.add(addr)
    return found


def test_a_second_deployment_on_taken_ports_is_refused_before_it_starts(stack: Stack) -> None:
    first = stack.deployment
    assert first.triton is not None
    log_before = first.triton.log_path.stat().st_size
    second = Deployment(stack.settings, first.ports, actor=ACTOR)
    with pytest.raises(PortInUse, match=f"port {first.ports.http} \\(Triton HTTP\\)"):
        second.start()
    assert second.triton is None  # nothing was launched
    assert first.triton.log_path.stat().st_size == log_before  # nor written into its log
    # The CLI says the same, with exit code 2.
    grpc, metrics, gateway = free_ports(3, avoid=[first.ports.http])
    res = CliRunner().invoke(app, ["--json", "--home", str(stack.settings.home), "serve",
                                   "--http-port", str(first.ports.http),
                                   "--grpc-port", str(grpc), "--metrics-port", str(metrics),
                                   "--gateway-port", str(gateway)],
                             env={"LORAPLANE_DB_URL": stack.settings.db_url})
    assert res.exit_code == 2, res.output
    assert "already in use" in json.loads(res.stdout.splitlines()[0])["error"]
    # The first deployment serves on, undisturbed.
    assert generate(stack.http, "Hi", stack.ticket("acme", "acme-alpha"), max_tokens=2).text


# 127.0.0.1, ::ffff:127.0.0.1 and ::1 as /proc/net writes them; never 0.0.0.0 or ::
LOOPBACK = {"0100007F", "0000000000000000FFFF00000100007F", "00000000000000000000000001000000"}


def test_triton_listens_on_loopback_only(stack: Stack) -> None:
    ports = stack.deployment.ports
    for port in (ports.http, ports.grpc, ports.metrics, ports.gateway):
        found = _listening(port)
        assert found and found <= LOOPBACK, (port, found)


def test_stopping_says_what_it_stops_and_skips_triton_exit_timeout(stack: Stack) -> None:
    said: list[str] = []
    dep = Deployment(stack.settings, Ports.free(),
                     actor=ACTOR, progress=said.append, host_id="stop-test")
    dep.start()
    assert dep.triton is not None
    log = dep.triton.log_path
    dep.stop()
    stopping = [m for m in said if m.startswith("stopping")]
    assert stopping == ["stopping tritonserver, gateway, projection follower; "
                        "no request in flight"], said
    assert said[-1].startswith("stopped in ")
    assert "Exit timeout expired" not in log.read_text()
    assert dep.triton.proc is not None and dep.triton.proc.poll() is not None
