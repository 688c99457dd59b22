"""The balancer's bounded-load consistent hashing, through a real HAProxy in front of three
stand-in hosts that hold each request for a moment.

One alias is one affinity value for every tenant it serves (``control.contracts.placement``), so
without a bound a popular shared alias put all its traffic on one host. With HAProxy's
``hash-balance-factor``, requests of one value stay on one host while it holds no more than its
bound of the backend's connections, and spread over the next hosts on the ring past it.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from control.contracts.placement import AFFINITY_HEADER, affinity_of
from control.ops.balancer import start_balancer
from control.ops.front_door import FrontDoor, Upstream
from control.ops.triton_server import free_ports
from tests.control.ops.door_support import haproxy_or_skip

HOLD_S = 0.4  # how long a stand-in host holds each generate request


class _Host(BaseHTTPRequestHandler):
    """Answers the ready check at once and a generate request after ``HOLD_S``, with its name."""

    name = ""
    protocol_version = "HTTP/1.1"

    def _send(self, body: bytes) -> None:
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        self._send(b"{}")

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length") or 0))
        time.sleep(HOLD_S)
        self._send(json.dumps({"host": self.name}).encode())

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def balancer(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FrontDoor]:
    haproxy_or_skip()
    servers = []
    for i in range(3):
        handler = type(f"Host{i}", (_Host,), {"name": f"host-{i}"})
        server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        server.daemon_threads = True
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
    # the gRPC port is never called here: any free port stands for it
    grpc_ports = free_ports(3)
    http_port, grpc_port = free_ports(2, avoid=set(grpc_ports))
    door = start_balancer(tmp_path_factory.mktemp("balancer-load"),
                          [Upstream("127.0.0.1", s.server_address[1], g)
                           for s, g in zip(servers, grpc_ports, strict=True)],
                          http_port=http_port, grpc_port=grpc_port)
    try:
        yield door
    finally:
        door.stop()
        for server in servers:
            server.shutdown()


def _generate(door: FrontDoor, affinity: str) -> str:
    host, port = door.http_url.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.request("POST", "/v2/models/lora_llm/generate", body=b'{"text_input": "hi"}',
                     headers={AFFINITY_HEADER: affinity, "content-type": "application/json"})
        r = conn.getresponse()
        assert r.status == 200, r.read()
        return str(json.loads(r.read())["host"])
    finally:
        conn.close()


def test_one_value_stays_on_one_host_until_it_holds_its_bound(balancer: FrontDoor) -> None:
    popular = affinity_of("shared-summarizer")
    one_at_a_time = {_generate(balancer, popular) for _ in range(4)}
    assert len(one_at_a_time) == 1  # affinity: every request on the value's first host
    with ThreadPoolExecutor(12) as pool:  # twelve at once: past twice the average
        at_once = list(pool.map(lambda _: _generate(balancer, popular), range(12)))
    assert len(set(at_once)) >= 2, at_once  # spread past the bound
    first = one_at_a_time.pop()
    assert at_once.count(first) < 12 and at_once.count(first) >= 4, at_once  # it keeps its part
    assert {_generate(balancer, popular)} == {first}  # and the value comes back once it is quiet


def test_the_balancer_config_bounds_each_hosts_load(tmp_path: Path) -> None:
    from control.ops.balancer import balancer_config
    from control.ops.front_door import HASH_BALANCE_FACTOR, render

    cfg = render(balancer_config([Upstream("127.0.0.1", 8000, 8001)], http_port=9000,
                                 grpc_port=9001))
    assert cfg.count(f"hash-balance-factor {HASH_BALANCE_FACTOR}") == 2  # HTTP and gRPC
