"""Every gateway route that takes a body reads it whole, up to that route's limit, over real
sockets: a real aiohttp server on 127.0.0.1 and a raw socket client.

A body may arrive in many small writes with pauses between them (a slow sender), chunked
(no Content-Length), exactly at the limit, one byte over it, or with a Content-Length that
lies. The gateway used to read "what happens to be buffered": a valid body in two writes got
400 "body must be a JSON object". Now: at the limit it is served; one byte over is 413 in the
route's own error shape, answered without waiting for (or holding) the rest; a body that never
arrives in full is 408 once its time is up.
"""

from __future__ import annotations

import asyncio
import gzip
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import pytest

from control.gateway.server import NO_SUCH_REQUEST
from tests.control.gateway.harness import (
    ALIAS,
    Answer,
    Running,
    World,
    exchange,
    running_gateway,
    world,
)
from tests.fixtures_control import OnSQLite, WithRegistry

__all__ = ["world"]  # the fixture, imported so that pytest finds it here

TICKET_LIMIT = 4096  # documented limits (README, control.gateway.server / openai_api)
OPENAI_LIMIT = 64 * 1024
SLOW: dict[str, Any] = {"writes": 24, "pause_s": 0.01}  # a slow sender: 24 writes, 10 ms apart


@dataclass(frozen=True)
class Route:
    """One body-reading route: how to build a valid body of an exact size, and what a served
    one and a too-large one look like."""

    path: str
    limit: int
    make: Callable[[int], bytes]  # a valid body of exactly n bytes
    served: Callable[[Answer], bool]

    def too_large(self, a: Answer) -> bool:
        if a.status != 413 or not isinstance(a.body, dict):
            return False
        err = a.body.get("error")
        if self.limit == OPENAI_LIMIT:  # OpenAI's error shape
            return (isinstance(err, dict) and set(err) == {"message", "type", "param", "code"}
                    and "too large" in err["message"])
        return isinstance(err, str) and "too large" in err


def _padded(prefix: bytes, suffix: bytes, n: int, fill: bytes = b" ") -> bytes:
    """``prefix + fill * k + suffix`` of exactly ``n`` bytes."""
    k = n - len(prefix) - len(suffix)
    assert k >= 0, n
    return prefix + fill * k + suffix


def _openai_served(a: Answer) -> bool:
    return a.status == 200 and isinstance(a.body, dict) and bool(a.body.get("choices"))


ROUTES = {
    "tickets": Route("/v1/tickets", TICKET_LIMIT,
                     lambda n: _padded(b'{"alias": "' + ALIAS.encode() + b'"', b"}", n),
                     lambda a: a.status == 200 and "ticket" in a.body),
    # An id nobody has: a body read whole gets the fixed 404; a cut one would get 400.
    "feedback": Route("/v1/feedback", TICKET_LIMIT,
                      lambda n: _padded(b'{"request_id": "0b9c-none-such", "success": true',
                                        b"}", n),
                      lambda a: a.status == 404 and a.body == NO_SUCH_REQUEST),
    # The prompt fills the body: a long prompt is what OpenAI bodies are large for.
    "completions": Route("/v1/completions", OPENAI_LIMIT,
                         lambda n: _padded(b'{"model": "' + ALIAS.encode()
                                           + b'", "max_tokens": 2, "prompt": "', b'"}', n, b"x"),
                         _openai_served),
    "chat": Route("/v1/chat/completions", OPENAI_LIMIT,
                  lambda n: _padded(b'{"model": "' + ALIAS.encode() + b'", "messages": '
                                    b'[{"role": "user", "content": "', b'"}]}', n, b"x"),
                  _openai_served),
}


def _run(world: World, scenario: Callable[[Running], Awaitable[None]]) -> None:
    async def main() -> None:
        async with running_gateway(world) as gw:
            await scenario(gw)

    asyncio.run(main())


@pytest.fixture
def short_body_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    """A body that never completes is refused after 0.5 s instead of 30 (the code before the
    fix has no such timeout: then there is nothing to shorten)."""
    try:
        from control.gateway import bodies
    except ImportError:
        return
    monkeypatch.setattr(bodies, "BODY_TIMEOUT_S", 0.5)


@pytest.mark.parametrize("name", list(ROUTES))
class BodyReadingContract(WithRegistry):
    def test_valid_bodies_are_served_however_they_arrive(self, world: World,
                                                         name: str) -> None:
        route = ROUTES[name]
        at_limit = route.make(route.limit)
        small = route.make(route.limit // 4)

        async def scenario(gw: Running) -> None:
            port, key = gw.port, world.api_key
            cases: dict[str, Answer] = {
                "one write": await exchange(port, route.path, small, key),
                "two writes": await exchange(port, route.path, small, key, writes=2,
                                             pause_s=0.05),
                "slow sender": await exchange(port, route.path, small, key, **SLOW),
                "chunked": await exchange(port, route.path, small, key, chunked=True),
                "slow chunked": await exchange(port, route.path, small, key, chunked=True,
                                               **SLOW),
                "at the limit": await exchange(port, route.path, at_limit, key),
                "at the limit, slow": await exchange(port, route.path, at_limit, key, **SLOW),
                "at the limit, slow chunked": await exchange(
                    port, route.path, at_limit, key, chunked=True, **SLOW),
            }
            refused = {case: (a.status, a.body) for case, a in cases.items()
                       if not route.served(a)}
            assert not refused, refused

        _run(world, scenario)

    def test_one_byte_over_the_limit_is_413_in_the_routes_error_shape(
            self, world: World, name: str) -> None:
        route = ROUTES[name]
        over = route.make(route.limit + 1)

        async def scenario(gw: Running) -> None:
            port, key = gw.port, world.api_key
            cases = {
                "content-length": await exchange(port, route.path, over, key),
                "slow": await exchange(port, route.path, over, key, **SLOW),
                "chunked": await exchange(port, route.path, over, key, chunked=True),
                "slow chunked": await exchange(port, route.path, over, key, chunked=True,
                                               **SLOW),
                # Far over the limit, chunked, never ended: 413 as soon as one byte too many
                # has arrived; the gateway neither waits for the rest nor holds it.
                "unbounded chunked": await exchange(port, route.path, over * 4, key,
                                                    chunked=True, writes=8, finish=False,
                                                    timeout_s=5),
                # Small on the wire, over the limit once decompressed (aiohttp inflates
                # request bodies): the limit is on the body the route would read.
                "gzip": await exchange(port, route.path, gzip.compress(over * 100), key,
                                       extra_headers=("Content-Encoding: gzip",)),
            }
            wrong = {case: (a.status, a.body) for case, a in cases.items()
                     if not route.too_large(a)}
            assert not wrong, wrong
            assert gw.upstream.calls == [] and gw.issued == []

        _run(world, scenario)

    def test_a_lying_content_length(self, world: World, name: str,
                                    short_body_timeout: None) -> None:
        route = ROUTES[name]
        small = route.make(200)

        async def scenario(gw: Running) -> None:
            port, key = gw.port, world.api_key
            # Declares one byte over the limit, sends a small valid body: refused on the
            # declaration, before (and without) reading the body.
            declared_over = await exchange(port, route.path, small, key,
                                           declared=route.limit + 1, finish=False)
            assert route.too_large(declared_over), (declared_over.status, declared_over.body)
            assert gw.upstream.calls == [] and gw.issued == []
            # Declares more than it sends, then stalls: the part that came is not taken for
            # the body; the request is refused once its time is up.
            stalled = await exchange(port, route.path, small, key, declared=len(small) + 50,
                                     timeout_s=10)
            assert stalled.status == 408, (stalled.status, stalled.body)
            assert gw.upstream.calls == [] and gw.issued == []
            # Declares less than it sends: only the declared bytes are the body (here a cut
            # JSON object, refused as one), never the bytes after them.
            cut = await exchange(port, route.path, small, key, declared=len(small) - 2)
            assert cut.status == 400, (cut.status, cut.body)
            assert gw.upstream.calls == [] and gw.issued == []

        _run(world, scenario)


class TestBodiesSQLite(OnSQLite, BodyReadingContract):
    pass


class ReviewerCase(WithRegistry):
    def test_a_6kb_chat_body_in_two_writes_is_served_like_one_write(self, world: World
                                                                    ) -> None:
        """The reviewer's case: a 6 KB body against the gateway, in one write and in two."""
        body = ROUTES["chat"].make(6 * 1024)

        async def scenario(gw: Running) -> None:
            one = await exchange(gw.port, "/v1/chat/completions", body, world.api_key)
            two = await exchange(gw.port, "/v1/chat/completions", body, world.api_key,
                                 writes=2, pause_s=0.05)
            assert _openai_served(one) and _openai_served(two), (two.status, two.body)
            # Both forwarded the whole conversation, byte for byte.
            content = json.loads(body)["messages"][0]["content"]
            assert [c["text_input"] for c in gw.upstream.calls] == [f"user: {content}\n"
                                                                   "assistant:"] * 2

        _run(world, scenario)

    def test_unauthenticated_callers_are_refused_before_the_body(self, world: World) -> None:
        async def scenario(gw: Running) -> None:
            for route in ROUTES.values():
                a = await exchange(gw.port, route.path, route.make(route.limit + 1), None)
                assert a.status == 401, (route.path, a.status)

        _run(world, scenario)


class TestReviewerCaseSQLite(OnSQLite, ReviewerCase):
    pass
