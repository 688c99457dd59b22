"""What the gateway body tests share: a world with one tenant, the gateway on a real socket in
front of a fake Triton that records every call reaching it, and a raw HTTP/1.1 client that
sends a body the way a slow or lying client does (many small writes with pauses, chunked
framing, a Content-Length that is not the body's).

Nothing here imports ``control.gateway.bodies``: the tests using it were run against the code
before that module existed, and must fail there on their assertions, not on an import.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from aiohttp import web

from control.app.registry import Registry
from control.contracts.config import Settings
from control.contracts.ledger import Ledger
from control.contracts.tickets import TicketSigner
from control.contracts.wire import INPUTS, MODEL, REQUEST_ID, TEXT_OUTPUT
from control.gateway.server import make_app
from control.gateway.ticket_office import TicketOffice
from projections.route_cache import CachedRoutingView
from tests.fixtures_control import Artifacts

ALIAS = "tiny-base"


@dataclass
class World:
    api_key: str
    office: TicketOffice
    ledger: Ledger


def make_world(registry: Registry, settings: Settings, artifacts: Artifacts) -> World:
    """Tenant ``acme`` granted the base-only alias ``tiny-base``; the gateway's office as
    ``serve`` builds it (cached routing, a recorded signing key)."""
    registry.register_base(artifacts.base, artifacts.tokenizer, name="tiny", actor="op",
                           alias=ALIAS)
    key = registry.create_tenant("acme", actor="op")
    registry.grant("acme", ALIAS, actor="op")
    signer, _ = TicketSigner.load_or_create(settings.keys_dir)
    registry.record_signing_key(signer.kid, signer.public_b64, actor="op")
    engine = registry.follower.engine
    office = TicketOffice(settings, CachedRoutingView(engine, refresh_s=0, max_stale_s=5.0),
                          signer)
    return World(key, office, Ledger(engine))


@dataclass
class FakeTriton:
    """Triton's generate extension, as far as the gateway uses it; records each call."""

    calls: list[dict[str, Any]] = field(default_factory=list)

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/v2/models/{model}/config", self.config)
        app.router.add_post("/v2/models/{model}/generate", self.generate)
        app.router.add_post("/v2/models/{model}/generate_stream", self.generate_stream)
        return app

    async def config(self, request: web.Request) -> web.Response:
        if request.match_info["model"] != MODEL:
            return web.json_response({"error": "no such model"}, status=404)
        return web.json_response({"name": MODEL, "input": [{"name": i.name} for i in INPUTS]})

    async def generate(self, request: web.Request) -> web.Response:
        self.calls.append(await request.json())
        return web.json_response({TEXT_OUTPUT: "ok", REQUEST_ID: f"r{len(self.calls)}"})

    async def generate_stream(self, request: web.Request) -> web.StreamResponse:
        self.calls.append(await request.json())
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        event = {TEXT_OUTPUT: "ok", REQUEST_ID: f"r{len(self.calls)}"}
        await resp.write(b"data: " + json.dumps(event).encode() + b"\n\n")
        await resp.write_eof()
        return resp


@dataclass
class Running:
    port: int
    upstream: FakeTriton
    issued: list[tuple[Any, ...]]  # every office.issue call: a ticket signed (or attempted)


@contextlib.asynccontextmanager
async def running_gateway(world: World) -> AsyncIterator[Running]:
    """The gateway (tickets, feedback, OpenAI routes) on 127.0.0.1, forwarding to a fake
    Triton; ``issued`` records every attempt to sign a ticket."""
    fake = FakeTriton()
    issued: list[tuple[Any, ...]] = []
    office = world.office
    real_issue = office.issue

    def spy(*args: Any, **kwargs: Any) -> Any:
        issued.append(args)
        return real_issue(*args, **kwargs)

    office.issue = spy  # type: ignore[method-assign]
    runners: list[web.AppRunner] = []
    try:
        up_port = await _serve(fake.app(), runners)
        app = make_app(office, triton_urls=[f"127.0.0.1:{up_port}"], ledger=world.ledger)
        yield Running(await _serve(app, runners), fake, issued)
    finally:
        office.issue = real_issue  # type: ignore[method-assign]
        for runner in reversed(runners):
            await runner.cleanup()


async def _serve(app: web.Application, runners: list[web.AppRunner]) -> int:
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    runners.append(runner)
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return int(runner.addresses[0][1])  # the port the system chose


@dataclass
class Answer:
    status: int
    body: Any  # the JSON body, or the raw bytes when it is not JSON


def pieces(body: bytes, n: int) -> Iterator[bytes]:
    """``body`` cut into ``n`` parts of near-equal length (none empty)."""
    n = max(1, min(n, len(body)))
    step, extra = divmod(len(body), n)
    at = 0
    for i in range(n):
        size = step + (1 if i < extra else 0)
        yield body[at:at + size]
        at += size


async def exchange(port: int, path: str, body: bytes, api_key: str | None, *,
                   writes: int = 1, pause_s: float = 0.0, chunked: bool = False,
                   declared: int | None = None, finish: bool = True,
                   extra_headers: tuple[str, ...] = (), timeout_s: float = 15.0) -> Answer:
    """POST ``body`` to ``path`` over a raw socket and read the first answer.

    ``writes``: how many writes carry the body, ``pause_s`` apart. ``chunked``: send it with
    chunked transfer encoding (one chunk per write), else with ``Content-Length: declared``
    (default: the body's length). ``extra_headers``: more header lines. ``finish=False``: stop
    after the last write without ending the body (no terminating chunk) and keep the
    connection open: the answer must come anyway.
    """
    head = [f"POST {path} HTTP/1.1", "Host: 127.0.0.1", "Content-Type: application/json"]
    if api_key is not None:
        head.append(f"Authorization: Bearer {api_key}")
    head.extend(extra_headers)
    if chunked:
        head.append("Transfer-Encoding: chunked")
    else:
        head.append(f"Content-Length: {len(body) if declared is None else declared}")
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(("\r\n".join(head) + "\r\n\r\n").encode())
        with contextlib.suppress(ConnectionError):  # answered early and closed: read it
            for part in pieces(body, writes):
                writer.write(b"%x\r\n%s\r\n" % (len(part), part) if chunked else part)
                await writer.drain()
                if pause_s:
                    await asyncio.sleep(pause_s)
            if chunked and finish:
                writer.write(b"0\r\n\r\n")
                await writer.drain()
        return await asyncio.wait_for(_read_answer(reader), timeout_s)
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()


async def _read_answer(reader: asyncio.StreamReader) -> Answer:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ")[1])
    headers = {k.strip().lower(): v.strip() for k, _, v in
               (line.partition(":") for line in lines[1:] if line)}
    if "content-length" in headers:
        raw = await reader.readexactly(int(headers["content-length"]))
    else:
        raw = await reader.read()
    try:
        return Answer(status, json.loads(raw))
    except ValueError:
        return Answer(status, raw)


@pytest.fixture
def world(registry: Registry, settings: Settings, artifacts: Artifacts) -> World:
    return make_world(registry, settings, artifacts)
