"""Client side: getting tickets from the gateway and calling lora_llm with stock tritonclient.

Used by the demo, the tests and the benchmarks, so all three speak to Triton exactly the way a
tenant's application would.
"""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any

import numpy as np

MODEL = "lora_llm"


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


def request_ticket(gateway_url: str, api_key: str, alias: str) -> tuple[int, dict[str, Any]]:
    """POST /v1/tickets; returns (HTTP status, JSON body)."""
    req = urllib.request.Request(
        f"{gateway_url}/v1/tickets",
        data=json.dumps({"alias": alias}).encode(),
        headers={"Authorization": f"Bearer {api_key}", "Content-Type": "application/json"},
        method="POST",
    )
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return int(r.status), json.loads(r.read())
    except urllib.error.HTTPError as e:
        return int(e.code), json.loads(e.read() or b"{}")


def _inputs(mod: Any, text: str, max_tokens: int) -> list[Any]:
    t = mod.InferInput("text_input", [1, 1], "BYTES")
    t.set_data_from_numpy(np.array([[text.encode("utf-8")]], dtype=np.object_))
    m = mod.InferInput("max_tokens", [1, 1], "INT32")
    m.set_data_from_numpy(np.array([[max_tokens]], dtype=np.int32))
    return [t, m]


def _first(result: Any, name: str) -> str:
    v = result.as_numpy(name).reshape(-1)[0]
    return v.decode("utf-8") if isinstance(v, bytes) else str(v)


def generate(
    url: str,
    text: str,
    ticket: str | None,
    *,
    protocol: str = "http",
    max_tokens: int = 16,
    header: bool = False,
    parameters: dict[str, Any] | None = None,
) -> Generation:
    """One lora_llm inference over HTTP or gRPC; raises TritonRefused on an error answer.

    The ticket goes in the request parameter ``lora_ticket``, or with ``header=True`` in the
    ``x-lora-ticket`` header that Triton forwards to the model.
    """
    from tritonclient.utils import InferenceServerException

    if protocol == "http":
        import tritonclient.http as mod
    elif protocol == "grpc":
        import tritonclient.grpc as mod
    else:
        raise ValueError("protocol is http or grpc")
    params = dict(parameters or {})
    headers = {}
    if ticket is not None:
        if header:
            headers["x-lora-ticket"] = ticket
        else:
            params["lora_ticket"] = ticket
    client = mod.InferenceServerClient(url)
    try:
        result = client.infer(MODEL, _inputs(mod, text, max_tokens), parameters=params or None,
                              headers=headers or None)
    except InferenceServerException as e:
        raise TritonRefused(str(e.status()), e.message() or "") from None
    finally:
        client.close()
    return Generation(_first(result, "text_output"), _first(result, "request_id"),
                      _first(result, "adapter_digest"))


def generate_endpoint(
    http_url: str, text: str, ticket: str, max_tokens: int = 16
) -> dict[str, Any]:
    """POST /v2/models/lora_llm/generate (Triton's generate extension); returns the JSON body."""
    body = {"text_input": text, "max_tokens": max_tokens, "parameters": {"lora_ticket": ticket}}
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


STREAM_MODEL = "lora_llm_stream"


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
    inputs = _inputs(grpcclient, text, max_tokens)
    s = grpcclient.InferInput("stream", [1, 1], "BOOL")
    s.set_data_from_numpy(np.array([[True]], dtype=bool))
    inputs.append(s)
    pieces: list[str] = []
    rid = digest = ""
    cancelled = False
    try:
        client.async_stream_infer(STREAM_MODEL, inputs,
                                  parameters={"lora_ticket": ticket} if ticket else None,
                                  enable_empty_final_response=True)
        while True:
            result, error = answers.get(timeout=timeout_s)
            if error is not None:
                raise TritonRefused(str(error.status()), error.message() or "")
            response = result.get_response()
            if result.as_numpy("text_output") is not None:
                pieces.append(_first(result, "text_output"))
                rid, digest = _first(result, "request_id"), _first(result, "adapter_digest")
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
    body = {"text_input": text, "max_tokens": max_tokens, "stream": True,
            "parameters": {"lora_ticket": ticket}}
    req = urllib.request.Request(
        f"http://{http_url}/v2/models/{STREAM_MODEL}/generate_stream",
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
