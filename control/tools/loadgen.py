"""A lean closed-loop HTTP/1.1 load generator for the gateway benchmark.

``concurrency`` keep-alive connections each send one request, wait for the whole response, and
send the next. The client is raw asyncio streams with pre-built request bytes, so that on a small
machine the measurement is dominated by the server, not by the client's own HTTP stack (an aiohttp
client in the server's process cost as much CPU as the server and shared its GIL).

Run it in its own process (``python -m control.tools.loadgen``) so it does not share an interpreter
lock
with the server it measures; it prints one JSON object with the latencies' percentiles.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from collections.abc import Callable

from control.contracts import loops


class LoadError(RuntimeError):
    """A response other than the expected status, or a broken connection."""


def _request(host: str, port: int, path: str, headers: dict[str, str], body: bytes,
             method: str = "POST") -> bytes:
    lines = [f"{method} {path} HTTP/1.1", f"Host: {host}:{port}", "Connection: keep-alive",
             "Content-Type: application/json", f"Content-Length: {len(body)}"]
    lines += [f"{k}: {v}" for k, v in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


async def _read_response(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    status_line, _, rest = head.partition(b"\r\n")
    status = int(status_line.split(b" ", 2)[1])
    length = 0
    for line in rest.split(b"\r\n"):
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    return status, await reader.readexactly(length)


async def run(
    host: str,
    port: int,
    path: str,
    headers: dict[str, str],
    body_for: Callable[[int], bytes],
    *,
    requests: int,
    concurrency: int,
    warmup: int = 100,
    method: str = "POST",
) -> dict[str, float]:
    """Send ``warmup + requests`` POSTs over ``concurrency`` connections; latency percentiles
    (ms) of the last ``requests`` and the throughput over the whole measured span."""
    total = warmup + requests
    counter = iter(range(total))
    latencies: list[float] = []
    started: list[float] = []

    async def connection() -> None:
        reader, writer = await asyncio.open_connection(host, port)
        try:
            for i in counter:
                if i == warmup:
                    started.append(time.perf_counter())
                t0 = time.perf_counter()
                writer.write(_request(host, port, path, headers, body_for(i), method))
                status, payload = await _read_response(reader)
                if status != 200:
                    raise LoadError(f"HTTP {status}: {payload[:200]!r}")
                if i >= warmup:
                    latencies.append(time.perf_counter() - t0)
        finally:
            writer.close()

    await asyncio.gather(*(connection() for _ in range(concurrency)))
    wall = time.perf_counter() - (started[0] if started else time.perf_counter())
    ms = sorted(x * 1000 for x in latencies)
    q = statistics.quantiles(ms, n=100)
    return {"p50_ms": statistics.median(ms), "p90_ms": q[89], "p99_ms": q[98],
            "requests": len(ms), "per_s": len(ms) / wall if wall > 0 else 0.0,
            "concurrency": concurrency}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", required=True, help="http://host:port/path")
    p.add_argument("--bearer", default="")
    p.add_argument("--alias", default="")
    p.add_argument("--method", default="POST", choices=("POST", "GET"),
                   help="GET sends no body (the gateway's /healthz: the HTTP floor)")
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--concurrency", type=int, default=16)
    a = p.parse_args(argv)
    hostport, _, path = a.url.removeprefix("http://").partition("/")
    host, _, port = hostport.partition(":")

    def body(i: int) -> bytes:  # a fresh session per request: exercises the canary hash
        if a.method == "GET":
            return b""
        return json.dumps({"alias": a.alias, "session": f"s{i}"}).encode()

    try:
        out = loops.run(run(host, int(port), "/" + path, {"Authorization": f"Bearer {a.bearer}"},
                              body, requests=a.requests, concurrency=a.concurrency,
                              method=a.method))
    except (LoadError, OSError, asyncio.IncompleteReadError) as e:
        print(json.dumps({"error": str(e)}))
        return 1
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
