"""Contract: a live host's metrics port, read as the endpoint picker reads it
(``tests.integration.router_protocol``): queue, KV and LoRA series in vLLM's names, adapters
named by the affinity values their requests' tickets carried (issue 25; digests only in the
operators' ``digest`` label), residency by level."""

from __future__ import annotations

import json
import re
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from control.ops.clients import generate, request_ticket
from tests.integration.conftest import Stack
from tests.integration.router_protocol import PodMetrics, families, lora_affinity, parse

DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")
AFFINITY = re.compile(r"^[0-9a-f]{16}$")


def _answer(stack: Stack, tenant: str, alias: str) -> tuple[str, str]:
    """(ticket, affinity) of the gateway's ticket answer."""
    status, body = request_ticket(stack.deployment.gateway_url, stack.api_keys[tenant], alias)
    assert status == 200, body
    return str(body["ticket"]), str(body["affinity"])


def _scrape(stack: Stack) -> str:
    url = f"http://127.0.0.1:{stack.deployment.ports.metrics}/metrics"
    with urllib.request.urlopen(url, timeout=10) as r:
        return str(r.read().decode())


def _until(stack: Stack, ok: object, timeout_s: float = 30.0) -> PodMetrics:
    assert callable(ok)
    deadline = time.monotonic() + timeout_s
    pod = parse(_scrape(stack))
    while not ok(pod) and time.monotonic() < deadline:
        time.sleep(0.05)
        pod = parse(_scrape(stack))
    return pod


def test_live_host_speaks_the_pickers_protocol(stack: Stack) -> None:
    alpha, beta = stack.digests["alpha"], stack.digests["beta"]
    (ticket_a, alpha_at), (ticket_b, beta_at) = (_answer(stack, "acme", "acme-alpha"),
                                                 _answer(stack, "acme", "acme-beta"))
    tickets = [ticket_a, ticket_b]
    # The session's stack is shared: the last in-flight series of an earlier test stands while
    # the host is idle (the picker skips empty ones). One request of this test's first, so what
    # stands when the burst starts is this test's own adapter.
    assert generate(stack.http, "placement warm-up", tickets[0], max_tokens=2
                    ).adapter_digest == alpha
    _until(stack, lambda p: p.running == 0 and p.waiting == 0
           and p.active_models == {alpha_at})
    seen: list[PodMetrics] = []
    stop = threading.Event()

    def watch() -> None:  # what the picker would have seen while the burst ran
        while not stop.is_set():
            seen.append(parse(_scrape(stack)))
            time.sleep(0.05)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        with ThreadPoolExecutor(4) as pool:
            outs = list(pool.map(lambda i: generate(stack.http, f"placement {i}",
                                                    tickets[i % 2], max_tokens=64), range(12)))
    finally:
        stop.set()
        watcher.join(10)
    assert {o.adapter_digest for o in outs} == {alpha, beta}
    # this burst's adapters by their affinity values, or by their digests where earlier requests
    # of the session on them came with tickets carrying none (the gate's, the rollout probes',
    # tests' own): an adapter is published by its two latest names
    names = {alpha_at, beta_at, alpha, beta}
    # Queue and KV families are always there. The LoRA family is rebuilt when its series
    # changes (Triton drops series only with their family), so a scrape may rarely miss it:
    # the picker then keeps what it had.
    missing_info = "metric family 'vllm:lora_requests_info' not found"
    assert seen and all(set(p.errors) <= {missing_info} for p in seen), seen[-1].errors
    assert sum(1 for p in seen if p.errors) <= max(1, len(seen) // 10)
    busy = [p for p in seen if p.active_models]
    assert busy, "no scrape saw an adapter in flight"
    assert any((p.running or 0) + (p.waiting or 0) > 0 for p in busy)
    for p in busy:
        # While this burst's requests run, the series names only their adapters. A scrape of an
        # idle host shows the last in-flight series standing; a CI run once saw, in a scrape with
        # nothing running or waiting, an adapter of an earlier test standing there (the warm-up
        # above waits for its own series but does not require it), so idle scrapes are judged
        # below, after the burst, when the standing series must be this test's.
        if (p.running or 0) + (p.waiting or 0) > 0:
            assert p.active_models is not None and p.active_models <= names
        assert p.max_active_models is not None and p.max_active_models >= 1
        assert len(p.active_models) <= 2 * p.max_active_models
        assert p.kv_usage is not None and 0.0 <= p.kv_usage <= 1.0

    idle = _until(stack, lambda p: p.running == 0 and p.waiting == 0)
    assert idle.running == 0 and idle.waiting == 0
    # idle: the last busy series stands (the picker skips empty ones), residency is reported
    assert idle.active_models and idle.active_models <= names
    resident = set().union(*idle.loaded.values())
    assert {alpha_at, beta_at} <= resident
    assert set(idle.loaded) <= {"device", "host"}


def test_series_name_affinity_values_or_digests_only_and_stay_bounded(stack: Stack) -> None:
    generate(stack.http, "bounded", stack.ticket("globex", "globex-gamma"), max_tokens=4)
    text = _scrape(stack)
    fams = families(text)
    info = fams["vllm:lora_requests_info"]
    assert len(info) == 1  # one series, however many adapters passed through
    for s in info:
        max_lora = int(s.labels["max_lora"])
        for key in ("running_lora_adapters", "waiting_lora_adapters"):
            names = [n for n in s.labels[key].split(",") if n]
            assert len(names) <= max_lora
            assert all(AFFINITY.match(n) or DIGEST.match(n) for n in names), names
    for s in fams["vllm:lora_adapter_loaded"]:
        assert set(s.labels) == {"adapter_name", "digest", "level"}
        assert AFFINITY.match(s.labels["adapter_name"]) or DIGEST.match(s.labels["adapter_name"])
        assert DIGEST.match(s.labels["digest"]) and s.labels["level"] in ("device", "host")
    secrets = ["acme", "globex", "alpha", "gamma", *stack.api_keys.values()]
    for line in text.splitlines():
        if line.startswith("vllm:"):
            assert not any(x in line for x in secrets), line


def test_the_picker_finds_the_model_a_host_openai_request_named(stack: Stack) -> None:
    """Issue 25: a request through the host's OpenAI route names its ticket's affinity value
    as ``model``; afterwards the host's metrics, read as the picker reads them, score that
    value 1.0 (active on this host) and list it as resident."""
    if stack.deployment.door is None:
        pytest.skip("haproxy is not installed: no front door")
    ticket, model = _answer(stack, "globex", "globex-gamma")
    statuses: list[int] = []

    def send(i: int) -> None:
        req = urllib.request.Request(
            f"http://{stack.deployment.tenant_http_url}/v1/completions", method="POST",
            data=json.dumps({"model": model, "prompt": f"placed {i}", "max_tokens": 64,
                             "temperature": 1.0, "seed": i}).encode(),
            headers={"Content-Type": "application/json", "x-loraplane-ticket": ticket})
        with urllib.request.urlopen(req, timeout=60) as r:
            statuses.append(r.status)

    # a burst in flight long enough for publish ticks (0.25 s) to see it: the picker, like the
    # exporter, only learns what runs while it runs
    burst = threading.Thread(target=lambda: list(ThreadPoolExecutor(3).map(send, range(9))))
    burst.start()
    pod = _until(stack, lambda p: model in (p.active_models or set()))
    burst.join(120)
    assert statuses == [200] * 9
    assert lora_affinity(pod, model) == 1.0
    assert model in set().union(*parse(_scrape(stack)).loaded.values())
    assert stack.digests["gamma"] not in (pod.active_models or set())
