"""Running a deployment: projection follower, gateway and a real tritonserver, as one unit.

``loraplane serve`` runs this in the foreground; the demo and the integration tests run the same
class, so what they prove is what an operator starts.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from aiohttp import web

from backend.triton_glue import BASE_DIGEST_ENV
from backend.triton_server import TritonProcess
from control.config import Settings
from control.db import make_engine
from control.gateway import make_app
from control.registry import Registry
from control.ticket_office import TicketOffice
from control.tickets import TicketSigner
from projections.follower import ProjectionFollower
from projections.routing import RoutingView

log = logging.getLogger("loraplane.serve")


@dataclass(frozen=True)
class Ports:
    http: int = 8000
    grpc: int = 8001
    metrics: int = 8002
    gateway: int = 8080


def open_signer(settings: Settings, registry: Registry, actor: str) -> TicketSigner:
    """The signing key, created on first use; its public half is recorded as an event."""
    signer, _created = TicketSigner.load_or_create(settings.keys_dir)
    if signer.kid not in RoutingView(make_engine(settings.db_url)).signing_keys():
        registry.record_signing_key(signer.kid, signer.public_b64, actor=actor)
    return signer


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


@dataclass
class Deployment:
    settings: Settings
    ports: Ports = field(default_factory=Ports)
    base: str | None = None
    actor: str = "operator"
    progress: Callable[[str], None] = lambda _msg: None
    triton: TritonProcess | None = None
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)
    _loop: asyncio.AbstractEventLoop | None = None
    _runner: web.AppRunner | None = None

    def start(self, ready_timeout_s: float = 240.0) -> None:
        s = self.settings
        s.ensure_dirs()
        registry = Registry(s)
        routing = RoutingView(make_engine(s.db_url))
        follower = ProjectionFollower.from_settings(s)
        follower.catch_up()
        t = threading.Thread(target=follower.run, args=(self._stop,), name="follower",
                             daemon=True)
        t.start()
        self._threads.append(t)
        signer = open_signer(s, registry, self.actor)
        base = pick_base(routing, self.base)
        self.progress("starting tritonserver (model lora_llm)")
        self.triton = TritonProcess(
            work_dir=s.run_dir,
            http_port=self.ports.http,
            grpc_port=self.ports.grpc,
            metrics_port=self.ports.metrics,
            env={"LORAPLANE_HOME": str(s.home), "LORAPLANE_DB_URL": s.db_url,
                 BASE_DIGEST_ENV: base},
        )
        self.triton.start()
        self._start_gateway(TicketOffice(s, routing, signer))
        self.progress(f"gateway on http://127.0.0.1:{self.ports.gateway}")
        try:
            self.triton.wait_ready(ready_timeout_s)
        except Exception:
            self.stop()
            raise
        self.progress(
            f"triton ready: http {self.triton.http_url}, grpc {self.triton.grpc_url}"
        )

    def _start_gateway(self, office: TicketOffice) -> None:
        started = threading.Event()
        errors: list[BaseException] = []

        def serve() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            asyncio.set_event_loop(loop)
            runner = web.AppRunner(make_app(office), access_log=None)
            try:
                loop.run_until_complete(runner.setup())
                site = web.TCPSite(runner, "127.0.0.1", self.ports.gateway)
                loop.run_until_complete(site.start())
            except BaseException as e:  # reported to the starting thread
                errors.append(e)
                started.set()
                return
            self._runner = runner
            started.set()
            loop.run_forever()
            loop.run_until_complete(runner.cleanup())
            loop.close()

        t = threading.Thread(target=serve, name="gateway", daemon=True)
        t.start()
        self._threads.append(t)
        started.wait(30)
        if errors:
            raise RuntimeError(f"gateway failed to start: {errors[0]}")

    @property
    def gateway_url(self) -> str:
        return f"http://127.0.0.1:{self.ports.gateway}"

    def stop(self) -> None:
        """Stop everything this deployment started."""
        self._stop.set()
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
        if self.triton is not None:
            self.triton.stop()
        for t in self._threads:
            t.join(timeout=10)

    def __enter__(self) -> Deployment:
        self.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self.stop()
