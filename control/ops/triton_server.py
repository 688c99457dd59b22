"""Finding, starting and stopping the real ``tritonserver`` binary.

On a CPU-only machine the binary and the Python backend come from the ``nvidia-pytriton`` wheel
(only its server files are used). In the official Triton container they live under
``/opt/tritonserver``. ``LORAPLANE_TRITONSERVER`` points at any other binary.

Every launch restricts Triton's operator APIs to the home's operator token (see
``control/ops/triton_access.py``); the command line has no form without the restriction. A launch
may run the server as another user (``user``, see ``control/ops/triton_user.py``); ``serve``
puts it behind the front door (``control/ops/front_door.py``), on loopback ports of its own.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import pwd
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from control.contracts.config import Settings
from control.contracts.wire import ENGINE_MODEL, FORWARDED_HEADERS, MODEL
from control.ops.triton_access import OperatorAccess, Protocol
from control.ops.triton_user import ServiceUser, check_reachable, needed_paths

REPO_ROOT = Path(__file__).resolve().parents[2]
MODEL_REPOSITORY = REPO_ROOT / "model_repository"
# What "ready" means, for TritonProcess.ready() and for the container health checks
# (docker/compose.yaml, docker/triton.Dockerfile probe exactly these; tests/
# test_docker_consistency.py holds them to it). Triton's server readiness is true only once every
# model in the repository is ready (strict readiness, its default); both models are named as
# well, so that a repository missing one of them cannot pass for ready. The front lora_llm loads
# no weights and is ready long before the engine lora_llm_stream can answer, so it alone is not.
READY_PATHS = ("/v2/health/ready", f"/v2/models/{ENGINE_MODEL}/ready",
               f"/v2/models/{MODEL}/ready")
READY_PROBE_TIMEOUT_S = 1.0  # per path; a host slower than this to say it is ready is not


class TritonUnavailable(RuntimeError):
    """No usable tritonserver here; the message says how to get one."""


@dataclass(frozen=True)
class TritonInstall:
    binary: Path
    backend_dir: Path  # a directory holding python/ with the Python backend and stub


def _pytriton_root() -> Path | None:
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        return None
    root = Path(next(iter(spec.submodule_search_locations))) / "tritonserver"
    return root if (root / "bin" / "tritonserver").exists() else None


def find_triton(work_dir: Path) -> TritonInstall:
    """Locate tritonserver and assemble a backend directory for this Python under ``work_dir``."""
    explicit = os.environ.get("LORAPLANE_TRITONSERVER")
    if explicit:
        binary = Path(explicit)
        return TritonInstall(binary, binary.parent.parent / "backends")
    if Path("/opt/tritonserver/bin/tritonserver").exists():
        return TritonInstall(
            Path("/opt/tritonserver/bin/tritonserver"), Path("/opt/tritonserver/backends")
        )
    root = _pytriton_root()
    if root is None:
        on_path = shutil.which("tritonserver")
        if on_path:
            return TritonInstall(Path(on_path), Path(on_path).parent.parent / "backends")
        raise TritonUnavailable(
            "tritonserver not found: install the 'serve' extra (pip install 'loraplane[serve]', "
            "which brings nvidia-pytriton's server files), run inside the official Triton "
            "container, or set LORAPLANE_TRITONSERVER"
        )
    pyver = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = root / "python_backend_stubs" / pyver / "triton_python_backend_stub"
    if not stub.exists():
        raise TritonUnavailable(f"no Triton Python backend stub for Python {pyver}")
    # The stub must match the running Python, so the backend directory is assembled per launch
    # from symlinks instead of writing into site-packages.
    py_dir = work_dir / "triton-backends" / "python"
    py_dir.mkdir(parents=True, exist_ok=True)
    links = {
        "libtriton_python.so": root / "backends" / "python" / "libtriton_python.so",
        "triton_python_backend_utils.py": root / "backends" / "python"
        / "triton_python_backend_utils.py",
        "triton_python_backend_stub": stub,
    }
    for name, target in links.items():
        # Made beside and renamed over: two launches sharing a work dir (a restart racing
        # another) each see a whole link, never a missing one or an "exists" error.
        staged = py_dir / f".{name}.{os.getpid()}.{secrets.token_hex(4)}"
        staged.symlink_to(target)
        os.replace(staged, py_dir / name)
    return TritonInstall(root / "bin" / "tritonserver", py_dir.parent)


class PortInUse(RuntimeError):
    """A port a launch needs is taken (another ``loraplane serve``, or any other server)."""


def check_ports_free(address: str, ports: dict[str, int]) -> None:
    """Raise :class:`PortInUse`, naming the port and what it was for, unless every port can be
    bound on ``address`` now (a server started just after may still take one: the launch then
    fails, and readiness, checked against the launch's own ``--id``, never passes)."""
    host = "0.0.0.0" if address in ("", "::") else address
    for role, port in ports.items():
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((host, port))
            except OSError:
                raise PortInUse(
                    f"port {port} ({role}) on {host} is already in use: is another "
                    "`loraplane serve` running? Stop it, or choose other ports "
                    "(--http-port, --grpc-port, --metrics-port, --gateway-port)") from None


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now (the kernel's choice)."""
    return free_ports(1, host)[0]


def free_ports(n: int, host: str = "127.0.0.1", avoid: Iterable[int] = ()) -> list[int]:
    """``n`` distinct TCP ports free on ``host`` now, none in ``avoid``. The sockets stay bound
    until all are chosen: one ``free_port()`` after another may get the same port twice (the
    kernel can hand a port it just released out again), and tritonserver then refuses to start
    ("cannot listen to GRPC requests and metrics requests at the same address and port")."""
    held: list[socket.socket] = []
    ports: list[int] = []
    try:
        while len(ports) < n:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            held.append(s)
            s.bind((host, 0))
            port = int(s.getsockname()[1])
            if port not in avoid and port not in ports:
                ports.append(port)
    finally:
        for s in held:
            s.close()
    return ports


@dataclass
class TritonProcess:
    """One running tritonserver serving ``model_repository/``."""

    # How long a starting server may take to answer ready: ``Deployment.start`` waits this long
    # (``serve``, ``triton-host``), and the container health checks give it as their start
    # period (tests/docker/test_docker_consistency.py checks both). An 8B base is 16 GB of bf16
    # weights: read from a cold network volume at 100-200 MB/s that alone takes 80-160 s, and
    # torch's import, CUDA's initialisation and the slot banks' allocation come on top. 300 s covers
    # that with room to spare; a host not ready by then is stuck, not slow. One figure for both,
    # so that neither gives up on a start the other would still wait for.
    READY_TIMEOUT_S: ClassVar[float] = 300.0

    work_dir: Path
    http_port: int
    grpc_port: int
    metrics_port: int
    env: dict[str, str] = field(default_factory=dict)
    model_repository: Path = MODEL_REPOSITORY
    home: Path | None = None  # whose operator token; else LORAPLANE_HOME of ``env``, then ours
    # The address Triton's HTTP, gRPC and metrics ports listen on: loopback unless a host
    # serves other machines (``serve --listen 0.0.0.0``; the containers do).
    listen: str = "127.0.0.1"
    # The user tritonserver (and so every stub) runs as; None: the user running this. Only root
    # may name another (control/ops/triton_user.py; `serve --triton-user`).
    user: str | None = None
    proc: subprocess.Popen[bytes] | None = None
    # Names this launch (Triton's ``--id``): readiness is checked against the server that
    # answers with it, so a second ``serve`` on ports another server holds never mistakes that
    # server for its own; it also names this launch's log file.
    server_id: str = field(default="", init=False)
    # Counts deliberate lifecycle steps (start, stop, kill). A watcher that saw a crash acts
    # only if nobody started, stopped or killed the server since it looked (:meth:`restart_if`):
    # a graceful stop unloads the engine first, which looks like a crash from outside.
    generation: int = field(default=0, init=False)
    _lifecycle: threading.RLock = field(default_factory=threading.RLock, init=False, repr=False)
    _operator: OperatorAccess | None = field(default=None, init=False, repr=False)

    @property
    def log_path(self) -> Path:
        """This launch's own log (a second server on the same ports never writes into it)."""
        return self.work_dir / f"tritonserver-{self.http_port}-{self.server_id or 'new'}.log"

    @property
    def _client_host(self) -> str:
        return "127.0.0.1" if self.listen in ("0.0.0.0", "::", "") else self.listen

    @property
    def http_url(self) -> str:
        return f"{self._client_host}:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"{self._client_host}:{self.grpc_port}"

    def ports(self) -> dict[str, int]:
        return {"Triton HTTP": self.http_port, "Triton gRPC": self.grpc_port,
                "Triton metrics": self.metrics_port}

    @property
    def operator(self) -> OperatorAccess:
        """The operator token this server's restricted APIs answer to (created on first use)."""
        if self._operator is None:
            home = self.home
            if home is None:
                given = self.env.get("LORAPLANE_HOME")
                home = Settings.from_env(Path(given) if given else None).home
            self._operator = OperatorAccess.for_home(home)
        return self._operator

    def operator_headers(self, protocol: Protocol = "http") -> dict[str, str]:
        """Headers for an operator tool calling this server's restricted APIs."""
        return self.operator.headers(protocol)

    def command(self, install: TritonInstall) -> list[str]:
        return [
            str(install.binary),
            f"--model-repository={self.model_repository}",
            f"--backend-directory={install.backend_dir}",
            # the models are fixed at start; loading one is running its code
            "--model-control-mode=none",
            f"--id={self.server_id}",
            f"--http-address={self.listen}",
            f"--http-port={self.http_port}",
            f"--grpc-address={self.listen}",
            f"--grpc-port={self.grpc_port}",
            f"--metrics-address={self.listen}",
            f"--metrics-port={self.metrics_port}",
            # frontends that would open another port beside the restricted ones: SageMaker's
            # skipped the restriction (CVE-2026-24207); Vertex AI's opens when AIP_MODE is set
            "--allow-sagemaker=false",
            "--allow-vertex-ai=false",
            *self.operator.flags(),
            f"--http-header-forward-pattern={FORWARDED_HEADERS}",
            f"--grpc-header-forward-pattern={FORWARDED_HEADERS}",
            "--exit-timeout-secs=5",
            "--log-verbose=0",
            *self.trace_flags(),
        ]

    def trace_flags(self) -> list[str]:
        """Triton's own OpenTelemetry spans when ``LORAPLANE_TRACES=otlp``: they join the
        gateway's trace through the ``traceparent`` header the gateway sends."""
        env = {**os.environ, **self.env}
        if env.get("LORAPLANE_TRACES", "off").strip() != "otlp":
            return []
        endpoint = env.get("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4318").rstrip("/")
        return ["--trace-config=mode=opentelemetry", "--trace-config=rate=1",
                "--trace-config=level=TIMESTAMPS",
                f"--trace-config=opentelemetry,url={endpoint}/v1/traces",
                "--trace-config=opentelemetry,resource=service.name=triton"]

    def observed(self) -> tuple[int, subprocess.Popen[bytes] | None]:
        """The current generation and process, read together."""
        with self._lifecycle:
            return self.generation, self.proc

    def restart_if(self, generation: int, before: Callable[[], None] = lambda: None) -> bool:
        """Kill and start again, running ``before`` first, only if nothing started, stopped or
        killed this server since ``generation`` was observed; False (and nothing done) if
        something did: whoever did it owns the server's state now."""
        with self._lifecycle:
            if generation != self.generation:
                return False
            before()
            self.kill()
            self.start()
            return True

    def start(self) -> None:
        """Launch tritonserver; raises :class:`PortInUse` first when a port is taken."""
        with self._lifecycle:
            self.generation += 1
            self._launch()

    def _launch(self) -> None:
        check_ports_free(self.listen, self.ports())
        install = find_triton(self.work_dir)
        self.server_id = f"loraplane-{os.getpid()}-{secrets.token_hex(4)}"
        env = dict(os.environ)
        env.update(self.env)
        # The stub links libpython: use the running interpreter's, and its environment on PATH
        # so the stub imports torch, transformers and this project from the same place.
        libdir = sysconfig.get_config_var("LIBDIR") or ""
        env["LD_LIBRARY_PATH"] = os.pathsep.join(
            p for p in (libdir, env.get("LD_LIBRARY_PATH", "")) if p
        )
        bindir = str(Path(sys.executable).parent)
        env["PATH"] = os.pathsep.join((bindir, env.get("PATH", "")))
        env["VIRTUAL_ENV"] = sys.prefix
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p
        )
        self.work_dir.mkdir(parents=True, exist_ok=True)
        command = self.command(install)  # reads the operator token, as this user
        as_user: dict[str, object] = {}
        if self.user is not None:
            pw = pwd.getpwnam(self.user)
            user = ServiceUser(self.user, pw.pw_uid, pw.pw_gid)
            # Refused here, naming the path and the fix, rather than as an import error in
            # Triton's log minutes later.
            check_reachable(user, needed_paths(
                install.binary, install.backend_dir, self.model_repository, REPO_ROOT,
                self._settings(env)))
            # cwd: ours may be a folder the Triton user cannot enter (/root)
            as_user = {"user": user.uid, "group": user.gid, "extra_groups": [], "cwd": "/"}
        log = self.log_path.open("ab")  # opened here: the Triton user needs no access to run/
        try:
            self.proc = subprocess.Popen(
                command,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,  # its stubs die with it when we signal the group
                **as_user,  # type: ignore[call-overload]
            )
        finally:
            log.close()

    @staticmethod
    def _settings(env: dict[str, str]) -> Settings:
        """The home and database the launched server will use (its environment's)."""
        given = env.get("LORAPLANE_HOME")
        home = Settings.from_env(Path(given) if given else None).home
        return Settings(home=home, db_url=env.get("LORAPLANE_DB_URL")
                        or f"sqlite:///{home / 'loraplane.db'}")

    def ready(self) -> bool:
        """The server on these ports is the one this object launched (its ``--id``), and every
        path of :data:`READY_PATHS` answers 200: the server (so every model it loaded) and each
        of the two models by name."""
        try:
            with urllib.request.urlopen(f"http://{self.http_url}/v2",
                                        timeout=READY_PROBE_TIMEOUT_S) as r:
                if json.loads(r.read()).get("name") != self.server_id:
                    return False
        except (urllib.error.URLError, OSError, ValueError):
            return False
        for path in READY_PATHS:
            try:
                with urllib.request.urlopen(f"http://{self.http_url}{path}",
                                            timeout=READY_PROBE_TIMEOUT_S) as r:
                    if r.status != 200:
                        return False
            except (urllib.error.URLError, OSError):
                return False
        return True

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(
                    f"tritonserver exited with code {self.proc.returncode}; see {self.log_path}"
                )
            if self.ready():
                return
            time.sleep(0.5)
        raise TimeoutError(f"tritonserver not ready after {timeout_s:.0f}s; see {self.log_path}")

    def kill(self) -> None:
        """SIGKILL the server and its stubs (fault tests, and a dead engine's restart)."""
        with self._lifecycle:
            self.generation += 1
            if self.proc and self.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()

    def stop(self, timeout_s: float = 20.0) -> None:
        """Stop gracefully, then by force; never leaves a stub behind.

        SIGTERM first: Triton stops taking requests, lets those in flight finish (up to its
        exit timeout) and unloads the models; the engine model's finalize ends what is left and
        writes the ledger. Once the engine model is unloaded nothing with state is left: the
        front model's sixteen stubs hold none, and Triton 2.51 takes several seconds to unload
        them one by one (past its exit timeout), so the group is killed then rather than waited
        for.
        """
        with self._lifecycle:  # a watcher that saw the engine unload does not restart it
            self.generation += 1
            self._halt(timeout_s)

    def _halt(self, timeout_s: float) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            offset = self.log_path.stat().st_size if self.log_path.exists() else 0
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            deadline = time.monotonic() + timeout_s
            while self.proc.poll() is None and time.monotonic() < deadline:
                if self._engine_unloaded(offset):
                    break
                time.sleep(0.05)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        if self.proc.poll() is None:
            self.proc.wait()

    def _engine_unloaded(self, offset: int) -> bool:
        """Triton logged, since ``offset``, that the engine model finished unloading."""
        try:
            with self.log_path.open("rb") as f:
                f.seek(offset)
                return f"successfully unloaded '{ENGINE_MODEL}'".encode() in f.read()
        except OSError:
            return False
