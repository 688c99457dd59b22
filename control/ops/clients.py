"""Client side: getting tickets from the gateway and calling lora_llm with stock tritonclient.

Used by the demo, the tests, the benchmarks and the hostile self-test, so all of them speak to
Triton exactly the way a tenant's application would: every unary inference goes through
:func:`infer_with` (:func:`generate` opens a client for one call).
"""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from control.contracts.placement import AFFINITY_HEADER, POOL_HEADER
from control.contracts.wire import (
    ADAPTER_DIGEST,
    ENGINE_MODEL,
    INPUT_DATATYPES,
    MAX_TOKENS,
    MODEL,
    REQUEST_ID,
    STREAM,
    TEXT_INPUT,
    TEXT_OUTPUT,
    TICKET_HEADER,
    TICKET_PARAM,
)


@dataclass(frozen=True)
class Generation:
    text: str
    request_id: str
    adapter_digest: str


class TritonRefused(Exception):
    """Triton answered with an error; ``status`` is its HTTP status or gRPC code name."""

    def __init__(self, status: str, message: str) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status
        self.message = message


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def request_ticket(gateway_url: str, api_key: str, alias: str,
                   session: str | None = None) -> tuple[int, dict[str, Any]]:
    """POST /v1/tickets (``session``: the client's session id, which keeps its release);
    returns (HTTP status, JSON body)."""
    body: dict[str, str] = {"alias": alias}
    if session is not None:
        body["session"] = session
    req = urllib.request.Request(
        f"{gateway_url}/v1/tickets",
        data=json.dumps(body).encode(),
        headers={"Authorization": f"Bearer {api_key}", "Content-Type": "application/json"},
        method="POST",
    )
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return int(r.status), json.loads(r.read())
    except urllib.error.HTTPError as e:
        return int(e.code), json.loads(e.read() or b"{}")


def _client_module(protocol: str) -> Any:
    """``tritonclient.http`` or ``tritonclient.grpc`` (imported here: only callers need it)."""
    if protocol == "http":
        import tritonclient.http as mod
    elif protocol == "grpc":
        import tritonclient.grpc as mod
    else:
        raise ValueError("protocol is http or grpc")
    return mod


def _inputs(mod: Any, text: str, values: Mapping[str, object]) -> list[Any]:
    """``text_input``, then each of ``values`` under its input name, with the datatype both
    models declare for it; values go as they are, in their range or not."""
    from tritonclient.utils import triton_to_np_dtype

    t = mod.InferInput(TEXT_INPUT, [1, 1], INPUT_DATATYPES[TEXT_INPUT])
    t.set_data_from_numpy(np.array([[text.encode("utf-8")]], dtype=np.object_))
    tensors = [t]
    for name, value in values.items():
        datatype = INPUT_DATATYPES[name]
        x = mod.InferInput(name, [1, 1], datatype)
        x.set_data_from_numpy(np.array([[value]], dtype=triton_to_np_dtype(datatype)))
        tensors.append(x)
    return tensors


def _first(result: Any, name: str) -> str:
    v = result.as_numpy(name).reshape(-1)[0]
    return v.decode("utf-8") if isinstance(v, bytes) else str(v)


def infer_with(
    client: Any,
    protocol: str,
    text: str,
    ticket: str | None,
    *,
    max_tokens: int = 16,
    header: bool = False,
    parameters: Mapping[str, Any] | None = None,
    headers: Mapping[str, str] | None = None,
    inputs: Mapping[str, float | int] | None = None,
    affinity: str | None = None,
    pool: str | None = None,
) -> Generation:
    """One lora_llm inference through an open ``tritonclient`` client of ``protocol`` (http or
    grpc); raises TritonRefused on an error answer.

    The ticket goes in the request parameter ``lora_ticket``, or with ``header=True`` in the
    ``x-lora-ticket`` header that Triton forwards to the model. ``parameters`` and ``headers``
    travel beside it as given; ``inputs`` adds optional inputs by name (``temperature``,
    ``top_p``, ``seed``; a ``max_tokens`` there replaces the argument). Nothing is checked here:
    the hostile self-test says through these whatever a hostile client would.
    """
    from tritonclient.utils import InferenceServerException

    mod = _client_module(protocol)
    params = dict(parameters or {})
    sent_headers = dict(headers or {})
    if affinity is not None:  # the ticket answer's placement value, for a balancer
        sent_headers[AFFINITY_HEADER] = affinity
    if pool is not None:  # the ticket answer's pool: the balancer's backend of that pool
        sent_headers[POOL_HEADER] = pool
    if ticket is not None:
        if header:
            sent_headers[TICKET_HEADER] = ticket
        else:
            params[TICKET_PARAM] = ticket
    tensors = _inputs(mod, text, {MAX_TOKENS: max_tokens, **(inputs or {})})
    try:
        result = client.infer(MODEL, tensors, parameters=params or None,
                              headers=sent_headers or None)
    except InferenceServerException as e:
        raise TritonRefused(str(e.status()), e.message() or "") from None
    return Generation(_first(result, TEXT_OUTPUT), _first(result, REQUEST_ID),
                      _first(result, ADAPTER_DIGEST))


def generate(
    url: str,
    text: str,
    ticket: str | None,
    *,
    protocol: str = "http",
    max_tokens: int = 16,
    header: bool = False,
    parameters: Mapping[str, Any] | None = None,
    headers: Mapping[str, str] | None = None,
    inputs: Mapping[str, float | int] | None = None,
    affinity: str | None = None,
    pool: str | None = None,
) -> Generation:
    """One lora_llm inference over HTTP or gRPC on a client of its own (see
    :func:`infer_with` for the arguments; ``affinity`` and ``pool``: the ticket answer's, sent
    as the balancer's placement headers); raises TritonRefused on an error answer."""
    client = _client_module(protocol).InferenceServerClient(url)
    try:
        return infer_with(client, protocol, text, ticket, max_tokens=max_tokens, header=header,
                          parameters=parameters, headers=headers, inputs=inputs,
                          affinity=affinity, pool=pool)
    finally:
        client.close()


def generate_endpoint(
    http_url: str, text: str, ticket: str, max_tokens: int = 16
) -> dict[str, Any]:
    """POST /v2/models/lora_llm/generate (Triton's generate extension); returns the JSON body."""
    body = {TEXT_INPUT: text, MAX_TOKENS: max_tokens, "parameters": {TICKET_PARAM: ticket}}
    req = urllib.request.Request(
        f"http://{http_url}/v2/models/{MODEL}/generate",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return dict(json.loads(r.read()))
    except urllib.error.HTTPError as e:
        raise TritonRefused(str(e.code), json.loads(e.read() or b"{}").get("error", "")) from None



@dataclass(frozen=True)
class Streamed:
    """A streamed generation: the pieces as they arrived, and the joined text."""

    pieces: list[str]
    request_id: str
    adapter_digest: str

    @property
    def text(self) -> str:
        return "".join(self.pieces)


def stream_generate(
    grpc_url: str,
    text: str,
    ticket: str | None,
    *,
    max_tokens: int = 16,
    cancel_after: int | None = None,
    timeout_s: float = 120.0,
) -> Streamed:
    """Stream one generation over gRPC ``stream_infer`` from the decoupled engine model.

    With ``cancel_after=n`` the stream is cancelled once ``n`` pieces have arrived. Raises
    TritonRefused on an error answer.
    """
    import queue

    import tritonclient.grpc as grpcclient

    answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
    client = grpcclient.InferenceServerClient(grpc_url)
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    inputs = _inputs(grpcclient, text, {MAX_TOKENS: max_tokens, STREAM: True})
    pieces: list[str] = []
    rid = digest = ""
    cancelled = False
    try:
        client.async_stream_infer(ENGINE_MODEL, inputs,
                                  parameters={TICKET_PARAM: ticket} if ticket else None,
                                  enable_empty_final_response=True)
        while True:
            result, error = answers.get(timeout=timeout_s)
            if error is not None:
                raise TritonRefused(str(error.status()), error.message() or "")
            response = result.get_response()
            if result.as_numpy(TEXT_OUTPUT) is not None:
                pieces.append(_first(result, TEXT_OUTPUT))
                rid, digest = _first(result, REQUEST_ID), _first(result, ADAPTER_DIGEST)
            final = response.parameters.get("triton_final_response")
            if final is not None and final.bool_param:
                break
            if cancel_after is not None and len(pieces) >= cancel_after:
                cancelled = True
                break
    finally:
        client.stop_stream(cancel_requests=cancelled)
        client.close()
    return Streamed(pieces, rid, digest)


def generate_stream_endpoint(
    http_url: str, text: str, ticket: str, max_tokens: int = 16
) -> list[dict[str, Any]]:
    """POST /v2/models/lora_llm_stream/generate_stream (server-sent events); the events' JSON."""
    body = {TEXT_INPUT: text, MAX_TOKENS: max_tokens, STREAM: True,
            "parameters": {TICKET_PARAM: ticket}}
    req = urllib.request.Request(
        f"http://{http_url}/v2/models/{ENGINE_MODEL}/generate_stream",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    events: list[dict[str, Any]] = []
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            for line in r:
                line = line.strip()
                if line.startswith(b"data:"):
                    events.append(dict(json.loads(line[5:])))
    except urllib.error.HTTPError as e:
        raise TritonRefused(str(e.code), json.loads(e.read() or b"{}").get("error", "")) from None
    return events


def post_feedback(gateway_url: str, api_key: str, request_id: str,
                  success: bool) -> tuple[int, dict[str, Any]]:
    """POST /v1/feedback: rate one of the tenant's own requests; returns (HTTP status, body)."""
    req = urllib.request.Request(
        f"{gateway_url}/v1/feedback",
        data=json.dumps({"request_id": request_id, "success": success}).encode(),
        headers={"Authorization": f"Bearer {api_key}", "Content-Type": "application/json"},
        method="POST",
    )
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return int(r.status), json.loads(r.read())
    except urllib.error.HTTPError as e:
        return int(e.code), json.loads(e.read() or b"{}")
