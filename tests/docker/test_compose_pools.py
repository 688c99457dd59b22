"""The compose file's Triton hosts and its balancer agree on pools: each host's
LORAPLANE_HOST_POOL is the pool of its server in docker/haproxy.cfg (``compose_config``), so a
host moved to a dedicated pool without its backend (or the reverse) fails here, not in
production where its tickets would be refused."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from control.contracts.config import SHARED_POOL
from control.ops.balancer import balancer_config
from control.ops.front_door import Upstream, compose_config, render

DOCKER = Path(__file__).resolve().parents[2] / "docker"


def _triton_pools() -> dict[str, str]:
    services: dict[str, Any] = yaml.safe_load((DOCKER / "compose.yaml").read_text())["services"]
    return {name: str(svc["environment"].get("LORAPLANE_HOST_POOL", SHARED_POOL))
            for name, svc in services.items()
            if "LORAPLANE_HOST_ID" in (svc.get("environment") or {})}


def _balanced_pools(cfg: str) -> dict[str, str]:
    pools: dict[str, str] = {}
    backend = ""
    for line in cfg.splitlines():
        if line.startswith("backend triton_http"):
            backend = line.split()[1]
        elif line.strip().startswith("server ") and backend:
            name = line.split()[1]
            pools[name] = backend.removeprefix("triton_http").removeprefix("_") or SHARED_POOL
        elif not line.strip():
            backend = ""
    return pools


def test_each_compose_host_is_balanced_in_its_own_pool() -> None:
    hosts = _triton_pools()
    assert set(hosts) == {"triton-a", "triton-b"}
    assert _balanced_pools(compose_config()) == hosts
    assert _balanced_pools((DOCKER / "haproxy.cfg").read_text()) == hosts


def test_the_check_sees_a_host_in_another_pool() -> None:
    cfg = render(balancer_config([Upstream("triton-a", 8000, 8001),
                                  Upstream("triton-b", 8000, 8001, pool="gold")],
                                 http_port=8000, grpc_port=8001))
    assert _balanced_pools(cfg) == {"triton-a": "shared", "triton-b": "gold"}
