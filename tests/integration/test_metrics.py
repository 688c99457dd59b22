"""Metrics after a mixed burst: Triton's metrics port (backend custom metrics) and the gateway's
``/metrics``, with bounded labels; the stats endpoint scoped to the caller."""

from __future__ import annotations

import json
import re
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import openai
import pytest

from control.contracts.synthetic import is_synthetic
from control.ops.clients import TritonRefused, generate, request_ticket
from tests.integration.conftest import Stack

ADMIN = "test-operator-token-6"
ALLOWED_LABELS = {"outcome", "reason", "kind", "event", "route", "code",
                  "tier",  # the adapter cache's tiers: device, host, store
                  # Triton's own series
                  "model", "version", "gpu_uuid"}
SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})? (\S+)$")


def _scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as r:
        return str(r.read().decode())


def _samples(text: str, prefix: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    out = {}
    for line in text.splitlines():
        m = SAMPLE.match(line)
        if m and m.group(1).startswith(prefix):
            labels = frozenset(re.findall(r'(\w+)="([^"]*)"', m.group(3) or ""))
            out[(m.group(1), labels)] = float(m.group(4))
    return out


def _value(samples: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str,
           **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def _get(url: str, token: str) -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return int(r.status), json.loads(r.read())
    except urllib.error.HTTPError as e:
        return int(e.code), json.loads(e.read() or b"{}")


@pytest.fixture(scope="module")
def burst(stack: Stack) -> Iterator[dict[str, int]]:
    """A mixed burst: served requests on three adapters and the base, refused tickets, requests
    over the limits, OpenAI-route calls and ticket refusals at the gateway."""
    tickets = {a: stack.ticket(t, a) for t, a in (("acme", "acme-alpha"), ("acme", "acme-beta"),
                                                  ("globex", "globex-gamma"), ("acme", "base"))}
    jobs: list[tuple[str, str | None, int]] = []
    for i in range(12):
        alias = list(tickets)[i % 4]
        jobs.append((f"burst {i}", tickets[alias], 8))
    jobs += [("forged", "v4.public.not-a-ticket", 8)] * 3 + [("missing", None, 8)] * 2
    jobs += [("too long", tickets["acme-alpha"], 100000)] * 2

    def call(job: tuple[str, str | None, int]) -> str:
        prompt, ticket, max_tokens = job
        try:
            generate(stack.http, prompt, ticket, max_tokens=max_tokens)
            return "ok"
        except TritonRefused:
            return "refused"

    with ThreadPoolExecutor(6) as pool:
        outcomes = list(pool.map(call, jobs))
    client = openai.OpenAI(base_url=stack.deployment.gateway_url + "/v1",
                           api_key=stack.api_keys["acme"], max_retries=0)
    client.completions.create(model="acme-alpha", prompt="metrics", max_tokens=8)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="globex-gamma", prompt="metrics", max_tokens=8)
    assert request_ticket(stack.deployment.gateway_url, "wrong-key", "acme-alpha")[0] == 401
    assert request_ticket(stack.deployment.gateway_url, stack.api_keys["acme"],
                          "globex-gamma")[0] == 403
    yield {"ok": outcomes.count("ok") + 1, "refused": outcomes.count("refused")}


def _backend(stack: Stack, want_ok: float) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Backend series once its accounting thread has caught up with the burst."""
    url = f"http://127.0.0.1:{stack.deployment.ports.metrics}/metrics"
    deadline = time.monotonic() + 60
    while True:
        samples = _samples(_scrape(url), "loraplane_backend_")
        if _value(samples, "loraplane_backend_requests_total", outcome="ok") >= want_ok or \
                time.monotonic() > deadline:
            return samples
        time.sleep(0.5)


def test_backend_series_after_a_mixed_burst(stack: Stack, burst: dict[str, int]) -> None:
    s = _backend(stack, burst["ok"])
    assert _value(s, "loraplane_backend_requests_total", outcome="ok") >= burst["ok"]
    assert _value(s, "loraplane_backend_requests_total", outcome="rejected") >= burst["refused"]
    # ticket refusals by reason: forged tickets, missing tickets, and limits
    assert _value(s, "loraplane_backend_refusals_total", reason="missing") >= 2
    assert sum(v for (n, labels), v in s.items() if n == "loraplane_backend_refusals_total"
               and ("reason", "missing") not in labels) >= 5
    assert _value(s, "loraplane_backend_tokens_total", kind="completion") > 0
    assert _value(s, "loraplane_backend_tokens_total", kind="prompt") > 0
    assert _value(s, "loraplane_backend_request_seconds_count") >= burst["ok"]
    assert _value(s, "loraplane_backend_adapter_cache_total", event="hit",
                  reason="resident") > 0
    for kind in ("base_weights", "adapter_weights", "kv_cache", "workspace"):
        assert ("loraplane_backend_resident_bytes", frozenset({("kind", kind)})) in s
    assert _value(s, "loraplane_backend_resident_bytes", kind="base_weights") > 0
    assert _value(s, "loraplane_backend_resident_bytes", kind="adapter_weights") > 0
    for kind in ("adapter_banks", "gathered", "prefix_cache"):
        assert ("loraplane_backend_resident_bytes", frozenset({("kind", kind)})) in s
    # the banks are allocated in full: the resident adapters occupy part of them
    assert _value(s, "loraplane_backend_resident_bytes", kind="adapter_banks") > \
        _value(s, "loraplane_backend_resident_bytes", kind="adapter_weights")
    assert _value(s, "loraplane_backend_resident_adapters") >= 3


def test_gateway_series_after_a_mixed_burst(stack: Stack, burst: dict[str, int]) -> None:
    s = _samples(_scrape(stack.deployment.gateway_url + "/metrics"), "loraplane_gateway_")
    assert _value(s, "loraplane_gateway_tickets_total", outcome="issued") >= 4
    assert _value(s, "loraplane_gateway_tickets_total", outcome="unauthorised") >= 1
    assert _value(s, "loraplane_gateway_tickets_total", outcome="forbidden") >= 1
    assert _value(s, "loraplane_gateway_requests_total", route="/v1/completions",
                  code="200") >= 1
    assert _value(s, "loraplane_gateway_requests_total", route="/v1/completions",
                  code="404") >= 1
    assert _value(s, "loraplane_gateway_tokens_total", kind="completion") > 0
    assert _value(s, "loraplane_gateway_request_seconds_count", route="/v1/tickets") >= 4


def test_labels_are_bounded_and_name_no_one(stack: Stack, burst: dict[str, int]) -> None:
    _backend(stack, burst["ok"])
    texts = [_scrape(f"http://127.0.0.1:{stack.deployment.ports.metrics}/metrics"),
             _scrape(stack.deployment.gateway_url + "/metrics")]
    secrets = ["sha256:", "acme", "globex", "alpha", "gamma", *stack.api_keys.values()]
    for text in texts:
        for line in text.splitlines():
            if not line.startswith("loraplane_"):
                continue
            labels = dict(re.findall(r'(\w+)="([^"]*)"', line.split(" ")[0]))
            assert set(labels) <= ALLOWED_LABELS | {"le"}, line
            assert labels.get("tier", "device") in ("device", "host", "store"), line
            for secret in secrets:
                assert secret not in line, line


def test_stats_endpoint_scoped_to_the_caller(stack: Stack, burst: dict[str, int],
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    url = stack.deployment.gateway_url + "/v1/stats"
    status, acme = _get(url, stack.api_keys["acme"])
    assert status == 200 and acme["scope"] == "tenant"
    acme_digests = {d["adapter_digest"] for d in acme["digests"]}
    assert stack.digests["alpha"] in acme_digests and stack.digests["beta"] in acme_digests
    assert stack.digests["gamma"] not in acme_digests
    body = json.dumps(acme)
    assert "globex" not in body and stack.digests["gamma"] not in body
    assert all("tenant" not in d for d in acme["digests"])
    alpha = next(d for d in acme["digests"] if d["adapter_digest"] == stack.digests["alpha"])
    assert alpha["ok"] >= 3 and alpha["rejected"] >= 2 and alpha["tokens_out"] > 0

    status, globex = _get(url, stack.api_keys["globex"])
    assert {d["adapter_digest"] for d in globex["digests"]} <= {stack.digests["gamma"], None}
    assert "acme" not in json.dumps(globex)

    assert _get(url, ADMIN)[0] == 401  # no admin token configured yet: nobody is an operator
    monkeypatch.setenv("LORAPLANE_ADMIN_TOKEN", ADMIN)
    status, everyone = _get(url, ADMIN)
    assert status == 200 and everyone["scope"] == "all"
    # The operator sees every tenant, and the control plane's own traffic (the gate's, the
    # probes') under its synthetic tenant, apart from the tenants'.
    tenants = {d["tenant"] for d in everyone["digests"]}
    assert {"acme", "globex"} <= tenants
    # (every other tenant is one this session created: other tests add their own)
    assert all(t in stack.api_keys or is_synthetic(t) for t in tenants), tenants
    assert _get(url, "not-the-token")[0] == 401
