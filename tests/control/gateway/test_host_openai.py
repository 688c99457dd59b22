"""A host's OpenAI route (issue 25) in front of a stand-in Triton on a real socket: what it
forwards, where usage comes from, and how each of Triton's answers reaches the client. The
same route on a real tritonserver, through the door: tests/integration/test_host_openai.py."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import sqlalchemy as sa
from aiohttp import web
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from control.contracts.ledger import request_ledger
from control.contracts.tickets import GENERIC_REFUSAL, TicketSigner
from control.gateway.host_openai import make_host_app

VALUE = "00112233aabbccdd"  # an affinity value (16 lowercase hex characters)
DIGEST = "sha256:" + "c" * 64
SIGNER = TicketSigner(Ed25519PrivateKey.generate())


def _ticket(affinity: str | None = VALUE) -> str:
    return SIGNER.issue(tenant="acme", model="lora_llm", base="sha256:" + "a" * 64,
                        adapter=DIGEST, tokenizer="sha256:" + "b" * 64, release=None,
                        disclose=False, ttl_s=60, affinity=affinity)[0]


class StandIn:
    """Answers generate with ``status`` and ``body``; remembers what it was sent."""

    def __init__(self) -> None:
        self.status, self.body = 200, {"text_output": "hi", "request_id": "r-1"}
        self.seen: list[dict[str, Any]] = []

    def app(self) -> web.Application:
        async def config(request: web.Request) -> web.Response:
            if request.match_info["model"] != "lora_llm":
                return web.json_response({"error": "no such model"}, status=404)
            return web.json_response({"input": [{"name": "text_input"}]})

        async def generate(request: web.Request) -> web.Response:
            self.seen.append(await request.json())
            return web.json_response(self.body, status=self.status)

        app = web.Application()
        app.router.add_get("/v2/models/{model}/config", config)
        app.router.add_post("/v2/models/{model}/generate", generate)
        return app


def _ledger(tmp_path: Path, max_tokens: int) -> sa.engine.Engine:
    tmp_path.mkdir(parents=True, exist_ok=True)
    engine = sa.create_engine(f"sqlite:///{tmp_path / 'ledger.db'}")
    request_ledger.metadata.create_all(engine, tables=[request_ledger])
    with engine.begin() as conn:
        conn.execute(request_ledger.insert().values(
            request_id="r-1", model="lora_llm", host="h", admitted_at=time.time(),
            outcome="ok", tokens_in=3, tokens_out=2, max_tokens=max_tokens))
    return engine


async def _run(tmp_path: Path, stand_in: StandIn, calls: list[tuple[dict[str, Any],
               dict[str, str]]], max_tokens: int = 2,
               drop_ledger: bool = False) -> list[tuple[int, Any]]:
    runners = []
    try:
        ports = []
        for app in (stand_in.app(), None):
            if app is None:
                ledger = _ledger(tmp_path, max_tokens)
                if drop_ledger:  # a database that cannot answer for the row
                    request_ledger.drop(ledger)
                app = make_host_app(f"127.0.0.1:{ports[0]}", ledger)
            runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", 0).start()
            runners.append(runner)
            ports.append(int(runner.addresses[0][1]))
        out = []
        async with aiohttp.ClientSession() as http:
            for body, headers in calls:
                async with http.post(f"http://127.0.0.1:{ports[1]}/v1/completions",
                                     data=json.dumps(body), headers=headers) as r:
                    out.append((r.status, await r.json()))
        return out
    finally:
        for runner in reversed(runners):
            await runner.cleanup()


def _call(model: str = VALUE, ticket: str | None = None, **body: Any
          ) -> tuple[dict[str, Any], dict[str, str]]:
    headers = {"Content-Type": "application/json"}
    if ticket is not None:
        headers["x-loraplane-ticket"] = ticket
    return {"model": model, "prompt": "hello", **body}, headers


@pytest.mark.parametrize(("max_tokens", "finish"), [(2, "length"), (8, "stop")])
def test_forwards_the_ticket_and_reads_usage_from_the_ledger(tmp_path: Path, max_tokens: int,
                                                             finish: str) -> None:
    stand_in, ticket = StandIn(), _ticket()
    [(status, body)] = asyncio.run(_run(tmp_path, stand_in, [_call(ticket=ticket,
                                                                   max_tokens=2)], max_tokens))
    assert status == 200, body
    assert stand_in.seen == [{"text_input": "hello", "max_tokens": 2,
                              "parameters": {"lora_ticket": ticket}}]
    assert body["model"] == VALUE and body["id"] == "cmpl-r-1"
    assert body["choices"][0]["text"] == "hi" and body["choices"][0]["finish_reason"] == finish
    # the ledger row's figures; finish: its max_tokens (what the engine ran with) reached
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}


def test_what_triton_refuses_reaches_the_client_as_a_fixed_text(tmp_path: Path) -> None:
    cases = [(400, GENERIC_REFUSAL, 401), (400, "prompt too long for sha256:abc", 400),
             (503, "queue full on host-7", 503), (500, "stub died in /opt/x", 502)]
    for triton_status, text, expected in cases:
        stand_in = StandIn()
        stand_in.status, stand_in.body = triton_status, {"error": text}
        [(status, body)] = asyncio.run(_run(tmp_path / str(expected), stand_in,
                                            [_call(ticket=_ticket())]))
        assert status == expected, (text, body)
        message = body["error"]["message"]
        assert text == GENERIC_REFUSAL or text not in message
        assert "sha256" not in message and "/opt" not in message


def test_the_model_must_be_the_tickets_affinity_value(tmp_path: Path) -> None:
    stand_in = StandIn()
    answers = asyncio.run(_run(tmp_path, stand_in, [
        _call(model="ffeeddccbbaa9988", ticket=_ticket()),  # another route's value
        _call(model=DIGEST, ticket=_ticket()),
        _call(ticket=_ticket(affinity=None)),  # a ticket signed without the claim
        _call(ticket=None),
        _call(ticket="v4.public.not-a-ticket"),
    ]))
    assert [s for s, _ in answers] == [404, 404, 404, 401, 401]
    assert {b["error"]["code"] for _, b in answers} == {"model_not_found", "invalid_ticket"}
    assert stand_in.seen == []  # nothing reached Triton



def test_a_ledger_that_cannot_answer_is_an_openai_error(tmp_path: Path) -> None:
    """Triton answered, but the usage cannot be read: an OpenAI-shaped 503 that names nothing
    (before: aiohttp's bare 500)."""
    [(status, body)] = asyncio.run(_run(tmp_path, StandIn(), [_call(ticket=_ticket())],
                                        drop_ledger=True))
    assert status == 503 and body["error"]["code"] == "ledger_unavailable", body
    assert "sha256" not in body["error"]["message"]
