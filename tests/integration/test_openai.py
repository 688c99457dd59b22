"""The official ``openai`` client against the gateway's OpenAI-compatible routes, real Triton."""

from __future__ import annotations

import urllib.error
import urllib.request

import openai
import pytest

from control.contracts.wire import ENGINE_MODEL
from control.gateway.openai_request import MODEL_NOT_FOUND, render_chat
from control.ops.clients import generate
from tests.integration.conftest import Stack

MAX_TOKENS = 16


def _serves_stream_model(stack: Stack) -> bool:
    try:
        with urllib.request.urlopen(
                f"http://{stack.http}/v2/models/{ENGINE_MODEL}/ready", timeout=5) as r:
            return bool(r.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def _client(stack: Stack, tenant: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.deployment.gateway_url + "/v1",
                         api_key=stack.api_keys[tenant], max_retries=0, timeout=120)


def test_models_lists_only_the_callers_granted_aliases(stack: Stack) -> None:
    assert {m.id for m in _client(stack, "acme").models.list()} == {
        "acme-alpha", "acme-beta", "base"}
    assert {m.id for m in _client(stack, "globex").models.list()} == {"globex-gamma", "base"}
    assert _client(stack, "acme").models.retrieve("acme-alpha").id == "acme-alpha"
    with pytest.raises(openai.NotFoundError):
        _client(stack, "acme").models.retrieve("globex-gamma")


def test_completion_equals_triton_served_with_a_ticket(stack: Stack) -> None:
    prompt = "Hello there"
    out = _client(stack, "acme").completions.create(model="acme-alpha", prompt=prompt,
                                                    max_tokens=MAX_TOKENS)
    direct = generate(stack.http, prompt, stack.ticket("acme", "acme-alpha"),
                      max_tokens=MAX_TOKENS)
    assert out.choices[0].text == direct.text
    assert out.choices[0].text.startswith(stack.kit.adapters["alpha"].marker)
    assert out.model == "acme-alpha"
    assert out.usage is not None and out.usage.completion_tokens > 0
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens


def test_chat_uses_the_documented_template(stack: Stack) -> None:
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Name a colour"}]
    out = _client(stack, "globex").chat.completions.create(
        model="globex-gamma", messages=messages, max_tokens=MAX_TOKENS)  # type: ignore[arg-type]
    direct = generate(stack.http, render_chat(messages), stack.ticket("globex", "globex-gamma"),
                      max_tokens=MAX_TOKENS)
    msg = out.choices[0].message
    assert msg.role == "assistant" and msg.content == direct.text
    assert direct.adapter_digest == stack.digests["gamma"]


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_streaming_chunks_add_up_to_the_completion(stack: Stack, chat: bool) -> None:
    client = _client(stack, "acme")
    if chat:
        messages = [{"role": "user", "content": "Tell me a story"}]
        full = client.chat.completions.create(model="acme-beta", messages=messages,  # type: ignore[arg-type]
                                              max_tokens=MAX_TOKENS).choices[0].message.content
        chunks = list(client.chat.completions.create(
            model="acme-beta", messages=messages, max_tokens=MAX_TOKENS,  # type: ignore[arg-type]
            stream=True, stream_options={"include_usage": True}))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    else:
        full = client.completions.create(model="acme-beta", prompt="Tell me a story",
                                         max_tokens=MAX_TOKENS).choices[0].text
        chunks = list(client.completions.create(
            model="acme-beta", prompt="Tell me a story", max_tokens=MAX_TOKENS, stream=True,
            stream_options={"include_usage": True}))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full and text.startswith(stack.kit.adapters["beta"].marker)
    pieces = [c for c in chunks if c.choices and (c.choices[0].text if not chat
                                                  else c.choices[0].delta.content)]
    if _serves_stream_model(stack):
        assert len(pieces) > 1  # token by token from the decoupled engine model
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] in ("stop", "length") and not any(finishes[:-1])
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0


@pytest.mark.parametrize("model", ["globex-gamma", "no-such-alias", "acme-alpha-typo"])
def test_foreign_or_unknown_model_is_one_404_naming_nothing(stack: Stack, model: str) -> None:
    client = _client(stack, "acme")
    for call in (
        lambda: client.completions.create(model=model, prompt="hi", max_tokens=4),
        lambda: client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4),
        lambda: client.completions.create(model=model, prompt="hi", max_tokens=4, stream=True),
    ):
        with pytest.raises(openai.NotFoundError) as e:
            call()
        body = e.value.response.text
        assert e.value.response.status_code == 404
        assert MODEL_NOT_FOUND in body
        for other in ("globex", "gamma", "acme-beta", "sha256:"):
            assert other not in body


def test_bad_key_and_bad_input_are_clean_errors(stack: Stack) -> None:
    bad = openai.OpenAI(base_url=stack.deployment.gateway_url + "/v1", api_key="nope",
                        max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    with pytest.raises(openai.BadRequestError):
        _client(stack, "acme").completions.create(model="acme-alpha", prompt="hi",
                                                  max_tokens=100000)
    with pytest.raises(openai.BadRequestError):
        _client(stack, "acme").chat.completions.create(
            model="acme-alpha", messages=[{"role": "tool", "content": "x"}])  # type: ignore[list-item,misc]
