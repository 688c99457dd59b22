"""The local balancer: one HAProxy in front of several Triton hosts, placing by adapter affinity.

It is the front door (``control.ops.front_door``) with several upstreams: the same tenant routes
pass (health, metadata, model configuration, inference; HTTP/1.1 and gRPC over HTTP/2), the same
admin routes are refused, operator headers are removed. On top:

- placement: ``balance hdr(x-loraplane-affinity)`` with ``hash-type consistent``. The gateway's
  ticket answer carries the affinity value (``control.contracts.placement``) and the bundled
  clients send it, so one route's requests land on one host and its adapters stay resident
  there. Without the header, round robin.
- health: each host's ``/v2/health/ready`` is checked every ``check_ms``; a host that fails one
  check is out until it passes one, and its share of affinity values moves to the others. A
  connection refused before a host is marked down is retried on another host (the request never
  reached the first, so nothing runs twice); a request already on a host that dies ends with a
  clear error (HTTP 502/503, gRPC UNAVAILABLE), never a hang.

The header only places a request: every host verifies the ticket itself, so a forged value
costs a cold load, never access. Canary splits stay in the ticket, not here.

``policy="roundrobin"`` drops the placement (the benchmark's baseline).
"""

from __future__ import annotations

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
