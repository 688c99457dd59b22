"""A session keeps its release on the real deployment: gateway (``serve``'s, recording pins) and
tritonserver. The alias moves to another stable release; a session-less request and a new
session get the new one at once, while the session that started before the move keeps getting
tickets for, and answers computed by, its pinned release, on the tickets route and the
OpenAI route (``x-session-id``) alike."""

from __future__ import annotations

import json
import time
import urllib.request
import uuid

import pytest
import sqlalchemy as sa

from control.contracts.ledger import request_ledger
from control.ops.clients import generate, request_ticket
from tests.fixtures_control import ticket_claims
from tests.integration.conftest import ACTOR, Stack

pytestmark = pytest.mark.triton


def _ticket(stack: Stack, session: str | None = None) -> dict[str, str]:
    status, body = request_ticket(stack.deployment.gateway_url, stack.api_keys["acme"],
                                  "acme-alpha", session)
    assert status == 200, body
    # The answer names no arm: the release and adapter a test checks are the ticket's claims.
    claims = ticket_claims(str(body["ticket"]), stack.settings.keys_dir)
    return {**body, "release": claims["release"], "adapter_digest": claims["adapter"]}


def _served_by(stack: Stack, body: dict[str, str]) -> str:
    """The adapter digest the engine's slot held while it answered ``body``'s ticket."""
    return generate(stack.http, "Hi", body["ticket"], max_tokens=2).adapter_digest


def _openai_completion(stack: Stack, session: str) -> str:
    """One OpenAI completion in ``session``; returns the adapter digest its ledger row names."""
    req = urllib.request.Request(
        f"{stack.deployment.gateway_url}/v1/completions",
        data=json.dumps({"model": "acme-alpha", "prompt": "Hi", "max_tokens": 2}).encode(),
        headers={"Authorization": f"Bearer {stack.api_keys['acme']}",
                 "Content-Type": "application/json", "x-session-id": session},
        method="POST")
    with urllib.request.urlopen(req, timeout=60) as r:
        request_id = json.loads(r.read())["id"].removeprefix("cmpl-")
    with stack.registry.follower.engine.connect() as conn:
        return str(conn.execute(sa.select(request_ledger.c.served_digest)
                                .where(request_ledger.c.request_id == request_id)).scalar())


def test_a_session_keeps_its_release_across_a_move_of_the_alias(stack: Stack) -> None:
    reg = stack.registry
    alpha, beta = stack.digests["alpha"], stack.digests["beta"]
    r_alpha, r_beta = reg.adapter(alpha).release, reg.adapter(beta).release
    assert r_alpha is not None and r_beta is not None
    chat, assistant = f"chat-{uuid.uuid4().hex}", f"oa-{uuid.uuid4().hex}"
    assert _ticket(stack, chat)["release"] == r_alpha
    assert _openai_completion(stack, assistant) == alpha
    try:
        reg.point_alias("acme-alpha", r_beta, actor=ACTOR)  # acme owns beta's release too
        deadline = time.monotonic() + 2.0
        while (fresh := _ticket(stack))["release"] != r_beta:  # the gateway's 20 ms refresh
            assert time.monotonic() < deadline, "the gateway did not see the alias move"
            time.sleep(0.02)
        assert _served_by(stack, fresh) == beta
        assert _ticket(stack, f"new-{uuid.uuid4().hex}")["release"] == r_beta
        for _turn in range(3):  # later turns and reconnects: never the new release
            pinned = _ticket(stack, chat)
            assert (pinned["release"], pinned["adapter_digest"]) == (r_alpha, alpha)
            assert _served_by(stack, pinned) == alpha
        assert _openai_completion(stack, assistant) == alpha
    finally:
        reg.point_alias("acme-alpha", r_alpha, actor=ACTOR)  # as the other tests expect it
