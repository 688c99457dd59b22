"""Where a client may put its ticket, on every route it can use, and what two tickets do.

Triton forwards ``x-lora-.*`` headers to the model on HTTP and gRPC ``infer`` and on gRPC
``stream_infer``; there a ticket in the header works, and a header ticket that differs from the
parameter ticket is refused. Triton 2.51 forwards no header on the generate extension
(``generate``, ``generate_stream``): there only ``parameters.lora_ticket`` reaches the model, a
header-only request is refused as having no ticket, and a header beside a parameter is never seen.
The README says the same; this test pins it on the real server.
"""

from __future__ import annotations

import json
import queue
import urllib.error
import urllib.request
from typing import Any

import numpy as np
import pytest

from control.contracts.tickets import GENERIC_REFUSAL
from control.contracts.wire import (
    ADAPTER_DIGEST,
    ENGINE_MODEL,
    MAX_TOKENS,
    MODEL,
    STREAM,
    TEXT_INPUT,
    TICKET_HEADER,
    TICKET_PARAM,
)
from control.ops.clients import TritonRefused, generate
from tests.integration.conftest import Stack

pytestmark = pytest.mark.triton


def _post(url: str, body: dict[str, Any], headers: dict[str, str]) -> tuple[int, str]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json", **headers})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return int(r.status), r.read().decode()
    except urllib.error.HTTPError as e:
        return int(e.code), e.read().decode()


def _stream_infer(stack: Stack, params: dict[str, Any] | None,
                  headers: dict[str, str] | None) -> tuple[bool, str]:
    """One gRPC stream_infer request; (ok, adapter digest or error message)."""
    import tritonclient.grpc as grpcclient

    answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
    client = grpcclient.InferenceServerClient(stack.grpc)
    client.start_stream(callback=lambda result, error: answers.put((result, error)),
                        headers=headers)
    text = grpcclient.InferInput(TEXT_INPUT, [1, 1], "BYTES")
    text.set_data_from_numpy(np.array([[b"Hi"]], dtype=np.object_))
    n = grpcclient.InferInput(MAX_TOKENS, [1, 1], "INT32")
    n.set_data_from_numpy(np.array([[4]], dtype=np.int32))
    try:
        client.async_stream_infer(ENGINE_MODEL, [text, n], parameters=params)
        result, error = answers.get(timeout=60)
        if error is not None:
            return False, str(error.message())
        return True, str(result.as_numpy(ADAPTER_DIGEST).reshape(-1)[0].decode())
    finally:
        client.stop_stream()
        client.close()


def test_tickets_in_headers_and_parameters_on_every_route(stack: Stack) -> None:
    alpha, beta = stack.ticket("acme", "acme-alpha"), stack.ticket("acme", "acme-beta")
    want_alpha = stack.digests["alpha"]

    # infer, HTTP and gRPC: the header works alone; two different tickets are refused.
    for proto, url in (("http", stack.http), ("grpc", stack.grpc)):
        assert generate(url, "Hi", alpha, protocol=proto, header=True,
                        max_tokens=4).adapter_digest == want_alpha
        with pytest.raises(TritonRefused) as e:
            generate(url, "Hi", alpha, protocol=proto, max_tokens=4,
                     parameters={TICKET_HEADER: beta})
        assert e.value.message == GENERIC_REFUSAL
    # The same two tickets as a real header beside the parameter (HTTP infer).
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(stack.http)
    text = httpclient.InferInput(TEXT_INPUT, [1, 1], "BYTES")
    text.set_data_from_numpy(np.array([[b"Hi"]], dtype=np.object_))
    with pytest.raises(Exception, match="invalid or unauthorised routing ticket"):
        client.infer(MODEL, [text], parameters={TICKET_PARAM: alpha},
                     headers={TICKET_HEADER: beta})
    client.close()

    # stream_infer (gRPC): the same as infer.
    assert _stream_infer(stack, None, {TICKET_HEADER: alpha}) == (True, want_alpha)
    ok, message = _stream_infer(stack, {TICKET_PARAM: alpha}, {TICKET_HEADER: beta})
    assert not ok and message == GENERIC_REFUSAL

    # The generate extension: headers never reach the model.
    for route, stream in ((f"{MODEL}/generate", False),
                          (f"{ENGINE_MODEL}/generate_stream", True)):
        url = f"http://{stack.http}/v2/models/{route}"
        body: dict[str, Any] = {TEXT_INPUT: "Hi", MAX_TOKENS: 4, STREAM: stream}
        status, text_out = _post(url, body, {TICKET_HEADER: alpha})
        assert status == 400 and GENERIC_REFUSAL in text_out  # no ticket reached it
        status, text_out = _post(url, {**body, "parameters": {TICKET_PARAM: alpha}},
                                 {TICKET_HEADER: beta})
        assert status == 200 and want_alpha in text_out  # the parameter's, the header unseen
