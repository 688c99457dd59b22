"""The local balancer for real: HAProxy (``control.ops.balancer``) in front of three tritonserver
hosts on one PostgreSQL, many adapters, fewer device slots per host than adapters.

Shows: requests place by the ticket answer's affinity; a forged affinity header gets only what
the ticket allows; admin routes never pass; affinity beats round robin on adapter hits (the
figures are printed: ``affinity_vs_roundrobin_tokens`` and each policy's hit rate); a host
killed mid-burst leaves answers or clear errors, never a hang, the others absorb its share, and
every answered request has its ledger row on the host that answered it. Skipped without
LORAPLANE_TEST_PG_URL or haproxy.
"""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
import sqlalchemy as sa

from backend.serving.messages import FAILURE_MESSAGE
from control.app.registry import Registry
from control.contracts import root_of_trust
from control.contracts.db import make_engine
from control.contracts.ledger import adapter_loads, request_ledger
from control.contracts.replica_claims import ReplicaTable
from control.domain import TenantPolicy
from control.ops.balancer import start_balancer
from control.ops.clients import Generation, TritonRefused, generate, request_ticket
from control.ops.front_door import FrontDoor, Upstream
from control.ops.scale_out import host_settings, start_all
from control.ops.serve import Deployment, Ports
from control.ops.triton_server import free_ports
from control.tools.bench_cli import fresh_adapter
from control.tools.kit import KitManifest
from projections.follower import open_registry
from tests.fixtures_control import close_registry, postgres_settings
from tests.integration.conftest import hosts_of, post_json, require_servers

ACTOR = "placement-test"
HOSTS = ("host-0", "host-1", "host-2")
HOST_ADDRESS = "127.0.0.2"  # where the hosts listen (see the pool fixture)
ADAPTERS = 24  # over three hosts of SLOTS device slots each
SLOTS = 12
pytestmark = pytest.mark.postgres


@dataclass
class Pool:
    registry: Registry
    gateway: Deployment
    hosts: list[Deployment]
    api_key: str
    other_key: str
    digests: dict[str, str]  # alias -> adapter digest
    db_url: str
    affinity: FrontDoor
    roundrobin: FrontDoor

    def ticket(self, alias: str, key: str | None = None) -> tuple[str, str]:
        status, body = request_ticket(self.gateway.gateway_url, key or self.api_key, alias)
        assert status == 200, body
        return str(body["ticket"]), str(body["affinity"])

    def host_of(self, request_ids: list[str]) -> dict[str, str]:
        return hosts_of(self.db_url, request_ids)

    def tokens_out(self, request_ids: list[str]) -> int:
        t = request_ledger
        with make_engine(self.db_url).connect() as conn:
            return int(conn.execute(sa.select(sa.func.coalesce(sa.func.sum(t.c.tokens_out), 0))
                                    .where(t.c.request_id.in_(request_ids))).scalar() or 0)

    def loads(self) -> int:
        with make_engine(self.db_url).connect() as conn:
            return int(conn.execute(sa.select(sa.func.count()).select_from(adapter_loads)
                                    .where(adapter_loads.c.outcome == "loaded")).scalar() or 0)


def _aliases() -> list[str]:
    return [f"a{i:02d}" for i in range(ADAPTERS)]


@pytest.fixture(scope="module")
def pool(kit_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pool]:
    root = tmp_path_factory.mktemp("placement")
    require_servers(root, haproxy=True)
    with postgres_settings(root / "gw") as first:
        url = first.db_url
        first.home.mkdir(parents=True, exist_ok=True)
        first.ensure_dirs()
        root_of_trust.dev_root(first.keys_dir)
        # homes as `serve --hosts` makes them: one store, one database, the root public key;
        # one tenant owns every adapter here: its resident share is the whole device
        settings = [host_settings(first, name, adapter_slots=SLOTS, resident_share=1.0)
                    for name in HOSTS]
        kit = KitManifest.load(kit_dir)
        reg = open_registry(first)
        reg.register_base(kit_dir / kit.base_path, kit_dir / kit.tokenizer_path,
                          name="tiny-llama", actor=ACTOR)
        key = reg.create_tenant("acme", actor=ACTOR)
        other = reg.create_tenant("globex", actor=ACTOR)
        digests: dict[str, str] = {}
        src = kit_dir / kit.adapters["alpha"].path
        for i, alias in enumerate(_aliases()):
            adapter_dir = fresh_adapter(src, root / "adapters" / alias, i + 1)
            digests[alias] = reg.register_adapter(adapter_dir, tenant="acme", alias=alias,
                                                  actor=ACTOR)
            reg.advance(digests[alias], external=True,
                        evaluation={"suite": "smoke", "passed": True}, actor=ACTOR)
            reg.grant("acme", alias, actor=ACTOR)
        digests["globex-gamma"] = reg.register_adapter(
            kit_dir / kit.adapters["gamma"].path, tenant="globex", alias="globex-gamma",
            actor=ACTOR)
        reg.advance(digests["globex-gamma"], external=True,
                    evaluation={"suite": "smoke", "passed": True}, actor=ACTOR)
        reg.grant("globex", "globex-gamma", actor=ACTOR)
        gateway = Deployment(first, Ports.free(),
                             role="control", actor=ACTOR)
        # As the compose file runs them: no door of their own (the balancer is it), listening
        # where the balancer reaches them, here a loopback address other than 127.0.0.1, so
        # that a route left on 127.0.0.1 is out of the balancer's reach as in a container
        hosts = [Deployment(s, Ports.free(), role="triton", host_id=name, actor=ACTOR,
                            front_door="external", bind=HOST_ADDRESS)
                 for name, s in zip(HOSTS, settings, strict=True)]
        doors: list[FrontDoor] = []
        try:
            gateway.start()
            start_all(hosts)
            upstreams = [Upstream(HOST_ADDRESS, h.ports.http, h.ports.grpc,
                                  openai_port=h.ports.openai) for h in hosts]
            taken = {p for h in (*hosts, gateway) for p in vars(h.ports).values()}
            door_ports = free_ports(4, avoid=taken)
            for i, policy in enumerate(("affinity", "roundrobin")):
                doors.append(start_balancer(root / f"balancer-{policy}", upstreams,
                                            http_port=door_ports[2 * i],
                                            grpc_port=door_ports[2 * i + 1], policy=policy))
            yield Pool(reg, gateway, hosts, key, other, digests, url, doors[0], doors[1])
        finally:
            for door in doors:
                door.stop()
            for d in (*hosts, gateway):
                d.stop()
            close_registry(reg)


def test_the_openai_route_passes_the_balancer_to_the_tickets_host(pool: Pool) -> None:
    """The compose file's topology (issue 25): hosts without doors of their own, each host's
    OpenAI route where its Triton listens, the balancer placing ``/v1/completions`` by the
    body's ``model`` onto the host the affinity header places the same ticket's Triton
    requests on. The route answers with the ticket's adapter, with a ledger row there."""
    ticket, affinity = pool.ticket("a03")
    triton_ids = [_call(pool.affinity.http_url, ticket, affinity, f"triton {i}").request_id
                  for i in range(2)]
    (triton_host,) = set(pool.host_of(triton_ids).values())
    ids = []
    for i in range(2):
        status, answer = post_json(
            f"http://{pool.affinity.http_url}/v1/completions",
            {"model": affinity, "prompt": f"openai {i}", "max_tokens": 4, "temperature": 0},
            {"x-loraplane-ticket": ticket})
        assert status == 200, answer
        assert answer["model"] == affinity and answer["choices"][0]["text"] is not None
        ids.append(answer["id"].removeprefix("cmpl-"))
    assert set(pool.host_of(ids).values()) == {triton_host}
    t = request_ledger
    with make_engine(pool.db_url).connect() as conn:
        served = conn.execute(sa.select(t.c.served_digest).where(t.c.request_id.in_(ids))).all()
    assert [r[0] for r in served] == [pool.digests["a03"]] * 2


def _call(url: str, ticket: str | None, affinity: str | None, text: str,
          protocol: str = "http") -> Generation:
    return generate(url, text, ticket, max_tokens=4, affinity=affinity, protocol=protocol)


def test_requests_place_by_affinity(pool: Pool) -> None:
    placed: dict[str, set[str]] = {}
    for alias in _aliases()[:6]:
        ticket, affinity = pool.ticket(alias)
        ids = [_call(pool.affinity.http_url, ticket, affinity, f"place {alias} {i}").request_id
               for i in range(3)]
        ids.append(_call(pool.affinity.grpc_url, ticket, affinity, f"grpc {alias}",
                         protocol="grpc").request_id)
        placed[alias] = set(pool.host_of(ids).values())
    assert all(len(hosts) == 1 for hosts in placed.values()), placed  # one host per route
    assert len(set().union(*placed.values())) >= 2, placed  # and routes spread over hosts


def test_a_forged_affinity_header_gets_only_what_the_ticket_allows(pool: Pool) -> None:
    ticket, _ = pool.ticket("a00")
    _, other_affinity = pool.ticket("a05")
    for forged in (other_affinity, "0" * 16, "x" * 200):
        g = _call(pool.affinity.http_url, ticket, forged, "forged")
        assert g.adapter_digest == pool.digests["a00"]  # the ticket's adapter, wherever placed
    globex_ticket, _ = pool.ticket("globex-gamma", pool.other_key)
    g = _call(pool.affinity.http_url, globex_ticket, other_affinity, "other tenant")
    assert g.adapter_digest == pool.digests["globex-gamma"]
    for bad in (None, "v4.public.forged"):
        with pytest.raises(TritonRefused):
            _call(pool.affinity.http_url, bad, other_affinity, "no ticket")


def test_admin_routes_never_pass_the_balancer(pool: Pool) -> None:
    for method, path in (("POST", "/v2/repository/index"), ("GET", "/v2/models/stats"),
                         ("POST", "/v2/repository/models/lora_llm/unload"),
                         ("GET", "/v2/trace/setting"), ("GET", "/metrics")):
        req = urllib.request.Request(f"http://{pool.affinity.http_url}{path}", method=method,
                                     data=b"{}" if method == "POST" else None)
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(req, timeout=10)
        assert refused.value.code == 403, path


def test_a_revocation_is_refused_by_every_host_within_a_second(pool: Pool) -> None:
    ticket, affinity = pool.ticket("globex-gamma", pool.other_key)
    urls = []
    for dep in pool.hosts:  # resident and serving on every host before the revocation
        assert dep.triton is not None
        urls.append(dep.triton.http_url)
        assert _call(urls[-1], ticket, None, "before").adapter_digest == \
            pool.digests["globex-gamma"]
    pool.registry.revoke(pool.digests["globex-gamma"], reason="placement test", actor=ACTOR)
    revoked_at, revoked_wall = time.monotonic(), time.time()
    served_after: list[str] = []
    refused: dict[int, float] = {}

    def until_refused(i: int) -> None:
        while time.monotonic() - revoked_at < 5:
            try:
                served_after.append(_call(urls[i], ticket, None, "after").request_id)
            except TritonRefused as e:
                assert e.status == "400"
                refused[i] = time.monotonic() - revoked_at
                return

    with ThreadPoolExecutor(len(urls)) as ex:
        list(ex.map(until_refused, range(len(urls))))
    assert not served_after and set(refused) == set(range(len(urls))), (served_after, refused)
    t = request_ledger
    with make_engine(pool.db_url).connect() as conn:
        rows = conn.execute(sa.select(t.c.host, sa.func.min(t.c.admitted_at))
                            .where(t.c.adapter_digest == pool.digests["globex-gamma"],
                                   t.c.reason == "revoked", t.c.admitted_at >= revoked_wall)
                            .group_by(t.c.host)).all()
    decided = {r[0]: r[1] - revoked_wall for r in rows}
    print(f"\nrevocation decided on every host within {max(decided.values()):.3f} s")
    assert set(decided) == set(HOSTS) and max(decided.values()) < 1.0, decided
    with pytest.raises(TritonRefused):  # and through the balancer, whatever the header says
        _call(pool.affinity.http_url, ticket, affinity, "balanced")


def test_max_replicas_bounds_the_hosts_holding_an_adapter(pool: Pool) -> None:
    """acme's policy bounds its adapters to one replica each: asked on every host, a23 is
    served by one host only; the others refuse it as unavailable, with ``adapter_max_replicas``
    on their ledger rows, and the claims table names the one host. With the bound lifted,
    every host serves it again."""
    digest = pool.digests["a23"]
    ticket, _ = pool.ticket("a23")
    urls = [dep.triton.http_url for dep in pool.hosts if dep.triton is not None]
    since = time.time()
    pool.registry.set_policy("acme", TenantPolicy(max_replicas=1), actor=ACTOR)
    try:
        served: list[str] = []
        refused: list[TritonRefused] = []
        deadline = time.monotonic() + 10  # the hosts see the policy event within it
        while time.monotonic() < deadline and len(refused) < 2 * (len(urls) - 1):
            for url in urls:
                try:
                    served.append(_call(url, ticket, None, "bounded").request_id)
                except TritonRefused as e:
                    refused.append(e)
        holder = set(pool.host_of(served).values())
        assert len(holder) == 1 and refused, (holder, refused)
        assert all(e.status == "503" and "sha256" not in e.message for e in refused), refused
        assert ReplicaTable(make_engine(pool.db_url), "test").holders(digest) == sorted(holder)
        t = request_ledger
        with make_engine(pool.db_url).connect() as conn:
            refusers = {str(h) for h in conn.execute(
                sa.select(t.c.host).where(t.c.adapter_digest == digest,
                                          t.c.reason == "adapter_max_replicas",
                                          t.c.admitted_at >= since)).scalars()}
        assert refusers == set(HOSTS) - holder, refusers
    finally:
        pool.registry.set_policy("acme", TenantPolicy(), actor=ACTOR)
    deadline = time.monotonic() + 10
    answered: set[str] = set()
    while time.monotonic() < deadline and len(answered) < len(urls):
        for url in urls:
            try:
                answered.add(pool.host_of([_call(url, ticket, None, "unbounded").request_id])
                             .popitem()[1])
            except TritonRefused:
                time.sleep(0.1)
    assert answered == set(HOSTS), answered


def test_a_grantees_traffic_never_keeps_the_owner_from_a_bounded_adapter(pool: Pool) -> None:
    """acme bounds its adapters to one replica and grants a22 to globex. globex's requests, sent
    straight to host-0 (where a forged affinity header would place them), take a22's only
    place; acme's own requests on host-1 are still served, and within a renewal host-0 gives
    the place up: globex's requests there are refused with ``adapter_max_replicas``."""
    digest = pool.digests["a22"]
    urls = [dep.triton.http_url for dep in pool.hosts if dep.triton is not None]
    claims = ReplicaTable(make_engine(pool.db_url), "test")
    pool.registry.grant("globex", "a22", actor=ACTOR)
    pool.registry.set_policy("acme", TenantPolicy(max_replicas=1), actor=ACTOR)
    try:
        deadline = time.monotonic() + 15  # the gateway and hosts see both events within it
        while claims.holders(digest) != ["host-0"]:
            assert time.monotonic() < deadline, claims.holders(digest)
            try:
                _call(urls[0], pool.ticket("a22", pool.other_key)[0], None, "grantee")
            except (AssertionError, TritonRefused):
                time.sleep(0.2)  # the grant or the policy not seen yet
        owners = _call(urls[1], pool.ticket("a22")[0], None, "owner").request_id
        assert pool.host_of([owners]) == {owners: "host-1"}
        assert claims.holders(digest)[0] == "host-1"
        since = time.time()
        refused: list[TritonRefused] = []
        deadline = time.monotonic() + 15  # host-0 renews every 5 s (a 15 s lease)
        while not refused and time.monotonic() < deadline:
            try:
                _call(urls[0], pool.ticket("a22", pool.other_key)[0], None, "grantee again")
                time.sleep(0.3)
            except TritonRefused as e:
                refused.append(e)
        assert refused and refused[0].status == "503", refused
        assert claims.holders(digest) == ["host-1"]
        t = request_ledger
        with make_engine(pool.db_url).connect() as conn:
            reasons = set(conn.execute(sa.select(t.c.host, t.c.reason).where(
                t.c.adapter_digest == digest, t.c.admitted_at >= since,
                t.c.reason.is_not(None))).tuples())
        assert reasons == {("host-0", "adapter_max_replicas")}, reasons
    finally:
        pool.registry.set_policy("acme", TenantPolicy(), actor=ACTOR)
        pool.registry.remove_grant("globex", "a22", actor=ACTOR)


def _phase(pool: Pool, url: str, rounds: int) -> tuple[float, int, int, int]:
    """Every alias ``rounds`` times, four clients; (tokens per second, requests, loads,
    refusals). A refusal is a cost of the policy: cold loads past the tenant's load rate."""
    tickets = {a: pool.ticket(a) for a in _aliases()}
    jobs = [a for _ in range(rounds) for a in _aliases()]
    before = pool.loads()

    def one(alias: str) -> Generation | None:
        try:
            return _call(url, *tickets[alias], f"bench {alias}")
        except TritonRefused:
            return None

    started = time.monotonic()
    with ThreadPoolExecutor(4) as ex:
        outs = list(ex.map(one, jobs))
    seconds = time.monotonic() - started
    served = [o for o in outs if o is not None]
    tokens = pool.tokens_out([o.request_id for o in served])  # as the ledger counted them
    return tokens / seconds, len(jobs), pool.loads() - before, len(outs) - len(served)


def test_affinity_beats_round_robin_on_adapter_hits(pool: Pool) -> None:
    results = {}
    for name, door in (("roundrobin", pool.roundrobin), ("affinity", pool.affinity)):
        _phase(pool, door.http_url, 1)  # warm: the policy's steady state
        time.sleep(8)  # the load-rate buckets refill between phases
        rate, requests, loads, refused = _phase(pool, door.http_url, 2)
        results[name] = (rate, 1.0 - (loads + refused) / requests, refused)
        time.sleep(8)
    ratio = results["affinity"][0] / results["roundrobin"][0]
    print(f"\naffinity_vs_roundrobin_tokens={ratio:.2f} "
          f"hit_rate_affinity={results['affinity'][1]:.2f} "
          f"hit_rate_roundrobin={results['roundrobin'][1]:.2f} "
          f"refused_affinity={results['affinity'][2]} "
          f"refused_roundrobin={results['roundrobin'][2]}")
    assert results["affinity"][1] > results["roundrobin"][1]
    assert results["affinity"][1] >= 0.9 and results["affinity"][2] == 0


def test_a_host_killed_mid_burst(pool: Pool) -> None:
    """Last in this module: it takes a host down for good."""
    tickets = {a: pool.ticket(a) for a in _aliases()}
    victim_alias = _aliases()[0]
    where = {a: _call(pool.affinity.http_url, *tickets[a], "where").request_id
             for a in _aliases()}
    host_of = pool.host_of(list(where.values()))
    victim_host = host_of[where[victim_alias]]
    # the routes the victim holds: only their requests may fail (in flight on it, or moved to
    # a survivor whose cold loads pass the tenant's load rate: a clear 503)
    on_victim = {a for a, rid in where.items() if host_of[rid] == victim_host}
    jobs = [a for _ in range(3) for a in _aliases()]
    killed_at: list[float] = []

    def one(i_alias: tuple[int, str]) -> tuple[str, float, Generation | TritonRefused]:
        i, alias = i_alias
        if i == 12:
            killed_at.append(time.monotonic())
            dep = pool.hosts[HOSTS.index(victim_host)]
            assert dep.triton is not None
            dep.triton.kill()
        started = time.monotonic()
        try:
            return alias, started, _call(pool.affinity.http_url, *tickets[alias], f"burst {i}")
        except TritonRefused as e:
            return alias, started, e

    burst_started, wall_started = time.monotonic(), time.time()
    with ThreadPoolExecutor(4) as ex:
        futures = [ex.submit(one, (i, a)) for i, a in enumerate(jobs)]
        done = [f.result(timeout=120) for f in futures]  # never a hang
    answered = [(a, s, g) for a, s, g in done if isinstance(g, Generation)]
    errors = [g for _, _, g in done if isinstance(g, TritonRefused)]
    for e in errors:  # clear errors: a status and a message, from HAProxy or Triton
        assert e.status and e.message, e
    print(f"\nhost_kill: requests={len(jobs)} answered={len(answered)} "
          f"clear_errors={len(errors)} ({sorted({e.status for e in errors})}) "
          f"burst_s={time.monotonic() - burst_started:.1f}")
    # A request lost with the dying host is a transport error (HAProxy's 502/503, or a reply
    # cut off); only the dying host's routes may meet one. Its routes then move to the
    # survivors, whose slots now hold every adapter: where the hash leaves one survivor more
    # adapters than slots, its cold loads pass the tenant's load rate and it refuses, with the
    # generic message, as a policy refusal that its ledger records with the reason.
    refused = [e for e in errors if FAILURE_MESSAGE in e.message and e.status == "503"]
    lost = [a for a, _, g in done if isinstance(g, TritonRefused) and g not in refused]
    assert set(lost) <= on_victim, (lost, errors)
    with make_engine(pool.db_url).connect() as conn:
        t = request_ledger
        reasons = [str(r) for r in conn.execute(
            sa.select(t.c.reason).where(t.c.admitted_at >= wall_started, t.c.host != victim_host,
                                        t.c.outcome != "ok")).scalars()]
    assert len(reasons) >= len(refused) and set(reasons) <= {"adapter_load_rate"}, reasons
    assert len(answered) >= len(jobs) // 2
    hosts = pool.host_of([g.request_id for _, _, g in answered])
    assert set(hosts) == {g.request_id for _, _, g in answered}  # every answer has its row
    for alias, _, g in answered:
        assert g.adapter_digest == pool.digests[alias]
    # once the health check has taken the host out (every 500 ms, fall 1), the others absorb
    # its routes: asked after the burst, which on a quiet machine can end before the check ran
    time.sleep(max(0.0, killed_at[0] + 2.0 - time.monotonic()))
    deadline = time.monotonic() + 15.0  # the load-rate bucket the burst drained refills
    while True:
        try:
            g = _call(pool.affinity.http_url, *tickets[victim_alias], "after")
            break
        except TritonRefused as e:
            if FAILURE_MESSAGE not in e.message or time.monotonic() > deadline:
                raise
            time.sleep(0.5)
    assert pool.host_of([g.request_id])[g.request_id] != victim_host
