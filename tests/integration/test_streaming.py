"""Streaming and cancellation on the decoupled engine model, against the real tritonserver."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from control.contracts.db import make_engine
from control.contracts.ledger import Ledger
from control.contracts.tickets import GENERIC_REFUSAL
from control.contracts.wire import ADAPTER_DIGEST, TEXT_OUTPUT
from control.ops.clients import (
    TritonRefused,
    generate,
    generate_stream_endpoint,
    stream_generate,
)
from tests.artifacts import perturbed_copy
from tests.integration.conftest import ACTOR, Stack

pytestmark = pytest.mark.triton


def test_grpc_stream_yields_pieces_that_join_to_the_unary_answer(stack: Stack) -> None:
    ticket = stack.ticket("acme", "acme-alpha")
    streamed = stream_generate(stack.grpc, "Hello there", ticket, max_tokens=16)
    unary = generate(stack.grpc, "Hello there", ticket, protocol="grpc", max_tokens=16)
    assert len(streamed.pieces) > 1
    assert streamed.text == unary.text
    assert streamed.text.startswith(stack.kit.adapters["alpha"].marker)
    assert streamed.adapter_digest == stack.digests["alpha"]
    row = Ledger(make_engine(stack.settings.db_url)).get(streamed.request_id)
    assert row is not None and row.outcome == "ok" and row.tenant == "acme"
    assert row.tokens_out is not None and row.tokens_out >= len(streamed.pieces)


def test_generate_stream_endpoint_streams_events(stack: Stack) -> None:
    ticket = stack.ticket("globex", "globex-gamma")
    events = generate_stream_endpoint(stack.http, "Name a colour", ticket, max_tokens=12)
    pieces = [e[TEXT_OUTPUT] for e in events if TEXT_OUTPUT in e]
    assert len(pieces) > 1
    assert "".join(pieces) == generate(stack.http, "Name a colour", ticket, max_tokens=12).text
    assert {e[ADAPTER_DIGEST] for e in events if ADAPTER_DIGEST in e} == {
        stack.digests["gamma"]}


def test_stream_refuses_a_bad_ticket_generically(stack: Stack) -> None:
    with pytest.raises(TritonRefused) as e:
        stream_generate(stack.grpc, "Hello", "not-a-ticket", max_tokens=4)
    # stream errors carry the message only (gRPC stream responses hold no status code)
    assert e.value.message == GENERIC_REFUSAL


def test_cancelled_stream_stops_between_steps_and_is_recorded(stack: Stack) -> None:
    ticket = stack.ticket("acme", "base")  # the bare base runs to max_tokens on these prompts
    streamed = stream_generate(stack.grpc, "Hello", ticket, max_tokens=200, cancel_after=2)
    assert len(streamed.pieces) >= 2
    ledger = Ledger(make_engine(stack.settings.db_url))
    deadline = time.monotonic() + 30
    row = ledger.get(streamed.request_id)
    while (row is None or row.outcome == "running") and time.monotonic() < deadline:
        time.sleep(0.1)
        row = ledger.get(streamed.request_id)
    assert row is not None and row.outcome == "cancelled", row
    assert row.tokens_out is not None and row.tokens_out < 200


def test_concurrent_streams_each_get_their_own_adapter(stack: Stack) -> None:
    routes = [("acme", "acme-alpha", "alpha"), ("acme", "acme-beta", "beta"),
              ("globex", "globex-gamma", "gamma")]
    tickets = {alias: stack.ticket(t, alias) for t, alias, _ in routes}
    jobs = [routes[i % 3] for i in range(12)]
    with ThreadPoolExecutor(12) as pool:
        out = list(pool.map(lambda r: stream_generate(stack.grpc, "Who are you",
                                                      tickets[r[1]], max_tokens=16), jobs))
    for (_, _, name), s in zip(jobs, out, strict=True):
        assert s.text.startswith(stack.kit.adapters[name].marker), (name, s.text)
        assert s.adapter_digest == stack.digests[name]


def test_moved_alias_never_serves_the_old_adapters_cached_prompt(stack: Stack,
                                                                tmp_path: Path) -> None:
    alpha = stack.kit_dir / stack.kit.adapters["alpha"].path
    gamma = stack.kit_dir / stack.kit.adapters["gamma"].path

    def register(src: Path, name: str, *, first: bool) -> str:
        digest = stack.registry.register_adapter(perturbed_copy(src, tmp_path / name, 1.04),
                                                 tenant="acme", alias="acme-moving",
                                                 actor=ACTOR)
        # The alias's first release may go straight to stable; a second one needs a completed
        # rollout or, as here (the move itself is what is tested), a recorded break-glass.
        stack.registry.advance(digest, external=True, actor=ACTOR,
                               to="stable" if first else "canary",
                               evaluation={"suite": "smoke", "passed": True})
        if not first:
            stack.registry.break_glass(digest, to="stable", actor=ACTOR,
                                       reason="test: the alias moves to another adapter")
        return digest

    old = register(alpha, "old", first=True)
    stack.registry.grant("acme", "acme-moving", actor=ACTOR)
    old_ticket = stack.ticket("acme", "acme-moving")
    first = generate(stack.http, "Hello there", old_ticket, max_tokens=16)
    cached = generate(stack.http, "Hello there", old_ticket, max_tokens=16)  # prefix cache hit
    assert first.adapter_digest == cached.adapter_digest == old
    assert first.text == cached.text and first.text.startswith(
        stack.kit.adapters["alpha"].marker)

    new = register(gamma, "new", first=False)  # the alias moves to another adapter
    deadline = time.monotonic() + 10
    while True:
        moved = generate(stack.http, "Hello there", stack.ticket("acme", "acme-moving"),
                         max_tokens=16)
        if moved.adapter_digest == new or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert moved.adapter_digest == new
    assert moved.text.startswith(stack.kit.adapters["gamma"].marker), moved.text
    # a ticket issued before the move stays bound to the digest it names
    assert generate(stack.http, "Hello there", old_ticket, max_tokens=16).text == first.text
