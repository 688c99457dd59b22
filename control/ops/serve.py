"""Running a deployment: projection follower, gateway and a real tritonserver, as one unit.

``loraplane serve`` runs this in the foreground; the demo and the integration tests run the same
class, so what they prove is what an operator starts.

Roles, for scale-out on one PostgreSQL URL (every process reads ``LORAPLANE_DB_URL``):

- ``all``: everything in one process group (the default; a laptop, the demo).
- ``control``: the gateway and the projection follower, no Triton. Several may run; the follower's
  compare-and-set keeps them consistent. Its OpenAI-compatible routes forward to the Triton hosts
  in ``triton_urls`` (``LORAPLANE_TRITON_URLS``), each request to a host of its ticket's pool.

``all`` and ``control`` also run the rollout controller (``control.ops.rollout_controller``),
which probes the Triton hosts above before each step of a rollout: several may run at once (each
step is recorded by exactly one of them), and one with no Triton host to probe does not run.
- ``triton``: one Triton host, no gateway. It reads the projection tables the control planes keep
  current, copies every recorded ticket-signing public key into its keys folder (and keeps doing
  so, so a gateway added later is trusted), and labels its ledger rows with ``host_id``
  (``LORAPLANE_HOST_ID``).

A role that runs Triton puts the front door (``control.ops.front_door``: HAProxy) in front of it
whenever haproxy is installed (``front_door``, ``serve --front-door``): tenants reach the door at
``bind`` on ``Ports.http`` and ``Ports.grpc``, and tritonserver listens on loopback only, on
``Ports.triton_http`` and ``Ports.triton_grpc``, where this deployment's gateway (its
OpenAI-compatible routes) and rollout controller reach it. Started as root, it runs tritonserver
as ``triton_user`` (``control.ops.triton_user``). Beside Triton it runs the host's own
OpenAI-compatible route (``control.gateway.host_openai``: model = the ticket's affinity, the
ticket in a header) on ``Ports.openai``, where Triton listens: on loopback behind this host's
own door, which sends ``/v1/completions`` and ``/v1/chat/completions`` there, and at ``bind``
with an external door (``--front-door external``: the compose file's ``haproxy`` service sends
them to each host's route on the compose network).

A role that runs Triton first checks the adapter memory plan (``backend.serving.memory``) for the
base
it will serve: a configuration that cannot hold one adapter of the maximum rank is refused before
anything starts, with the message the engine would give from inside Triton.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING

import sqlalchemy as sa

from backend.serving.memory import MemoryPlan, plan_for_host
from control.app.ledger_audit import keep_verifying
from control.app.registry import Registry
from control.app.serving_steps import keep_folding
from control.app.sessions import SessionPins
from control.contracts.config import (
    BASE_DIGEST_ENV,
    GATEWAY_DB_URL_ENV,
    HOST_DB_URL_ENV,
    HOST_ID_ENV,
    HOST_POOL_ENV,
    HOST_REGION_ENV,
    Settings,
    seal_interval_from_env,
)
from control.contracts.db import make_engine
from control.contracts.ledger import Ledger, request_ledger
from control.contracts.placement import HostUrl
from control.contracts.store import ArtifactStore
from control.contracts.ticket_seals import publish_seal
from control.contracts.tickets import TicketSigner
from control.gateway.ticket_office import TicketOffice
from control.ops.app_thread import AppThread
from control.ops.engine_watch import EngineWatch
from control.ops.front_door import (
    HAPROXY_PACKAGE,
    FrontDoor,
    HaproxyUnavailable,
    find_haproxy,
    local_door,
)
from control.ops.key_sync import sync_public_keys
from control.ops.rollout_controller import RolloutController, liveness_metrics
from control.ops.triton_access import TOKEN_EXPOSED_FIX, command_line_exposure
from control.ops.triton_server import (
    MODEL_REPOSITORY,
    TritonProcess,
    check_ports_free,
    free_ports,
)
from control.ops.triton_user import KEEP_ROOT, grant_home, triton_user_for
from projections.follower import ProjectionFollower, open_registry
from projections.route_cache import CachedRoutingView
from projections.routing import RoutingView

if TYPE_CHECKING:  # aiohttp: only a deployment that runs the gateway pays for it
    from aiohttp import web

log = logging.getLogger("loraplane.serve")

ROLES = ("all", "control", "triton")
# How tenants reach a Triton host (``--front-door``): ``auto`` puts a front door (HAProxy) in
# front whenever haproxy is installed, and serves loopback only without one; ``haproxy`` requires
# the door; ``external`` runs none, Triton listening on the tenant ports itself, because another
# proxy is the only way in (the compose file's haproxy service).
FRONT_DOORS = ("auto", "haproxy", "external")
TRITON_URLS_ENV = "LORAPLANE_TRITON_URLS"


@dataclass(frozen=True)
class Ports:
    """The ports a deployment listens on; 0: one the kernel picks at start.

    ``http`` and ``grpc`` are the ports tenants use: the front door's when this host runs one,
    else Triton's own. Behind a door, Triton listens on loopback on ``triton_http`` and
    ``triton_grpc``; its ``metrics`` port is on loopback then too, and never behind the door.
    """

    http: int = 8000
    grpc: int = 8001
    metrics: int = 8002
    gateway: int = 8080
    triton_http: int = 0
    triton_grpc: int = 0
    # The host's OpenAI-compatible route (control.gateway.host_openai), where Triton listens:
    # on loopback behind this host's door (the pod's sidecar on Kubernetes), at the bind
    # address for an external door (the compose file's haproxy service), as Triton is.
    openai: int = 0

    def resolved(self) -> Ports:
        """These ports with every 0 replaced by a port free now, each a different one."""
        zero = [f.name for f in fields(self) if getattr(self, f.name) == 0]
        given = [getattr(self, f.name) for f in fields(self) if f.name not in zero]
        return replace(self, **dict(zip(zero, free_ports(len(zero), avoid=given), strict=True)))

    @classmethod
    def free(cls) -> Ports:
        """Four different ports free now for the tenant-facing ones (tests, benches, the
        demo); Triton's loopback ports are chosen at start."""
        http, grpc, metrics, gateway = free_ports(4)
        return cls(http, grpc, metrics, gateway)


def open_signer(settings: Settings, registry: Registry, actor: str) -> TicketSigner:
    """The signing key, created on first use; its public half is recorded as an event."""
    signer, _created = TicketSigner.load_or_create(settings.keys_dir)
    engine = make_engine(settings.db_url)
    if signer.kid not in RoutingView(engine).signing_keys():
        registry.record_signing_key(signer.kid, signer.public_b64, actor=actor)
    publish_seal(engine, signer)  # before a host sees its first ticket
    return signer


_WARNED: set[str] = set()


def _warn_once(key: str, message: str, *args: object) -> None:
    """Log a warning once per process (a test session starts many deployments)."""
    if key not in _WARNED:
        _WARNED.add(key)
        log.warning(message, *args)


def _loopback(address: str) -> bool:
    if address == "localhost":
        return True
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def keep_sealed(registry: Registry, stop: threading.Event, interval: float) -> None:
    """Seal every unsealed event once per ``interval`` seconds, so a quiet deployment's last
    events are covered by a signed checkpoint within that interval, not after 100 more."""
    while not stop.wait(interval):
        try:
            row = registry.seal.seal_if_due(every=1)
            if row is not None:
                log.info("audit checkpoint %s sealed up to position %s", row["seq"],
                         row["last_position"])
        except Exception:  # the database may be briefly away; the next interval retries
            log.warning("audit checkpoint failed", exc_info=True)


def check_adapter_memory(settings: Settings, base_digest: str) -> MemoryPlan:
    """The adapter memory plan a Triton host started with ``settings`` will build for this
    base on this machine's device; raises ``AdapterMemoryError`` (naming the budget variable,
    what one adapter needs and what the budget gives) when it cannot hold one adapter."""
    return plan_for_host(ArtifactStore(settings.store_dir).path(base_digest), settings)


def pick_base(routing: RoutingView, base: str | None) -> str:
    """The base digest to serve: the one given, or the only one registered."""
    digests = [b.digest for b in routing.bases()]
    if base is not None:
        if base not in digests:
            raise ValueError("that base model digest is not registered")
        return base
    if len(digests) != 1:
        raise ValueError(
            "register a base model first" if not digests
            else "several base models are registered: choose one with --base"
        )
    return digests[0]


def door_wanted(front_door: str, bind: str) -> bool:
    """Whether a Triton host with these settings runs its own front door; raises when it needs
    one and haproxy is missing."""
    if front_door not in FRONT_DOORS:
        raise ValueError(f"front door is one of {', '.join(FRONT_DOORS)}, "
                         f"not {front_door!r}")
    if front_door == "external":
        return False
    if find_haproxy() is not None:
        return True
    if front_door == "haproxy":
        raise HaproxyUnavailable(
            f"--front-door haproxy: haproxy is not installed (Debian/Ubuntu: apt-get "
            f"install {HAPROXY_PACKAGE})")
    if not _loopback(bind):
        raise HaproxyUnavailable(
            f"--listen {bind} serves other machines, which reach Triton only through "
            f"the front door, and haproxy is not installed: install it (Debian/Ubuntu: "
            f"apt-get install {HAPROXY_PACKAGE}), or pass --front-door external when "
            "another proxy is the only way to this host")
    _warn_once("no-haproxy", "haproxy is not installed: Triton serves this machine's "
               "clients directly, without the front door (apt-get install %s)",
               HAPROXY_PACKAGE)
    return False


@dataclass
class Deployment:
    settings: Settings
    ports: Ports = field(default_factory=Ports)
    base: str | None = None
    actor: str = "operator"
    progress: Callable[[str], None] = lambda _msg: None
    role: str = "all"
    host_id: str | None = None  # the ledger's host column for this Triton host
    # extra Triton hosts: host:port, or POOL=host:port for a host of a dedicated pool
    triton_urls: list[str] = field(default_factory=list)
    # The address the gateway and the front door (Triton itself when there is none) listen on:
    # loopback unless the deployment serves other machines (`--listen 0.0.0.0`; the containers
    # do). Behind a door, Triton listens on loopback whatever this says.
    bind: str = "127.0.0.1"
    # The Triton model repository; None: the project's model_repository/. Only test and
    # benchmark deployments pass another (control.ops.model_repositories.derived_repository); no
    # command
    # line option or environment variable reaches this.
    model_repository: Path | None = None
    # Whether this deployment runs the rollout controller. Only a test that runs the controller
    # as a process of its own (to kill it mid-rollout) passes False; like model_repository, no
    # command line option or environment variable reaches this.
    rollout_controller: bool = True
    front_door: str = "auto"  # one of FRONT_DOORS
    # The user tritonserver runs as (control.ops.triton_user): None, the user running this
    # (the CLI passes `loraplane-triton` when that is root); "root" keeps Triton as root.
    triton_user: str | None = None
    triton: TritonProcess | None = None
    door: FrontDoor | None = None
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)
    _apps: list[AppThread] = field(default_factory=list)  # the gateway, the host's OpenAI route

    def start(self, ready_timeout_s: float = TritonProcess.READY_TIMEOUT_S) -> None:
        self.settings.check_timing()  # timing settings vs the 1 s promises, before anything
        if self.role not in ROLES:
            raise ValueError(f"role is one of {', '.join(ROLES)}, not {self.role!r}")
        s = self.settings
        s.ensure_dirs()
        with_door = self.role != "control" and door_wanted(self.front_door, self.bind)
        self.ports = self.ports.resolved()
        # Every port this deployment will listen on, checked before anything starts: a second
        # `serve` on ports in use is refused, never left talking to the first one's servers.
        # Behind a door, tenants' ports keep their names: they serve Triton's protocols.
        ports = {} if self.role == "control" else {
            "Triton HTTP": self.ports.http, "Triton gRPC": self.ports.grpc}
        internal = {"Triton HTTP (internal)": self.ports.triton_http,
                    "Triton gRPC (internal)": self.ports.triton_grpc} if with_door else {}
        if self.role != "control":
            beside_triton = internal if with_door else ports
            beside_triton["OpenAI route"] = self.ports.openai
            beside_triton["Triton metrics"] = self.ports.metrics
        if self.role != "triton":
            ports["gateway"] = self.ports.gateway
        check_ports_free(self.bind, ports)
        check_ports_free("127.0.0.1", internal)
        # A Triton-only host reads with its own credential: the host view is all it may read.
        routing = RoutingView(make_engine(s.host_db_url if self.role == "triton" else s.db_url))
        if self.role != "control":
            # Refused here, before any thread or process starts, rather than by the engine
            # inside Triton, whose failure an operator would have to find in Triton's log.
            self.progress(check_adapter_memory(s, pick_base(routing, self.base)).describe())
        office: TicketOffice | None = None
        if self.role != "triton":
            registry = open_registry(s)
            follower = ProjectionFollower.from_settings(s)
            follower.catch_up()
            self._thread("follower", follower.run)
            # Hosts report revocation steps into a table (no event), and sign checkpoints of
            # their ledger logs: the steps folded into events, the checkpoints verified here.
            db = make_engine(s.db_url)
            self._thread("serving-steps", lambda stop: keep_folding(registry, db, stop))
            self._thread("ledger-audit", lambda stop: keep_verifying(registry, db, stop))
            interval = seal_interval_from_env()  # checked at start (check_timing) already
            self._thread("audit-seal", lambda stop: keep_sealed(registry, stop, interval))
            # The ticket path answers from memory, refreshed as the projection moves. Session
            # pins are recorded without catching the projection up in the request: the office
            # remembers its own pins, and the follower thread projects them for other gateways.
            pins = SessionPins(open_registry(s, follow=False), actor=self.actor)
            office = TicketOffice(s, CachedRoutingView(make_engine(s.gateway_db_url)),
                                  open_signer(s, registry, self.actor), pins)
        if self.role != "control":
            try:
                self._start_triton(routing, with_door)
            except Exception:
                self.stop()  # nothing started is left running: threads, Triton, the door
                raise
        if office is not None:
            self._start_gateway(office, self._host_urls())
            self.progress(f"gateway on {self.gateway_url}")
        if self.triton is not None:
            try:
                self.triton.wait_ready(ready_timeout_s)
            except Exception:
                self.stop()
                raise
            self.progress(
                f"triton ready: tenants http {self.tenant_http_url}, grpc {self.tenant_grpc_url}"
                + (f" (front door, log {self.door.log_path}); Triton itself http "
                   f"{self.triton.http_url}, grpc {self.triton.grpc_url}"
                   if self.door is not None else "")
                + f", metrics http://{self.triton.http_url.rsplit(':', 1)[0]}:"
                f"{self.ports.metrics}/metrics (log {self.triton.log_path}); OpenAI route "
                f"http://127.0.0.1:{self.ports.openai}/v1/completions (model: the ticket's "
                "affinity value)"
            )
            # Started once the engine runs: a stub that dies from now on is noticed, its
            # requests recorded and Triton restarted (control.ops.engine_watch).
            watch = EngineWatch(self.triton, Ledger(make_engine(self.settings.host_db_url)),
                                self.host_id or socket.gethostname(), self.progress)
            self._thread("engine-watch", watch.run)
        if office is not None and self.rollout_controller:
            # Started once Triton answers: its first act may be a probe.
            self._start_rollouts(self._host_urls())

    def _host_urls(self) -> list[str]:
        """The Triton hosts this control plane calls (its own first), each with its pool
        (``POOL=host:port`` unless shared), as ``LORAPLANE_TRITON_URLS`` spells them."""
        own = [HostUrl(self.triton.http_url, self.settings.host_pool).spec()] if self.triton else []
        return own + list(self.triton_urls)

    def _start_rollouts(self, hosts: list[str]) -> None:
        if not hosts:
            log.warning("no Triton host to probe (%s): the rollout controller does not run "
                        "here", TRITON_URLS_ENV)
            return
        controller = RolloutController.for_hosts(self.settings, hosts)
        self._thread("rollouts", controller.run)

    def _thread(self, name: str, target: Callable[[threading.Event], None]) -> None:
        t = threading.Thread(target=target, args=(self._stop,), name=name, daemon=True)
        t.start()
        self._threads.append(t)

    def _start_triton(self, routing: RoutingView, with_door: bool) -> None:
        s = self.settings
        base = pick_base(routing, self.base)
        sync_public_keys(s, routing)

        def keep_keys(stop: threading.Event) -> None:
            while not stop.wait(1.0):
                try:
                    sync_public_keys(s, routing)
                except Exception:  # the database may be briefly away; try again next second
                    log.warning("public key sync failed", exc_info=True)

        self._thread("key-sync", keep_keys)
        # Triton holds the host's credential only (db roles): the others blanked, as it inherits.
        env = {"LORAPLANE_HOME": str(s.home), "LORAPLANE_DB_URL": s.host_db_url,
               HOST_DB_URL_ENV: "", GATEWAY_DB_URL_ENV: "", BASE_DIGEST_ENV: base,
               # the pool and region this host serves: it refuses tickets for others
               HOST_POOL_ENV: s.host_pool, HOST_REGION_ENV: s.host_region,
               **s.memory_env()}
        if self.host_id:
            env[HOST_ID_ENV] = self.host_id
        user = triton_user_for(self.triton_user)
        if user is not None:
            # Its HOME and caches: a folder of its own, not root's
            env["HOME"] = env["XDG_CACHE_HOME"] = str(grant_home(s, user))
        elif os.geteuid() == 0:
            _warn_once("triton-root", "tritonserver runs as root (--triton-user %s): code "
                       "inside Triton can read every key in %s", KEEP_ROOT, s.keys_dir)
        p = self.ports
        # Behind the door Triton listens on loopback only, whatever --listen says; the host's
        # OpenAI route (the same ticket-checked service on another path) listens where it does.
        listen = "127.0.0.1" if with_door else self.bind
        self.progress("starting tritonserver (model lora_llm)"
                      + (f" as {user.name}" if user is not None else ""))
        self.triton = TritonProcess(
            work_dir=s.run_dir,
            http_port=p.triton_http if with_door else p.http,
            grpc_port=p.triton_grpc if with_door else p.grpc,
            metrics_port=p.metrics,
            env=env,
            listen=listen,
            model_repository=self.model_repository or MODEL_REPOSITORY,
            user=user.name if user is not None else None,
        )
        self.triton.start()
        self._serve(AppThread("host-openai", self._host_app, listen, p.openai))
        exposed = command_line_exposure()
        if exposed is not None:
            _warn_once("token-exposed", "%s: %s", exposed, TOKEN_EXPOSED_FIX)
        if with_door:
            self.door = local_door(s.run_dir, self.bind, p.http, p.grpc, p.triton_http,
                                   p.triton_grpc, as_root=os.geteuid() == 0,
                                   openai_port=p.openai)
            self.door.start()
            self.door.wait_ready()
            self.progress(f"front door (haproxy) on {self.door.http_url} (HTTP) and "
                          f"{self.door.grpc_url} (gRPC)")

    def _start_gateway(self, office: TicketOffice, triton_urls: list[str]) -> None:
        def make() -> web.Application:
            from control.gateway.server import make_app  # the gateway's routes: only here

            # The controller's liveness on this gateway's /metrics, where it runs here.
            gauges = liveness_metrics if self.rollout_controller else None
            return make_app(office, triton_urls=triton_urls, gauges=gauges)

        self._serve(AppThread("gateway", make, self.bind, self.ports.gateway))

    def _host_app(self) -> web.Application:
        from control.gateway.host_openai import make_host_app  # aiohttp: only a Triton host

        assert self.triton is not None
        return make_host_app(self.triton.http_url, make_engine(self.settings.host_db_url))

    def _serve(self, app: AppThread) -> None:
        self._apps.append(app)  # before it starts: stop() stops what half-started
        app.start()
        if app.thread is not None:
            self._threads.append(app.thread)

    @property
    def tenant_http_url(self) -> str:
        """host:port where tenants send HTTP to Triton: the front door's, else Triton's."""
        if self.door is not None:
            return self.door.http_url
        assert self.triton is not None, "no Triton host in this deployment"
        return self.triton.http_url

    @property
    def tenant_grpc_url(self) -> str:
        """host:port where tenants send gRPC to Triton: the front door's, else Triton's."""
        if self.door is not None:
            return self.door.grpc_url
        assert self.triton is not None, "no Triton host in this deployment"
        return self.triton.grpc_url

    @property
    def gateway_url(self) -> str:
        host = "127.0.0.1" if self.bind in ("0.0.0.0", "::") else self.bind
        return f"http://{host}:{self.ports.gateway}"

    def stop(self) -> None:
        """Stop everything this deployment started; stopping again changes nothing (a failed
        start stops itself, and its caller's cleanup may stop it once more)."""
        t0 = time.monotonic()
        running = self.triton is not None and self.triton.proc is not None and (
            self.triton.proc.poll() is None)
        if running or self._threads:
            parts = (["tritonserver"] if running else []) + (
                ["gateway"] if any(a.name == "gateway" and a.running for a in self._apps)
                else []) + (
                ["projection follower"] if self.role != "triton" else [])
            in_flight = self._in_flight() if running else 0
            self.progress(f"stopping {', '.join(parts)}" + (
                f"; {in_flight} request(s) in flight get up to 5 s to finish, the rest end as "
                "failed (ledger reason 'shutdown')" if in_flight else "; no request in flight"))
        self._stop.set()
        for app in self._apps:
            app.stop()
        if self.door is not None:
            self.door.stop()  # first: no new request reaches a Triton that is stopping
        if self.triton is not None:
            self.triton.stop()
        for t in self._threads:
            t.join(timeout=10)
        if running:
            self.progress(f"stopped in {time.monotonic() - t0:.1f} s")

    def _in_flight(self) -> int:
        """This host's requests the ledger shows running now (0 when it cannot tell)."""
        t = request_ledger
        host = self.host_id or socket.gethostname()
        try:
            with make_engine(self.settings.host_db_url).connect() as conn:
                n = conn.execute(sa.select(sa.func.count()).select_from(t).where(
                    t.c.host == host, t.c.outcome == "running")).scalar()
        except Exception:  # the database may be away: stopping must not depend on it
            return 0
        return int(n or 0)

    @classmethod
    def from_env(cls, settings: Settings, ports: Ports, **kw: object) -> Deployment:
        """A deployment whose host id and Triton URLs come from the environment
        (``LORAPLANE_HOST_ID``, ``LORAPLANE_TRITON_URLS``, comma-separated host:port or
        POOL=host:port)."""
        urls = [u.strip() for u in os.environ.get(TRITON_URLS_ENV, "").split(",") if u.strip()]
        return cls(settings, ports, host_id=os.environ.get(HOST_ID_ENV) or None,
                   triton_urls=urls, **kw)  # type: ignore[arg-type]

    def __enter__(self) -> Deployment:
        self.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self.stop()
