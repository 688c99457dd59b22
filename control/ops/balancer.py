"""The local balancer: one HAProxy in front of several Triton hosts, placing by adapter affinity.

It is the front door (``control.ops.front_door``) with several upstreams: the same tenant routes
pass (health, metadata, model configuration, inference; HTTP/1.1 and gRPC over HTTP/2), the same
admin routes are refused, operator headers are removed. When every host names its OpenAI port
(``Upstream.openai_port``), ``POST /v1/completions`` and ``/v1/chat/completions`` go to the hosts'
own OpenAI routes (``control.gateway.host_openai``), per pool like the rest. On top:

- placement: ``balance hdr(x-loraplane-affinity)`` with ``hash-type consistent``. The gateway's
  ticket answer carries the affinity value (``control.contracts.placement``) and the bundled
  clients send it, so one route's requests land on one host and its adapters stay resident
  there. Without the header, round robin. The OpenAI paths hash the body's ``model`` (the same
  affinity value, as OpenAI clients send it) the same way onto the same servers, so a ticket's
  requests land on one host on either route; the header places those whose ``model`` lies past
  HAProxy's buffer.
- health: each host's ``/v2/health/ready`` is checked every ``check_ms``; a host that fails one
  check is out until it passes one, and its share of affinity values moves to the others. A
  connection refused before a host is marked down is retried on another host (the request never
  reached the first, so nothing runs twice); a request already on a host that dies ends with a
  clear error (HTTP 502/503, gRPC UNAVAILABLE), never a hang.

The header only places a request: every host verifies the ticket itself, so a forged value
costs a cold load, never access. Canary splits stay in the ticket, not here.

``policy="roundrobin"`` drops the placement (the benchmark's baseline).

``python -m control.ops.balancer --upstream HOST:HTTP:GRPC[:OPENAI] ...`` runs one in the
foreground (the scale-out of hosts started by hand: ``loraplane triton-host`` on each; a host's
OpenAI route listens on its loopback, so OPENAI only for hosts on the balancer's machine).
"""

from __future__ import annotations

import argparse
import signal
import tempfile
from collections.abc import Sequence
from pathlib import Path

from control.contracts.placement import AFFINITY_HEADER
from control.ops.front_door import DoorConfig, FrontDoor, Upstream

POLICIES = ("affinity", "roundrobin")
CHECK_MS = 500  # local hosts: a dead one is out within about a second


def balancer_config(upstreams: Sequence[Upstream], *, listen: str = "127.0.0.1",
                    http_port: int, grpc_port: int, policy: str = "affinity",
                    check_ms: int = CHECK_MS) -> DoorConfig:
    """The HAProxy configuration of a balancer over ``upstreams`` (each host's tenant ports)."""
    if policy not in POLICIES:
        raise ValueError(f"policy is one of {', '.join(POLICIES)}, not {policy!r}")
    if not upstreams:
        raise ValueError("a balancer needs at least one Triton host")
    if len({u.openai_port is None for u in upstreams}) > 1:
        raise ValueError("give every Triton host's OpenAI port or none: the OpenAI paths are "
                         "placed on the same hosts as the Triton routes")
    return DoorConfig(listen=listen, http_port=http_port, grpc_port=grpc_port,
                      upstreams=tuple(upstreams), health_checks=True,
                      affinity_header=AFFINITY_HEADER if policy == "affinity" else None,
                      check_ms=check_ms)


def start_balancer(work_dir: Path, upstreams: Sequence[Upstream], *, http_port: int,
                   grpc_port: int, listen: str = "127.0.0.1", policy: str = "affinity",
                   check_ms: int = CHECK_MS) -> FrontDoor:
    """Start a balancer (HAProxy, checked before launch) and wait until it listens."""
    door = FrontDoor(work_dir, balancer_config(upstreams, listen=listen, http_port=http_port,
                                               grpc_port=grpc_port, policy=policy,
                                               check_ms=check_ms))
    door.start()
    try:
        door.wait_ready()
    except Exception:
        door.stop()
        raise
    return door


def _upstream(text: str) -> Upstream:
    """``HOST:HTTP:GRPC`` or ``HOST:HTTP:GRPC:OPENAI``; a bare IPv6 host takes the first form
    only (its colons make the second ambiguous)."""
    parts = text.rsplit(":", 3)
    if len(parts) == 4 and ":" not in parts[0] and all(x.isdigit() for x in parts[1:]):
        return Upstream(parts[0], int(parts[1]), int(parts[2]), openai_port=int(parts[3]))
    host, http, grpc = text.rsplit(":", 2)
    return Upstream(host, int(http), int(grpc))


def main(argv: Sequence[str] | None = None) -> None:
    """Run a balancer over the given hosts until interrupted."""
    p = argparse.ArgumentParser(prog="python -m control.ops.balancer", description=__doc__
                                and __doc__.splitlines()[0])
    p.add_argument("--upstream", action="append", type=_upstream, required=True,
                   metavar="HOST:HTTP:GRPC[:OPENAI]",
                   help="a Triton host's tenant ports, and its OpenAI route's (repeat)")
    p.add_argument("--listen", default="127.0.0.1")
    p.add_argument("--http-port", type=int, default=8000)
    p.add_argument("--grpc-port", type=int, default=8001)
    p.add_argument("--policy", choices=POLICIES, default="affinity")
    p.add_argument("--check-ms", type=int, default=CHECK_MS)
    a = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="loraplane-balancer-") as work:
        door = start_balancer(Path(work), a.upstream, http_port=a.http_port,
                              grpc_port=a.grpc_port, listen=a.listen, policy=a.policy,
                              check_ms=a.check_ms)
        openai = (f", OpenAI http://{door.http_url}/v1"
                  if a.upstream[0].openai_port is not None else "")
        print(f"balancing {len(a.upstream)} hosts ({a.policy}) on http {door.http_url}, "
              f"grpc {door.grpc_url}{openai}; log {door.log_path}", flush=True)
        try:
            signal.sigwait({signal.SIGINT, signal.SIGTERM})
        finally:
            door.stop()


if __name__ == "__main__":
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    main()
