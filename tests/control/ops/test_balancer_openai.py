"""The balancer's OpenAI paths on real HAProxy, in front of stand-in hosts that say who they are.

Each stand-in host is two HTTP servers on loopback: its "Triton" (every path, health checks
included) and its "OpenAI route". Shows that ``POST /v1/completions`` and
``/v1/chat/completions`` reach the OpenAI route of the host the Triton routes reach for the same
affinity value (the body's ``model`` against the ``x-loraplane-affinity`` header), that the body
is what places, that a dead host's values move and the others' stay, that a pool header picks the
pool's hosts, and that the door's refusals hold on these paths. The rendering is in
tests/control/ops/test_balancer.py; the single host's door in test_front_door.py.
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from control.contracts.placement import AFFINITY_HEADER, POOL_HEADER, affinity_of
from control.ops.balancer import start_balancer
from control.ops.front_door import NOT_A_TENANT_ROUTE, FrontDoor, Upstream
from control.ops.triton_access import OPERATOR_HEADER
from control.ops.triton_server import free_ports
from tests.control.ops.door_support import haproxy_or_skip

INFER = "/v2/models/lora_llm/infer"
CHECK_MS = 100  # a stopped stand-in is out within a few checks
VALUES = [affinity_of(f"alias-{i}") for i in range(24)]


class _Host(BaseHTTPRequestHandler):
    """Answers every request with the host's name and which of its servers answered."""

    host = ""
    route = ""
    seen: list[dict[str, str]]
    protocol_version = "HTTP/1.1"

    def _answer(self) -> None:
        self.rfile.read(int(self.headers.get("content-length") or 0))
        self.seen.append({k.lower(): v for k, v in self.headers.items()})
        body = json.dumps({"host": self.host, "route": self.route, "path": self.path}).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = _answer

    def log_message(self, format: str, *args: Any) -> None:
        pass


class _Quiet(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # HAProxy's health checks close without a request


@dataclass
class StandIn:
    name: str
    servers: list[_Quiet]  # Triton HTTP, OpenAI route
    seen: list[dict[str, str]]  # the headers of each request its OpenAI route answered

    def upstream(self, pool: str, grpc: int) -> Upstream:
        triton, openai = (s.server_address[1] for s in self.servers)
        return Upstream("127.0.0.1", triton, grpc, pool=pool, name=self.name,
                        openai_port=openai)

    def stop(self) -> None:
        for s in self.servers:
            s.shutdown()
            s.server_close()


def _stand_in(name: str) -> StandIn:
    seen: list[dict[str, str]] = []
    servers = []
    for route in ("triton", "openai"):
        handler = type("Handler", (_Host,), {"host": name, "route": route,
                                              "seen": seen if route == "openai" else []})
        server = _Quiet(("127.0.0.1", 0), handler)
        # a short poll: shutdown() waits for one, eight times per test
        threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
        servers.append(server)
    return StandIn(name, servers, seen)


@dataclass
class Balanced:
    door: FrontDoor
    hosts: dict[str, StandIn]

    def post(self, path: str, body: bytes, headers: dict[str, str] | None = None,
             ) -> tuple[int, dict[str, Any]]:
        host, port = self.door.http_url.rsplit(":", 1)
        conn = http.client.HTTPConnection(host, int(port), timeout=30)
        try:
            conn.request("POST", path, body=body, headers=headers or {})
            r = conn.getresponse()
            raw = r.read()
            return r.status, json.loads(raw) if raw else {}
        finally:
            conn.close()

    def triton_host(self, value: str, pool: str | None = None) -> str:
        status, answer = self.post(INFER, b"{}", {AFFINITY_HEADER: value, **_pool(pool)})
        assert status == 200 and answer["route"] == "triton", (status, answer)
        return str(answer["host"])

    def openai_host(self, path: str, model: str, headers: dict[str, str] | None = None,
                    pad: int = 0) -> str:
        # the fields in the order OpenAI's Python client sends a chat: messages before model
        body = {"messages": [{"role": "user", "content": "x" * pad}], "model": model}
        status, answer = self.post(path, json.dumps(body).encode(),
                                   {"content-type": "application/json", **(headers or {})})
        assert status == 200 and answer["route"] == "openai", (status, answer)
        assert answer["path"] == path
        return str(answer["host"])


def _pool(pool: str | None) -> dict[str, str]:
    return {POOL_HEADER: pool} if pool else {}


@pytest.fixture
def balanced(tmp_path: Path) -> Iterator[Balanced]:
    haproxy_or_skip()
    hosts = {n: _stand_in(n) for n in ("shared-0", "shared-1", "shared-2", "gold-0")}
    taken = [s.server_address[1] for h in hosts.values() for s in h.servers]
    http, grpc, nothing = free_ports(3, avoid=taken)  # gRPC: not used here
    upstreams = [h.upstream("gold" if n.startswith("gold") else "shared", nothing)
                 for n, h in hosts.items()]
    door = start_balancer(tmp_path, upstreams, http_port=http, grpc_port=grpc,
                          check_ms=CHECK_MS)
    try:
        yield Balanced(door, hosts)
    finally:
        door.stop()
        for h in hosts.values():
            h.stop()


def test_one_value_lands_on_one_host_on_every_route(balanced: Balanced) -> None:
    placed = {}
    for value in VALUES:
        triton = balanced.triton_host(value)
        for path in ("/v1/completions", "/v1/chat/completions"):
            assert [balanced.openai_host(path, value) for _ in range(2)] == [triton, triton]
        placed[value] = triton
    # the model places, not chance: different values spread over the pool's three hosts
    assert set(placed.values()) == {"shared-0", "shared-1", "shared-2"}, placed


def test_the_body_places_not_the_header(balanced: Balanced) -> None:
    placed = {v: balanced.triton_host(v) for v in VALUES[:8]}
    a, b = next((a, b) for a in placed for b in placed if placed[a] != placed[b])
    # an affinity header naming another host's value changes nothing: the model places
    assert balanced.openai_host("/v1/completions", a, {AFFINITY_HEADER: b}) == placed[a]
    # a model past HAProxy's buffer (a long chat before it) is not read: the header places
    for value in (a, b):
        assert balanced.openai_host("/v1/chat/completions", "x", {AFFINITY_HEADER: value},
                                    pad=64 * 1024) == placed[value]


def test_a_dead_hosts_values_move_and_the_others_stay(balanced: Balanced) -> None:
    before = {v: balanced.triton_host(v) for v in VALUES}
    dead = before[VALUES[0]]
    balanced.hosts[dead].stop()
    time.sleep(10 * CHECK_MS / 1000)  # marked down at its first failed check
    after = {v: balanced.openai_host("/v1/completions", v) for v in VALUES}
    for v in VALUES:
        assert after[v] != dead
        if before[v] != dead:
            assert after[v] == before[v], v  # consistent hashing: only the dead host's move
        assert balanced.triton_host(v) == after[v]  # both routes still agree


def test_the_pool_header_picks_the_pools_hosts(balanced: Balanced) -> None:
    for value in VALUES[:6]:
        status, answer = balanced.post("/v1/completions", json.dumps({"model": value}).encode(),
                                       {POOL_HEADER: "gold"})
        assert (status, answer["host"], answer["route"]) == (200, "gold-0", "openai")
        assert balanced.triton_host(value, "gold") == "gold-0"
        assert balanced.openai_host("/v1/completions", value) != "gold-0"  # no header: shared


def test_the_doors_refusals_hold_on_the_openai_paths(balanced: Balanced) -> None:
    host, port = balanced.door.http_url.rsplit(":", 1)
    for method, path in (("GET", "/v1/completions"), ("GET", "/v1/models"),
                         ("POST", "/v1/embeddings"), ("POST", "/v1/completions/x"),
                         ("POST", "/v1/models/x/load"), ("GET", "/metrics")):
        conn = http.client.HTTPConnection(host, int(port), timeout=30)
        conn.request(method, path, body=b"{}" if method == "POST" else None)
        r = conn.getresponse()
        assert (r.status, json.loads(r.read())) == (403, {"error": NOT_A_TENANT_ROUTE}), path
        conn.close()
    # too large by its length alone, and a body without one
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.putrequest("POST", "/v1/chat/completions")
    conn.putheader("Content-Length", str(8 * 1024 * 1024 + 1))
    conn.endheaders()
    assert conn.getresponse().status == 413
    conn.close()
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        # sent whole at once: the door answers before reading the body, then closes
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: door\r\nTransfer-Encoding: "
                     b"chunked\r\nConnection: close\r\n\r\n2\r\n{}\r\n0\r\n\r\n")
        assert sock.recv(65536).startswith(b"HTTP/1.1 411 ")
    assert not any(h.seen for h in balanced.hosts.values())  # none reached a host
    # the operator's header never reaches an OpenAI route
    value = VALUES[0]
    where = balanced.openai_host("/v1/completions", value, {OPERATOR_HEADER: "t" * 43})
    assert [OPERATOR_HEADER in h for h in balanced.hosts[where].seen] == [False]
