"""The served path against the real tritonserver: right adapter, right ledger row, every time."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from typer.testing import CliRunner

from control.cli.main import app
from control.contracts.db import make_engine
from control.contracts.ledger import Ledger
from control.contracts.synthetic import is_synthetic
from control.contracts.wire import ADAPTER_DIGEST, TEXT_OUTPUT
from control.ops.clients import Generation, generate, generate_endpoint, request_ticket
from projections.routing import RoutingView
from tests.integration.conftest import ROUTES, Stack
from tests.integration.reference import Reference

PROMPTS = ["Hello there", "What is the weather", "Tell me a story", "Name a colour",
           "Count to three", "Who are you", "Open the door", "The quiet river"]
MAX_TOKENS = 16  # byte-level tokens: enough for every kit marker phrase


@pytest.fixture(scope="module")
def reference(stack: Stack) -> Reference:
    return Reference(stack.kit_dir / stack.kit.base_path, stack.kit_dir / stack.kit.tokenizer_path)


def _adapter_dir(stack: Stack, name: str | None) -> Path | None:
    return None if name is None else stack.kit_dir / stack.kit.adapters[name].path


def _release(stack: Stack, tenant: str, alias: str) -> str:
    """The release manifest an alias resolves to (no canary split in this stack)."""
    route = RoutingView(make_engine(stack.settings.db_url)).resolve(tenant, alias)
    assert route is not None and route.release is not None
    return route.release


@pytest.mark.parametrize("route", ROUTES[:4], ids=lambda r: r[1])
def test_each_route_equals_its_peft_reference(stack: Stack, reference: Reference,
                                              route: tuple[str, str, str | None]) -> None:
    tenant, alias, name = route
    ticket = stack.ticket(tenant, alias)
    for proto, url in (("http", stack.http), ("grpc", stack.grpc)):
        g = generate(url, PROMPTS[0], ticket, protocol=proto, max_tokens=MAX_TOKENS)
        assert g.text == reference.generate(PROMPTS[0], _adapter_dir(stack, name), MAX_TOKENS)
        assert g.adapter_digest == (stack.digests[name] if name else "")
        if name:
            assert g.text.startswith(stack.kit.adapters[name].marker)


def test_adapters_answer_differently(stack: Stack) -> None:
    outs = {alias: generate(stack.http, "Hello", stack.ticket(t, alias), max_tokens=8).text
            for t, alias, _ in ROUTES[:4]}
    assert len(set(outs.values())) == 4, outs


def test_concurrent_mixed_burst_each_answer_its_own(stack: Stack, reference: Reference) -> None:
    tickets = {(t, a): stack.ticket(t, a) for t, a, _ in ROUTES}
    jobs = [(ROUTES[i % len(ROUTES)], PROMPTS[i % len(PROMPTS)], "http" if i % 3 else "grpc")
            for i in range(40)]

    def call(job: tuple[tuple[str, str, str | None], str, str]) -> Generation:
        (tenant, alias, _), prompt, proto = job
        url = stack.http if proto == "http" else stack.grpc
        return generate(url, prompt, tickets[(tenant, alias)], protocol=proto,
                        max_tokens=MAX_TOKENS)

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(call, jobs))
    ledger = Ledger(make_engine(stack.settings.db_url))
    assert len({g.request_id for g in results}) == len(jobs)
    releases = {(t, a): _release(stack, t, a) for t, a, _ in ROUTES}
    for ((tenant, alias, name), prompt, _), g in zip(jobs, results, strict=True):
        want = stack.digests[name] if name else None
        assert g.text == reference.generate(prompt, _adapter_dir(stack, name), MAX_TOKENS)
        assert (g.adapter_digest or None) == want
        row = ledger.get(g.request_id)
        assert row is not None and row.outcome == "ok"
        assert row.adapter_digest == want and row.tenant == tenant
        assert row.base_digest == stack.kit.base_digest
        assert row.tokenizer_digest == stack.kit.tokenizer_digest
        assert row.release_digest == releases[(tenant, alias)]  # signed in the ticket
        assert row.finished_at is not None and row.tokens_out is not None


def test_generate_extension_and_header_ticket(stack: Stack, reference: Reference) -> None:
    ticket = stack.ticket("acme", "acme-beta")
    want = reference.generate("Hello there", _adapter_dir(stack, "beta"), MAX_TOKENS)
    body = generate_endpoint(stack.http, "Hello there", ticket, MAX_TOKENS)
    assert body[TEXT_OUTPUT] == want
    assert body[ADAPTER_DIGEST] == stack.digests["beta"]
    for proto, url in (("http", stack.http), ("grpc", stack.grpc)):
        g = generate(url, "Hello there", ticket, protocol=proto, max_tokens=MAX_TOKENS,
                     header=True)
        assert g.text == want


def test_incident_query_lists_exactly_what_a_digest_served(stack: Stack) -> None:
    digest = stack.digests["alpha"]
    ticket = stack.ticket("acme", "acme-alpha")
    served = {generate(stack.http, p, ticket, max_tokens=4).request_id for p in PROMPTS[:5]}
    result = CliRunner().invoke(
        app, ["--json", "--home", str(stack.settings.home), "incident", "requests",
              "--adapter", digest], env={"LORAPLANE_DB_URL": stack.settings.db_url})
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)
    ids = {r["request_id"] for r in rows}
    assert served <= ids
    ledger = Ledger(make_engine(stack.settings.db_url))
    ok_for_digest = {r.request_id for r in ledger.query(outcome="ok")
                     if r.adapter_digest == digest}
    assert ids == ok_for_digest  # no more, no fewer
    # acme's requests, and any the control plane sent itself on the same digest (the gate's
    # control runs on the stable release): every request the digest served is on the list.
    assert all(r["adapter_digest"] == digest and (r["tenant"] == "acme"
                                                   or is_synthetic(r["tenant"])) for r in rows)
    # The same requests by the release the tickets named.
    release = _release(stack, "acme", "acme-alpha")
    by_release = CliRunner().invoke(
        app, ["--json", "--home", str(stack.settings.home), "incident", "requests",
              "--release", release], env={"LORAPLANE_DB_URL": stack.settings.db_url})
    assert by_release.exit_code == 0, by_release.output
    release_rows = json.loads(by_release.stdout)
    assert served <= {r["request_id"] for r in release_rows}
    assert {r["request_id"] for r in release_rows} == {
        r.request_id for r in ledger.query(release=release, outcome="ok")}
    assert all(r["release_digest"] == release and r["adapter_digest"] == digest
               for r in release_rows)


def test_tenant_cannot_get_a_ticket_for_another_tenants_alias(stack: Stack) -> None:
    status, body = request_ticket(stack.deployment.gateway_url, stack.api_keys["acme"],
                                  "globex-gamma")
    assert status == 403
    text = json.dumps(body)
    for secret in ("globex", "gamma", stack.digests["gamma"],
                   stack.digests["gamma"].removeprefix("sha256:")[:12]):
        assert secret not in text
    # Unknown alias: the same answer, so existence cannot be probed.
    status2, body2 = request_ticket(stack.deployment.gateway_url, stack.api_keys["acme"],
                                    "no-such-alias")
    assert (status2, body2) == (status, body)
    status3, _ = request_ticket(stack.deployment.gateway_url, "lp_wrong-key", "acme-alpha")
    assert status3 == 401
