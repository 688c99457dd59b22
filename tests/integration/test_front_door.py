"""A deployment with its front door, on the real tritonserver and HAProxy.

- Tenants' health, metadata, model configuration and inference calls (HTTP and gRPC, through
  tritonclient, streaming included) work through the door.
- The operator APIs are refused at the door even with the right operator token, which still
  opens them on Triton's own loopback port; a ticket header on the generate routes is refused.
- Started as root, tritonserver and every stub run as the Triton user, who cannot read the
  operator token or the signing keys, and the door runs as an unprivileged user of its own.

One deployment for the module (its own home under /tmp: pytest's temporary folders are root's
alone, and the Triton user must reach the home).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import struct
import subprocess
import tempfile
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from control.contracts.config import Settings
from control.contracts.wire import ENGINE_MODEL, MODEL, TICKET_HEADER, TICKET_PARAM
from control.ops import serve
from control.ops.clients import (
    free_port,
    generate,
    generate_endpoint,
    generate_stream_endpoint,
    request_ticket,
    stream_generate,
)
from control.ops.front_door import GENERATE_TICKET_HEADER_REFUSAL, NOT_A_TENANT_ROUTE, door_user
from control.ops.serve import Deployment, Ports
from control.ops.triton_access import TOKEN_FILE, command_line_exposure
from control.ops.triton_server import TritonUnavailable, find_triton
from control.ops.triton_user import (
    DEFAULT_TRITON_USER,
    ServiceUser,
    ensure_user,
    needed_paths,
    unreachable,
)
from tests.control.ops.door_support import haproxy_or_skip
from tests.integration.conftest import ACTOR, provision
from tests.required import unavailable

pytestmark = pytest.mark.triton

AS_ROOT = os.geteuid() == 0
MODULES: dict[str, Any] = {"http": httpclient, "grpc": grpcclient}


@dataclass
class DoorStack:
    settings: Settings
    deployment: Deployment
    api_keys: dict[str, str]
    digests: dict[str, str]
    user: ServiceUser | None

    def ticket(self, tenant: str, alias: str) -> str:
        status, body = request_ticket(self.deployment.gateway_url, self.api_keys[tenant], alias)
        assert status == 200, body
        return str(body["ticket"])

    def url(self, protocol: str) -> str:
        d = self.deployment
        return d.tenant_http_url if protocol == "http" else d.tenant_grpc_url


# --- letting the Triton user cross folders it may not enter (this machine's Python is under
# /root, mode 0700): what an operator does with `setfacl -m u:USER:x FOLDER`, undone afterwards

ACL_XATTR = "system.posix_acl_access"
_UNDEFINED_ID = 0xFFFFFFFF


def _acl_adding_traverse(mode: int, uid: int) -> bytes:
    """A POSIX access ACL (the kernel's xattr form: version 2, then sorted (tag, perm, id)
    entries) equal to ``mode`` plus execute for ``uid``."""
    entries = [(0x01, (mode >> 6) & 7, _UNDEFINED_ID),  # owner
               (0x02, 1, uid),  # the named user: execute only
               (0x04, (mode >> 3) & 7, _UNDEFINED_ID),  # owning group
               (0x10, ((mode >> 3) & 7) | 1, _UNDEFINED_ID),  # mask
               (0x20, mode & 7, _UNDEFINED_ID)]  # others
    return struct.pack("<I", 2) + b"".join(struct.pack("<HHI", *e) for e in entries)


def _can_enter(user: ServiceUser, folder: Path) -> bool:
    return subprocess.run(["/bin/sh", "-c", '[ -x "$1" ]', "sh", str(folder)], user=user.uid,
                          group=user.gid, extra_groups=[], cwd="/", timeout=10).returncode == 0


@contextlib.contextmanager
def _traversable_for(user: ServiceUser, paths: list[Path], home: Path) -> Iterator[None]:
    """Folders on the way to ``paths`` that ``user`` cannot enter, outside ``home`` (``serve``
    grants what it needs there itself), get an ACL entry letting it through."""
    granted: list[tuple[Path, int]] = []
    try:
        for path in paths:
            for folder in reversed(path.parents):
                if folder == home or home in folder.parents or _can_enter(user, folder):
                    continue
                try:
                    os.getxattr(folder, ACL_XATTR)
                    pytest.skip(f"{folder} already has an ACL; give {user.name} access to it")
                except OSError:
                    pass
                mode = os.stat(folder).st_mode & 0o7777
                os.setxattr(folder, ACL_XATTR, _acl_adding_traverse(mode, user.uid))
                granted.append((folder, mode))
        yield
    finally:
        for folder, mode in reversed(granted):
            os.removexattr(folder, ACL_XATTR)
            os.chmod(folder, mode)


@pytest.fixture(scope="module")
def door_stack(kit_dir: Path) -> Iterator[DoorStack]:
    haproxy_or_skip()
    home = Path(tempfile.mkdtemp(prefix="loraplane-door-"))
    try:
        install = find_triton(home / "run")
    except TritonUnavailable as e:
        shutil.rmtree(home)
        unavailable("the real tritonserver", str(e))
    settings = Settings(home=home, db_url=f"sqlite:///{home / 'loraplane.db'}")
    settings.ensure_dirs()
    _reg, _kit, keys, digests = provision(settings, kit_dir)
    user = ensure_user(DEFAULT_TRITON_USER) if AS_ROOT else None
    paths = [] if user is None else list(needed_paths(
        install.binary, install.backend_dir, Path(__file__).parents[2] / "model_repository",
        Path(__file__).parents[2], settings))
    dep = Deployment(settings, Ports.free(),
                     actor=ACTOR, front_door="haproxy",
                     triton_user=user.name if user is not None else None)
    try:
        with _traversable_for(user, paths, home) if user is not None else contextlib.nullcontext():
            try:
                dep.start()
                yield DoorStack(settings, dep, keys, digests, user)
            finally:
                dep.stop()
    finally:
        shutil.rmtree(home, ignore_errors=True)


def _status(pid: int) -> dict[str, str]:
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return dict(line.split(":\t", 1) for line in lines if ":\t" in line)


def _process_group(pgid: int) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                # the fields after the command name, which is in parentheses
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                if int(fields[2]) == pgid:
                    pids.append(int(entry.name))
    return pids


@pytest.mark.skipif(not AS_ROOT, reason="only root runs Triton as another user")
def test_triton_and_every_stub_run_as_the_triton_user(door_stack: DoorStack) -> None:
    user, dep = door_stack.user, door_stack.deployment
    assert user is not None and dep.triton is not None and dep.triton.proc is not None
    assert dep.door is not None and dep.door.proc is not None
    group = _process_group(dep.triton.proc.pid)
    assert dep.triton.proc.pid in group and len(group) >= 3  # the server and its two models' stubs
    for pid in group:
        uids = _status(pid)["Uid"].split()  # real, effective, saved, filesystem
        assert uids == [str(user.uid)] * 4, (pid, uids)
        assert _status(pid)["Groups"].split() in ([], [str(user.gid)]), pid
    # the door drops to a user of its own, neither root nor the Triton user
    door_uid, _gid = door_user()
    assert _status(dep.door.proc.pid)["Uid"].split() == [str(door_uid)] * 4
    assert door_uid not in (0, user.uid)
    # what only root may read stays root's: the operator token, the signing keys
    keys = door_stack.settings.keys_dir
    secret = {keys / TOKEN_FILE: "r", keys / "private": "x"}
    assert len(unreachable(user, secret)) == 2
    assert unreachable(user, {keys / "public": "rx"}) == []
    # and serve said so once when other local users can read Triton's command line
    assert ("token-exposed" in serve._WARNED) == (command_line_exposure() is not None)


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_tenants_reach_health_metadata_config_and_inference_through_the_door(
        door_stack: DoorStack, protocol: str) -> None:
    dep = door_stack.deployment
    assert dep.triton is not None
    url = door_stack.url(protocol)
    assert url != (dep.triton.http_url if protocol == "http" else dep.triton.grpc_url)
    c = MODULES[protocol].InferenceServerClient(url)
    try:
        assert c.is_server_live() and c.is_server_ready()
        assert c.is_model_ready(MODEL) and c.is_model_ready(ENGINE_MODEL)
        assert c.get_server_metadata()
        assert c.get_model_metadata(MODEL)
        assert c.get_model_config(MODEL)
    finally:
        c.close()
    alpha = door_stack.digests["alpha"]
    ticket = door_stack.ticket("acme", "acme-alpha")
    assert generate(url, "Hello", ticket, protocol=protocol, max_tokens=4).adapter_digest == alpha
    # the ticket as a header: on infer, Triton forwards it to the model
    assert generate(url, "Hello", ticket, protocol=protocol, max_tokens=4,
                    header=True).adapter_digest == alpha
    if protocol == "grpc":
        streamed = stream_generate(url, "Hello", ticket, max_tokens=4)  # ModelStreamInfer
        assert streamed.adapter_digest == alpha and streamed.pieces
    else:
        assert generate_endpoint(url, "Hello", ticket, max_tokens=4)["adapter_digest"] == alpha
        events = generate_stream_endpoint(url, "Hello", ticket, max_tokens=4)
        assert events and events[-1]["adapter_digest"] == alpha


def _operator_calls(c: Any) -> dict[str, Callable[[dict[str, str] | None], object]]:
    return {
        "list the repository": lambda h: c.get_model_repository_index(headers=h),
        "load a model": lambda h: c.load_model(MODEL, headers=h),
        "unload a model": lambda h: c.unload_model(ENGINE_MODEL, headers=h),
        "register shared memory": lambda h: c.register_system_shared_memory(
            "tenant-probe", "/loraplane-tenant-probe", 64, headers=h),
        "read shared memory status": lambda h: c.get_system_shared_memory_status(headers=h),
        "read trace settings": lambda h: c.get_trace_settings(headers=h),
        "change log settings": lambda h: c.update_log_settings({"log_verbose_level": 1},
                                                               headers=h),
        "read statistics": lambda h: c.get_inference_statistics(MODEL, headers=h),
    }


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_operator_apis_are_refused_at_the_door_even_with_the_token(
        door_stack: DoorStack, protocol: str) -> None:
    triton = door_stack.deployment.triton
    assert triton is not None
    token = triton.operator_headers(protocol)
    door = MODULES[protocol].InferenceServerClient(door_stack.url(protocol))
    inside = MODULES[protocol].InferenceServerClient(
        triton.http_url if protocol == "http" else triton.grpc_url)
    try:
        for what, call in _operator_calls(door).items():
            for headers in (None, token):
                with pytest.raises(InferenceServerException) as refused:
                    call(headers)
                assert refused.value.message() == NOT_A_TENANT_ROUTE, what
                if protocol == "grpc":
                    assert refused.value.status() == "StatusCode.PERMISSION_DENIED", what
        # the token is the right one: on Triton's own loopback port it opens the same API
        assert inside.get_model_repository_index(headers=token)
    finally:
        door.close()
        inside.close()
    if protocol == "http":  # nor does the door serve Triton's metrics
        with pytest.raises(urllib.error.HTTPError) as metrics:
            urllib.request.urlopen(f"http://{door_stack.url('http')}/metrics", timeout=10)
        assert metrics.value.code == 403


def test_a_ticket_header_on_generate_is_refused_at_the_door(door_stack: DoorStack) -> None:
    ticket = door_stack.ticket("acme", "acme-alpha")
    body = json.dumps({"text_input": "Hello", "max_tokens": 2,
                       "parameters": {TICKET_PARAM: ticket}}).encode()
    for path in (f"/v2/models/{MODEL}/generate", f"/v2/models/{ENGINE_MODEL}/generate_stream"):
        req = urllib.request.Request(f"http://{door_stack.url('http')}{path}", data=body,
                                     headers={"Content-Type": "application/json",
                                              TICKET_HEADER: ticket}, method="POST")
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(req, timeout=30)
        assert refused.value.code == 400
        assert json.loads(refused.value.read()) == {"error": GENERATE_TICKET_HEADER_REFUSAL}


def test_a_gateway_elsewhere_serves_openai_routes_through_the_door(door_stack: DoorStack) -> None:
    """A control plane on another machine reaches this host only through its door, as tenants
    do: the OpenAI routes read the model configuration and generate (streamed or not) there."""
    import openai  # the official client: only this test speaks OpenAI

    gateway = Deployment(door_stack.settings, Ports(gateway=free_port()), role="control",
                         actor=ACTOR, triton_urls=[door_stack.deployment.tenant_http_url],
                         rollout_controller=False)
    gateway.start()
    try:
        client = openai.OpenAI(base_url=f"{gateway.gateway_url}/v1",
                               api_key=door_stack.api_keys["acme"])
        out = client.completions.create(model="acme-alpha", prompt="Hello", max_tokens=4)
        assert out.choices[0].text
        pieces = [c.choices[0].text for c in client.completions.create(
            model="acme-alpha", prompt="Hello", max_tokens=4, stream=True)]
        assert "".join(pieces) == out.choices[0].text
    finally:
        gateway.stop()
    door = door_stack.deployment.door
    assert door is not None
    logged = door.log_path.read_text()  # HAProxy's access lines: these came through the door
    assert "/config HTTP/1.1" in logged and "/generate_stream HTTP/1.1" in logged
