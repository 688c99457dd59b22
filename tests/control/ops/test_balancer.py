"""The balancer's HAProxy configuration and the affinity value clients send it."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest

from control.contracts.placement import AFFINITY_HEADER, POOL_HEADER, affinity_of
from control.ops import clients
from control.ops.balancer import _upstream, balancer_config
from control.ops.front_door import (
    DoorConfig,
    Upstream,
    compose_config,
    find_haproxy,
    local_door,
    render,
)

UPSTREAMS = [Upstream("127.0.0.1", 8000, 8001), Upstream("127.0.0.1", 8010, 8011),
             Upstream("127.0.0.1", 8020, 8021)]
# the same hosts with their OpenAI routes, the last one in a dedicated pool
WITH_OPENAI = [Upstream("127.0.0.1", 8000, 8001, name="shared-0", openai_port=8002),
               Upstream("127.0.0.1", 8010, 8011, name="shared-1", openai_port=8012),
               Upstream("127.0.0.1", 8020, 8021, name="gold-0", pool="gold", openai_port=8022)]


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
    for i, (upstreams, policy) in enumerate(((UPSTREAMS, "affinity"),
                                             (WITH_OPENAI, "affinity"),
                                             (WITH_OPENAI, "roundrobin"))):
        path = tmp_path / f"balancer-{i}.cfg"
        path.write_text(render(balancer_config(upstreams, http_port=9000, grpc_port=9001,
                                               policy=policy)))
        checked = subprocess.run([binary, "-c", "-f", str(path)], capture_output=True,
                                 text=True, timeout=30)
        assert checked.returncode == 0, checked.stderr
        assert "[WARNING]" not in checked.stderr, checked.stderr  # every rule does its part


def _servers(lines: list[str]) -> list[tuple[str, str]]:
    """(name, id) of each server of a backend."""
    out = []
    for line in lines:
        if line.startswith("server "):
            words = line.split()
            out.append((words[1], words[words.index("id") + 1]))
    return out


def test_the_openai_paths_hash_the_model_onto_the_triton_backends_hosts() -> None:
    cfg = render(balancer_config(WITH_OPENAI, http_port=9000, grpc_port=9001))
    for suffix, names in (("", ["shared-0", "shared-1"]), ("_gold", ["gold-0"])):
        triton = _servers(_backend(cfg, f"triton_http{suffix}"))
        assert [n for n, _ in triton] == names
        assert _servers(_backend(cfg, f"triton_grpc{suffix}")) == triton
        openai = _backend(cfg, f"host_openai{suffix}")
        assert _servers(openai) == triton  # same names, same ids: the same ring
        assert "option http-buffer-request" in openai
        assert "http-request set-var(txn.affinity) req.body,json_query('$.model')" in openai
        # the header first, so the body's model wins where HAProxy finds it
        assert openai.index(f"http-request set-var(txn.affinity) req.hdr({AFFINITY_HEADER})") \
            < openai.index("http-request set-var(txn.affinity) req.body,json_query('$.model')")
        assert "balance hash var(txn.affinity)" in openai and "hash-type consistent" in openai
        assert "retry-on conn-failure" in openai
        assert "option httpchk GET /v2/health/ready" in openai
        ports = [x.split()[2] for x in openai if x.startswith("server ")]
        checks = [x.split()[x.split().index("port") + 1] for x in openai
                  if x.startswith("server ")]
        hosts = [u for u in WITH_OPENAI if u.name in names]
        assert ports == [f"127.0.0.1:{u.openai_port}" for u in hosts]
        assert checks == [str(u.http_port) for u in hosts]  # checked on Triton's HTTP port
    assert [x for x in cfg.splitlines() if "host_openai" in x and "use_backend" in x] == [
        f"    use_backend host_openai_gold if post openai "
        f"{{ req.hdr({POOL_HEADER}) -m str gold }}",
        "    use_backend host_openai if post openai"]
    assert "or post openai" in cfg  # the 403 rule lets them pass


def test_openai_ports_come_from_every_host_or_none() -> None:
    cfg = render(balancer_config(UPSTREAMS, http_port=9000, grpc_port=9001))
    assert "openai" not in cfg  # the /v1/ paths are refused as before
    with pytest.raises(ValueError, match="every"):
        balancer_config([*UPSTREAMS[:1], *WITH_OPENAI[1:]], http_port=9000, grpc_port=9001)
    rr = render(balancer_config(WITH_OPENAI, http_port=9000, grpc_port=9001,
                                policy="roundrobin"))
    assert "backend host_openai" in rr and "balance" not in rr and "http-buffer" not in rr


def test_one_hosts_door_renders_as_before() -> None:
    door = local_door(Path("/tmp"), "127.0.0.1", 8000, 8001, 18000, 18001, openai_port=18002)
    cfg = render(door.config)
    assert _backend(cfg, "host_openai") == ["server openai 127.0.0.1:18002"]
    assert "balance" not in cfg and " id " not in cfg and "http-buffer" not in cfg
    with pytest.raises(ValueError):  # one loopback route, or each upstream's: not both
        render(DoorConfig("127.0.0.1", 8000, 8001, tuple(WITH_OPENAI[:1]), openai_port=1))


def test_the_command_line_takes_an_openai_port() -> None:
    assert _upstream("10.0.0.1:8000:8001") == Upstream("10.0.0.1", 8000, 8001)
    assert _upstream("h:8000:8001:8002") == Upstream("h", 8000, 8001, openai_port=8002)
    assert _upstream("::1:8000:8001") == Upstream("::1", 8000, 8001)


def test_affinity_is_per_alias_and_names_nothing() -> None:
    a = affinity_of("chat")
    assert a == affinity_of("chat") and len(a) == 16 and a != affinity_of("chat2")
    # a tenant's own value: one spelling per (tenant, alias), none equal to another pair's
    pairs = [("acme", "chat"), ("globex", "chat"), ("acme", "chat2"), ("a", "cme:chat"),
             ("acme:", "chat")]
    values = {affinity_of(alias, tenant) for tenant, alias in pairs}
    assert len(values) == len(pairs) and a not in values
    assert all(len(v) == 16 and int(v, 16) >= 0 for v in values)
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
