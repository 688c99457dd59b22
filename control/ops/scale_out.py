"""Scale-out on one machine: several Triton hosts behind the local balancer, one control plane.

``loraplane serve --hosts N`` runs this (:class:`ScaleOut`); the placement tests start their
hosts with the same :func:`host_settings` and :func:`start_all`, so what they prove is what an
operator starts.

Each host is a ``triton`` role deployment (``control.ops.serve``) with a home of its own under
the main home (``<home>/hosts/<name>``: its ``run/`` folder, tritonserver's log, its keys
folder), sharing the main home's database URLs, memory settings and artifact store (a symlink,
so an adapter registered once is readable by every host) and the main home's root public key.
Its host id, the ledger's host column, is its name: ``<pool>-<i>``. Tritonserver listens on
loopback only (``front_door="external"``): the balancer (``control.ops.balancer``, HAProxy) is
the only way in, on the tenant ports, and is every host's front door. The control plane (the
gateway, the projection follower, the rollout controller) runs as a ``control`` role deployment
whose OpenAI routes and rollout probes go to the hosts' own ports, each to the hosts of the
ticket's pool (``POOL=host:port``, ``control.contracts.placement.place``).

Pools: ``--pool NAME=COUNT`` puts COUNT of the N hosts in pool NAME (``Settings.host_pool``);
the rest are in the shared pool. The balancer renders one backend per pool and sends a request
to the pool its ``x-loraplane-pool`` header names, the shared pool's without one.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace

from control.contracts import root_of_trust
from control.contracts.config import SHARED_POOL, Settings, check_placement_name
from control.contracts.placement import HostUrl
from control.ops.balancer import CHECK_MS, start_balancer
from control.ops.front_door import FrontDoor, Upstream, require_haproxy
from control.ops.serve import Deployment, Ports

HOSTS_DIR = "hosts"  # under the main home: one home per host


@dataclass(frozen=True)
class HostPlan:
    """One host of a scale-out: its name (also its host id) and pool."""

    name: str
    pool: str


def parse_pools(specs: Sequence[str]) -> dict[str, int]:
    """``["gold=1", ...]`` as {pool: host count}; raises ValueError naming the bad one."""
    pools: dict[str, int] = {}
    for spec in specs:
        name, sep, count = spec.partition("=")
        if not sep or not count.strip().isdigit() or int(count) < 1:
            raise ValueError(f"--pool takes NAME=COUNT with a count of 1 or more, not {spec!r}")
        name = name.strip()
        check_placement_name("a pool name", name)
        if name == SHARED_POOL or name in pools:
            raise ValueError(f"--pool {name} is given twice, or names the shared pool (which "
                             "holds the hosts no --pool names)")
        pools[name] = int(count)
    return pools


def plan_hosts(hosts: int, pools: dict[str, int]) -> list[HostPlan]:
    """``hosts`` hosts, each pool's count of them in that pool and the rest shared."""
    if hosts < 1:
        raise ValueError("a scale-out needs at least one Triton host")
    dedicated = sum(pools.values())
    if dedicated > hosts:
        raise ValueError(f"--pool puts {dedicated} hosts in pools, more than --hosts {hosts}")
    counts = {SHARED_POOL: hosts - dedicated, **pools}
    return [HostPlan(f"{pool}-{i}", pool) for pool, n in counts.items() for i in range(n)]


def host_settings(main: Settings, name: str, pool: str = SHARED_POOL,
                  **overrides: object) -> Settings:
    """The settings of host ``name``: a home of its own under ``main``'s, the same database,
    artifact store and root public key, ``pool`` as its pool; ``overrides`` replace fields."""
    home = main.home / HOSTS_DIR / name
    s = replace(main, home=home, host_pool=pool, **overrides)  # type: ignore[arg-type]
    home.mkdir(parents=True, exist_ok=True)
    main.store_dir.mkdir(parents=True, exist_ok=True)
    if not s.store_dir.exists() and not s.store_dir.is_symlink():
        s.store_dir.symlink_to(main.store_dir.resolve())  # one artifact store for all
    s.keys_dir.mkdir(parents=True, exist_ok=True)
    root_pub = root_of_trust.root_pub_path(main.keys_dir)
    if root_pub.exists():  # a home without a root key has nothing for its hosts to trust
        shutil.copy(root_pub, root_of_trust.root_pub_path(s.keys_dir))
    return s


def start_all(deployments: Sequence[Deployment]) -> None:
    """Start the deployments at once (each waits for its tritonserver); if one fails, stop
    every one and raise its error."""
    with ThreadPoolExecutor(max(1, len(deployments))) as ex:
        futures = [ex.submit(d.start) for d in deployments]
        failures = [f.exception() for f in futures]
    failed = next((e for e in failures if e is not None), None)
    if failed is not None:
        for d in deployments:
            d.stop()
        raise failed


def _offset(port: int, by: int) -> int:
    return 0 if port == 0 else port + by  # 0: any free port, for every host


@dataclass
class ScaleOut:
    """A control plane, ``hosts`` Triton hosts and the balancer in front of them.

    ``ports`` are the tenant ports (the balancer's ``http`` and ``grpc``) and the gateway's.
    Host i's Triton listens on ``ports.triton_http + 2i`` and ``ports.triton_grpc + 2i``, its
    metrics on ``ports.metrics + i``, its OpenAI route (loopback, behind the balancer's
    ``/v1/completions`` and ``/v1/chat/completions``) on ``ports.openai + i``; 0 in any of
    them: free ports.
    """

    settings: Settings
    hosts: int
    pools: dict[str, int] = field(default_factory=dict)
    ports: Ports = field(default_factory=Ports)
    base: str | None = None
    actor: str = "operator"
    progress: Callable[[str], None] = lambda _msg: None
    bind: str = "127.0.0.1"  # the gateway's and the balancer's address
    triton_user: str | None = None
    check_ms: int = CHECK_MS
    control: Deployment | None = None
    triton_hosts: list[Deployment] = field(default_factory=list)
    balancer: FrontDoor | None = None

    def start(self) -> None:
        plan = plan_hosts(self.hosts, self.pools)  # refused before anything starts
        require_haproxy()
        p = self.ports
        self.triton_hosts = [
            Deployment(host_settings(self.settings, h.name, h.pool),
                       Ports(http=_offset(p.triton_http, 2 * i),
                             grpc=_offset(p.triton_grpc, 2 * i),
                             metrics=_offset(p.metrics, i),
                             openai=_offset(p.openai, i)).resolved(),
                       base=self.base, actor=self.actor, role="triton", host_id=h.name,
                       front_door="external", triton_user=self.triton_user,
                       progress=self._tagged(h.name))
            for i, h in enumerate(plan)]
        # the OpenAI routes and the rollout probes place by pool too (POOL=host:port)
        urls = [HostUrl(f"127.0.0.1:{d.ports.http}", h.pool).spec()
                for h, d in zip(plan, self.triton_hosts, strict=True)]
        self.control = Deployment(self.settings, Ports(gateway=p.gateway), base=self.base,
                                  actor=self.actor, role="control", triton_urls=urls,
                                  bind=self.bind, progress=self.progress)
        try:
            self.control.start()  # first: it records the signing key the hosts will trust
            start_all(self.triton_hosts)
            # each host runs its OpenAI route on loopback, as behind its own door
            upstreams = [Upstream("127.0.0.1", d.ports.http, d.ports.grpc, pool=h.pool,
                                  name=h.name, openai_port=d.ports.openai)
                         for h, d in zip(plan, self.triton_hosts, strict=True)]
            self.balancer = start_balancer(self.settings.run_dir / "balancer", upstreams,
                                           http_port=p.http, grpc_port=p.grpc,
                                           listen=self.bind, check_ms=self.check_ms)
        except BaseException:
            self.stop()
            raise
        for line in self.describe():
            self.progress(line)

    def _tagged(self, name: str) -> Callable[[str], None]:
        return lambda msg: self.progress(f"[{name}] {msg}")

    def describe(self) -> list[str]:
        """Where each host and the balancer listen, one line each."""
        lines = []
        for d in self.triton_hosts:
            lines.append(f"host {d.host_id} (pool {d.settings.host_pool}): Triton http "
                         f"127.0.0.1:{d.ports.http}, grpc 127.0.0.1:{d.ports.grpc}, metrics "
                         f"http://127.0.0.1:{d.ports.metrics}/metrics, OpenAI route "
                         f"127.0.0.1:{d.ports.openai}, home {d.settings.home}")
        if self.balancer is not None:
            pools = sorted({d.settings.host_pool for d in self.triton_hosts})
            lines.append(f"balancer (haproxy): tenants http {self.balancer.http_url}, grpc "
                         f"{self.balancer.grpc_url}, OpenAI {self.tenant_openai_url}"
                         f"/completions and /chat/completions (model: the ticket's affinity "
                         f"value); pools {', '.join(pools)} by the x-loraplane-pool header "
                         f"(log {self.balancer.log_path})")
        return lines

    @property
    def tenant_http_url(self) -> str:
        assert self.balancer is not None, "the scale-out is not started"
        return self.balancer.http_url

    @property
    def tenant_grpc_url(self) -> str:
        assert self.balancer is not None, "the scale-out is not started"
        return self.balancer.grpc_url

    @property
    def tenant_openai_url(self) -> str:
        """The OpenAI base URL of the hosts' own routes, through the balancer."""
        return f"http://{self.tenant_http_url}/v1"

    @property
    def gateway_url(self) -> str:
        assert self.control is not None, "the scale-out is not started"
        return self.control.gateway_url

    def stop(self) -> None:
        """Stop the balancer first (no new request reaches a stopping host), then the hosts,
        then the control plane; stopping again changes nothing."""
        if self.balancer is not None:
            self.balancer.stop()
        with ThreadPoolExecutor(max(1, len(self.triton_hosts))) as ex:
            list(ex.map(lambda d: d.stop(), self.triton_hosts))
        if self.control is not None:
            self.control.stop()

    def __enter__(self) -> ScaleOut:
        self.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self.stop()

