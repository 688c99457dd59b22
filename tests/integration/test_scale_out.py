"""``serve --hosts 2 --pool gold=1`` for real: what the CLI starts (``control.ops.scale_out``),
two tritonserver hosts (``shared-0`` and ``gold-0``) behind the local balancer (HAProxy) and one
control plane, on one PostgreSQL.

Shows: tickets and inferences sent through the balancer's ports are answered by both hosts, each
request by the host of the pool its ``x-loraplane-pool`` header names (the ticket answer's
``pool``), the shared host without one; a forged or wrong pool header only places: the host of
the wrong pool refuses the ticket with the generic refusal; the scale-out says where everything
listens and stops cleanly. Skipped without LORAPLANE_TEST_PG_URL, tritonserver or haproxy.
"""

from __future__ import annotations

import json
import socket
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import sqlalchemy as sa

from control.app.registry import Registry
from control.contracts import root_of_trust
from control.contracts.db import make_engine
from control.contracts.ledger import request_ledger
from control.contracts.tickets import GENERIC_REFUSAL
from control.domain.policy import TenantPolicy
from control.ops.clients import Generation, TritonRefused, generate, request_ticket
from control.ops.scale_out import ScaleOut
from control.ops.serve import Ports
from control.ops.triton_server import free_ports
from control.tools.kit import KitManifest
from projections.follower import open_registry
from tests.fixtures_control import close_registry, postgres_settings
from tests.integration.conftest import hosts_of, require_servers

ACTOR = "scale-out-test"
pytestmark = pytest.mark.postgres


@dataclass
class Cluster:
    scale: ScaleOut
    registry: Registry
    keys: dict[str, str]  # tenant -> API key
    digests: dict[str, str]  # alias -> adapter digest
    db_url: str

    def ticket(self, tenant: str, alias: str) -> dict[str, str]:
        status, body = request_ticket(self.scale.gateway_url, self.keys[tenant], alias)
        assert status == 200, body
        return {k: str(v) for k, v in body.items()}

    def host_of(self, request_ids: list[str]) -> dict[str, str]:
        return hosts_of(self.db_url, request_ids)

    def refusals_on(self, host: str) -> int:
        t = request_ledger
        with make_engine(self.db_url).connect() as conn:
            return int(conn.execute(sa.select(sa.func.count()).select_from(t).where(
                t.c.host == host, t.c.outcome == "rejected")).scalar() or 0)


@pytest.fixture(scope="module")
def cluster(kit_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    root = tmp_path_factory.mktemp("scale-out")
    require_servers(root, haproxy=True)
    with postgres_settings(root / "home") as s:
        s.ensure_dirs()
        root_of_trust.dev_root(s.keys_dir)
        kit = KitManifest.load(kit_dir)
        reg = open_registry(s)
        reg.register_base(kit_dir / kit.base_path, kit_dir / kit.tokenizer_path,
                          name="tiny-llama", actor=ACTOR)
        keys = {"acme": reg.create_tenant("acme", actor=ACTOR),
                "globex": reg.create_tenant("globex", actor=ACTOR)}
        # globex's adapters and prompts run in its dedicated pool only
        reg.set_policy("globex", TenantPolicy(isolation="dedicated:gold"), actor=ACTOR)
        digests = {}
        for tenant, alias, adapter in (("acme", "chat", "alpha"), ("globex", "law", "gamma")):
            digests[alias] = reg.register_adapter(kit_dir / kit.adapters[adapter].path,
                                                  tenant=tenant, alias=alias, actor=ACTOR)
            reg.advance(digests[alias], external=True,
                        evaluation={"suite": "smoke", "passed": True}, actor=ACTOR)
            reg.grant(tenant, alias, actor=ACTOR)
        # what `serve --hosts 2 --pool gold=1` starts, on free loopback ports
        http, grpc, gateway = free_ports(3)
        scale = ScaleOut(s, 2, {"gold": 1},
                         Ports(http=http, grpc=grpc, metrics=0, gateway=gateway,
                               triton_http=0, triton_grpc=0, openai=0),
                         actor=ACTOR)
        try:
            scale.start()
            yield Cluster(scale, reg, keys, digests, s.db_url)
        finally:
            scale.stop()
            close_registry(reg)


def _send(c: Cluster, answer: dict[str, str], text: str, *, pool: str | None,
          protocol: str = "http") -> Generation:
    url = c.scale.tenant_http_url if protocol == "http" else c.scale.tenant_grpc_url
    return generate(url, text, answer["ticket"], max_tokens=4, protocol=protocol,
                    affinity=answer["affinity"], pool=pool)


def test_requests_land_on_the_host_of_their_pool(cluster: Cluster) -> None:
    shared, gold = cluster.ticket("acme", "chat"), cluster.ticket("globex", "law")
    assert shared["pool"] == "shared" and gold["pool"] == "gold"
    served: dict[str, list[str]] = {"chat": [], "law": []}
    for protocol in ("http", "grpc"):
        for i in range(2):
            # as the bundled clients send them: the pool header from the ticket answer
            for alias, answer in (("chat", shared), ("law", gold)):
                g = _send(cluster, answer, f"{alias} {protocol} {i}", pool=answer["pool"],
                          protocol=protocol)
                assert g.adapter_digest == cluster.digests[alias]
                served[alias].append(g.request_id)
        # a shared ticket without any pool header goes to the shared pool too
        served["chat"].append(_send(cluster, shared, f"bare {protocol}", pool=None,
                                    protocol=protocol).request_id)
    hosts = {alias: set(cluster.host_of(ids).values()) for alias, ids in served.items()}
    assert hosts == {"chat": {"shared-0"}, "law": {"gold-0"}}, hosts  # both hosts answered


def test_a_forged_pool_header_only_places(cluster: Cluster) -> None:
    shared, gold = cluster.ticket("acme", "chat"), cluster.ticket("globex", "law")
    # an unknown pool is the shared pool: the shared ticket is served there
    g = _send(cluster, shared, "unknown pool", pool="platinum")
    assert cluster.host_of([g.request_id]) == {g.request_id: "shared-0"}
    # the wrong pool's host refuses, with the refusal any bad ticket gets
    for answer, forged, host in ((shared, "gold", "gold-0"), (gold, None, "shared-0"),
                                 (gold, "platinum", "shared-0")):
        before = cluster.refusals_on(host)
        for protocol in ("http", "grpc"):
            with pytest.raises(TritonRefused) as refused:
                _send(cluster, answer, "misplaced", pool=forged, protocol=protocol)
            assert GENERIC_REFUSAL in refused.value.message, refused.value
            for name in ("acme", "globex", "gold", "chat", "law"):  # names nothing
                assert name not in refused.value.message.replace(GENERIC_REFUSAL, "")
        assert cluster.refusals_on(host) == before + 2  # refused by that host, and recorded


def _openai(c: Cluster, tenant: str, alias: str, i: int) -> str:
    """One OpenAI completion through the control plane's gateway; its request id."""
    req = urllib.request.Request(
        f"{c.scale.gateway_url}/v1/completions",
        data=json.dumps({"model": alias, "prompt": f"openai {i}", "max_tokens": 2}).encode(),
        headers={"Authorization": f"Bearer {c.keys[tenant]}",
                 "Content-Type": "application/json", "x-session-id": f"s{i}"},
        method="POST")
    with urllib.request.urlopen(req, timeout=60) as r:
        return str(json.loads(r.read())["id"]).removeprefix("cmpl-")


def test_the_gateways_openai_routes_place_by_pool_too(cluster: Cluster) -> None:
    # the gateway calls the hosts itself (POOL=host:port): each request on its pool's host
    served = {alias: [_openai(cluster, tenant, alias, i) for i in range(3)]
              for tenant, alias in (("acme", "chat"), ("globex", "law"))}
    hosts = {alias: set(cluster.host_of(ids).values()) for alias, ids in served.items()}
    assert hosts == {"chat": {"shared-0"}, "law": {"gold-0"}}, hosts


def _host_openai(c: Cluster, answer: dict[str, str], path: str, pool: str | None) -> str:
    """One OpenAI request through the balancer to a host's own route; its request id."""
    chat = path.endswith("chat/completions")
    prompt = {"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"}
    headers = {"x-loraplane-ticket": answer["ticket"], "Content-Type": "application/json",
               **({"x-loraplane-pool": pool} if pool else {})}
    req = urllib.request.Request(
        f"{c.scale.tenant_openai_url}{path}", method="POST", headers=headers,
        data=json.dumps({"model": answer["affinity"], "max_tokens": 2, **prompt}).encode())
    with urllib.request.urlopen(req, timeout=60) as r:
        body = json.loads(r.read())
    assert body["model"] == answer["affinity"]
    return str(body["id"]).removeprefix("chatcmpl-").removeprefix("cmpl-")


def test_the_balancer_sends_openai_paths_to_the_hosts_routes(cluster: Cluster) -> None:
    # the hosts' own OpenAI routes behind the balancer: model is the affinity value, each
    # ticket served in its pool as on the Triton routes
    shared, gold = cluster.ticket("acme", "chat"), cluster.ticket("globex", "law")
    served = {"chat": [_host_openai(cluster, shared, "/completions", None),
                       _host_openai(cluster, shared, "/chat/completions", "shared")],
              "law": [_host_openai(cluster, gold, "/completions", "gold")]}
    hosts = {alias: set(cluster.host_of(ids).values()) for alias, ids in served.items()}
    assert hosts == {"chat": {"shared-0"}, "law": {"gold-0"}}, hosts


def test_it_says_where_everything_listens(cluster: Cluster) -> None:
    lines = cluster.scale.describe()
    assert len(lines) == 3, lines
    for d in cluster.scale.triton_hosts:
        line = next(x for x in lines if x.startswith(f"host {d.host_id} "))
        assert f"pool {d.settings.host_pool}" in line
        assert f"127.0.0.1:{d.ports.http}" in line and f":{d.ports.metrics}/metrics" in line
    assert cluster.scale.tenant_http_url in lines[-1]
    assert cluster.scale.tenant_grpc_url in lines[-1]
    assert f"OpenAI {cluster.scale.tenant_openai_url}/completions" in lines[-1]


def _listens(url: str) -> bool:
    host, port = url.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=0.5):
            return True
    except OSError:
        return False


def test_it_stops_cleanly(cluster: Cluster) -> None:
    """Last in this module: it stops the scale-out (the fixture's stop then changes nothing)."""
    scale = cluster.scale
    urls = [scale.tenant_http_url, scale.tenant_grpc_url,
            *(f"127.0.0.1:{d.ports.http}" for d in scale.triton_hosts)]
    assert all(_listens(u) for u in urls)
    scale.stop()
    assert scale.balancer is not None and scale.balancer.proc is not None
    assert scale.balancer.proc.poll() is not None
    for d in scale.triton_hosts:
        assert d.triton is not None and d.triton.proc is not None
        assert d.triton.proc.poll() is not None
    assert not any(_listens(u) for u in urls)
