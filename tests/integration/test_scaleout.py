"""Scale-out on one PostgreSQL: two gateways (control-plane role) and two Triton hosts (triton
role), each with its own home folder, sharing only the database URL and the artifact store.

Shows: tickets from either gateway are served by either host (each host trusts both gateways'
signing keys, taken from the recorded events); a revocation reaches both hosts at once; one
incident query covers requests served by both hosts. Skipped without LORAPLANE_TEST_PG_URL.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest

from control.app.registry import Registry
from control.contracts import root_of_trust
from control.contracts.config import Settings
from control.contracts.db import make_engine
from control.contracts.ledger import Ledger
from control.ops.clients import TritonRefused, generate, request_ticket
from control.ops.serve import Deployment, Ports
from control.tools.kit import KitManifest
from projections.follower import open_registry
from projections.routing import RoutingView
from tests.fixtures_control import close_registry, postgres_settings
from tests.integration.conftest import require_servers

ACTOR = "scaleout-test"
pytestmark = pytest.mark.postgres


@dataclass
class Cluster:
    registry: Registry
    gateways: list[Deployment]
    hosts: list[Deployment]
    keys: dict[str, str]
    digests: dict[str, str]
    db_url: str

    def ticket(self, gateway: int, tenant: str, alias: str) -> str:
        status, body = request_ticket(self.gateways[gateway].gateway_url, self.keys[tenant], alias)
        assert status == 200, body
        return str(body["ticket"])

    def http(self, host: int) -> str:
        triton = self.hosts[host].triton
        assert triton is not None
        return triton.http_url


def _ports() -> Ports:
    return Ports.free()


@pytest.fixture(scope="module")
def cluster(kit_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    root = tmp_path_factory.mktemp("scaleout")
    require_servers(root)
    with postgres_settings(root / "gw-1") as first:
        url = first.db_url
        homes = {name: root / name for name in ("gw-1", "gw-2", "host-a", "host-b")}
        settings = {n: Settings(home=h, db_url=url) for n, h in homes.items()}
        for s in settings.values():
            s.home.mkdir(parents=True, exist_ok=True)
        settings["gw-1"].ensure_dirs()
        for name in ("gw-2", "host-a", "host-b"):
            # the shared artifact store: one volume mounted on every host in production
            (homes[name] / "store").symlink_to(settings["gw-1"].store_dir)
        # One root of trust for the deployment, as an operator configures it: every process gets
        # its public half (root.pub); the gateways, which record their own signing keys here,
        # also hold the (development) root that vouches for them. Hosts never hold it.
        root_of_trust.dev_root(settings["gw-1"].keys_dir)
        for name in ("gw-2", "host-a", "host-b"):
            keys = settings[name].keys_dir
            keys.mkdir(parents=True, exist_ok=True)
            shutil.copy(root_of_trust.root_pub_path(settings["gw-1"].keys_dir),
                        root_of_trust.root_pub_path(keys))
        dev = root_of_trust.dev_root_path(settings["gw-2"].keys_dir)
        dev.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        shutil.copy(root_of_trust.dev_root_path(settings["gw-1"].keys_dir), dev)
        kit = KitManifest.load(kit_dir)
        reg = open_registry(settings["gw-1"])
        reg.register_base(kit_dir / kit.base_path, kit_dir / kit.tokenizer_path,
                          name="tiny-llama", actor=ACTOR)
        keys = {t: reg.create_tenant(t, actor=ACTOR) for t in ("acme", "globex")}
        digests = {}
        for tenant, alias, name in (("acme", "acme-alpha", "alpha"),
                                    ("globex", "globex-gamma", "gamma")):
            digests[name] = reg.register_adapter(kit_dir / kit.adapters[name].path,
                                                 tenant=tenant, alias=alias, actor=ACTOR)
            reg.advance(digests[name], external=True, evaluation={"suite": "smoke", "passed": True},
                        actor=ACTOR)  # as the session stack does
            reg.grant(tenant, alias, actor=ACTOR)
        gateways = [Deployment(settings[n], _ports(), role="control", actor=ACTOR)
                    for n in ("gw-1", "gw-2")]
        hosts = [Deployment(settings[n], _ports(), role="triton", host_id=n, actor=ACTOR)
                 for n in ("host-a", "host-b")]
        for h in hosts:
            gw_urls = [f"127.0.0.1:{h.ports.http}"]
            for g in gateways:
                g.triton_urls += gw_urls
        try:
            for g in gateways:
                g.start()
            with ThreadPoolExecutor(2) as pool:  # two servers warm up side by side
                list(pool.map(lambda d: d.start(), hosts))
            yield Cluster(reg, gateways, hosts, keys, digests, url)
        finally:
            for d in (*hosts, *gateways):
                d.stop()
            close_registry(reg)


def test_tickets_from_either_gateway_are_served_by_either_host(cluster: Cluster) -> None:
    for gw in (0, 1):
        for tenant, alias, name in (("acme", "acme-alpha", "alpha"),
                                    ("globex", "globex-gamma", "gamma")):
            ticket = cluster.ticket(gw, tenant, alias)
            for host in (0, 1):
                g = generate(cluster.http(host), f"scale {gw}{host}", ticket, max_tokens=4)
                assert g.adapter_digest == cluster.digests[name]
    # the two gateways sign with different keys, and both hosts trust both
    assert len(RoutingView(make_engine(cluster.db_url)).signing_keys()) == 2


def test_openai_route_spreads_over_both_hosts(cluster: Cluster) -> None:
    client = openai.OpenAI(base_url=cluster.gateways[1].gateway_url + "/v1",
                           api_key=cluster.keys["globex"], max_retries=0)
    for i in range(4):
        out = client.completions.create(model="globex-gamma", prompt=f"spread {i}", max_tokens=4)
        assert out.choices[0].text


def test_one_incident_query_covers_both_hosts(cluster: Cluster) -> None:
    ticket = cluster.ticket(0, "acme", "acme-alpha")
    for host in (0, 1):
        generate(cluster.http(host), "incident", ticket, max_tokens=4)
    rows = Ledger(make_engine(cluster.db_url)).query(adapter=cluster.digests["alpha"],
                                                     outcome="ok")
    assert {r.host for r in rows} == {"host-a", "host-b"}
    assert {r.tenant for r in rows} == {"acme"}
    gamma = Ledger(make_engine(cluster.db_url)).query(adapter=cluster.digests["gamma"])
    assert {r.host for r in gamma} == {"host-a", "host-b"}


def test_revocation_reaches_both_hosts_within_a_second(cluster: Cluster) -> None:
    tickets = [cluster.ticket(gw, "acme", "acme-alpha") for gw in (0, 1)]
    for host in (0, 1):  # resident and serving on both hosts before the revocation
        generate(cluster.http(host), "before", tickets[host], max_tokens=4)
    cluster.registry.revoke(cluster.digests["alpha"], reason="scale-out test", actor=ACTOR)
    revoked_at, revoked_wall = time.monotonic(), time.time()
    refused_after: dict[int, float] = {}
    served_after: list[str] = []

    def until_refused(host: int) -> None:  # one client per host, side by side
        while time.monotonic() - revoked_at < 5:
            try:
                g = generate(cluster.http(host), "after", tickets[1 - host], max_tokens=4)
                served_after.append(f"host {host}: {g.request_id}")
            except TritonRefused as e:
                assert e.status == "400"
                refused_after[host] = time.monotonic() - revoked_at
                return

    with ThreadPoolExecutor(2) as pool:
        list(pool.map(until_refused, (0, 1)))
    # revoke() returns once the revocation set the hosts read holds the digest: from then on
    # not one request may be served under it, on either host
    assert not served_after, served_after
    assert set(refused_after) == {0, 1}, refused_after
    # When each host decided, from its own ledger rows (admitted_at is stamped as the host takes
    # the request, before its governance check). The client's round trip also includes the
    # refusal row's durable commit, which a busy disk can stall; the host's decision cannot hide
    # behind it.
    refusals = [r for r in Ledger(make_engine(cluster.db_url)).query(
                    adapter=cluster.digests["alpha"], since=revoked_wall)
                if r.reason == "revoked"]
    decided = {h: min(r.admitted_at for r in refusals if r.host == h) - revoked_wall
               for h in ("host-a", "host-b")}
    print(f"revocation decided on both hosts after {max(decided.values()):.3f} s; refused "
          f"round trip {max(refused_after.values()):.3f} s")
    assert max(decided.values()) < 1.0, decided
    for gw in (0, 1):  # and neither gateway issues a new ticket for it
        status, _ = request_ticket(cluster.gateways[gw].gateway_url, cluster.keys["acme"],
                                   "acme-alpha")
        assert status == 403
    # globex is unaffected on both hosts
    ticket = cluster.ticket(1, "globex", "globex-gamma")
    for host in (0, 1):
        assert generate(cluster.http(host), "still", ticket,
                        max_tokens=4).adapter_digest == cluster.digests["gamma"]
