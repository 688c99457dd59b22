"""A ledger row for every input that reaches the models, through the real tritonserver: 120 mixed
requests over HTTP infer, gRPC infer, generate, generate_stream and gRPC streaming, including
every malformed kind that reaches model code, give 120 rows, each with the reason it deserves.

Malformed kinds that reach the models: a tensor holding a batch of prompts (shape [2, 1]), a
tensor of the wrong length (shape [1, 2]), a generate body whose text_input is a list, duplicate
ticket keys, a ticket parameter and header that disagree, no ticket, a forged ticket, a prompt
that is not UTF-8, a prompt that is too long, a sampling value out of range.

What Triton itself refuses before any model code runs is listed apart and checked to stay out of
the count: a tensor of another datatype than the model declares, inputs whose batch sizes
differ, a generate body whose JSON types do not match the inputs' datatypes, a parameter that is
neither a string, an integer nor a boolean. No component of loraplane sees those requests (no
ticket is read, no tenant is known); Triton answers them itself (HTTP 400 or 500).

Before: a text_input holding two values raised out of the model's ``execute()``, and such requests
left no row (112 rows for 120 requests in the reviewer's run).
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from control.contracts.db import make_engine
from control.contracts.ledger import Ledger
from control.contracts.wire import MODEL, TEXT_INPUT, TICKET_HEADER, TICKET_PARAM
from control.ops.clients import (
    TritonRefused,
    generate,
    generate_endpoint,
    generate_stream_endpoint,
    stream_generate,
)
from tests.integration.conftest import Stack

pytestmark = pytest.mark.triton


def _post(url: str, body: bytes | dict[str, Any]) -> int:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"},
                                 method="POST")
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            r.read()
            return int(r.status)
    except urllib.error.HTTPError as e:
        e.read()
        return int(e.code)


def _raw_infer(stack: Stack, inputs: list[dict[str, Any]], params: dict[str, Any]) -> int:
    return _post(f"http://{stack.http}/v2/models/{MODEL}/infer",
                 {"inputs": inputs, "parameters": params})


def _text(values: list[str], shape: list[int]) -> dict[str, Any]:
    return {"name": TEXT_INPUT, "shape": shape, "datatype": "BYTES", "data": values}


def _refused(call: Callable[[], object]) -> None:
    with pytest.raises(TritonRefused):
        call()


def _kinds(stack: Stack, ticket: str) -> dict[str, tuple[Callable[[], object], str | None]]:
    """kind -> (one request of that kind, the ledger reason its row must carry)."""
    gen_url = f"http://{stack.http}/v2/models/{MODEL}/generate"

    def raw_bytes_prompt(raw: bytes) -> None:
        client = httpclient.InferenceServerClient(stack.http)
        try:
            t = httpclient.InferInput(TEXT_INPUT, [1, 1], "BYTES")
            t.set_data_from_numpy(np.array([[raw]], dtype=np.object_))
            with pytest.raises(Exception, match="invalid input text_input"):
                client.infer(MODEL, [t], parameters={TICKET_PARAM: ticket})
        finally:
            client.close()

    return {
        "http": (lambda: generate(stack.http, "Hi", ticket, max_tokens=2), None),
        "grpc": (lambda: generate(stack.grpc, "Hi", ticket, protocol="grpc", max_tokens=2),
                 None),
        "grpc_header": (lambda: generate(stack.grpc, "Hi", ticket, protocol="grpc",
                                         header=True, max_tokens=2), None),
        "generate": (lambda: generate_endpoint(stack.http, "Hi", ticket, 2), None),
        "generate_stream": (lambda: generate_stream_endpoint(stack.http, "Hi", ticket, 2),
                            None),
        "stream": (lambda: stream_generate(stack.grpc, "Hi", ticket, max_tokens=2), None),
        "batch_of_two": (lambda: _raw_infer(stack, [_text(["Hi", "Yo"], [2, 1])],
                                            {TICKET_PARAM: ticket}), "input_shape"),
        "wrong_length": (lambda: _raw_infer(stack, [_text(["Hi", "Yo"], [1, 2])],
                                            {TICKET_PARAM: ticket}), "input_shape"),
        "generate_list": (lambda: _post(gen_url, {TEXT_INPUT: ["Hi", "Yo"],
                                                  "parameters": {TICKET_PARAM: ticket}}),
                          "input_shape"),
        "duplicate_keys": (lambda: _post(gen_url, (
            f'{{"{TEXT_INPUT}": "Hi", "parameters": {{"{TICKET_PARAM}": "{ticket}", '
            f'"{TICKET_PARAM}": "{ticket}"}}}}').encode()), "parameters"),
        "disagreeing_header": (lambda: _refused(lambda: generate(
            stack.http, "Hi", ticket, headers={TICKET_HEADER: ticket + "x"})), "ambiguous"),
        "no_ticket": (lambda: _refused(lambda: generate(stack.http, "Hi", None)), "missing"),
        "forged_ticket": (lambda: _refused(lambda: generate(stack.http, "Hi", "v4.public.x")),
                          "format"),
        "not_utf8": (lambda: raw_bytes_prompt(b"\xff\xfe"), "prompt_encoding"),
        "too_long": (lambda: _refused(lambda: generate(stack.http, "x" * 9000, ticket)),
                     "prompt"),
        "bad_temperature": (lambda: _refused(lambda: generate(
            stack.http, "Hi", ticket, inputs={"temperature": float("nan")})),
            "invalid_temperature"),
    }


def test_120_mixed_requests_give_120_rows(stack: Stack) -> None:
    ticket = stack.ticket("acme", "acme-alpha")
    kinds = _kinds(stack, ticket)
    names = sorted(kinds)
    plan = [names[i % len(names)] for i in range(120)]
    ledger = Ledger(make_engine(stack.settings.db_url))
    since = time.time()
    for name in plan:
        kinds[name][0]()
    deadline = time.monotonic() + 30
    while True:
        rows = [r for r in ledger.query(since=since) if r.outcome != "running"]
        if len(rows) >= 120 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert len(rows) == 120, Counter(r.reason for r in rows)
    want = Counter(kinds[n][1] for n in plan)
    got = Counter(r.reason for r in rows)
    assert got == want
    served = [r for r in rows if r.reason is None]
    assert {r.outcome for r in served} == {"ok"}
    assert {r.served_digest for r in served} == {stack.digests["alpha"]}


def test_what_triton_refuses_itself_never_reaches_the_models(stack: Stack) -> None:
    ticket = stack.ticket("acme", "acme-alpha")
    gen_url = f"http://{stack.http}/v2/models/{MODEL}/generate"
    ledger = Ledger(make_engine(stack.settings.db_url))
    since = time.time()
    statuses = [
        _raw_infer(stack, [_text(["Hi"], [1, 1]), {"name": "max_tokens", "shape": [1, 1],
                                                   "datatype": "FP32", "data": [2.0]}],
                   {TICKET_PARAM: ticket}),  # a datatype the model does not declare
        _raw_infer(stack, [_text(["Hi", "Yo"], [2, 1]), {"name": "max_tokens", "shape": [1, 1],
                                                         "datatype": "INT32", "data": [2]}],
                   {TICKET_PARAM: ticket}),  # batch sizes that differ
        _post(gen_url, {TEXT_INPUT: "Hi", "max_tokens": "two",
                        "parameters": {TICKET_PARAM: ticket}}),  # JSON type vs datatype
        _post(gen_url, {TEXT_INPUT: "Hi", "parameters": {TICKET_PARAM: ticket,
                                                         "x": {"nested": 1}}}),
    ]
    assert all(400 <= s < 600 for s in statuses), statuses
    time.sleep(0.5)
    assert ledger.query(since=since) == []  # no model code saw them: nothing to record


def test_a_malformed_tensor_through_each_client_gets_its_own_message(stack: Stack) -> None:
    ticket = stack.ticket("acme", "acme-alpha")
    for mod, url in ((httpclient, stack.http), (grpcclient, stack.grpc)):
        client = mod.InferenceServerClient(url)
        try:
            t = mod.InferInput(TEXT_INPUT, [2, 1], "BYTES")
            t.set_data_from_numpy(np.array([[b"Hi"], [b"Yo"]], dtype=np.object_))
            with pytest.raises(Exception) as e:
                client.infer(MODEL, [t], parameters={TICKET_PARAM: ticket})
            assert "invalid input text_input: must hold exactly one value" in str(e.value)
        finally:
            client.close()
