"""Tenant-private caches through the real tritonserver (issue 23): tenant B sends tenant A's exact
prompt, on the base model and on an adapter granted to both, after A sent it and when A did not.
B's prefix-cache hits, read from the host's metrics, are 0 in both conditions; B's time to first
token in each condition is printed (median, p90), not asserted (two busy cores decide timing).

The hit count is the host's ``loraplane_backend_prefix_cache_total`` on Triton's metrics port:
every greedy request makes exactly one lookup, so the test waits until hits + misses have moved
by the number of requests it sent, then reads how many of them hit. A's own repeat and B's own
repeat must hit, so a cache that was off, or a metric that did not move, cannot pass.
"""

from __future__ import annotations

import statistics
import time
import urllib.request
import uuid
from pathlib import Path

import pytest

from control.ops.clients import generate, request_ticket
from tests.artifacts import perturbed_copy
from tests.integration.conftest import ACTOR, Stack

pytestmark = pytest.mark.triton

# Tenants of this test alone, so the session's acme and globex see no alias, adapter or
# statistics of it (other tests list their tenants' aliases and stats).
A, B = "iso-a", "iso-b"
SHARED_ALIAS = "iso-shared"  # an adapter of A's, granted to B as well
SHARED_FACTOR = 1.0917  # a perturbation no other test registers: the bytes are this test's
ROUNDS, PER_ROUND = 2, 4  # per condition and route: 8 of B's requests
HITS = 'loraplane_backend_prefix_cache_total{event="hit"}'
MISSES = 'loraplane_backend_prefix_cache_total{event="miss"}'
SETTLE_S = 20.0


def _lookups(stack: Stack) -> tuple[int, int]:
    """(hits, misses) of the host's prefix cache, as exported now (absent: none yet)."""
    url = f"http://127.0.0.1:{stack.deployment.ports.metrics}/metrics"
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    found = {HITS: 0, MISSES: 0}
    for line in text.splitlines():
        name, _, value = line.rpartition(" ")
        if name in found:
            found[name] = int(float(value))
    return found[HITS], found[MISSES]


class Lookups:
    """Counts the host's lookups from a settled start; ``delta(n)``: the hits among the next
    ``n`` lookups, once all ``n`` are exported."""

    def __init__(self, stack: Stack) -> None:
        self.stack = stack
        self.now = self._quiet()

    def _quiet(self) -> tuple[int, int]:
        # Earlier tests' lookups may still be on their way to the metric: wait for a second in
        # which nothing moves.
        deadline = time.monotonic() + SETTLE_S
        last = _lookups(self.stack)
        while time.monotonic() < deadline:
            time.sleep(1.1)
            now = _lookups(self.stack)
            if now == last:
                return now
            last = now
        raise AssertionError("the prefix-cache metric never settled")

    def delta(self, n: int) -> int:
        deadline = time.monotonic() + SETTLE_S
        while True:
            hits, misses = _lookups(self.stack)
            moved = hits + misses - sum(self.now)
            if moved >= n or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert moved == n, f"{moved} lookups exported for the {n} requests sent"
        got, self.now = hits - self.now[0], (hits, misses)
        return got


def _ttft(stack: Stack, ticket: str, prompt: str) -> float:
    """Seconds to B's first token: a one-token greedy answer, end to end over HTTP."""
    t0 = time.perf_counter()
    answer = generate(stack.http, prompt, ticket, max_tokens=1)
    elapsed = time.perf_counter() - t0
    assert answer.text is not None
    return elapsed


def _shared_adapter(stack: Stack, tmp_path: Path) -> None:
    """Tenants A and B, both granted the base; A's adapter on ``SHARED_ALIAS``, granted to both;
    waits until B may use it."""
    for tenant in (A, B):
        stack.api_keys[tenant] = stack.registry.create_tenant(tenant, actor=ACTOR)
        stack.registry.grant(tenant, "base", actor=ACTOR)
    alpha = stack.kit_dir / stack.kit.adapters["alpha"].path
    digest = stack.registry.register_adapter(
        perturbed_copy(alpha, tmp_path / "shared", SHARED_FACTOR), tenant=A, alias=SHARED_ALIAS,
        actor=ACTOR)
    stack.registry.advance(digest, external=True, evaluation={"suite": "smoke", "passed": True},
                           actor=ACTOR)
    for tenant in (A, B):
        stack.registry.grant(tenant, SHARED_ALIAS, actor=ACTOR)
    deadline = time.monotonic() + 30
    while any(request_ticket(stack.deployment.gateway_url, stack.api_keys[t], alias)[0] != 200
              for t in (A, B) for alias in ("base", SHARED_ALIAS)):
        assert time.monotonic() < deadline, "the tenants' grants never became visible"
        time.sleep(0.1)


def _summary(xs: list[float]) -> str:
    q = statistics.quantiles(xs, n=10, method="inclusive")
    return f"median {statistics.median(xs) * 1e3:6.1f} ms  p90 {q[8] * 1e3:6.1f} ms  n={len(xs)}"


def test_another_tenants_prompt_is_no_hit_through_triton(stack: Stack, tmp_path: Path) -> None:
    _shared_adapter(stack, tmp_path)
    lookups = Lookups(stack)
    report: list[str] = []
    for route, alias in (("base model", "base"), ("adapter granted to both", SHARED_ALIAS)):
        ta, tb = stack.ticket(A, alias), stack.ticket(B, alias)
        nonce = uuid.uuid4().hex[:8]  # no entry from an earlier test or run can answer
        ttft: dict[str, list[float]] = {"A sent it": [], "A did not": []}
        hits = {"A sent it": 0, "A did not": 0}
        a_prompts: list[str] = []
        for rnd in range(ROUNDS):  # the conditions alternate, so drift weighs on both alike
            order = ["A did not", "A sent it"]
            for condition in order if rnd % 2 == 0 else order[::-1]:
                for i in range(PER_ROUND):
                    prompt = f"{nonce} {rnd}.{i} {condition}: the quarterly numbers for {route}"
                    # Paired: A sends right before B in both conditions (so the host is as busy
                    # and as warm), its prompt B's own or another of the same length.
                    a_sends = prompt if condition == "A sent it" else prompt.swapcase()
                    generate(stack.http, a_sends, ta, max_tokens=1)
                    if a_sends == prompt:
                        a_prompts.append(prompt)
                    ttft[condition].append(_ttft(stack, tb, prompt))
                # A's sends are first sends of fresh prompts: every hit here is one of B's
                hits[condition] += lookups.delta(2 * PER_ROUND)
        for condition, xs in ttft.items():
            report.append(f"[{route}] B, {condition:9}: {hits[condition]} hits; TTFT "
                          f"{_summary(xs)}")
        # Both caches work: A's and B's own repeats hit (one each).
        own_ttft = [_ttft(stack, ta, a_prompts[0]),
                    _ttft(stack, tb, a_prompts[0])]  # B's own entry now (from above)
        own = lookups.delta(2)
        report.append(f"[{route}] own repeats (A, B): {own}/2 hits; TTFT "
                      + ", ".join(f"{t * 1e3:.1f} ms" for t in own_ttft))
        assert hits == {"A sent it": 0, "A did not": 0}, (route, hits)
        assert own == 2, f"{route}: a tenant's own repeat did not hit ({own}/2)"
    print("\n" + "\n".join(report))
