"""The gateway's OpenAI routes place requests as the balancer does (issue 25): each goes to a
host of its ticket's pool (``LORAPLANE_TRITON_URLS`` entries ``POOL=host:port``), the host its
route's affinity hashes to first, the next one when that host refuses connections, and nowhere
when the pool has no host listed (503), never to a host of another pool.

Three fake Tritons (two shared, one ``gold``) behind the real gateway on real sockets; acme
uses the shared pool, globex's policy is ``dedicated:gold``.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
from aiohttp import web

from control.app.registry import Registry
from control.contracts.config import Settings
from control.domain import TenantPolicy
from control.gateway.server import make_app
from tests.control.gateway.harness import ALIAS, FakeTriton, make_world
from tests.fixtures_control import Artifacts, OnSQLite, WithRegistry

COMPLETIONS = "/v1/completions"
BODY = json.dumps({"model": ALIAS, "prompt": "hello", "max_tokens": 2}).encode()


async def _serve(app: web.Application) -> tuple[web.AppRunner, int]:
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, int(runner.addresses[0][1])


async def _post(http: aiohttp.ClientSession, port: int, key: str, n: int) -> list[int]:
    statuses = []
    for i in range(n):
        async with http.post(f"http://127.0.0.1:{port}{COMPLETIONS}", data=BODY,
                             headers={"Authorization": f"Bearer {key}",
                                      "Content-Type": "application/json",
                                      "x-session-id": f"s{i}"}) as r:
            await r.read()
            statuses.append(r.status)
    return statuses


class OpenAIPlacementContract(WithRegistry):
    def test_requests_go_to_their_pools_hosts_by_affinity(
            self, registry: Registry, settings: Settings, artifacts: Artifacts) -> None:
        world = make_world(registry, settings, artifacts)
        globex = registry.create_tenant("globex", actor="op")
        registry.grant("globex", ALIAS, actor="op")
        registry.set_policy("globex", TenantPolicy(isolation="dedicated:gold"), actor="op")
        fakes = {name: FakeTriton() for name in ("shared-a", "shared-b", "gold")}

        async def main() -> dict[str, Any]:
            runners: dict[str, web.AppRunner] = {}
            ports: dict[str, int] = {}
            for name, fake in fakes.items():
                runners[name], ports[name] = await _serve(fake.app())
            urls = [f"127.0.0.1:{ports['shared-a']}", f"127.0.0.1:{ports['shared-b']}",
                    f"gold=127.0.0.1:{ports['gold']}"]
            gw_runner, gw = await _serve(make_app(world.office, triton_urls=urls,
                                                  ledger=world.ledger))
            seen: dict[str, Any] = {}
            try:
                async with aiohttp.ClientSession() as http:
                    seen["acme"] = await _post(http, gw, world.api_key, 6)
                    seen["acme_calls"] = {n: len(f.calls) for n, f in fakes.items()}
                    seen["globex"] = await _post(http, gw, globex, 6)
                    seen["globex_calls"] = {n: len(f.calls) for n, f in fakes.items()}
                    # acme's host goes away: the next of the shared pool takes its route
                    first = max(("shared-a", "shared-b"), key=lambda n: len(fakes[n].calls))
                    await runners.pop(first).cleanup()
                    seen["first"] = first
                    seen["acme_after"] = await _post(http, gw, world.api_key, 3)
                    seen["after_calls"] = {n: len(f.calls) for n, f in fakes.items()}
                    # the gold pool's only host goes away: globex waits (503), and no host
                    # of the shared pool ever sees its prompts
                    await runners.pop("gold").cleanup()
                    seen["globex_down"] = await _post(http, gw, globex, 2)
                    seen["down_calls"] = {n: len(f.calls) for n, f in fakes.items()}
            finally:
                await gw_runner.cleanup()
                for runner in runners.values():
                    await runner.cleanup()
            return seen

        seen = asyncio.run(main())
        assert seen["acme"] == [200] * 6
        # one route, one host: every acme request on the same shared host, none on gold
        calls = seen["acme_calls"]
        assert calls["gold"] == 0 and sorted((calls["shared-a"], calls["shared-b"])) == [0, 6]
        assert seen["globex"] == [200] * 6
        assert seen["globex_calls"] == {**calls, "gold": 6}  # globex's went to gold only
        other = "shared-b" if seen["first"] == "shared-a" else "shared-a"
        assert seen["acme_after"] == [200] * 3
        assert seen["after_calls"][other] == 3 and seen["after_calls"]["gold"] == 6
        assert seen["globex_down"] == [503, 503]
        assert seen["down_calls"] == seen["after_calls"]  # nothing reached a shared host


class TestOpenAIPlacementSQLite(OnSQLite, OpenAIPlacementContract):
    pass
