"""Forwarding an OpenAI-shaped request to Triton's generate extension, and answering in OpenAI's
shape: shared by the gateway's OpenAI routes (``control.gateway.openai_api``, API key, model =
alias) and each host's own route (``control.gateway.host_openai``, ticket, model = affinity).

Both send the same body to ``/v2/models/<model>/generate`` (``generate_stream`` when streaming),
map Triton's errors to a fixed text per class, and build the same completion objects and SSE
chunks; they differ in how the caller is authorised and where ``usage`` is read.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web

from control.contracts import wire
from control.contracts.placement import HostUrl, place
from control.contracts.tickets import GENERIC_REFUSAL
from control.gateway.bodies import OPENAI_BODY_LIMIT, BodyError, read_json_object
from control.gateway.observability import GatewayMetrics
from control.gateway.openai_request import (
    ApiError,
    Generation,
    bad_request,
    generation_of,
    model_of,
    prompt_of,
)

log = logging.getLogger("loraplane.gateway")

BUSY = "the model is busy or unavailable; retry"
# What a caller whose ticket is missing, malformed or refused by the host is told: the ticket
# verifier's own generic refusal, whatever the reason (the ledger keeps the reason).
TICKET_REFUSED = ApiError(401, GENERIC_REFUSAL, "invalid_request_error", "invalid_ticket")
# (usage, finish_reason) of a finished request, from its request id.
Closer = Callable[[str], tuple[dict[str, int], str]]


@dataclass
class Upstream:
    """Triton hosts to forward to: a request goes to the hosts of its ticket's pool, the one
    its route's affinity hashes to first (``control.contracts.placement.place``); a host that
    refuses connections is skipped for the next.

    ``ticket_refusals``: a Triton refusal of the ticket itself (its generic refusal) is told as
    :data:`TICKET_REFUSED`, for callers that bring their own ticket; the gateway signs its
    tickets, so one refused there is the request's fault class (400) as before."""

    hosts: list[HostUrl]
    model: str = wire.MODEL
    session: aiohttp.ClientSession | None = None
    tracer: Any = None
    metrics: GatewayMetrics | None = None
    ticket_refusals: bool = False
    _models: dict[str, frozenset[str]] | None = None

    def order(self, pool: str, affinity: str) -> list[str]:
        """Where to send a request of ticket pool ``pool`` and route ``affinity``, in turn."""
        return place(self.hosts, pool, affinity)

    async def target(self, stream: bool) -> tuple[str, frozenset[str]]:
        """The model to call and its input names. Streaming goes to ``<model>_stream`` (the
        decoupled engine model) where the hosts serve it; otherwise, and always for a plain
        completion, to ``model``. Read once from the first host that answers (every host serves
        the same model repository)."""
        if self._models is None:
            assert self.session is not None
            found: dict[str, frozenset[str]] = {}
            for url in (h.url for h in self.hosts):
                try:
                    for name in (self.model, self.model + wire.ENGINE_SUFFIX):
                        async with self.session.get(
                                f"http://{url}/v2/models/{name}/config") as r:
                            if r.status == 200:
                                cfg = await r.json(content_type=None)
                                found[name] = frozenset(str(i.get("name"))
                                                        for i in cfg.get("input", []))
                except aiohttp.ClientConnectionError:
                    continue
                break
            if self.model not in found:
                raise ApiError(503, BUSY, "server_error")
            self._models = found
        engine = self.model + wire.ENGINE_SUFFIX
        name = engine if stream and engine in self._models else self.model
        return name, self._models[name]

    def error(self, status: int, text: str = "") -> ApiError:
        """The OpenAI error for Triton's answer ``status`` (its error ``text`` only decides
        the class): never Triton's own words."""
        if self.metrics is not None:
            self.metrics.upstream_errors.labels("refused" if status == 400 else "error").inc()
        if status == 400 and self.ticket_refusals and GENERIC_REFUSAL in text:
            return TICKET_REFUSED
        if status == 400:
            return bad_request("request refused: check the prompt length, max_tokens and "
                               "sampling values")
        if status in (429, 503):
            return ApiError(503, BUSY, "server_error")
        return ApiError(502, "the model failed to answer", "server_error")


async def openai_body(request: web.Request) -> dict[str, Any]:
    """The body as a JSON object, read whole (:mod:`control.gateway.bodies`)."""
    try:
        return await read_json_object(request, OPENAI_BODY_LIMIT)
    except BodyError as e:
        code = {413: "request_too_large", 408: "request_timeout"}.get(e.status)
        raise ApiError(e.status, e.message, "invalid_request_error", code) from None


async def parsed_request(request: web.Request, chat: bool
                         ) -> tuple[dict[str, Any], str, Generation]:
    """The body, its ``model`` and the generation it asks for, every field checked (ApiError
    naming the first that is wrong): what both OpenAI routes, the gateway's and a host's, do
    before anything else."""
    body = await openai_body(request)
    return body, model_of(body), generation_of(body, prompt_of(body, chat))


def triton_body(up_inputs: frozenset[str], g: Generation, ticket: str,
                traceparent: str | None) -> dict[str, Any]:
    # What the client left out is left out here too: the host fills it from the release's
    # inference defaults (control.contracts.sampling.with_defaults), as for any other client.
    body: dict[str, Any] = {wire.TEXT_INPUT: g.prompt}
    for name, value in ((wire.MAX_TOKENS, g.max_tokens), (wire.TEMPERATURE, g.temperature),
                        (wire.TOP_P, g.top_p), (wire.SEED, g.seed)):
        if value is not None:
            body[name] = value
    if wire.STREAM in up_inputs:
        body[wire.STREAM] = g.stream
    params = {wire.TICKET_PARAM: ticket}
    if traceparent:
        params["traceparent"] = traceparent
    body["parameters"] = params
    return body


async def events(up: Upstream, model: str, body: dict[str, Any], stream: bool,
                 hosts: list[str]) -> AsyncGenerator[dict[str, Any], None]:
    """Triton's answer(s) from the first of ``hosts`` that takes the connection, as JSON
    objects; raises ApiError before the first one on failure."""
    assert up.session is not None
    endpoint = "generate_stream" if stream else "generate"
    last: Exception | None = None
    for url in hosts:
        try:
            # traceparent also as a header: Triton's own OpenTelemetry trace links to it
            tp = body["parameters"].get("traceparent")
            resp = await up.session.post(f"http://{url}/v2/models/{model}/{endpoint}",
                                         json=body, headers={"traceparent": tp} if tp else None)
        except aiohttp.ClientConnectionError as e:
            last = e
            continue
        async with resp:
            if resp.status != 200:
                raise up.error(resp.status, await resp.text())
            if not stream:
                yield dict(await resp.json(content_type=None))
                return
            async for raw in resp.content:
                line = raw.decode("utf-8", "replace").strip()
                if not line.startswith("data:"):
                    continue
                event = json.loads(line[5:].strip())
                if "error" in event:
                    raise up.error(400, str(event["error"]))
                yield event
        return
    log.warning("no Triton host reachable: %s", type(last).__name__)
    raise ApiError(503, BUSY, "server_error")


def answer(chat: bool, rid: str, created: int, model: str, text: str, finish: str,
           usage: Mapping[str, int]) -> web.Response:
    """A whole (not streamed) completion or chat completion."""
    choice: dict[str, Any] = (
        {"index": 0, "message": {"role": "assistant", "content": text},
         "finish_reason": finish} if chat else
        {"index": 0, "text": text, "logprobs": None, "finish_reason": finish})
    return web.json_response({"id": ("chatcmpl-" if chat else "cmpl-") + rid,
                              "object": "chat.completion" if chat else "text_completion",
                              "created": created, "model": model, "choices": [choice],
                              "usage": dict(usage)})


async def stream(request: web.Request, chat: bool, g: Generation, model: str, created: int,
                 first: dict[str, Any], rest: AsyncIterator[dict[str, Any]], s: Any,
                 close: Closer) -> web.StreamResponse:
    """The SSE answer: ``first`` and every event of ``rest`` as one chunk each, then the
    finish reason and (when asked) the usage ``close`` gives for the request id."""
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                       "Cache-Control": "no-cache"})
    await resp.prepare(request)
    rid = str(first.get(wire.REQUEST_ID, ""))
    s.set_attribute("loraplane.request_id", rid)
    cid = ("chatcmpl-" if chat else "cmpl-") + rid
    kind = "chat.completion.chunk" if chat else "text_completion"

    async def send(delta: str | None, finish: str | None, role: bool = False) -> None:
        if chat:
            d: dict[str, Any] = {"role": "assistant"} if role else {}
            if delta is not None:
                d["content"] = delta
            choice: dict[str, Any] = {"index": 0, "delta": d, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": delta or "", "logprobs": None, "finish_reason": finish}
        chunk = {"id": cid, "object": kind, "created": created, "model": model,
                 "choices": [choice]}
        await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")

    try:
        if chat:
            await send(None, None, role=True)
        await send(str(first.get(wire.TEXT_OUTPUT, "")), None)
        async for event in rest:
            await send(str(event.get(wire.TEXT_OUTPUT, "")), None)
        usage, finish = await _closed(close, rid)
        await send(None if chat else "", finish)
        if g.include_usage:
            tail = {"id": cid, "object": kind, "created": created, "model": model,
                    "choices": [], "usage": usage}
            await resp.write(b"data: " + json.dumps(tail).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
    except ApiError as e:
        # Headers are gone: report in-band, as OpenAI's API does.
        await resp.write(b"data: " + json.dumps({"error": {"message": e.message,
                                                           "type": e.kind}}).encode() + b"\n\n")
    except (ConnectionResetError, asyncio.CancelledError):
        log.info("stream closed by the client", extra={"request_id": rid})
        raise
    await resp.write_eof()
    return resp


async def _closed(close: Closer, rid: str) -> tuple[dict[str, int], str]:
    """``close(rid)`` (a database read) off the event loop, which serves every other request
    meanwhile; a ledger that cannot answer is an OpenAI-shaped 503, not a bare 500."""
    try:
        return await asyncio.to_thread(close, rid)
    except Exception:
        log.warning("could not read the ledger row of request %s", rid, exc_info=True)
        raise ApiError(503, "the request ran but its usage could not be read; retry later",
                       "server_error", "ledger_unavailable") from None


async def respond(request: web.Request, chat: bool, g: Generation, model: str, created: int,
                  answers: AsyncGenerator[dict[str, Any], None], s: Any,
                  close: Closer) -> web.StreamResponse:
    """The answer to the client from Triton's ``answers``: whole, or streamed as SSE."""
    first = await anext(answers)  # errors before the first event still get a status code
    if g.stream:
        return await stream(request, chat, g, model, created, first, answers, s, close)
    await answers.aclose()  # releases the upstream connection now
    rid = str(first.get(wire.REQUEST_ID, ""))
    s.set_attribute("loraplane.request_id", rid)
    usage, finish = await _closed(close, rid)
    return answer(chat, rid, created, model, str(first.get(wire.TEXT_OUTPUT, "")), finish, usage)


def add_completion_routes(app: web.Application,
                          serve: Callable[[web.Request, bool], Awaitable[web.StreamResponse]]
                          ) -> None:
    """``POST /v1/completions`` and ``/v1/chat/completions``, served by ``serve(request,
    chat)``."""
    async def completions(request: web.Request) -> web.StreamResponse:
        return await serve(request, False)

    async def chat_completions(request: web.Request) -> web.StreamResponse:
        return await serve(request, True)

    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)


def open_session(up: Upstream) -> Callable[[web.Application], AsyncIterator[None]]:
    """A cleanup context that holds ``up``'s client session while the app runs."""
    async def ctx(_app: web.Application) -> AsyncIterator[None]:
        up.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600))
        yield
        await up.session.close()

    return ctx
