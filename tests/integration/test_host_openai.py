"""Issue 25: a host's own OpenAI-compatible route, through its front door, on a real
tritonserver: ``model`` is the ticket answer's affinity value, the ticket travels in a header,
and the answer is what Triton's own generate gives for the same ticket and prompt."""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest
import sqlalchemy as sa

from control.contracts.db import make_engine
from control.contracts.ledger import request_ledger
from control.gateway.openai_request import MODEL_NOT_FOUND, render_chat
from control.ops.clients import request_ticket
from tests.integration.conftest import Stack, post_json

HEADER = "x-loraplane-ticket"
GREEDY = {"max_tokens": 8, "temperature": 0}


def _answer(stack: Stack, tenant: str, alias: str) -> dict[str, Any]:
    status, body = request_ticket(stack.deployment.gateway_url, stack.api_keys[tenant], alias)
    assert status == 200, body
    return dict(body)


def _triton_generate(stack: Stack, ticket: str, prompt: str) -> dict[str, Any]:
    """The reference: Triton's own generate endpoint, same ticket, prompt and sampling."""
    status, body = post_json(f"http://{stack.http}/v2/models/lora_llm/generate",
                         {"text_input": prompt, **GREEDY,
                          "parameters": {"lora_ticket": ticket}}, {})
    assert status == 200, body
    return dict(body)


def _ledger(stack: Stack, request_id: str) -> Any:
    t = request_ledger
    with make_engine(stack.settings.db_url).connect() as conn:
        return conn.execute(sa.select(t).where(t.c.request_id == request_id)).one_or_none()


def _names_nothing(stack: Stack, body: object) -> None:
    text = json.dumps(body)
    for secret in ("acme", "globex", "alpha", "beta", "gamma", "sha256",
                   *stack.digests.values()):
        assert secret not in text, text


@pytest.fixture(scope="module")
def door(stack: Stack) -> str:
    if stack.deployment.door is None:
        pytest.skip("haproxy is not installed: no front door")
    return f"http://{stack.deployment.tenant_http_url}"


def test_completion_through_the_door_is_tritons_own(stack: Stack, door: str) -> None:
    ans = _answer(stack, "acme", "acme-alpha")
    prompt = "host route"
    status, body = post_json(f"{door}/v1/completions",
                         {"model": ans["affinity"], "prompt": prompt, **GREEDY},
                         {HEADER: ans["ticket"]})
    assert status == 200, body
    assert body["object"] == "text_completion" and body["model"] == ans["affinity"]
    expected = _triton_generate(stack, ans["ticket"], prompt)
    assert body["choices"][0]["text"] == expected["text_output"]
    rid = body["id"].removeprefix("cmpl-")
    row = _ledger(stack, rid)
    assert row is not None and row.outcome == "ok"
    assert (row.tenant, row.adapter_digest) == ("acme", stack.digests["alpha"])
    assert body["usage"]["completion_tokens"] == row.tokens_out > 0
    _names_nothing(stack, {k: v for k, v in body.items() if k != "choices"})


def test_streamed_chat_with_a_bearer_ticket(stack: Stack, door: str) -> None:
    ans = _answer(stack, "acme", "acme-beta")
    messages = [{"role": "user", "content": "stream please"}]
    status, raw = post_json(f"{door}/v1/chat/completions",
                        {"model": ans["affinity"], "messages": messages, "stream": True,
                         **GREEDY}, {"Authorization": f"Bearer {ans['ticket']}"})
    assert status == 200, raw
    events = [json.loads(line[6:]) for line in str(raw).splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    assert str(raw).rstrip().endswith("data: [DONE]")
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events)
    assert text == _triton_generate(stack, ans["ticket"], render_chat(messages))["text_output"]
    assert events[-1]["choices"][0]["finish_reason"] in ("stop", "length")


def test_refusals_name_nothing(stack: Stack, door: str) -> None:
    alpha = _answer(stack, "acme", "acme-alpha")
    beta = _answer(stack, "acme", "acme-beta")
    gamma = _answer(stack, "globex", "globex-gamma")
    url = f"{door}/v1/completions"

    def call(model: str, headers: dict[str, str]) -> tuple[int, Any]:
        return post_json(url, {"model": model, "prompt": "x", **GREEDY}, headers)

    # the ticket's own alias, named by another value: the fixed 404
    for model in (beta["affinity"], "acme-alpha", stack.digests["alpha"]):
        status, body = call(model, {HEADER: alpha["ticket"]})
        assert status == 404 and body["error"]["message"] == MODEL_NOT_FOUND, body
        _names_nothing(stack, body)
    # no ticket, two different ones, or a malformed one: the generic refusal
    for headers in ({}, {HEADER: alpha["ticket"], "Authorization": f"Bearer {beta['ticket']}"},
                    {HEADER: "not a ticket"}):
        status, body = call(alpha["affinity"], headers)
        assert status == 401 and body["error"]["code"] == "invalid_ticket", body
        _names_nothing(stack, body)
    # another tenant's ticket cannot reach an adapter it is not granted by naming its value
    status, body = call(alpha["affinity"], {HEADER: gamma["ticket"]})
    assert status == 404, body
    # alpha's ticket with its affinity claim rewritten to beta's: Triton refuses the signature
    head, ver, payload, footer = alpha["ticket"].split(".")
    raw = base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4))
    forged_claims = raw[:-64].replace(alpha["affinity"].encode(), beta["affinity"].encode())
    forged = ".".join([head, ver, base64.urlsafe_b64encode(forged_claims + raw[-64:]).rstrip(
        b"=").decode(), footer])
    status, body = call(beta["affinity"], {HEADER: forged})
    assert status == 401 and body["error"]["code"] == "invalid_ticket", body
    _names_nothing(stack, body)
    # globex's own ticket, its own value: served with its own adapter only
    status, body = call(gamma["affinity"], {HEADER: gamma["ticket"]})
    assert status == 200, body
    row = _ledger(stack, body["id"].removeprefix("cmpl-"))
    assert (row.tenant, row.adapter_digest) == ("globex", stack.digests["gamma"])


def test_the_door_still_refuses_what_is_not_a_tenant_route(stack: Stack, door: str) -> None:
    for path in ("/v1/models", "/v2/repository/index", "/v1/embeddings"):
        status, _ = post_json(f"{door}{path}", {}, {})
        assert status == 403, path
