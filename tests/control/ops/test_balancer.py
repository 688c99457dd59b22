"""The balancer's HAProxy configuration and the affinity value clients send it."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest

from control.contracts.placement import AFFINITY_HEADER, affinity_of
from control.ops import clients
from control.ops.balancer import balancer_config
from control.ops.front_door import Upstream, compose_config, find_haproxy, render

UPSTREAMS = [Upstream("127.0.0.1", 8000, 8001), Upstream("127.0.0.1", 8010, 8011),
             Upstream("127.0.0.1", 8020, 8021)]


def _backend(cfg: str, name: str) -> list[str]:
    lines = cfg.splitlines()
    start = lines.index(f"backend {name}")
    out = []
    for line in lines[start + 1:]:
        if not line.strip():
            break
        out.append(line.strip())
    return out


def test_affinity_policy_hashes_the_header_consistently_on_both_protocols() -> None:
    cfg = render(balancer_config(UPSTREAMS, http_port=9000, grpc_port=9001))
    for backend in ("triton_http", "triton_grpc"):
        lines = _backend(cfg, backend)
        assert f"balance hdr({AFFINITY_HEADER})" in lines
        assert "hash-type consistent" in lines
        assert "retry-on conn-failure" in lines  # never a retry of a request a host received
        servers = [x for x in lines if x.startswith("server ")]
        assert len(servers) == 3 and all("check" in x and "inter 500ms" in x for x in servers)
    assert "frontend tenant_http" in cfg and "frontend tenant_grpc" in cfg  # the same door


def test_round_robin_policy_has_no_placement() -> None:
    cfg = render(balancer_config(UPSTREAMS, http_port=9000, grpc_port=9001,
                                 policy="roundrobin"))
    assert "balance hdr" not in cfg and "hash-type" not in cfg
    with pytest.raises(ValueError):
        balancer_config(UPSTREAMS, http_port=9000, grpc_port=9001, policy="random")
    with pytest.raises(ValueError):
        balancer_config([], http_port=9000, grpc_port=9001)


def test_the_compose_door_places_its_two_hosts_by_affinity() -> None:
    cfg = compose_config()
    assert _backend(cfg, "triton_http").count(f"balance hdr({AFFINITY_HEADER})") == 1
    assert "inter 5s" in cfg  # compose's own check interval stays


def test_haproxy_accepts_the_configuration(tmp_path: Path) -> None:
    binary = find_haproxy()
    if binary is None:
        pytest.skip("haproxy is not installed")
    path = tmp_path / "balancer.cfg"
    path.write_text(render(balancer_config(UPSTREAMS, http_port=9000, grpc_port=9001)))
    checked = subprocess.run([binary, "-c", "-q", "-f", str(path)], capture_output=True,
                             text=True, timeout=30)
    assert checked.returncode == 0, checked.stderr


def test_affinity_is_per_alias_and_names_nothing() -> None:
    a = affinity_of("chat")
    assert a == affinity_of("chat") and len(a) == 16 and a != affinity_of("chat2")
    assert "chat" not in a


def test_clients_send_the_affinity_header(monkeypatch: pytest.MonkeyPatch) -> None:
    sent: dict[str, Any] = {}

    class FakeClient:
        def infer(self, model: str, tensors: Any, parameters: Any = None,
                  headers: Any = None) -> Any:
            sent.update(headers or {})
            raise RuntimeError("stop here")

    monkeypatch.setattr(clients, "_inputs", lambda *a, **k: [])
    with pytest.raises(RuntimeError):
        clients.infer_with(FakeClient(), "http", "hi", "ticket", affinity="abc")
    assert sent == {AFFINITY_HEADER: "abc"}
