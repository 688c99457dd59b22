"""Chaos attribution through the real tritonserver: every ``ok`` answer is its own adapter's.

One deployment of its own (SQLite home, gateway, follower, tritonserver), whose engine model is
the production glue over a fault-injecting engine (tests/chaos_glue.py; a derived model
repository, which ``serve`` can never launch) with 4 device slots under 12 adapters of two
tenants, so loads evict all the time. 32 clients send ``LORAPLANE_CHAOS_REQUESTS`` (default 2,000)
requests over HTTP ``infer``, gRPC ``infer`` and gRPC streaming, mixed with hang-ups (streams
cancelled after the first piece, HTTP clients that give up), poisoned rows (non-finite logits)
and injected decode-step failures.

Evidence, all of it from outside the request: each ``ok`` answer's text equals PEFT's greedy output
for its own adapter computed in this process (the references of every adapter and the base differ
pairwise on every prompt used, so a swap cannot hide), and its ledger row says ``ok`` for the
right tenant with ``served_digest`` (read from the slot) equal to the ticket's adapter. Afterwards
no ledger row is ``running``, no row is ``identity_mismatch``, and Triton's metrics show 0 leases,
0 slot pins and 0 invariant violations.
"""

from __future__ import annotations

import os
import random
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from control.app.registry import Registry
from control.contracts import wire
from control.contracts.db import make_engine
from control.contracts.ledger import Ledger
from control.ops.clients import (
    Generation,
    Streamed,
    TritonRefused,
    generate,
    request_ticket,
    stream_generate,
)
from control.ops.model_repositories import derived_repository
from control.ops.serve import Deployment, Ports
from projections.follower import open_registry
from tests.artifacts import perturbed_copy
from tests.chaos_glue import MODEL_SOURCE, SLOTS
from tests.faults import FAIL_STEP, POISON_ROW
from tests.integration.conftest import ACTOR, sqlite_home
from tests.integration.reference import Reference

pytestmark = pytest.mark.triton

REQUESTS = int(os.environ.get("LORAPLANE_CHAOS_REQUESTS", "2000"))
CLIENTS = 32
MAX_TOKENS = 8
FACTORS = (1.0, 0.5, 2.0, -2.0)
# Which prompts set a route apart from every other (see the fixture) depends on the kit's
# training, whose floats differ with the CPU's instruction set, so offer plenty.
CANDIDATE_PROMPTS = ("Once upon a time", "The cat", "1 + 1", "A red bird", "What is", "x",
                     "the old king", "Hello", "a quiet river", "Why", "7", "sun and moon",
                     "The door opens", "zz", "One day")
TICKET_REFRESH_S = 60.0


@dataclass
class ChaosStack:
    deployment: Deployment
    registry: Registry
    keys: dict[str, str]  # tenant -> API key
    routes: list[tuple[str, str, str | None]]  # (tenant, alias, digest or None)
    paths: dict[str, Path]  # digest -> adapter directory
    prompts: dict[str | None, list[str]]  # digest or None -> prompts only it answers so
    expected: dict[tuple[str | None, str], str]  # (digest, prompt) -> PEFT greedy text


@pytest.fixture(scope="module")
def chaos(kit_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ChaosStack]:
    from control.tools.kit import KitManifest

    settings = sqlite_home(tmp_path_factory, "chaos-home")
    kit = KitManifest.load(kit_dir)
    reg = open_registry(settings)
    reg.register_base(kit_dir / kit.base_path, kit_dir / kit.tokenizer_path, name="tiny-llama",
                      actor=ACTOR, alias="base")
    keys = {t: reg.create_tenant(t, actor=ACTOR) for t in ("acme", "globex")}
    root = tmp_path_factory.mktemp("chaos-adapters")
    routes: list[tuple[str, str, str | None]] = []
    paths: dict[str, Path] = {}
    for i, (factor, name) in enumerate((f, n) for f in FACTORS
                                       for n in ("alpha", "beta", "gamma")):
        tenant = ("acme", "globex")[i % 2]
        path = perturbed_copy(kit_dir / kit.adapters[name].path, root / f"a{i}", factor)
        alias = f"{tenant}-{name}-{i}"
        digest = reg.register_adapter(path, tenant=tenant, alias=alias, actor=ACTOR)
        reg.advance(digest, external=True, evaluation={"suite": "chaos", "passed": True},
                    actor=ACTOR)
        reg.grant(tenant, alias, actor=ACTOR)
        routes.append((tenant, alias, digest))
        paths[digest] = path
    for tenant in keys:
        reg.grant(tenant, "base", actor=ACTOR)
        routes.append((tenant, "base", None))

    reference = Reference(kit_dir / "base", kit_dir / "tokenizer")
    texts = {p: {d: reference.generate(p, paths.get(d) if d else None, MAX_TOKENS)
                 for d in [None, *paths]} for p in CANDIDATE_PROMPTS}
    expected = {(d, p): t for p, by_route in texts.items() for d, t in by_route.items()}
    # A prompt proves a route's attribution when no other route answers it the same way: a
    # swap to any other adapter, or to the base, then shows in the text. Each route is asked
    # only such prompts.
    prompts = {d: [p for p, by_route in texts.items()
                   if list(by_route.values()).count(by_route[d]) == 1]
               for d in [None, *paths]}
    lacking = sum(not ps for ps in prompts.values())
    assert not lacking, f"{lacking} routes have no prompt that sets them apart from every other"

    ports = Ports.free()
    repo = derived_repository(tmp_path_factory.mktemp("chaos-repo") / "models", MODEL_SOURCE)
    dep = Deployment(settings, ports, actor=ACTOR, model_repository=repo)
    dep.start()
    try:
        yield ChaosStack(dep, reg, keys, routes, paths, prompts, expected)
    finally:
        dep.stop()


@dataclass(frozen=True)
class Job:
    tenant: str
    alias: str
    digest: str | None
    prompt: str
    kind: str  # http | grpc | stream | hangup_stream | hangup_http | poison | fail_step


KINDS = (["http"] * 34 + ["grpc"] * 30 + ["stream"] * 20 + ["hangup_stream"] * 6
         + ["hangup_http"] * 4 + ["poison"] * 4 + ["fail_step"] * 2)


class Tickets:
    """Fresh tickets from the gateway, one per alias, renewed before they expire."""

    def __init__(self, stack: ChaosStack) -> None:
        self.stack = stack
        self._lock = threading.Lock()
        self._held: dict[tuple[str, str], tuple[float, str]] = {}

    def __call__(self, tenant: str, alias: str) -> str:
        with self._lock:
            got = self._held.get((tenant, alias))
            if got is not None and time.monotonic() - got[0] < TICKET_REFRESH_S:
                return got[1]
        status, body = request_ticket(self.stack.deployment.gateway_url,
                                      self.stack.keys[tenant], alias)
        assert status == 200, body
        with self._lock:
            self._held[(tenant, alias)] = (time.monotonic(), str(body["ticket"]))
        return str(body["ticket"])


def _hang_up_http(http_url: str, prompt: str, ticket: str) -> None:
    """Send a generate request and give up before the answer (the client goes away)."""
    import json

    body = {wire.TEXT_INPUT: prompt, wire.MAX_TOKENS: 64,
            "parameters": {wire.TICKET_PARAM: ticket}}
    req = urllib.request.Request(f"http://{http_url}/v2/models/{wire.MODEL}/generate",
                                 data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=0.01) as r:
            r.read()
    except (urllib.error.URLError, TimeoutError, OSError):
        pass


def _metric(text: str, name: str) -> list[float]:
    return [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith(name) and not line.startswith("#")]


def test_chaos_attribution_through_real_triton(chaos: ChaosStack) -> None:
    rng = random.Random(20261201)
    jobs = []
    for _ in range(REQUESTS):
        tenant, alias, digest = rng.choice(chaos.routes)
        kind = rng.choice(KINDS)
        prompt = rng.choice(chaos.prompts[digest])
        if kind == "poison":
            prompt += POISON_ROW
        elif kind == "fail_step":
            prompt += FAIL_STEP
        jobs.append(Job(tenant, alias, digest, prompt, kind))
    tickets = Tickets(chaos)
    since = time.time()
    triton = chaos.deployment.triton
    assert triton is not None

    def run(job: Job) -> Generation | Streamed | str | None:
        ticket = tickets(job.tenant, job.alias)
        try:
            if job.kind in ("http", "poison"):
                return generate(triton.http_url, job.prompt, ticket, max_tokens=MAX_TOKENS)
            if job.kind in ("grpc", "fail_step"):
                return generate(triton.grpc_url, job.prompt, ticket, protocol="grpc",
                                max_tokens=MAX_TOKENS)
            if job.kind == "stream":
                return stream_generate(triton.grpc_url, job.prompt, ticket, max_tokens=MAX_TOKENS)
            if job.kind == "hangup_stream":
                stream_generate(triton.grpc_url, job.prompt, ticket, max_tokens=64, cancel_after=1)
                return None
            _hang_up_http(triton.http_url, job.prompt, ticket)
            return None
        except TritonRefused as e:
            return f"refused {e.status}: {e.message}"

    t0 = time.monotonic()
    with ThreadPoolExecutor(CLIENTS) as pool:
        results = list(pool.map(run, jobs))
    seconds = time.monotonic() - t0

    ledger = Ledger(make_engine(chaos.deployment.settings.db_url))
    wrong: list[tuple[Job, str, str]] = []
    outcomes: Counter[str] = Counter()
    ok_answers = 0
    for job, got in zip(jobs, results, strict=True):
        outcomes[job.kind + ":" + ("ok" if isinstance(got, Generation | Streamed)
                                   else "refused" if isinstance(got, str) else "gone")] += 1
        if not isinstance(got, Generation | Streamed):
            continue
        ok_answers += 1
        assert job.kind in ("http", "grpc", "stream"), f"a faulty row was answered ok: {job}"
        want = chaos.expected[(job.digest, job.prompt)]
        row = ledger.get(got.request_id)
        if (got.text != want or got.adapter_digest != (job.digest or "") or row is None
                or row.outcome != "ok" or row.tenant != job.tenant
                or row.adapter_digest != job.digest or row.served_digest != job.digest):
            wrong.append((job, got.text, want))
    rows = ledger.query(since=since - 1)
    by_outcome = Counter(r.outcome for r in rows)
    # Everything answered is on the record; hang-ups may finish after their client left.
    deadline = time.monotonic() + 30
    while by_outcome.get("running") and time.monotonic() < deadline:
        time.sleep(0.5)
        rows = ledger.query(since=since - 1)
        by_outcome = Counter(r.outcome for r in rows)

    metrics_url = f"http://127.0.0.1:{chaos.deployment.ports.metrics}/metrics"
    deadline = time.monotonic() + 10
    while True:  # gauges refresh every second
        with urllib.request.urlopen(metrics_url, timeout=5) as r:
            text = r.read().decode()
        leases = _metric(text, "loraplane_backend_leases")
        pins = _metric(text, "loraplane_backend_slot_pins")
        if (leases == [0.0] and pins == [0.0]) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    violations = _metric(text, "loraplane_backend_invariant_violations")
    mismatches = _metric(text, "loraplane_backend_identity_mismatches")

    print(f"\nchaos: {REQUESTS} requests, {CLIENTS} clients, {SLOTS} slots, "
          f"{len(chaos.paths)} adapters, {seconds:.0f} s; {ok_answers} ok answers checked "
          f"against PEFT; {len(wrong)} misattributed")
    print(f"chaos: by kind: {dict(sorted(outcomes.items()))}")
    print(f"chaos: ledger rows by outcome: {dict(sorted(by_outcome.items()))}")
    print(f"chaos: leases {leases}, pins {pins}, violations {sum(violations)}, "
          f"identity mismatches {mismatches}")
    assert wrong == [], wrong[:5]
    assert ok_answers >= REQUESTS // 2, "too few ok answers to mean anything"
    # An HTTP client that gives up within 10 ms may leave before its request was sent.
    gave_up = sum(1 for j in jobs if j.kind == "hangup_http")
    assert len(rows) >= REQUESTS - gave_up, "a request has no ledger row"
    assert not by_outcome.get("running"), "rows left running"
    assert not by_outcome.get("identity_mismatch")
    assert by_outcome.get("failed", 0) > 0  # the injected faults did reach the engine
    assert leases == [0.0] and pins == [0.0], "a lease or pin was leaked"
    assert violations and all(v == 0.0 for v in violations)
    assert mismatches == [0.0]
