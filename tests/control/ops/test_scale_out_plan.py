"""Scale-out without starting anything: the hosts ``serve --hosts N --pool NAME=COUNT`` plans,
their homes, the balancer's backend per pool, and the pool header the clients send."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest

from control.contracts import root_of_trust
from control.contracts.config import ConfigError, Settings
from control.contracts.placement import POOL_HEADER
from control.ops import clients
from control.ops.balancer import balancer_config
from control.ops.front_door import Upstream, compose_config, find_haproxy, render
from control.ops.scale_out import HostPlan, host_settings, parse_pools, plan_hosts

POOLED = [Upstream("127.0.0.1", 8000, 8001, name="shared-0"),
          Upstream("127.0.0.1", 8010, 8011, name="shared-1"),
          Upstream("127.0.0.1", 8020, 8021, pool="gold", name="gold-0")]


def _section(cfg: str, header: str) -> list[str]:
    lines = cfg.splitlines()
    out = []
    for line in lines[lines.index(header) + 1:]:
        if not line.strip():
            break
        out.append(line.strip())
    return out


def test_pools_and_hosts_are_planned_from_the_options() -> None:
    assert parse_pools([]) == {}
    assert parse_pools(["gold=1", "silver=2"]) == {"gold": 1, "silver": 2}
    assert plan_hosts(3, {"gold": 1}) == [HostPlan("shared-0", "shared"),
                                          HostPlan("shared-1", "shared"),
                                          HostPlan("gold-0", "gold")]
    assert plan_hosts(1, {"gold": 1}) == [HostPlan("gold-0", "gold")]
    for bad in ("gold", "gold=0", "gold=x", "=1", "Gold=1", "shared=1", "a b=1"):
        with pytest.raises(ValueError):
            parse_pools([bad])
    with pytest.raises(ValueError):
        parse_pools(["gold=1", "gold=2"])
    with pytest.raises(ValueError, match="more than --hosts 2"):
        plan_hosts(2, {"gold": 2, "silver": 1})
    with pytest.raises(ValueError):
        plan_hosts(0, {})


def test_a_host_home_shares_the_store_the_database_and_the_root_key(tmp_path: Path) -> None:
    main = Settings(home=tmp_path / "home", db_url="sqlite:///x.db", adapter_slots=6)
    main.ensure_dirs()
    root_of_trust.dev_root(main.keys_dir)
    s = host_settings(main, "gold-0", "gold", resident_share=1.0)
    assert s.home == main.home / "hosts" / "gold-0"
    assert (s.host_pool, s.db_url, s.adapter_slots, s.resident_share) == (
        "gold", main.db_url, 6, 1.0)
    assert s.store_dir.resolve() == main.store_dir.resolve()
    (main.store_dir / "blob").write_text("x")
    assert (s.store_dir / "blob").read_text() == "x"  # one store: no copy
    assert root_of_trust.root_pub_path(s.keys_dir).read_bytes() == \
        root_of_trust.root_pub_path(main.keys_dir).read_bytes()
    assert not root_of_trust.dev_root_path(s.keys_dir).exists()  # the public half only
    assert host_settings(main, "gold-0", "gold").home == s.home  # again: the same home
    with pytest.raises(ConfigError):
        host_settings(main, "x-0", "Not A Pool")


def test_the_balancer_has_a_backend_per_pool_chosen_by_the_pool_header() -> None:
    cfg = render(balancer_config(POOLED, http_port=9000, grpc_port=9001))
    for proto in ("http", "grpc"):
        front = _section(cfg, f"frontend tenant_{proto}")
        assert f"use_backend triton_{proto}_gold if {{ req.hdr({POOL_HEADER}) -m str gold }}" \
            in front
        assert front[-1] == f"default_backend triton_{proto}"  # no or another header: shared
        shared = [x.split()[1] for x in _section(cfg, f"backend triton_{proto}")
                  if x.startswith("server ")]
        gold = [x.split()[1] for x in _section(cfg, f"backend triton_{proto}_gold")
                if x.startswith("server ")]
        assert (shared, gold) == (["shared-0", "shared-1"], ["gold-0"])
        assert "hash-type consistent" in _section(cfg, f"backend triton_{proto}_gold")


def test_one_pool_renders_as_before() -> None:
    one = render(balancer_config(POOLED[:2], http_port=9000, grpc_port=9001))
    assert "use_backend" not in one and POOL_HEADER not in one
    # docker/haproxy.cfg: both hosts shared, so no pool rule; its one use_backend is the
    # hosts' OpenAI routes'
    compose = compose_config()
    assert POOL_HEADER not in compose
    assert [x.strip() for x in compose.splitlines() if "use_backend" in x] == [
        "use_backend host_openai if post openai"]
    # a dedicated pool alone leaves the shared backend empty: HAProxy answers 503 there
    only_gold = render(balancer_config(POOLED[2:], http_port=9000, grpc_port=9001))
    assert not [x for x in _section(only_gold, "backend triton_http") if x.startswith("server")]


def test_haproxy_accepts_the_pooled_configuration(tmp_path: Path) -> None:
    binary = find_haproxy()
    if binary is None:
        pytest.skip("haproxy is not installed")
    for i, upstreams in enumerate((POOLED, POOLED[2:])):
        path = tmp_path / f"pooled-{i}.cfg"
        path.write_text(render(balancer_config(upstreams, http_port=9000, grpc_port=9001)))
        checked = subprocess.run([binary, "-c", "-q", "-f", str(path)], capture_output=True,
                                 text=True, timeout=30)
        assert checked.returncode == 0, checked.stderr


def test_clients_send_the_pool_header_only_when_given(monkeypatch: pytest.MonkeyPatch) -> None:
    sent: list[dict[str, str] | None] = []

    class Refusing:
        def infer(self, *_a: Any, headers: dict[str, str] | None = None, **_k: Any) -> None:
            sent.append(headers)
            raise RuntimeError("stop here")

    for pool in ("gold", None):
        with pytest.raises(RuntimeError):
            clients.infer_with(Refusing(), "http", "hi", "ticket", affinity="abc", pool=pool)
    assert sent[0] is not None and sent[0][POOL_HEADER] == "gold"
    assert sent[1] is not None and POOL_HEADER not in sent[1]
