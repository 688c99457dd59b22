"""Hostile bodies on the OpenAI-compatible routes (and duplicate keys on every route): each gets
400 in the route's error shape, naming the field where there is one, and never reaches Triton
nor gets a ticket signed. Table-driven: wrong JSON types for every field, NaN/Infinity literals,
numbers that overflow, booleans where numbers go, duplicate keys, nested junk.

Valid edge values (the ends of each range, a negative seed, explicit nulls) are served, and
reach Triton as given: the table's refusals are not a gateway that refuses everything.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp

from tests.control.gateway.harness import ALIAS, World, running_gateway, world
from tests.fixtures_control import OnSQLite, WithRegistry

__all__ = ["world"]  # the fixture, imported so that pytest finds it here

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
BASE: dict[str, Any] = {"model": ALIAS, "prompt": "hello", "max_tokens": 2}
CHAT_BASE: dict[str, Any] = {"model": ALIAS, "max_tokens": 2,
                             "messages": [{"role": "user", "content": "hello"}]}


def _with(**fields: Any) -> bytes:
    return json.dumps(BASE | fields).encode()


def _chat(**fields: Any) -> bytes:
    return json.dumps(CHAT_BASE | fields).encode()


def _raw(text: str) -> bytes:
    return text.encode()


B = json.dumps(BASE)[1:-1]  # the base fields, to splice into hand-written JSON
# (route, body, the param the refusal must name: None for a body that is not acceptable JSON)
HOSTILE: list[tuple[str, str, bytes, str | None]] = [
    # stream must be a JSON boolean: "false" used to START a stream
    ("stream string false", COMPLETIONS, _with(stream="false"), "stream"),
    ("stream string true", CHAT, _chat(stream="true"), "stream"),
    ("stream 1", COMPLETIONS, _with(stream=1), "stream"),
    ("stream 0", COMPLETIONS, _with(stream=0), "stream"),
    ("stream list", COMPLETIONS, _with(stream=[True]), "stream"),
    ("stream object", CHAT, _chat(stream={}), "stream"),
    ("stream_options string", COMPLETIONS, _with(stream=True, stream_options="usage"),
     "stream_options"),
    ("stream_options list", COMPLETIONS, _with(stream=True, stream_options=[]),
     "stream_options"),
    ("include_usage string", CHAT, _chat(stream=True, stream_options={"include_usage": "yes"}),
     "stream_options.include_usage"),
    ("include_usage 1", COMPLETIONS, _with(stream=True, stream_options={"include_usage": 1}),
     "stream_options.include_usage"),
    ("include_usage nested", COMPLETIONS,
     _with(stream=True, stream_options={"include_usage": {"deep": [1, {"x": []}]}}),
     "stream_options.include_usage"),
    # n: an integer, and only 1
    ("n string", COMPLETIONS, _with(n="1"), "n"),
    ("n float", COMPLETIONS, _with(n=1.0), "n"),
    ("n true", CHAT, _chat(n=True), "n"),
    ("n 2", COMPLETIONS, _with(n=2), "n"),
    ("n huge", COMPLETIONS, _with(n=10**30), "n"),
    # user: a string
    ("user number", COMPLETIONS, _with(user=42), "user"),
    ("user list", CHAT, _chat(user=["alice"]), "user"),
    ("user object", COMPLETIONS, _with(user={"id": "alice"}), "user"),
    ("user true", COMPLETIONS, _with(user=True), "user"),
    # max_tokens / max_completion_tokens: integers in 1..512
    ("max_tokens string", COMPLETIONS, _with(max_tokens="16"), "max_tokens"),
    ("max_tokens float", COMPLETIONS, _with(max_tokens=16.0), "max_tokens"),
    ("max_tokens true", CHAT, _chat(max_tokens=True), "max_tokens"),
    ("max_tokens 0", COMPLETIONS, _with(max_tokens=0), "max_tokens"),
    ("max_tokens 513", COMPLETIONS, _with(max_tokens=513), "max_tokens"),
    ("max_tokens negative", COMPLETIONS, _with(max_tokens=-1), "max_tokens"),
    ("max_tokens huge", COMPLETIONS, _with(max_tokens=10**40), "max_tokens"),
    ("max_completion_tokens string", CHAT,
     json.dumps({k: v for k, v in CHAT_BASE.items() if k != "max_tokens"}
                | {"max_completion_tokens": "8"}).encode(), "max_completion_tokens"),
    ("max_completion_tokens 513", CHAT,
     json.dumps({k: v for k, v in CHAT_BASE.items() if k != "max_tokens"}
                | {"max_completion_tokens": 513}).encode(), "max_completion_tokens"),
    ("max_completion_tokens bad beside max_tokens", CHAT,
     _chat(max_completion_tokens=[1]), "max_completion_tokens"),
    # temperature: a number, 0 or 0.01..2 (OpenAI's 0..2 within the hosts' 0 or 0.01..10)
    ("temperature string", COMPLETIONS, _with(temperature="0.5"), "temperature"),
    ("temperature true", COMPLETIONS, _with(temperature=True), "temperature"),
    ("temperature list", CHAT, _chat(temperature=[0.5]), "temperature"),
    ("temperature negative", COMPLETIONS, _with(temperature=-0.1), "temperature"),
    ("temperature denormal", COMPLETIONS, _with(temperature=1e-39), "temperature"),
    ("temperature below 0.01", COMPLETIONS, _with(temperature=0.005), "temperature"),
    ("temperature above OpenAI's 2", CHAT, _chat(temperature=2.5), "temperature"),
    ("temperature above the hosts' 10", COMPLETIONS, _with(temperature=11), "temperature"),
    ("temperature huge int", COMPLETIONS, _with(temperature=10**400), "temperature"),
    # top_p: a number in 0.001..1
    ("top_p string", COMPLETIONS, _with(top_p="1"), "top_p"),
    ("top_p false", CHAT, _chat(top_p=False), "top_p"),
    ("top_p 0", COMPLETIONS, _with(top_p=0), "top_p"),
    ("top_p tiny", COMPLETIONS, _with(top_p=0.0005), "top_p"),
    ("top_p 1.5", COMPLETIONS, _with(top_p=1.5), "top_p"),
    # seed: an integer in the signed 64-bit range
    ("seed string", COMPLETIONS, _with(seed="1"), "seed"),
    ("seed float", COMPLETIONS, _with(seed=1.5), "seed"),
    ("seed true", CHAT, _chat(seed=True), "seed"),
    ("seed 2**63", COMPLETIONS, _with(seed=2**63), "seed"),
    ("seed below -2**63", COMPLETIONS, _with(seed=-(2**63) - 1), "seed"),
    ("seed 1e30", COMPLETIONS, _with(seed=1e30), "seed"),
    # prompt: a string, or a list of one string
    ("prompt number", COMPLETIONS, _with(prompt=42), "prompt"),
    ("prompt null", COMPLETIONS, _with(prompt=None), "prompt"),
    ("prompt two strings", COMPLETIONS, _with(prompt=["a", "b"]), "prompt"),
    ("prompt token ids", COMPLETIONS, _with(prompt=[1, 2, 3]), "prompt"),
    ("prompt object", COMPLETIONS, _with(prompt={"text": "hello"}), "prompt"),
    ("prompt empty list", COMPLETIONS, _with(prompt=[]), "prompt"),
    # messages: as the chat template needs them
    ("messages string", CHAT, _chat(messages="hello"), "messages"),
    ("messages empty", CHAT, _chat(messages=[]), "messages"),
    ("messages bad role", CHAT, _chat(messages=[{"role": "robot", "content": "x"}]),
     "messages"),
    ("messages content number", CHAT, _chat(messages=[{"role": "user", "content": 5}]),
     "messages"),
    ("messages image part", CHAT,
     _chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]),
     "messages"),
    ("messages nested junk", CHAT,
     _chat(messages=[{"role": "user", "content": [{"type": "text", "text": {"a": [1]}}]}]),
     "messages"),
    # model: a non-empty string
    ("model number", COMPLETIONS, _with(model=42), "model"),
    ("model empty", CHAT, _chat(model=""), "model"),
    ("model list", COMPLETIONS, _with(model=[ALIAS]), "model"),
    ("model object", COMPLETIONS, _with(model={"name": ALIAS}), "model"),
    ("model missing", COMPLETIONS, json.dumps({"prompt": "hello"}).encode(), "model"),
    # Not JSON the gateway accepts: refused before any field is read (no param to name)
    ("NaN literal", COMPLETIONS, _raw('{' + B + ', "temperature": NaN}'), None),
    ("Infinity literal", COMPLETIONS, _raw('{' + B + ', "top_p": Infinity}'), None),
    ("-Infinity literal", CHAT,
     _raw(json.dumps(CHAT_BASE)[:-1] + ', "temperature": -Infinity}'), None),
    ("overflowing float", COMPLETIONS, _raw('{' + B + ', "temperature": 1e400}'), None),
    ("NaN nested", COMPLETIONS, _raw('{' + B + ', "metadata": {"x": [NaN]}}'), None),
    ("duplicate model", COMPLETIONS,
     _raw('{"model": "' + ALIAS + '", "model": "someone-elses", "prompt": "hello"}'), None),
    ("duplicate model, the last one good", CHAT,
     _raw('{"model": "x", "model": "' + ALIAS + '", "messages": '
          '[{"role": "user", "content": "hi"}]}'), None),
    ("duplicate stream", COMPLETIONS,
     _raw('{' + B + ', "stream": false, "stream": true}'), None),
    ("duplicate key nested", CHAT,
     _raw('{"model": "' + ALIAS + '", "messages": '
          '[{"role": "user", "role": "system", "content": "hi"}]}'), None),
    ("top-level list", COMPLETIONS, _raw("[" + json.dumps(BASE) + "]"), None),
    ("top-level string", COMPLETIONS, _raw('"hello"'), None),
    ("empty body", CHAT, b"", None),
    ("deep nesting", COMPLETIONS, _raw('{' + B + ', "x": ' + "[" * 30_000 + "]" * 30_000 + "}"),
     None),
    ("not UTF-8", COMPLETIONS, b'{"model": "' + ALIAS.encode() + b'", "prompt": "\xff\xfe"}',
     None),
    ("trailing junk", COMPLETIONS, _with() + b" {}", None),
]

# (route, body, what Triton must receive for the field) for valid edge values
SERVED: list[tuple[str, str, bytes, dict[str, Any]]] = [
    ("greedy", COMPLETIONS, _with(temperature=0), {"temperature": 0.0}),
    ("temperature 0.01", COMPLETIONS, _with(temperature=0.01), {"temperature": 0.01}),
    ("temperature float32 0.01", COMPLETIONS, _with(temperature=0.009999999776482582),
     {"temperature": 0.009999999776482582}),
    ("temperature 2", CHAT, _chat(temperature=2), {"temperature": 2.0}),
    ("top_p ends", COMPLETIONS, _with(top_p=0.001), {"top_p": 0.001}),
    ("top_p 1", CHAT, _chat(top_p=1), {"top_p": 1.0}),
    ("seed lowest", COMPLETIONS, _with(seed=-(2**63)), {"seed": -(2**63)}),
    ("seed highest", COMPLETIONS, _with(seed=2**63 - 1), {"seed": 2**63 - 1}),
    ("max_tokens 512", COMPLETIONS, _with(max_tokens=512), {"max_tokens": 512}),
    ("max_completion_tokens", CHAT,
     json.dumps({k: v for k, v in CHAT_BASE.items() if k != "max_tokens"}
                | {"max_completion_tokens": 7}).encode(), {"max_tokens": 7}),
    ("explicit nulls", COMPLETIONS,
     _with(temperature=None, top_p=None, seed=None, n=None, user=None, stream=None,
           stream_options=None), {"max_tokens": 2}),
    ("stream false", COMPLETIONS, _with(stream=False, n=1, user="alice"), {"stream": False}),
    ("stream true with usage", CHAT, _chat(stream=True, stream_options={"include_usage": True}),
     {"stream": True}),
    ("prompt list of one", COMPLETIONS, _with(prompt=["hello"]), {"text_input": "hello"}),
]


def _post_all(world: World, cases: list[tuple[str, bytes]]
              ) -> tuple[list[tuple[int, Any]], Any]:
    """POST each (path, body) to a running gateway; the answers and the running gateway."""
    async def main() -> tuple[list[tuple[int, Any]], Any]:
        out = []
        async with running_gateway(world) as gw, aiohttp.ClientSession() as http:
            headers = {"Authorization": f"Bearer {world.api_key}",
                       "Content-Type": "application/json"}
            for path, body in cases:
                async with http.post(f"http://127.0.0.1:{gw.port}{path}", data=body,
                                     headers=headers) as r:
                    text = await r.read()
                    try:
                        out.append((r.status, json.loads(text)))
                    except ValueError:  # an SSE stream: its text
                        out.append((r.status, text))
            return out, gw

    return asyncio.run(main())


class StrictBodiesContract(WithRegistry):
    def test_hostile_bodies_are_refused_naming_the_field(self, world: World) -> None:
        answers, gw = _post_all(world, [(path, body) for _, path, body, _ in HOSTILE])
        wrong = {}
        for (case, _, _, param), (status, body) in zip(HOSTILE, answers, strict=True):
            err = body.get("error") if isinstance(body, dict) else None
            ok = (status == 400 and isinstance(err, dict)
                  and set(err) == {"message", "type", "param", "code"}
                  and err["type"] == "invalid_request_error" and err["param"] == param
                  and (param is None or param in err["message"]))
            if not ok:
                wrong[case] = (status, body)
        assert not wrong, json.dumps(wrong, indent=1, default=str)[:6000]
        assert gw.upstream.calls == [], "a hostile body reached Triton"
        assert gw.issued == [], "a ticket was signed for a hostile body"

    def test_temperature_refusal_says_where_the_range_comes_from(self, world: World) -> None:
        (status, body), = _post_all(world, [(COMPLETIONS, _with(temperature=2.5))])[0]
        message = body["error"]["message"]
        assert status == 400 and "between 0.01 and 2" in message and "OpenAI" in message
        assert "2.5" in message

    def test_valid_edge_values_are_served_as_given(self, world: World) -> None:
        answers, gw = _post_all(world, [(path, body) for _, path, body, _ in SERVED])
        refused = {case: a for (case, *_), a in zip(SERVED, answers, strict=True)
                   if a[0] != 200}
        assert not refused, refused
        assert len(gw.upstream.calls) == len(SERVED)
        for (case, _, _, expect), call in zip(SERVED, gw.upstream.calls, strict=True):
            got = {k: call.get(k) for k in expect}
            assert got == expect, (case, got)

    def test_duplicate_keys_are_refused_on_the_ticket_and_feedback_routes(
            self, world: World) -> None:
        async def main() -> list[tuple[int, Any]]:
            out = []
            async with running_gateway(world) as gw, aiohttp.ClientSession() as http:
                headers = {"Authorization": f"Bearer {world.api_key}"}
                for path, body in (
                        ("/v1/tickets", '{"alias": "someone-elses", "alias": "' + ALIAS + '"}'),
                        ("/v1/tickets", '{"alias": "' + ALIAS + '", "session": "a", '
                                        '"session": "b"}'),
                        ("/v1/tickets", '{"alias": "' + ALIAS + '", "x": NaN}'),
                        ("/v1/feedback", '{"request_id": "0b9c-a", "request_id": "0b9c-b", '
                                         '"success": true}'),
                        ("/v1/feedback", '{"request_id": "0b9c-a", "success": false, '
                                         '"success": true}')):
                    async with http.post(f"http://127.0.0.1:{gw.port}{path}",
                                         data=body.encode(), headers=headers) as r:
                        out.append((r.status, await r.json()))
                assert gw.issued == []
            return out

        for status, body in asyncio.run(main()):
            assert status == 400 and isinstance(body["error"], str), (status, body)


class TestStrictBodiesSQLite(OnSQLite, StrictBodiesContract):
    pass

