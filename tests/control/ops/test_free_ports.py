"""Ports picked for a deployment are all different: the kernel may hand out a port it has just
released again, and two roles on one port stop tritonserver from starting (CI saw "cannot listen
to GRPC requests and metrics requests at the same address and port")."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from typing import Any

import pytest

from control.ops import triton_server
from control.ops.serve import Ports


class _Reused:
    """A socket whose kernel hands out 5000 twice, then 5001, 5002, ..."""

    ports: Iterator[int]

    def __init__(self, *_a: Any) -> None:
        self.port = next(self.ports)

    def bind(self, _addr: Any) -> None:
        pass

    def getsockname(self) -> tuple[str, int]:
        return "127.0.0.1", self.port

    def close(self) -> None:
        pass


def test_a_port_handed_out_twice_is_taken_once(monkeypatch: pytest.MonkeyPatch) -> None:
    _Reused.ports = iter([5000, 5000, 5001, 8000, 5002, 5003, 5003, 5004, 5005, 5006])
    monkeypatch.setattr(triton_server.socket, "socket", _Reused)
    assert triton_server.free_ports(2) == [5000, 5001]
    resolved = Ports(http=8000, grpc=0, metrics=0, gateway=8080).resolved()
    # 8000 is the http port already, and 5003 came twice: each skipped
    assert (resolved.grpc, resolved.metrics, resolved.triton_http, resolved.triton_grpc,
            resolved.openai) == (5002, 5003, 5004, 5005, 5006)


def test_free_ports_are_distinct_and_free() -> None:
    ports = triton_server.free_ports(64)
    assert len(set(ports)) == 64
    p = Ports.free()
    assert len({p.http, p.grpc, p.metrics, p.gateway}) == 4
    with socket.socket() as s:  # and free: each can be bound
        s.bind(("127.0.0.1", p.metrics))
