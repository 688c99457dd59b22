"""The front door: HAProxy between tenants and Triton, forwarding only the tenant routes.

Triton's secure-deployment guidance puts the server behind a proxy that does the authorisation,
so that Triton only ever sees trusted, validated requests. This module renders that proxy's
configuration and runs it (``FrontDoor``, managed like ``TritonProcess``); ``serve`` and
``triton-host`` start one in front of their tritonserver, which then listens on loopback only,
and ``docker/haproxy.cfg`` is the same rendering for the compose file's ``haproxy`` service.

What passes, over HTTP/1.1 on the tenant HTTP port:

- health: ``GET /v2/health/live``, ``/v2/health/ready``, ``/v2/models/<m>[/versions/<v>]/ready``;
- metadata: ``GET /v2``, ``/v2/models/<m>[/versions/<v>]``;
- model configuration: ``GET /v2/models/<m>[/versions/<v>]/config`` (the gateway's OpenAI
  route reads it);
- inference: ``POST /v2/models/<m>[/versions/<v>]/infer``, ``/generate``, ``/generate_stream``;
- where the host runs its OpenAI-compatible route (``control.gateway.host_openai``; a door
  rendered with ``openai_port``): ``POST /v1/completions`` and ``/v1/chat/completions``, sent
  to that route on loopback, not to Triton; a balancer whose every upstream names its
  ``openai_port`` sends them to the hosts' routes, placed by the body's ``model``
  (:func:`_openai_placement`).

Over HTTP/2 on the tenant gRPC port, the matching methods of ``inference.GRPCInferenceService``
(:data:`TENANT_GRPC_METHODS`). Everything else is refused at the door: model repository, shared
memory, statistics, trace and logging (even with the operator's token: the door removes the
operator headers from every request), unknown paths and methods, and Triton's metrics port, which
the door does not serve at all. HTTP refusals are 403 with a small JSON body; gRPC refusals are a
gRPC answer with status PERMISSION_DENIED.

Three more rules:

- A request carrying two ``x-lora-ticket`` headers is refused (400, or gRPC PERMISSION_DENIED):
  which one Triton would forward is up to its HTTP library, and ambiguity is refused everywhere.
- Triton's ``generate`` and ``generate_stream`` do not pass HTTP headers to the model
  (triton-inference-server/server#8790), so a ticket sent there as the ``x-lora-ticket`` header
  would be ignored and the request judged without it: the door answers 400
  (:data:`GENERATE_TICKET_HEADER_REFUSAL`) and the tenant sends ``lora_ticket`` instead.
- HTTP request bodies are capped at :data:`MAX_BODY_BYTES` (413), and an HTTP body must say its
  length (411): HAProxy counts a body only by its ``Content-Length``. gRPC bodies are
  HTTP/2 streams without one; the door caps those only when a client declares a length.
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from control.contracts.config import SHARED_POOL
from control.contracts.placement import AFFINITY_HEADER, POOL_HEADER
from control.contracts.wire import TICKET_HEADER
from control.ops.triton_access import GRPC_HEADER_PREFIX, OPERATOR_HEADER
from control.ops.triton_server import check_ports_free

HAPROXY_PACKAGE = "haproxy"  # the Debian/Ubuntu package that provides the binary
# Where Debian puts the binary; a non-root PATH often lacks /usr/sbin.
_SBIN = ("/usr/sbin", "/usr/local/sbin")
# The largest HTTP request body the door passes. A prompt of 128k tokens is about 0.5 MB of
# text, JSON-escaped perhaps twice that: 8 MiB leaves room for any prompt and refuses bodies far
# larger, which tritonserver 2.51 offers no option to cap.
MAX_BODY_BYTES = 8 * 1024 * 1024
GENERATE_TICKET_HEADER_REFUSAL = (
    "request refused: send the routing ticket as the lora_ticket parameter on generate routes "
    "(Triton does not forward headers there)")
# Two x-lora-ticket headers on one request: which of them Triton would forward is up to its
# HTTP library, so the door refuses the request (one ticket parser: ambiguity is refused).
TICKET_HEADERS_REFUSAL = "request refused: send exactly one routing ticket"
NOT_A_TENANT_ROUTE = ("refused at the front door: tenants reach health, metadata, model "
                      "configuration and inference only")
BODY_TOO_LARGE = "request refused: the body is larger than {} bytes"  # the door's cap
LENGTH_REQUIRED = "request refused: send the body with a Content-Length"
UNAVAILABLE = "Triton is not ready or cannot be reached; retry"
GRPC_SERVICE = "inference.GRPCInferenceService"
# The host's OpenAI-compatible route (control.gateway.host_openai), where a door sends them.
OPENAI_PATHS = ("/v1/completions", "/v1/chat/completions")
TENANT_GRPC_METHODS = ("ServerLive", "ServerReady", "ModelReady", "ServerMetadata",
                       "ModelMetadata", "ModelConfig", "ModelInfer", "ModelStreamInfer")
# Headers a tenant may never bring to Triton: the operator token's, in both protocols' spellings.
STRIPPED_HEADERS = (OPERATOR_HEADER, GRPC_HEADER_PREFIX + OPERATOR_HEADER)
GRPC_PERMISSION_DENIED = 7
# A model name as the door accepts it: no slash, no dot first (no '..'), no percent-escape.
_MODEL = r"[A-Za-z0-9_][A-Za-z0-9_.-]*"
_VERSION = r"(/versions/[0-9]+)?"


class HaproxyUnavailable(RuntimeError):
    """No haproxy binary here; the message names the package."""


def find_haproxy() -> str | None:
    """The haproxy binary on PATH or in Debian's sbin folders, else None."""
    path = os.pathsep.join([os.environ.get("PATH", ""), *_SBIN])
    return shutil.which("haproxy", path=path)


def require_haproxy() -> str:
    found = find_haproxy()
    if found is None:
        raise HaproxyUnavailable(
            f"haproxy is not installed: the front door runs on HAProxy (Debian/Ubuntu: "
            f"apt-get install {HAPROXY_PACKAGE})")
    return found


@dataclass(frozen=True)
class Upstream:
    """One Triton server behind the door: its HTTP and gRPC addresses."""

    host: str
    http_port: int
    grpc_port: int
    # The host's pool (``Settings.host_pool``): a balancer sends it the requests whose
    # ``x-loraplane-pool`` header names that pool. Names the config file may hold: checked by
    # the host's settings (lower-case letters, digits, dashes).
    pool: str = SHARED_POOL
    name: str | None = None  # the server's name in HAProxy's log; None: from ``host``
    # The host's OpenAI-compatible route (control.gateway.host_openai), where a balancer sends
    # /v1/completions and /v1/chat/completions; None: the balancer refuses them (every
    # upstream names one, or none does).
    openai_port: int | None = None


@dataclass(frozen=True)
class DoorConfig:
    """What the door listens on and forwards to."""

    listen: str  # an address, or "*" for every address (a container)
    http_port: int
    grpc_port: int
    upstreams: tuple[Upstream, ...]
    # Docker's embedded DNS: Triton hosts are resolved at run time, and an absent one (a
    # profile not started) is a server marked down rather than a door that refuses to start.
    docker_dns: bool = False
    # Health-check each upstream and send only to ready ones (several hosts); one local Triton
    # needs none: while it starts, the door answers 503.
    health_checks: bool = False
    # The user and group HAProxy drops to once it has read this file and bound its ports
    # (started as root); None: it stays who started it.
    uid: int | None = None
    gid: int | None = None
    max_body_bytes: int = MAX_BODY_BYTES
    # Several hosts (control.ops.balancer): place by consistent hashing on this header (the
    # ticket answer's affinity); None: round robin. Health checks every ``check_ms``.
    affinity_header: str | None = None
    check_ms: int = 5000
    # The host's OpenAI-compatible route on loopback (one host's door only); None: the door
    # refuses the /v1/ paths like any other non-tenant route, unless every upstream names its
    # own (a balancer: ``Upstream.openai_port``).
    openai_port: int | None = None


def _balanced_openai(c: DoorConfig) -> bool:
    """Whether ``c`` sends the OpenAI paths to its upstreams' routes (a balancer), rather than
    to one loopback route (``openai_port``) or nowhere. Some hosts with a route and some
    without are refused: the OpenAI backend would hash onto other servers than the Triton
    backends, so one affinity value would land on two hosts."""
    given = [u.openai_port is not None for u in c.upstreams]
    if any(given) and not all(given):
        raise ValueError("give every upstream's OpenAI port or none")
    if any(given) and c.openai_port is not None:
        raise ValueError("a door's OpenAI route is one loopback port (openai_port) or each "
                         "upstream's, not both")
    return any(given)


def _json_body(message: str) -> str:
    """An HAProxy single-quoted string holding ``{"error": message}``."""
    body = json.dumps({"error": message})
    assert "'" not in body and "\\" not in body, body  # single quotes end the string
    return f"'{body}'"


def _refuse_http(status: int, message: str, condition: str) -> str:
    return (f"    http-request return status {status} content-type application/json "
            f"string {_json_body(message)} {condition}")


def _refuse_grpc(message: str, condition: str) -> str:
    # An HTTP 200 whose headers end the stream with the gRPC status ("trailers-only"): clients
    # report PERMISSION_DENIED with the message.
    return (f"    http-request return status 200 "
            f"hdr grpc-status {GRPC_PERMISSION_DENIED} hdr grpc-message \"{message}\" "
            f"{condition}")


def render(c: DoorConfig) -> str:
    """The haproxy.cfg of a door with configuration ``c``."""
    bind = "" if c.listen == "*" else c.listen
    balanced_openai = _balanced_openai(c)
    openai = c.openai_port is not None or balanced_openai
    grpc_paths = " ".join(f"/{GRPC_SERVICE}/{m}" for m in TENANT_GRPC_METHODS)
    lines = [
        "# The front door: only tenant routes reach Triton. Rendered by",
        "# control/ops/front_door.py, which says what each rule is for",
        "# (docker/haproxy.cfg: python -m control.ops.front_door > docker/haproxy.cfg).",
        "global",
        "    log stdout format raw local0 info",
        "    maxconn 4096",
        *([f"    uid {c.uid}", f"    gid {c.gid}"] if c.uid is not None else []),
        "",
        *(["resolvers docker",
           "    nameserver dns 127.0.0.11:53",
           "    hold valid 10s",
           ""] if c.docker_dns else []),
        "defaults",
        "    mode http",
        "    log global",
        "    option httplog",
        "    option dontlognull",
        "    timeout connect 5s",
        "    timeout http-request 30s",
        # a stream's tokens may come slowly: a quiet minute is not a dead connection
        "    timeout client 600s",
        "    timeout server 600s",
        "    timeout http-keep-alive 60s",
        "",
        "frontend tenant_http",
        f"    bind {bind}:{c.http_port} proto h1",  # Triton's HTTP is HTTP/1.1 only
        *(f"    http-request del-header {h}" for h in STRIPPED_HEADERS),
        "    acl read method GET",
        "    acl post method POST",
        "    acl health path /v2/health/live /v2/health/ready",
        "    acl server path /v2",
        r"    acl stats path_reg ^/v2/models/stats(/|$)",
        f"    acl model path_reg ^/v2/models/{_MODEL}{_VERSION}(/ready|/config)?$",
        f"    acl infer path_reg ^/v2/models/{_MODEL}{_VERSION}/infer$",
        f"    acl generate path_reg ^/v2/models/{_MODEL}{_VERSION}/generate(_stream)?$",
        *([f"    acl openai path {' '.join(OPENAI_PATHS)}"] if openai else []),
        f"    acl ticket_header req.hdr_cnt({TICKET_HEADER}) gt 0",
        f"    acl ticket_headers req.hdr_cnt({TICKET_HEADER}) gt 1",
        "    acl has_length req.hdr(content-length) -m found",
        "    acl chunked req.hdr(transfer-encoding) -m found",
        f"    acl too_large req.hdr_val(content-length) gt {c.max_body_bytes}",
        # HAProxy's own answers (Triton down or still starting) in the same JSON shape
        f"    http-error status 503 content-type application/json string {_json_body(UNAVAILABLE)}",
        _refuse_http(403, NOT_A_TENANT_ROUTE, "unless read health or read server or "
                     "read model !stats or post infer or post generate"
                     + (" or post openai" if openai else "")),
        _refuse_http(400, TICKET_HEADERS_REFUSAL, "if ticket_headers"),
        _refuse_http(400, GENERATE_TICKET_HEADER_REFUSAL, "if generate ticket_header"),
        _refuse_http(411, LENGTH_REQUIRED, "if post !has_length or chunked"),
        _refuse_http(413, BODY_TOO_LARGE.format(c.max_body_bytes), "if too_large"),
        *(_pool_rules(c, "host_openai", "post openai ") if balanced_openai else []),
        *(["    use_backend host_openai if post openai"] if openai else []),
        *_pool_rules(c, "triton_http"),
        "    default_backend triton_http",
        "",
        "frontend tenant_grpc",
        f"    bind {bind}:{c.grpc_port} proto h2",
        *(f"    http-request del-header {h}" for h in STRIPPED_HEADERS),
        f"    acl tenant_method path {grpc_paths}",
        f"    acl ticket_headers req.hdr_cnt({TICKET_HEADER}) gt 1",
        f"    acl too_large req.hdr_val(content-length) gt {c.max_body_bytes}",
        _refuse_grpc(NOT_A_TENANT_ROUTE, "unless METH_POST tenant_method"),
        _refuse_grpc(TICKET_HEADERS_REFUSAL, "if ticket_headers"),
        _refuse_grpc(BODY_TOO_LARGE.format(c.max_body_bytes), "if too_large"),
        *_pool_rules(c, "triton_grpc"),
        "    default_backend triton_grpc",
        "",
    ]
    if c.openai_port:
        lines += ["backend host_openai", f"    server openai 127.0.0.1:{c.openai_port}", ""]
    for pool in _pools(c):
        members = [(i, u) for i, u in enumerate(c.upstreams) if u.pool == pool]
        lines += [
            f"backend {_backend('triton_http', pool)}",
            *(["    option httpchk GET /v2/health/ready"] if c.health_checks else []),
            *_placement(c),
            *(_server(i, u, u.http_port, c, "") for i, u in members),
            "",
            f"backend {_backend('triton_grpc', pool)}",
            *(["    option httpchk GET /v2/health/ready"] if c.health_checks else []),
            *_placement(c),
            *(_server(i, u, u.grpc_port, c, " proto h2") for i, u in members),
            "",
        ]
        if balanced_openai:
            lines += [
                f"backend {_backend('host_openai', pool)}",
                # a host is up for this route when its Triton is ready, as in the other two
                *(["    option httpchk GET /v2/health/ready"] if c.health_checks else []),
                *_openai_placement(c),
                *(_server(i, u, u.openai_port or 0, c, "") for i, u in members),
                "",
            ]
    return "\n".join(lines)


def _pools(c: DoorConfig) -> list[str]:
    """The pools of ``c``'s upstreams, the shared pool first and always: requests without a
    pool header (or naming no pool here) go to its backend, which answers 503 when empty."""
    return [SHARED_POOL, *sorted({u.pool for u in c.upstreams} - {SHARED_POOL})]


def _backend(prefix: str, pool: str) -> str:
    # the shared pool keeps the names a one-pool door has always had (docker/haproxy.cfg)
    return prefix if pool == SHARED_POOL else f"{prefix}_{pool}"


def _pool_rules(c: DoorConfig, prefix: str, condition: str = "") -> list[str]:
    """One rule per dedicated pool: the pool header names the backend. The header only
    places, like the affinity header: a host verifies that the ticket allows its pool, so a
    forged value is refused there, never served."""
    return [f"    use_backend {_backend(prefix, pool)} "
            f"if {condition}{{ req.hdr({POOL_HEADER}) -m str {pool} }}"
            for pool in _pools(c)[1:]]


def _placement(c: DoorConfig, balance: str | None = None) -> list[str]:
    if c.affinity_header is None:
        return []
    return [
        # one affinity value, one host while it is up; a host that goes takes only its share
        # of values elsewhere (consistent hashing), and no header at all is round robin
        balance or f"    balance hdr({c.affinity_header})",
        "    hash-type consistent",
        # a connection refused (a host just gone, not yet marked down) is tried on another
        # host: the request never reached the first one, so it cannot run twice
        "    retries 2",
        "    retry-on conn-failure",
        "    option redispatch 1",
    ]


def _openai_placement(c: DoorConfig) -> list[str]:
    """The OpenAI backend's placement: the body's ``model`` (the ticket's affinity value, what
    OpenAI clients send) hashed like the affinity header in the Triton backends: the same
    bytes through the same hash onto the same ring (same servers, same ids), so one value
    lands on one host on every route. HAProxy reads the body only as far as its buffer
    (16 kB): a ``model`` past that (a long chat history before it) is not found, and the
    affinity header places instead, else round robin."""
    if c.affinity_header is None:
        return []
    return [
        "    option http-buffer-request",  # the body is in the buffer before placement
        f"    http-request set-var(txn.affinity) req.hdr({c.affinity_header})",
        # a fetch that finds nothing leaves the variable as it was: the header's, or unset
        "    http-request set-var(txn.affinity) req.body,json_query('$.model')",
        *_placement(c, "    balance hash var(txn.affinity)"),
    ]


def _server(i: int, u: Upstream, port: int, c: DoorConfig, proto: str) -> str:
    label = u.name or u.host
    name = label if label.replace("-", "").isalnum() else f"triton{i}"
    # consistent hashing places a server on its ring by its id: host i is id i + 1 in every
    # backend (Triton HTTP, gRPC, OpenAI), so each maps a value to the same host
    opts = f" id {i + 1}{proto}" if c.affinity_header is not None else proto
    if c.health_checks:
        # every host is checked on its HTTP port, in HTTP/1.1 even behind an HTTP/2 server
        inter = "5s" if c.check_ms == 5000 else f"{c.check_ms}ms"
        opts += f" check port {u.http_port} check-proto h1 inter {inter}"
        if c.check_ms != 5000:
            opts += " fall 1 rise 1"
    if c.docker_dns:
        opts += " resolvers docker init-addr last,libc,none"
    return f"    server {name} {u.host}:{port}{opts}"


# Each compose host's OpenAI route (``triton-host --openai-port``), on the compose network.
COMPOSE_OPENAI_PORT = 8003


def compose_config() -> str:
    """The door of ``docker/compose.yaml`` (checked in as ``docker/haproxy.cfg``): every
    address, the tenant ports 8000 and 8001, both Triton hosts of the compose file, placed by
    the ticket answer's affinity (``control.ops.balancer``) when the scale-out profile runs
    both, and their OpenAI routes (``/v1/completions``, ``/v1/chat/completions``) placed by the
    body's ``model`` onto the same host."""
    return render(DoorConfig(
        listen="*", http_port=8000, grpc_port=8001,
        upstreams=(Upstream("triton-a", 8000, 8001, openai_port=COMPOSE_OPENAI_PORT),
                   Upstream("triton-b", 8000, 8001, openai_port=COMPOSE_OPENAI_PORT)),
        docker_dns=True, health_checks=True, affinity_header=AFFINITY_HEADER))


@dataclass
class FrontDoor:
    """One running HAProxy: the front door of one Triton host."""

    READY_TIMEOUT_S: ClassVar[float] = 10.0

    work_dir: Path
    config: DoorConfig
    proc: subprocess.Popen[bytes] | None = None
    _binary: str = field(default="", init=False, repr=False)

    @property
    def config_path(self) -> Path:
        return self.work_dir / f"front-door-{self.config.http_port}.cfg"

    @property
    def log_path(self) -> Path:
        return self.work_dir / f"front-door-{self.config.http_port}.log"

    @property
    def _client_host(self) -> str:
        listen = self.config.listen
        return "127.0.0.1" if listen in ("*", "0.0.0.0", "::", "") else listen

    @property
    def http_url(self) -> str:
        """host:port of the tenant HTTP port (as tritonclient takes it)."""
        return f"{self._client_host}:{self.config.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"{self._client_host}:{self.config.grpc_port}"

    def start(self) -> None:
        """Write the configuration, have HAProxy check it, then launch it in the foreground
        (its log, access lines included, goes to :attr:`log_path`)."""
        binary = require_haproxy()
        listen = "0.0.0.0" if self.config.listen == "*" else self.config.listen
        check_ports_free(listen, {"tenant HTTP (front door)": self.config.http_port,
                                  "tenant gRPC (front door)": self.config.grpc_port})
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self.config_path.write_text(render(self.config))
        checked = subprocess.run([binary, "-c", "-q", "-f", str(self.config_path)],
                                 capture_output=True, text=True, timeout=30)
        if checked.returncode != 0:
            raise RuntimeError(f"haproxy refused the front door's configuration "
                               f"{self.config_path}: {checked.stderr.strip()}")
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                [binary, "-db", "-f", str(self.config_path)], stdin=subprocess.DEVNULL,
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> None:
        """Both tenant ports accept connections from this HAProxy (it is still running)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc is None or self.proc.poll() is not None:
                code = None if self.proc is None else self.proc.returncode
                raise RuntimeError(f"the front door (haproxy) exited with code {code}; "
                                   f"see {self.log_path}")
            if all(_accepts(self._client_host, p)
                   for p in (self.config.http_port, self.config.grpc_port)):
                return
            time.sleep(0.05)
        raise TimeoutError(f"the front door (haproxy) does not listen after {timeout_s:.0f}s; "
                           f"see {self.log_path}")

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop now (SIGTERM ends HAProxy's connections at once), by force if it lingers."""
        if self.proc is None or self.proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def _accepts(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


def door_user() -> tuple[int, int]:
    """(uid, gid) a door started as root drops to: Debian's ``haproxy`` system user (the
    package creates it), else ``nobody``; never the Triton user, whose code the door guards."""
    for name in ("haproxy", "nobody"):
        with contextlib.suppress(KeyError):
            pw = pwd.getpwnam(name)
            return pw.pw_uid, pw.pw_gid
    return 65534, 65534


def local_door(work_dir: Path, listen: str, http_port: int, grpc_port: int,
               triton_http_port: int, triton_grpc_port: int,
               as_root: bool = False, openai_port: int | None = None) -> FrontDoor:
    """The door of one host: tenants on ``listen``, Triton (and the host's OpenAI route on
    ``openai_port``) on loopback; started as root, it drops to :func:`door_user` once
    listening."""
    uid, gid = door_user() if as_root else (None, None)
    return FrontDoor(work_dir, DoorConfig(
        listen=listen, http_port=http_port, grpc_port=grpc_port,
        upstreams=(Upstream("127.0.0.1", triton_http_port, triton_grpc_port),),
        uid=uid, gid=gid, openai_port=openai_port))


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m control.ops.front_door``: print the compose file's door
    (``docker/haproxy.cfg``)."""
    print(compose_config(), end="")


if __name__ == "__main__":
    main()
