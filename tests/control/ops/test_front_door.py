"""The front door on real HAProxy, in front of a stand-in Triton that records what reaches it.

Which routes pass and which are refused, that operator headers never pass, that a ticket header
on the generate routes is refused with the fixed message, and the body cap. The same door in front
of the real tritonserver: tests/integration/test_front_door.py.
"""

from __future__ import annotations

import http.client
import json
import socket
import subprocess
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from control.contracts.wire import TICKET_HEADER
from control.ops.front_door import (
    GENERATE_TICKET_HEADER_REFUSAL,
    LENGTH_REQUIRED,
    MAX_BODY_BYTES,
    NOT_A_TENANT_ROUTE,
    DoorConfig,
    FrontDoor,
    Upstream,
    compose_config,
    render,
)
from control.ops.triton_access import GRPC_HEADER_PREFIX, OPERATOR_HEADER
from control.ops.triton_server import free_ports
from tests.control.ops.door_support import haproxy_or_skip

TOKEN = "t" * 43
OPERATOR = {OPERATOR_HEADER: TOKEN, GRPC_HEADER_PREFIX + OPERATOR_HEADER: TOKEN}
MODEL = "lora_llm"

# (method, path) a tenant may use, each forwarded as it is
TENANT_ROUTES = [
    ("GET", "/v2/health/live"), ("GET", "/v2/health/ready"), ("GET", "/v2"),
    ("GET", f"/v2/models/{MODEL}"), ("GET", f"/v2/models/{MODEL}/versions/1"),
    ("GET", f"/v2/models/{MODEL}/ready"), ("GET", f"/v2/models/{MODEL}/versions/1/ready"),
    ("GET", f"/v2/models/{MODEL}/config"), ("GET", f"/v2/models/{MODEL}/versions/2/config"),
    ("POST", f"/v2/models/{MODEL}/infer"), ("POST", f"/v2/models/{MODEL}/versions/1/infer"),
    ("POST", f"/v2/models/{MODEL}/generate"), ("POST", f"/v2/models/{MODEL}_stream/generate"),
    ("POST", f"/v2/models/{MODEL}_stream/generate_stream"),
    ("POST", f"/v2/models/{MODEL}/versions/1/generate_stream"),
]
# Triton's other APIs (tritonserver 2.51's HTTP routes), and paths that only look like tenants'
OPERATOR_ROUTES = [
    ("POST", "/v2/repository/index"), ("POST", f"/v2/repository/models/{MODEL}/load"),
    ("POST", f"/v2/repository/models/{MODEL}/unload"),
    ("GET", "/v2/systemsharedmemory/status"),
    ("POST", "/v2/systemsharedmemory/region/probe/register"),
    ("POST", "/v2/systemsharedmemory/unregister"), ("GET", "/v2/cudasharedmemory/status"),
    ("POST", "/v2/cudasharedmemory/region/probe/register"),
    ("GET", "/v2/models/stats"), ("GET", f"/v2/models/{MODEL}/stats"),
    ("GET", f"/v2/models/{MODEL}/versions/1/stats"),
    ("GET", "/v2/trace/setting"), ("POST", "/v2/trace/setting"),
    ("GET", f"/v2/models/{MODEL}/trace/setting"), ("POST", f"/v2/models/{MODEL}/trace/setting"),
    ("GET", "/v2/logging"), ("POST", "/v2/logging"), ("GET", "/metrics"), ("GET", "/"),
    ("GET", "/v2/"), ("GET", "/v2/health"), ("GET", "/v2/models"),
    ("POST", "/invocations"), ("GET", "/ping"),  # SageMaker's routes
    ("GET", "/v2/models/../repository/index"), ("POST", "/v2/models/%2e%2e/repository/index"),
    ("GET", f"/v2/models/{MODEL}/versions/x/config"), ("GET", f"/v2/models/{MODEL}/extra"),
    ("GET", f"/v2/models/{MODEL}/infer"), ("POST", f"/v2/models/{MODEL}/ready"),
    ("PUT", f"/v2/models/{MODEL}/infer"), ("DELETE", f"/v2/models/{MODEL}"),
    ("HEAD", "/v2/health/ready"), ("OPTIONS", "/v2"),
]


class _Recorder(BaseHTTPRequestHandler):
    """Answers 200 with what it received; remembers every request."""

    seen: list[tuple[str, str, dict[str, str]]]
    protocol_version = "HTTP/1.1"

    def _answer(self) -> None:
        length = int(self.headers.get("content-length") or 0)
        self.rfile.read(length)
        headers = {k.lower(): v for k, v in self.headers.items()}
        self.seen.append((self.command, self.path, headers))
        body = json.dumps({"path": self.path}).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = do_PUT = do_DELETE = do_OPTIONS = _answer

    def do_HEAD(self) -> None:
        self.seen.append((self.command, self.path, {}))
        self.send_response(200)
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        pass


class _Quiet(ThreadingHTTPServer):
    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a client the door cut off mid-body is expected here


class Door:
    def __init__(self, door: FrontDoor, seen: list[tuple[str, str, dict[str, str]]]) -> None:
        self.door, self.seen = door, seen

    def request(self, method: str, path: str, body: bytes | None = None,
                headers: dict[str, str] | None = None) -> tuple[int, dict[str, Any]]:
        host, port = self.door.http_url.rsplit(":", 1)
        conn = http.client.HTTPConnection(host, int(port), timeout=30)
        try:
            conn.request(method, path, body=body, headers=headers or {})
            r = conn.getresponse()
            raw = r.read()
            return r.status, json.loads(raw) if raw else {}
        finally:
            conn.close()


@pytest.fixture(scope="module")
def door(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Door]:
    haproxy_or_skip()
    seen: list[tuple[str, str, dict[str, str]]] = []
    handler = type("Handler", (_Recorder,), {"seen": seen})
    server = _Quiet(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    # gRPC goes to a port nothing listens on: a forwarded call fails UNAVAILABLE, a refused one
    # PERMISSION_DENIED at the door.
    http, grpc, nothing = free_ports(3, avoid=[server.server_address[1]])
    config = DoorConfig("127.0.0.1", http, grpc,
                        (Upstream("127.0.0.1", server.server_address[1], nothing),))
    front = FrontDoor(tmp_path_factory.mktemp("door"), config)
    front.start()
    try:
        front.wait_ready()
        yield Door(front, seen)
    finally:
        front.stop()
        server.shutdown()
        server.server_close()
    assert front.proc is not None and front.proc.poll() is not None


def _body(method: str) -> bytes | None:
    return b"{}" if method == "POST" else None


@pytest.mark.parametrize(("method", "path"), TENANT_ROUTES)
def test_tenant_routes_pass(door: Door, method: str, path: str) -> None:
    door.seen.clear()
    status, body = door.request(method, path, _body(method))
    assert (status, body) == (200, {"path": path})
    assert [(m, p) for m, p, _h in door.seen] == [(method, path)]


@pytest.mark.parametrize(("method", "path"), OPERATOR_ROUTES)
def test_every_other_route_is_refused_at_the_door(door: Door, method: str, path: str) -> None:
    door.seen.clear()
    for headers in ({}, OPERATOR):  # the operator's own token changes nothing here
        status, body = door.request(method, path, _body(method), headers)
        assert status == 403, (method, path)
        if method != "HEAD":
            assert body == {"error": NOT_A_TENANT_ROUTE}
    assert door.seen == []


def test_operator_headers_never_pass_and_the_ticket_header_does(door: Door) -> None:
    door.seen.clear()
    status, _ = door.request("POST", f"/v2/models/{MODEL}/infer", b"{}",
                             {**OPERATOR, TICKET_HEADER: "v4.public.x"})
    assert status == 200
    status, _ = door.request("GET", "/v2/health/ready", None,
                             {OPERATOR_HEADER.upper(): TOKEN, "LoraPlane-Operator": TOKEN})
    assert status == 200
    infer, ready = door.seen
    assert not set(OPERATOR) & set(infer[2]) and not set(OPERATOR) & set(ready[2])
    assert infer[2][TICKET_HEADER] == "v4.public.x"


@pytest.mark.parametrize("path", [f"/v2/models/{MODEL}/generate",
                                  f"/v2/models/{MODEL}_stream/generate_stream",
                                  f"/v2/models/{MODEL}/versions/1/generate"])
def test_a_ticket_header_on_generate_is_refused_with_the_fixed_message(door: Door,
                                                                      path: str) -> None:
    door.seen.clear()
    body = json.dumps({"text_input": "hi", "parameters": {"lora_ticket": "v4.public.x"}})
    status, answer = door.request("POST", path, body.encode(), {TICKET_HEADER: "v4.public.x"})
    assert (status, answer) == (400, {"error": GENERATE_TICKET_HEADER_REFUSAL})
    assert door.seen == []
    assert door.request("POST", path, body.encode())[0] == 200  # the parameter alone passes
    assert GENERATE_TICKET_HEADER_REFUSAL == (
        "request refused: send the routing ticket as the lora_ticket parameter on generate "
        "routes (Triton does not forward headers there)")


def test_bodies_over_the_cap_or_without_a_length_are_refused(door: Door) -> None:
    path = f"/v2/models/{MODEL}/infer"
    door.seen.clear()
    assert door.request("POST", path, b"x" * MAX_BODY_BYTES)[0] == 200
    # refused on the length alone, before any of the body is read
    host, port = door.door.http_url.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.putrequest("POST", path)
    conn.putheader("Content-Length", str(MAX_BODY_BYTES + 1))
    conn.endheaders()
    r = conn.getresponse()
    assert r.status == 413 and "larger than" in json.loads(r.read())["error"]
    conn.close()
    # a chunked body, sent whole at once (the door answers before reading it)
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(f"POST {path} HTTP/1.1\r\nHost: door\r\nTransfer-Encoding: chunked\r\n"
                     "Connection: close\r\n\r\n2\r\n{}\r\n0\r\n\r\n".encode())
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    head, _, payload = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 411 ")
    assert json.loads(payload) == {"error": LENGTH_REQUIRED}
    assert len(door.seen) == 1


def _grpc_calls(c: Any) -> dict[str, Callable[[dict[str, str] | None], object]]:
    return {
        "repository index": lambda h: c.get_model_repository_index(headers=h),
        "load": lambda h: c.load_model(MODEL, headers=h),
        "unload": lambda h: c.unload_model(MODEL, headers=h),
        "shared memory": lambda h: c.register_system_shared_memory("p", "/p", 64, headers=h),
        "shared memory status": lambda h: c.get_system_shared_memory_status(headers=h),
        "CUDA shared memory": lambda h: c.get_cuda_shared_memory_status(headers=h),
        "statistics": lambda h: c.get_inference_statistics(MODEL, headers=h),
        "trace": lambda h: c.get_trace_settings(headers=h),
        "logging": lambda h: c.update_log_settings({"log_verbose_level": 1}, headers=h),
    }


def test_grpc_operator_methods_are_refused_as_permission_denied(door: Door) -> None:
    c = grpcclient.InferenceServerClient(door.door.grpc_url)
    try:
        for what, call in _grpc_calls(c).items():
            for headers in (None, OPERATOR):
                with pytest.raises(InferenceServerException) as refused:
                    call(headers)
                assert refused.value.status() == "StatusCode.PERMISSION_DENIED", what
                assert refused.value.message() == NOT_A_TENANT_ROUTE, what
        # a tenant method is forwarded: here to nothing, so unavailable, not refused
        with pytest.raises(InferenceServerException) as forwarded:
            c.is_server_live()
        assert forwarded.value.status() == "StatusCode.UNAVAILABLE"
    finally:
        c.close()


def test_rendered_configurations_pass_haproxys_own_check(tmp_path: Path) -> None:
    binary = haproxy_or_skip()
    local = DoorConfig("127.0.0.1", 8000, 8001, (Upstream("127.0.0.1", 18000, 18001),),
                       uid=65534, gid=65534)
    openai = DoorConfig("127.0.0.1", 8000, 8001, (Upstream("127.0.0.1", 18000, 18001),),
                        openai_port=18002)
    for name, text in (("local.cfg", render(local)), ("compose.cfg", compose_config()),
                       ("openai.cfg", render(openai))):
        path = tmp_path / name
        path.write_text(text)
        checked = subprocess.run([binary, "-c", "-f", str(path)], capture_output=True,
                                 text=True, timeout=30)
        assert checked.returncode == 0, checked.stderr
        # a warning means a rule does less than it says; the compose file's only ones are its
        # hosts' names, which Docker's DNS resolves and this machine does not
        warnings = [line for line in checked.stderr.splitlines() if "[WARNING]" in line]
        if name == "compose.cfg":
            warnings = [w for w in warnings if "could not resolve address" not in w]
        assert warnings == [], name


def test_the_openai_paths_go_to_the_hosts_openai_route(tmp_path: Path) -> None:
    """Issue 25: with the host's OpenAI route behind it, the door sends POST /v1/completions and
    /v1/chat/completions there (not to Triton), and still refuses every other /v1/ path, other
    methods, and what it refused before."""
    haproxy_or_skip()
    servers, seen = [], []
    for _ in range(2):  # a stand-in Triton, a stand-in OpenAI route
        log: list[tuple[str, str, dict[str, str]]] = []
        server = _Quiet(("127.0.0.1", 0), type("Handler", (_Recorder,), {"seen": log}))
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        seen.append(log)
    triton, openai = (s.server_address[1] for s in servers)
    http, grpc, nothing = free_ports(3, avoid=[triton, openai])
    front = FrontDoor(tmp_path, DoorConfig("127.0.0.1", http, grpc,
                                           (Upstream("127.0.0.1", triton, nothing),),
                                           openai_port=openai))
    front.start()
    try:
        front.wait_ready()
        door = Door(front, seen[0])
        for path in ("/v1/completions", "/v1/chat/completions"):
            assert door.request("POST", path, b"{}") == (200, {"path": path})
        assert [p for _, p, _ in seen[1]] == ["/v1/completions", "/v1/chat/completions"]
        assert door.request("POST", f"/v2/models/{MODEL}/generate", b"{}")[0] == 200
        assert [p for _, p, _ in seen[0]] == [f"/v2/models/{MODEL}/generate"]
        for method, path in (("GET", "/v1/completions"), ("GET", "/v1/models"),
                             ("POST", "/v1/embeddings"), ("POST", "/v1/completions/x"),
                             ("POST", "/v2/repository/index"), ("GET", "/metrics")):
            status, body = door.request(method, path, _body(method))
            assert (status, body) == (403, {"error": NOT_A_TENANT_ROUTE}), (method, path)
        assert len(seen[0]) == 1 and len(seen[1]) == 2
    finally:
        front.stop()
        for server in servers:
            server.shutdown()
            server.server_close()
