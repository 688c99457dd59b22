"""A release with ``temperature: 0`` and ``max_tokens: 7`` answers with those values on the OpenAI
route and on Triton's generate route, when the request omits them, through the real gateway and
tritonserver; the ledger records the values used.

Before, the OpenAI route always sent its own ``max_tokens`` of 16 and no host read a release's
defaults.
"""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest

from control.contracts.db import make_engine
from control.contracts.ledger import Ledger
from control.contracts.wire import MODEL, REQUEST_ID, TEXT_INPUT, TEXT_OUTPUT, TICKET_PARAM
from control.tools.hostile.artifacts import synth_adapter
from tests.integration.conftest import ACTOR, Stack
from tests.integration.reference import Reference

pytestmark = pytest.mark.triton

ALIAS = "acme-defaults"
PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def adapter_dir(stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = stack.registry.base(next(iter(stack.registry.follower.routing().bases())).digest)
    src = synth_adapter(tmp_path_factory.mktemp("defaults") / "adapter", base.linear_shapes,
                        base.digest, seed=41, targets=("q_proj", "v_proj", "o_proj"))
    digest = stack.registry.register_adapter(src, tenant="acme", alias=ALIAS, actor=ACTOR)
    stack.registry.advance(digest, external=True, actor=ACTOR,
                           inference_defaults={"temperature": 0, "max_tokens": 7},
                           evaluation={"suite": "smoke", "passed": True, "producer": "test"})
    stack.registry.grant("acme", ALIAS, actor=ACTOR)
    return src


def _post(url: str, body: dict[str, object], headers: dict[str, str]) -> dict[str, object]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json", **headers})
    with urllib.request.urlopen(req, timeout=60) as r:
        return dict(json.loads(r.read()))


def test_the_release_defaults_answer_on_both_routes(stack: Stack, adapter_dir: Path) -> None:
    want = Reference(stack.kit_dir / "base", stack.kit_dir / "tokenizer").generate(
        PROMPT, adapter_dir, 7)
    ledger = Ledger(make_engine(stack.settings.db_url))

    openai = _post(f"{stack.deployment.gateway_url}/v1/completions",
                   {"model": ALIAS, "prompt": PROMPT},
                   {"Authorization": f"Bearer {stack.api_keys['acme']}"})
    choice = openai["choices"][0]  # type: ignore[index]
    assert choice["text"] == want and choice["finish_reason"] == "length"
    assert openai["usage"]["completion_tokens"] == 7  # type: ignore[index]

    generated = _post(f"http://{stack.http}/v2/models/{MODEL}/generate",
                      {TEXT_INPUT: PROMPT, "parameters": {TICKET_PARAM: stack.ticket("acme",
                                                                                       ALIAS)}},
                      {})
    assert generated[TEXT_OUTPUT] == want

    for rid in (str(openai["id"]).removeprefix("cmpl-"), str(generated[REQUEST_ID])):
        row = ledger.get(rid)
        assert row is not None and row.outcome == "ok"
        assert (row.tokens_out, row.max_tokens, row.temperature) == (7, 7, 0.0)
