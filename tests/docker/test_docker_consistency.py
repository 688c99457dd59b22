"""The images and the compose file rely only on things that exist in this project.

No Docker engine runs here: the compose file is validated with Debian's ``docker-compose``
(skipped with a reason where it is not installed), and the Dockerfiles and compose file are read
to check every copied path, variable, command, option, port and health-check URL they use. The
Triton hosts' health checks are also run, against a stand-in server, beside
``TritonProcess.ready()``: they must agree on every way a host can be not yet ready, and wait as
long as ``serve`` does.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import re
import shlex
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from control.cli.main import app
from control.ops.front_door import compose_config, find_haproxy
from control.ops.serve import Deployment
from control.ops.triton_server import READY_PATHS, READY_PROBE_TIMEOUT_S, TritonProcess
from tests import REPO
from tests.docker.test_image_dependencies import IMAGE_PYTHON, read_pins
from tests.required import unavailable

ROOT = REPO
DOCKER = ROOT / "docker"
DOCKERFILES = sorted(DOCKER.glob("*.Dockerfile"))
SOURCES = [p for d in ("control", "projections", "backend") for p in (ROOT / d).rglob("*.py")]
# Variables read by libraries or by other images, not by this project's code.
FOREIGN_VARS = {"PYTHONUNBUFFERED", "OTEL_EXPORTER_OTLP_ENDPOINT", "POSTGRES_USER",
                "POSTGRES_PASSWORD", "POSTGRES_DB", "PATH", "VIRTUAL_ENV", "HOME",
                "PYTHONDONTWRITEBYTECODE"}
FIRST_FIXED_TRITON = (25, 7)  # fixes CVE-2025-23319, -23320, -23334 (August 2025)


def _compose() -> dict[str, Any]:
    return dict(yaml.safe_load((DOCKER / "compose.yaml").read_text()))


def _instructions(path: Path) -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", path.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            op, _, rest = line.partition(" ")
            out.append((op.upper(), rest.strip()))
    return out


def _args(path: Path) -> dict[str, str]:
    return dict(a.split("=", 1) for op, a in _instructions(path) if op == "ARG" and "=" in a)


def _runs(path: Path) -> list[str]:
    return [rest for op, rest in _instructions(path) if op == "RUN"]


def _shipped(path: Path, source: str) -> bool:
    """Whether the build context that ``path``'s .dockerignore leaves holds ``source`` (these
    files exclude everything, then re-include paths with ``!``)."""
    lines = [ln.strip() for ln in Path(f"{path}.dockerignore").read_text().splitlines()]
    assert "*" in lines, f"{path.name}.dockerignore no longer starts from nothing"
    kept = [ln[1:].rstrip("/") for ln in lines if ln.startswith("!")]
    return any(source.rstrip("/") == k or source.startswith(k + "/") for k in kept)


def _probes(test: list[str]) -> tuple[str, set[str]]:
    """(port, paths) a health check's command requests: from full URLs on 127.0.0.1, or from
    path literals joined to such a URL."""
    code = " ".join(test)
    port = re.search(r"http://127\.0\.0\.1:(\d+)", code)
    assert port is not None, code
    return port.group(1), set(re.findall(r"'(?:http://127\.0\.0\.1:\d+)?(/[^']*)'", code))


def _dockerfile_health(path: Path) -> tuple[dict[str, str], list[str]]:
    """The HEALTHCHECK instruction's options (``--interval=10s`` -> ``interval: 10s``) and its
    CMD as an argument list."""
    rest = next(r for op, r in _instructions(path) if op == "HEALTHCHECK")
    options, _, cmd = rest.partition(" CMD ")
    opts = dict(o[2:].replace("-", "_").split("=", 1) for o in options.split())
    return opts, ["CMD", *yaml.safe_load(cmd)]


def _seconds(duration: str) -> float:
    m = re.fullmatch(r"(\d+)s", duration)
    assert m is not None, f"durations here are written in whole seconds, not {duration!r}"
    return float(m.group(1))


def _read_in_code(var: str) -> bool:
    return any(var in p.read_text() for p in SOURCES)


def _cli_help(*verb: str) -> str:
    result = CliRunner().invoke(app, [*verb, "--help"], terminal_width=200)
    assert result.exit_code == 0, f"loraplane {' '.join(verb)} --help failed: {result.output}"
    return str(result.output)


def _check_loraplane_command(argv: list[str]) -> None:
    """``loraplane VERB [--option value]...``: the verb and every option exist."""
    assert argv[0] == "loraplane", argv
    # the verb is every word before the first option (`db roles --host a`: "db roles")
    first_option = next((i for i, a in enumerate(argv) if a.startswith("-")), len(argv))
    verb = argv[1:first_option]
    assert verb, argv
    text = _cli_help(*verb)
    for opt in (a for a in argv[1:] if a.startswith("--")):
        assert opt in text, f"option {opt} is not an option of loraplane {' '.join(verb)}"


def test_compose_validates_with_docker_compose() -> None:
    binary = shutil.which("docker-compose")
    if binary is None:
        unavailable("docker-compose", "not installed (Debian package docker-compose)")
    for profile in ([], ["--profile", "scale-out"]):
        r = subprocess.run([binary, "-f", str(DOCKER / "compose.yaml"), *profile, "config"],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr


def test_dockerfiles_copy_only_existing_paths_and_use_the_triton_base() -> None:
    assert {p.name for p in DOCKERFILES} == {"triton.Dockerfile", "control.Dockerfile"}
    for path in DOCKERFILES:
        steps = _instructions(path)
        for op, rest in steps:
            if op == "COPY":
                *sources, _dest = shlex.split(rest)
                for src in sources:
                    assert (ROOT / src).exists(), f"{path.name}: COPY source {src} is missing"
                    assert _shipped(path, src), f"{path.name}: .dockerignore drops {src}"
        if path.name == "triton.Dockerfile":
            args = dict(a.split("=", 1) for op, a in steps if op == "ARG" and "=" in a)
            frm = next(rest for op, rest in steps if op == "FROM")
            assert frm == "nvcr.io/nvidia/tritonserver:${TRITON_TAG}"
            assert re.fullmatch(r"\d\d\.\d\d-py3", args["TRITON_TAG"])
            year, month = map(int, args["TRITON_TAG"][:5].split("."))
            assert (year, month) >= FIRST_FIXED_TRITON, args["TRITON_TAG"]
        # the packages installed are the ones pyproject declares
        pyproject = (ROOT / "pyproject.toml").read_text()
        for op, rest in steps:
            for extra in re.findall(r'\.\[(\w+)\]', rest) if op == "RUN" else []:
                assert f"\n{extra} = [" in pyproject, f"{path.name}: unknown extra {extra}"


def test_commands_and_options_exist_in_the_cli() -> None:
    for path in DOCKERFILES:
        for op, rest in _instructions(path):
            if op == "CMD" and "loraplane" in rest:
                _check_loraplane_command(list(yaml.safe_load(rest)))
    compose = _compose()
    commands = [svc["command"] for svc in compose["services"].values() if "command" in svc]
    commands.append(compose["x-triton-host"]["command"])
    for cmd in commands:
        if cmd[0] == "loraplane":
            _check_loraplane_command(cmd)
    # commands the compose header tells operators to run
    for line in (DOCKER / "compose.yaml").read_text().splitlines():
        m = re.search(r"exec control (loraplane .*)$", line)
        if m:
            argv = shlex.split(m.group(1))
            _cli_help(*[a for a in argv[1:] if not a.startswith(("-", "/"))])


def test_environment_variables_are_read_by_the_project() -> None:
    compose = _compose()
    envs: dict[str, Any] = dict(compose["x-loraplane-env"])
    for svc in compose["services"].values():
        envs.update(svc.get("environment") or {})
    for path in DOCKERFILES:
        for op, rest in _instructions(path):
            if op == "ENV":
                envs.update(dict(kv.split("=", 1) for kv in shlex.split(rest)))
    for var in envs:
        if var in FOREIGN_VARS:
            continue
        assert var.startswith("LORAPLANE_"), var
        assert _read_in_code(var), f"{var} is set by docker/ but read nowhere in the code"
    assert envs["LORAPLANE_DB_URL"].startswith("postgresql+psycopg://")
    assert envs["LORAPLANE_LOG_FORMAT"] in ("json", "text")


def test_ports_volumes_and_health_checks_agree() -> None:
    compose = _compose()
    services = compose["services"]
    home = compose["x-loraplane-env"]["LORAPLANE_HOME"]
    model_repo = ROOT / "model_repository"
    for name, svc in services.items():
        if name in ("postgres", "haproxy"):  # images of their own (the door: its own test)
            continue
        if svc.get("restart") == "no":  # a one-shot job: what waits for it must say so
            waiting = [n for n, other in services.items()
                       if other.get("depends_on", {}).get(name, {}).get("condition")
                       == "service_completed_successfully"]
            assert waiting, f"{name} runs once but nothing waits for it to finish"
            continue
        merged = {**compose["x-triton-host"], **svc} if name.startswith("triton") else svc
        argv = [str(a) for a in merged["command"]]
        listened = {argv[i + 1] for i, a in enumerate(argv[:-1]) if a.endswith("-port")}
        for mapping in merged.get("ports", []):
            target = str(mapping).split(":")[-1]
            assert target in listened, f"{name} publishes {target} but listens on {listened}"
        if name.startswith("triton"):
            assert not merged.get("ports"), f"{name}: tenants reach Triton only through the door"
        port, paths = _probes(merged["healthcheck"]["test"])
        assert port in listened, f"{name}: health check on a port it does not serve"
        if name.startswith("triton"):
            assert paths == set(READY_PATHS), f"{name}: ready is {READY_PATHS}, not {paths}"
            for probe in paths - {"/v2/health/ready"}:
                assert (model_repo / probe.split("/")[3] / "config.pbtxt").exists(), probe
        else:
            assert paths == {"/healthz"}, paths
            assert '"/healthz"' in (ROOT / "control" / "gateway" / "server.py").read_text()
        mounts = {str(v).split(":")[1]: str(v) for v in merged["volumes"]}
        assert home in mounts and f"{home}/store" in mounts, f"{name}: home and store mounts"
        if name.startswith("triton"):
            assert mounts[f"{home}/store"].endswith(":ro"), "Triton hosts mount the store ro"
            assert merged["shm_size"]
            devices = merged["deploy"]["resources"]["reservations"]["devices"]
            assert devices and "gpu" in devices[0]["capabilities"]
            assert merged["environment"]["LORAPLANE_HOST_ID"] == name
    # every Triton host the control plane forwards to is a service listening on that port
    for url in services["control"]["environment"]["LORAPLANE_TRITON_URLS"].split(","):
        host, port = url.strip().split(":")
        assert host in services, url
        assert port == "8000"
    # Dockerfile defaults agree with the compose file
    for path in DOCKERFILES:
        steps = _instructions(path)
        env = dict(kv.split("=", 1) for op, r in steps if op == "ENV" for kv in shlex.split(r))
        assert env["LORAPLANE_HOME"] == home
        exposed = {p for op, r in steps if op == "EXPOSE" for p in r.split()}
        cmd = [str(a) for op, r in steps if op == "CMD" for a in yaml.safe_load(r)]
        assert exposed == {cmd[i + 1] for i, a in enumerate(cmd[:-1]) if a.endswith("-port")}


def test_the_front_door_is_the_only_published_way_to_triton() -> None:
    """The haproxy service publishes the tenant ports 8000 and 8001 (never Triton's metrics),
    runs the configuration control/ops/front_door.py renders (checked in as docker/haproxy.cfg,
    byte for byte), and forwards to every Triton host of the file on the ports they listen on;
    the hosts publish nothing and listen for the door on the compose network (as the images'
    unprivileged user: test_every_loraplane_container_is_least_privileged)."""
    compose = _compose()
    services = compose["services"]
    door = services["haproxy"]
    image, _, tag = door["image"].partition(":")
    assert image == "haproxy" and re.fullmatch(r"2\.6(\.\d+)?", tag), door["image"]
    local = find_haproxy()
    if local is not None:  # the series the tests run is the series the compose file runs
        version = subprocess.run([local, "-v"], capture_output=True, text=True, timeout=10)
        assert f"version {tag}" in version.stdout.splitlines()[0], version.stdout
    assert sorted(str(m) for m in door["ports"]) == ["8000:8000", "8001:8001"]
    cfg = "/usr/local/etc/haproxy/haproxy.cfg"  # where the official image reads it
    assert door["volumes"] == [f"./haproxy.cfg:{cfg}:ro"]
    assert (DOCKER / "haproxy.cfg").read_text() == compose_config(), (
        "docker/haproxy.cfg differs from its rendering: run "
        "`python -m control.ops.front_door > docker/haproxy.cfg`")
    hosts = sorted(n for n in services if n.startswith("triton"))
    argv = [str(a) for a in compose["x-triton-host"]["command"]]
    flag = {a: argv[i + 1] for i, a in enumerate(argv[:-1]) if a.startswith("--")}
    assert flag["--listen"] == "0.0.0.0" and flag["--front-door"] == "external"
    servers = re.findall(r"^    server (\S+) (\S+):(\d+)", compose_config(), re.MULTILINE)
    assert sorted({name for name, _h, _p in servers}) == hosts
    # Triton's two protocols and the host's OpenAI route, each where the host listens for it
    assert {(h, p) for _n, h, p in servers} == {(h, flag[f"--{k}-port"]) for h in hosts
                                                  for k in ("http", "grpc", "openai")}
    openai = compose_config().split("\nbackend host_openai", 1)[1].split("\nbackend ", 1)[0]
    assert {(h, p) for h, p in re.findall(r"server \S+ (\S+):(\d+)", openai)} == {
        (h, flag["--openai-port"]) for h in hosts}
    assert "use_backend host_openai" in compose_config()
    assert "triton-a" in door["depends_on"]
    for name in hosts:
        assert not services[name].get("ports"), name
    published = {str(m).split(":")[0] for svc in services.values() for m in svc.get("ports", [])}
    assert flag["--metrics-port"] not in published


def test_the_triton_image_refuses_releases_before_the_advisory_fixes() -> None:
    """The Dockerfile's own guard, run as the build runs it, for tags a build may be given."""
    guard = next(r for r in _runs(DOCKER / "triton.Dockerfile") if "TRITON_TAG" in r)
    for tag, allowed in (("24.10-py3", False), ("25.06-py3", False), ("23.12-py3-sdk", False),
                         ("25.07-py3", True), ("25.10-py3", True), ("26.04-py3", True)):
        r = subprocess.run(["sh", "-c", guard], env={"TRITON_TAG": tag},
                           capture_output=True, text=True, timeout=10)
        assert (r.returncode == 0) == allowed, (tag, r.stderr)
        if not allowed:
            assert "CVE-2025-23319" in r.stderr
    make = (ROOT / "Makefile").read_text()
    made = re.search(r"^TRITON_TAG \?= (\S+)$", make, re.MULTILINE)
    assert made is not None and made.group(1) == _args(DOCKER / "triton.Dockerfile")["TRITON_TAG"]


def test_both_images_install_the_pinned_requirements() -> None:
    """The Triton image installs docker/requirements.txt, which
    tests/docker/test_image_dependencies.py resolves for its Python, and nothing besides; the
    control image holds to the same pins."""
    triton = " ".join(_runs(DOCKER / "triton.Dockerfile"))
    assert "pip install --no-cache-dir -r docker/requirements.txt" in triton
    assert "--no-deps" in triton and "pip check" in triton
    assert "python3 -m venv /opt/venv" in triton  # PEP 668: never --break-system-packages
    assert "--break-system-packages" not in triton
    control = DOCKER / "control.Dockerfile"
    assert "-c docker/requirements.txt" in " ".join(_runs(control))
    args = _args(control)
    assert args["PYTHON_TAG"].startswith("{}.{}-".format(*IMAGE_PYTHON[:2]))
    assert args["TORCH_SPEC"].strip('"') == f"torch=={read_pins()['torch']}"


def test_triton_health_checks_wait_as_long_as_serve_and_agree_with_each_other() -> None:
    """The compose file's and the image's checks are one check: same command, same timings; the
    start period is how long ``Deployment.start`` (``serve``, ``triton-host``) waits for Triton,
    so neither gives up on a start the other still waits for; and every probe fits the check's
    timeout, else a slow but healthy answer would count as a failure."""
    compose = _compose()["x-triton-host"]["healthcheck"]
    options, command = _dockerfile_health(DOCKER / "triton.Dockerfile")
    assert command == compose["test"]
    for key in ("interval", "timeout", "retries", "start_period"):
        assert str(options[key]) == str(compose[key]), key
    assert _seconds(compose["start_period"]) == TritonProcess.READY_TIMEOUT_S
    default = inspect.signature(Deployment.start).parameters["ready_timeout_s"].default
    assert default == TritonProcess.READY_TIMEOUT_S
    code = " ".join(compose["test"])
    assert re.findall(r"timeout=([\d.]+)", code) == [f"{READY_PROBE_TIMEOUT_S:g}"]
    assert len(READY_PATHS) * READY_PROBE_TIMEOUT_S < _seconds(compose["timeout"])


STAND_IN_ID = "loraplane-stand-in"


class _StandIn(BaseHTTPRequestHandler):
    """Answers 200 on every path but those in ``failing`` (503, as Triton answers "not ready");
    ``/v2`` (server metadata) names the server ``STAND_IN_ID``."""

    failing: frozenset[str] = frozenset()

    def do_GET(self) -> None:
        body = json.dumps({"name": STAND_IN_ID}).encode() if self.path == "/v2" else b""
        self.send_response(503 if self.path in self.failing else 200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass


@contextlib.contextmanager
def _stand_in(failing: set[str]) -> Iterator[int]:
    handler = type("Handler", (_StandIn,), {"failing": frozenset(failing)})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("failing", [None, *READY_PATHS],
                         ids=["all-ready", *(p.split("/")[-2] for p in READY_PATHS)])
def test_health_check_and_ready_agree_when_any_part_is_not_ready(failing: str | None,
                                                                 tmp_path: Path) -> None:
    """The container's check, run as Docker runs it (with this Python, on the stand-in's port),
    and ``TritonProcess.ready()`` say ready exactly when the server and both models are."""
    argv = _compose()["x-triton-host"]["healthcheck"]["test"]
    assert argv[:2] == ["CMD", "python3"]
    with _stand_in({failing} if failing else set()) as port:
        code = [a.replace("127.0.0.1:8000", f"127.0.0.1:{port}") for a in argv[2:]]
        check = subprocess.run([sys.executable, *code], capture_output=True, text=True,
                               timeout=60)
        process = TritonProcess(work_dir=tmp_path, http_port=port, grpc_port=0, metrics_port=0)
        process.server_id = STAND_IN_ID
        assert (check.returncode == 0) == (failing is None), check.stderr
        assert process.ready() == (failing is None)
        # A server this process did not launch is never its own ready server (a second
        # `serve` on ports another server holds).
        process.server_id = "loraplane-someone-else"
        assert not process.ready()
        if failing:
            assert "503" in check.stderr


# -- least privilege (issue 23) -----------------------------------------------------------------

LORAPLANE_UID = "10001"


def _target(volume: str) -> str:
    """The container path of a short-syntax volume (its source may hold ${VAR:-x})."""
    parts = volume.rsplit(":", 2)
    return parts[-2] if parts[-1] in ("ro", "rw") else parts[-1]


def _loraplane_services() -> dict[str, dict[str, Any]]:
    """Every service that runs a loraplane image (Triton hosts, control plane, one-shots)."""
    return {name: svc for name, svc in _compose()["services"].items()
            if str(svc.get("image", "")).startswith("loraplane/")}


def test_images_run_as_a_dedicated_unprivileged_user_owning_the_home() -> None:
    for path in DOCKERFILES:
        steps = _instructions(path)
        users = [rest for op, rest in steps if op == "USER"]
        assert users and users[-1] == f"{LORAPLANE_UID}:{LORAPLANE_UID}", (
            f"{path.name} must end as the unprivileged user {LORAPLANE_UID}, not {users}")
        # The user exists with that uid, and owns the home that volumes are seeded from.
        made = " ".join(_runs(path))
        assert f"useradd --system --uid {LORAPLANE_UID}" in made, path.name
        assert f"chown -R {LORAPLANE_UID}:{LORAPLANE_UID} /var/lib/loraplane" in made, path.name
        env = " ".join(rest for op, rest in steps if op == "ENV")
        assert "HOME=/tmp" in env, f"{path.name}: HOME must be the writable tmpfs"
        # Not root: nothing may ask to switch users (only root can, triton_user.py).
        cmd = next(rest for op, rest in reversed(steps) if op == "CMD")
        assert "--triton-user" not in cmd, path.name


def test_every_loraplane_container_is_least_privileged() -> None:
    services = _loraplane_services()
    assert {"triton-a", "triton-b", "control", "migrate", "db-roles"} <= set(services)
    for name, svc in services.items():
        assert str(svc.get("user")) == f"{LORAPLANE_UID}:{LORAPLANE_UID}", name
        assert svc.get("read_only") is True, f"{name}: root filesystem must be read-only"
        assert svc.get("cap_drop") == ["ALL"], f"{name}: must drop every capability"
        assert not svc.get("cap_add"), f"{name}: adds capabilities back"
        assert "no-new-privileges:true" in svc.get("security_opt", []), name
        assert not svc.get("privileged"), name
        tmp = [t for t in svc.get("tmpfs", []) if t.split(":")[0] == "/tmp"]
        assert tmp and "size=" in tmp[0], f"{name}: /tmp must be a bounded tmpfs (HOME)"
        assert "--triton-user" not in svc.get("command", []), name
        # Whatever else is written lives on a named volume, never on the image.
        for volume in svc.get("volumes", []):
            assert _target(volume).startswith(("/var/lib/loraplane", "/models")), (name, volume)


def test_triton_hosts_write_only_their_home_tmp_and_shared_memory() -> None:
    services = _compose()["services"]
    for name in ("triton-a", "triton-b"):
        svc = services[name]
        assert svc["shm_size"], f"{name}: the Python backend needs a sized /dev/shm"
        writable = [v for v in svc["volumes"] if not v.endswith(":ro")]
        assert [_target(v) for v in writable] == ["/var/lib/loraplane"], writable
        store = [v for v in svc["volumes"] if _target(v) == "/var/lib/loraplane/store"]
        assert store and store[0].endswith(":ro"), f"{name}: the store is the control plane's"
    # The launcher writes under the home only: run/ (work_dir, logs) and keys/.
    source = inspect.getsource(Deployment)
    assert "work_dir=s.run_dir" in source
