"""The hostile self-test: tries on purpose to make a running deployment misroute, leak or lose.

``loraplane selftest hostile --json`` runs it against a deployment that is already serving. It
needs what an operator has: the gateway URL, Triton's HTTP and gRPC addresses, and the home
folder and database URL (``--home``/``LORAPLANE_DB_URL``) to create its own two tenants and
adapters (random ``st-...`` names, synthesised from the served base's shapes) and to read the
ledger. It signs forged tickets with keys it makes up, and with the home's signing key for
tickets that are genuine but bound to something else. It never stops or kills the deployment's
processes; the faults it injects are its own (a gateway subprocess it kills with SIGKILL, clients
that hang up mid-request). Killing tritonserver and cutting the database run in the pytest suite
(``tests/hostile``), which owns its deployment.

Every case counts as *refused as expected* (or served correctly, where serving is right) or as
*failed*, with a line saying what went wrong. After the run, the adapters it registered are
revoked so nothing it made stays servable.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import hmac
import http.client
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from control.clients import Generation, TritonRefused, free_port, generate, request_ticket
from control.config import Settings
from control.domain import ValidationFailed
from control.hostile_artifacts import HOSTILE_ARTIFACTS, synth_adapter
from control.tickets import GENERIC_REFUSAL, TicketSigner

CATEGORIES = ("identity", "tickets", "parameters", "artifacts", "faults", "attribution")
ACTOR = "selftest"
MAX_TOKENS = 8
REFUSED_STATUS = ("400", "StatusCode.INVALID_ARGUMENT")


@dataclass(frozen=True)
class Target:
    """A running deployment, as the operator sees it."""

    settings: Settings
    gateway_url: str
    http_url: str  # host:port
    grpc_url: str  # host:port
    metrics_url: str | None = None  # Triton's metrics endpoint, e.g. http://host:8002/metrics
    base: str | None = None  # the served base digest (default: the only one registered)


@dataclass
class CategoryResult:
    tried: int = 0
    refused: int = 0  # refused (or served correctly) as expected
    failed: int = 0
    failures: list[str] = field(default_factory=list)


@dataclass
class Report:
    categories: dict[str, CategoryResult] = field(
        default_factory=lambda: {c: CategoryResult() for c in CATEGORIES})

    def check(self, category: str, case: str, ok: bool, detail: str = "") -> bool:
        r = self.categories[category]
        r.tried += 1
        if ok:
            r.refused += 1
        else:
            r.failed += 1
            r.failures.append(f"{case}: {detail}"[:300])
        return ok

    @property
    def failed(self) -> int:
        return sum(r.failed for r in self.categories.values())

    def to_json(self) -> dict[str, Any]:
        return {c: {"tried": r.tried, "refused_as_expected": r.refused, "failed": r.failed,
                    "failures": r.failures} for c, r in self.categories.items()}


@dataclass(frozen=True)
class Route:
    tenant: str
    alias: str
    digest: str


def _stable(registry: Any, digest: str) -> None:
    """Walk a freshly registered adapter through candidate and canary to stable."""
    registry.release(digest, evaluation={"suite": "selftest", "passed": True}, actor=ACTOR)


class HostileSuite:
    """Creates its tenants and adapters, runs every category, revokes what it made."""

    def __init__(self, target: Target, *, attribution_requests: int = 1000, clients: int = 32,
                 work_dir: Path | None = None) -> None:
        from control.db import make_engine
        from control.registry import Registry
        from projections.routing import RoutingView

        self.t = target
        self.registry = Registry(target.settings)
        self.routing = RoutingView(make_engine(target.settings.db_url))
        self.attribution_requests = attribution_requests
        self.clients = clients
        self.work = Path(work_dir or tempfile.mkdtemp(prefix="lp-selftest-"))
        self.report = Report()
        tag = secrets.token_hex(3)
        self.a, self.b = f"st-a-{tag}", f"st-b-{tag}"
        self.keys: dict[str, str] = {}
        self.routes: dict[str, Route] = {}
        self.made: list[str] = []
        self._seed = int(tag, 16)
        self.base = ""
        self.shapes: dict[str, list[int]] = {}

    # -- setup ----------------------------------------------------------------------------------

    def _ledger(self) -> Any:
        from backend.ledger import Ledger
        from control.db import make_engine

        return Ledger(make_engine(self.t.settings.db_url))

    def _new_adapter(self, tenant: str, alias: str, *, grant: bool = True,
                     stable: bool = True) -> Route:
        self._seed += 1
        src = synth_adapter(self.work / f"{alias}-{self._seed}", self.shapes, self.base,
                            seed=self._seed, targets=("q_proj", "v_proj", "o_proj"))
        digest = self.registry.register_adapter(src, tenant=tenant, alias=alias, actor=ACTOR)
        self.made.append(digest)
        if stable:
            _stable(self.registry, digest)
        if grant:
            self.registry.grant(tenant, alias, actor=ACTOR)
        return Route(tenant, alias, digest)

    def setup(self) -> None:
        from control.serve import pick_base

        self.base = pick_base(self.routing, self.t.base)
        self.shapes = self.registry.base(self.base).linear_shapes
        for tenant in (self.a, self.b):
            self.keys[tenant] = self.registry.create_tenant(tenant, actor=ACTOR)
        for key, tenant in (("a1", self.a), ("a2", self.a), ("b1", self.b)):
            self.routes[key] = self._new_adapter(tenant, f"{tenant}-{key}")
        self._wait_routable(self.routes.values())

    def _wait_routable(self, routes: Any, timeout_s: float = 30.0) -> None:
        # The gateway resolves on the projection, which follows the event store.
        deadline = time.monotonic() + timeout_s
        for r in routes:
            while request_ticket(self.t.gateway_url, self.keys[r.tenant], r.alias)[0] != 200:
                if time.monotonic() > deadline:
                    raise RuntimeError("the selftest's aliases never became routable")
                time.sleep(0.1)

    def ticket(self, route: Route) -> str:
        status, body = request_ticket(self.t.gateway_url, self.keys[route.tenant], route.alias)
        if status != 200:
            raise RuntimeError(f"no ticket for the selftest's own alias ({status})")
        return str(body["ticket"])

    def secrets_of(self, tenant: str) -> list[str]:
        """Identifiers of ``tenant`` that no other tenant may ever see."""
        out = [tenant]
        for r in self.routes.values():
            if r.tenant == tenant:
                out += [r.alias, r.digest, r.digest.removeprefix("sha256:")[:12]]
        return out

    def leaks(self, text: str, tenant: str) -> list[str]:
        return [s for s in self.secrets_of(tenant) if s in text]

    def cleanup(self) -> None:
        for digest in self.made:
            with contextlib.suppress(Exception):  # already revoked by a case
                self.registry.revoke(digest, reason="selftest finished", actor=ACTOR)

    # -- helpers --------------------------------------------------------------------------------

    def refused_by_triton(self, category: str, case: str, ticket: str | None,
                          leak_of: str | None = None, **kw: Any) -> None:
        for proto, url in (("http", self.t.http_url), ("grpc", self.t.grpc_url)):
            try:
                g = generate(url, "Hello", ticket, protocol=proto, max_tokens=2, **kw)
            except TritonRefused as e:
                leaked = self.leaks(e.message, leak_of) if leak_of else []
                self.report.check(category, f"{case}/{proto}",
                                  e.status in REFUSED_STATUS and e.message == GENERIC_REFUSAL
                                  and not leaked, f"{e.status} {e.message[:80]} leaks={leaked}")
            else:
                self.report.check(category, f"{case}/{proto}", False,
                                  f"served (adapter {g.adapter_digest or 'base'})")

    def signer(self) -> TicketSigner:
        return TicketSigner.load_or_create(self.t.settings.keys_dir)[0]

    def claims(self, adapter: str | None, **over: Any) -> dict[str, Any]:
        c: dict[str, Any] = dict(tenant=self.a, model=self.t.settings.model_name, base=self.base,
                                 adapter=adapter, tokenizer=self._tokenizer(),
                                 release=self._release(adapter), ttl_s=300)
        c.update(over)
        return c

    def _release(self, adapter: str | None) -> str | None:
        """The release manifest the control plane would sign beside ``adapter``."""
        row = self.routing.adapter(adapter) if adapter is not None else None
        return row.release_digest if row is not None else None

    def _tokenizer(self) -> str:
        return next(b.tokenizer_digest for b in self.routing.bases() if b.digest == self.base)

    def no_loads(self, category: str, case: str, digest: str) -> None:
        loads = self._ledger().loads(digest)
        served = [r for r in self._ledger().query(adapter=digest) if r.outcome != "rejected"]
        self.report.check(category, case, not loads and not served,
                          f"{len(loads)} load records, {len(served)} served rows")

    # -- categories -----------------------------------------------------------------------------

    def run(self, categories: tuple[str, ...] = CATEGORIES) -> Report:
        self.setup()
        try:
            for c in categories:
                getattr(self, f"case_{c}")()
        finally:
            self.cleanup()
        return self.report

    def case_identity(self) -> None:
        cat, gw = "identity", self.t.gateway_url
        a_key, b1 = self.keys[self.a], self.routes["b1"]
        forbidden = request_ticket(gw, a_key, "no-such-alias-" + secrets.token_hex(4))
        for case, alias in (("b-alias", b1.alias), ("b-digest", b1.digest),
                            ("b-release", b1.digest.replace("sha256:", "sha256:0")[:71]),
                            ("b-tenant-name", b1.tenant), ("b-alias-case", b1.alias.upper())):
            status, body = request_ticket(gw, a_key, alias)
            text = json.dumps(body)
            self.report.check(cat, case, status in (400, 403) and not self.leaks(text, self.b)
                              and (status != 403 or (status, body) == forbidden),
                              f"{status} {text[:120]}")
        # B's key and no key against every route, admin and tenant-scoped ones included.
        for case, method, path, key in (
                ("no-key", "POST", "/v1/tickets", None), ("bad-key", "POST", "/v1/tickets",
                                                           "lp_" + secrets.token_urlsafe(32)),
                ("stats-no-key", "GET", "/v1/stats", None),
                ("admin-tenants", "GET", "/v1/admin/tenants", a_key),
                ("admin-adapters", "POST", "/v1/adapters", a_key),
                ("b-tenant-path", "GET", f"/v1/tenants/{b1.tenant}/tickets", a_key),
                ("b-model", "GET", f"/v1/models/{b1.alias}", a_key)):
            status, text = _http(gw + path, method, key, {"alias": b1.alias})
            self.report.check(cat, case, status in (400, 401, 403, 404, 405)
                              and not self.leaks(text, self.b), f"{status} {text[:120]}")
        for case, path in (("stats", "/v1/stats"), ("models", "/v1/models"),
                           ("metrics", "/metrics")):
            status, text = _http(gw + path, "GET", a_key, None)
            self.report.check(cat, f"{case}-visible-to-a", status in (200, 401, 403, 404)
                              and not self.leaks(text, self.b),
                              f"{status} leaks={self.leaks(text, self.b)}")
        if self.t.metrics_url:
            triton_metrics = _http(self.t.metrics_url, "GET", None, None)[1]
            self.report.check(cat, "triton-metrics", not self.leaks(triton_metrics, self.b),
                              f"leaks={self.leaks(triton_metrics, self.b)}")
        # A revoked version: the old ticket is refused, a new one is not issued.
        r = self._new_adapter(self.a, f"{self.a}-revoked")
        self._wait_routable([r])
        ticket = self.ticket(r)
        self.registry.revoke(r.digest, reason="selftest", actor=ACTOR)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            try:
                generate(self.t.http_url, "Hello", ticket, max_tokens=1)
            except TritonRefused:
                break
            time.sleep(0.05)
        self.refused_by_triton(cat, "revoked-version", ticket)
        self.report.check(cat, "revoked-no-new-ticket",
                          request_ticket(gw, a_key, r.alias)[0] == 403)
        # An adapter of another base, by a genuine ticket for a base this host does not serve.
        signer = self.signer()
        other_base = "sha256:" + hashlib.sha256(b"another base").hexdigest()
        token = signer.issue(**self.claims(self.routes["a1"].digest, base=other_base))[0]
        self.refused_by_triton(cat, "other-base", token)
        self._concurrent_alias_moves()
        self._client_disconnect(cat)

    def _concurrent_alias_moves(self) -> None:
        """Tickets issued while the alias flips between two releases: each serves its own."""
        cat = "identity"
        a1, a2 = self.routes["a1"], self.routes["a2"]
        alias = f"{self.a}-moving"
        first = self._new_adapter(self.a, alias)
        self._wait_routable([first])
        stop = threading.Event()
        targets = [a1.digest, a2.digest]

        def mover() -> None:
            i = 0
            while not stop.is_set():
                try:
                    self.registry.point_alias(alias, targets[i % 2], actor=ACTOR)
                except Exception as e:  # some lifecycles refuse a cross-alias point: fine
                    self.report.check(cat, "alias-move", False, type(e).__name__)
                    return
                i += 1
                time.sleep(0.02)

        allowed = {first.digest, *targets}

        def one(_i: int) -> tuple[str | None, Generation | str]:
            status, body = request_ticket(self.t.gateway_url, self.keys[self.a], alias)
            if status != 200:
                return None, f"ticket {status}"
            try:
                return body.get("adapter_digest"), generate(self.t.http_url, "Hi", body["ticket"],
                                                            max_tokens=2)
            except TritonRefused as e:
                return body.get("adapter_digest"), e.message

        th = threading.Thread(target=mover)
        th.start()
        try:
            with ThreadPoolExecutor(8) as pool:
                results = list(pool.map(one, range(48)))
        finally:
            stop.set()
            th.join()
        ledger = self._ledger()
        for want, g in results:
            if not isinstance(g, Generation):
                self.report.check(cat, "alias-move-ticket", False, str(g))
                continue
            row = ledger.get(g.request_id)
            self.report.check(cat, "alias-move-ticket",
                              want in allowed and g.adapter_digest == want and row is not None
                              and row.adapter_digest == want and row.tenant == self.a,
                              f"ticket {want} served {g.adapter_digest}")

    def _client_disconnect(self, cat: str) -> None:
        """A client that hangs up mid-generation: no row stays running, service unaffected.

        Streaming cancellation is not part of the non-decoupled model: this closes the socket
        before the answer, the nearest a client can get to cancelling.
        """
        ticket = self.ticket(self.routes["a1"])
        before = time.time()
        host, port = self.t.http_url.rsplit(":", 1)
        body = json.dumps({"text_input": "Tell me a long story", "max_tokens": 64,
                           "parameters": {"lora_ticket": ticket}}).encode()
        for _ in range(4):
            conn = http.client.HTTPConnection(host, int(port), timeout=0.05)
            try:
                conn.request("POST", "/v2/models/lora_llm/generate", body,
                             {"Content-Type": "application/json"})
                conn.getresponse().read()
            except (TimeoutError, OSError, http.client.HTTPException):
                pass
            finally:
                conn.close()
        deadline = time.monotonic() + 60
        running: list[Any] = []
        while time.monotonic() < deadline:
            running = [r for r in self._ledger().query(tenant=self.a, since=before)
                       if r.outcome == "running"]
            if not running:
                break
            time.sleep(0.2)
        self.report.check(cat, "client-disconnect-rows-closed", not running,
                          f"{len(running)} rows still running")
        try:
            ok = generate(self.t.http_url, "Hello", ticket,
                          max_tokens=2).adapter_digest == self.routes["a1"].digest
        except TritonRefused:
            ok = False
        self.report.check(cat, "client-disconnect-service-continues", ok)

    def case_tickets(self) -> None:
        cat = "tickets"
        signer = self.signer()
        unseen = self._new_adapter(self.a, f"{self.a}-unseen")
        good = signer.issue(**self.claims(unseen.digest))[0]
        real = signer.issue(**self.claims(self.routes["a1"].digest))[0]
        now = time.time()
        foreign = TicketSigner(Ed25519PrivateKey.generate())
        impostor = TicketSigner(Ed25519PrivateKey.generate())
        impostor.kid = signer.kid
        head, purpose, body, _footer = good.split(".")
        cases: dict[str, str | None] = {
            "missing": None, "garbage": "not-a-ticket", "truncated": good[:-10],
            "truncated-half": good[: len(good) // 2], "empty": "",
            "oversized": good + "A" * 5000,
            "padded-footer": good + "=",
            "wrong-version": good.replace("v4.public.", "v3.public.", 1),
            "v2-public": good.replace("v4.public.", "v2.public.", 1),
            "v4-local-with-public-key": _v4_local(signer, self.claims(unseen.digest)),
            "jws-hs256-with-public-key": _hs256(signer, self.claims(unseen.digest)),
            "jws-alg-none": _alg_none(self.claims(unseen.digest)),
            "expired": signer.issue(**self.claims(unseen.digest), now=now - 3600)[0],
            "not-yet-valid": signer.issue(**self.claims(unseen.digest), now=now + 3600)[0],
            "other-model": signer.issue(**self.claims(unseen.digest, model="other_llm"))[0],
            "other-tokenizer": signer.issue(**self.claims(
                unseen.digest, tokenizer="sha256:" + "e" * 64))[0],
            "unknown-key": foreign.issue(**self.claims(unseen.digest))[0],
            "rotated-out-key-kid": impostor.issue(**self.claims(unseen.digest))[0],
            "footer-swapped": ".".join((head, purpose, body, _b64e(b'{"kid":"0000000000000000"}'))),
        }
        for claim, value in (("tenant", self.b), ("model", "x"), ("base", "sha256:" + "d" * 64),
                             ("adapter", unseen.digest), ("tokenizer", "sha256:" + "d" * 64),
                             ("release", self._release(self.routes["b1"].digest)),
                             ("iat", 1), ("exp", 2**40), ("jti", "x"), ("kid", "0" * 16)):
            cases[f"altered-{claim}"] = _alter_claim(real, claim, value)
        for case, ticket in cases.items():
            self.refused_by_triton(cat, case, ticket)
        b_ticket = self.ticket(self.routes["b1"])
        self.refused_by_triton(cat, "param-and-header-differ", good,
                               parameters={"x-lora-ticket": real})
        self.refused_by_triton(cat, "param-and-header-case-differ", real, leak_of=self.b,
                               parameters={"X-Lora-Ticket": b_ticket})
        self._raw_header(cat, "non-utf8-header", b"v4.public.\xff\xfe\xc3(")
        self._raw_header(cat, "oversized-header", b"v4.public." + b"A" * 60_000)
        self.no_loads(cat, "refusals-loaded-nothing", unseen.digest)
        # The genuine ticket works (and only now is the adapter loaded).
        try:
            ok = generate(self.t.http_url, "Hello", good, max_tokens=2).adapter_digest
        except TritonRefused as e:
            ok = e.message
        self.report.check(cat, "genuine-still-served", ok == unseen.digest, str(ok))

    def _raw_header(self, cat: str, case: str, value: bytes) -> None:
        host, port = self.t.http_url.rsplit(":", 1)
        conn = http.client.HTTPConnection(host, int(port), timeout=30)
        body = json.dumps({"text_input": "Hello", "max_tokens": 2}).encode()
        try:
            conn.putrequest("POST", "/v2/models/lora_llm/generate")
            conn.putheader("Content-Type", "application/json")
            conn.putheader("Content-Length", str(len(body)))
            conn.putheader("x-lora-ticket", value)
            conn.endheaders(body)
            resp = conn.getresponse()
            status, text = resp.status, resp.read().decode("utf-8", "replace")
        except (OSError, http.client.HTTPException) as e:
            status, text = 0, type(e).__name__  # the server hung up: refused too
        finally:
            conn.close()
        self.report.check(cat, case, status != 200, f"{status} {text[:80]}")

    def case_parameters(self) -> None:
        """Names, paths, URLs, digests in every parameter and header: the ticket alone routes."""
        cat = "parameters"
        a1, b1 = self.routes["a1"], self.routes["b1"]
        ticket = self.ticket(a1)
        store_path = str(self.t.settings.store_dir / "sha256" / b1.digest.removeprefix("sha256:"))
        ref = generate(self.t.http_url, "Hello", ticket, max_tokens=MAX_TOKENS).text
        injections = [b1.digest, b1.alias, store_path, f"file://{store_path}",
                      f"http://127.0.0.1:1/{b1.alias}.safetensors", "../../" * 8 + "etc/passwd",
                      b1.tenant]
        names = ["adapter", "adapter_digest", "lora_adapter", "lora_name", "lora_path", "alias",
                 "model", "tenant", "x-lora-adapter", "x-lora-digest", "x-lora-alias",
                 "x-lora-tenant"]
        ledger = self._ledger()
        for name in names:
            for value in injections:
                for header in (False, True):
                    case = f"{'header' if header else 'param'}:{name}"
                    params = {} if header else {name: value}
                    try:
                        g = _generate_with_headers(self.t.http_url, ticket, params,
                                                   {name: value} if header else {})
                    except TritonRefused as e:
                        self.report.check(cat, case, e.message == GENERIC_REFUSAL
                                          and not self.leaks(e.message, self.b), e.message)
                        continue
                    row = ledger.get(g.request_id)
                    self.report.check(cat, case, g.adapter_digest == a1.digest and g.text == ref
                                      and row is not None and row.adapter_digest == a1.digest
                                      and row.tenant == self.a,
                                      f"served {g.adapter_digest} text={g.text!r}")
        # B's adapter was only ever loaded by B's own traffic (attribution runs after this).
        b_rows = [r for r in ledger.query(adapter=b1.digest) if r.outcome != "rejected"]
        self.report.check(cat, "b-adapter-never-served-to-a",
                          all(r.tenant == self.b for r in b_rows))

    def case_artifacts(self) -> None:
        cat = "artifacts"
        src = synth_adapter(self.work / "artifact-src", self.shapes, self.base, seed=7,
                            targets=("q_proj", "v_proj"))
        stored = set(self.registry.store.digests())
        for h in HOSTILE_ARTIFACTS:
            dst = self.work / "hostile" / h.name
            h.build(src, dst)
            try:
                digest = self.registry.register_adapter(dst, tenant=self.a,
                                                        alias=f"{self.a}-hostile", actor=ACTOR)
            except ValidationFailed as e:
                leaked = [s for s in (str(self.work), str(self.t.settings.home), *self.secrets_of(
                    self.b)) if s in e.message]
                self.report.check(cat, h.name, e.check == h.check and not leaked,
                                  f"check {e.check} (expected {h.check}) leaks={leaked}")
            except Exception as e:  # a crash or another refusal type
                self.report.check(cat, h.name, False, f"{type(e).__name__}")
            else:
                self.made.append(digest)
                self.report.check(cat, h.name, False, "registered")
        self.report.check(cat, "nothing-stored", set(self.registry.store.digests()) == stored)
        self._tampered_store(cat)

    def _tampered_store(self, cat: str) -> None:
        """A stored file changed after registration: refused at load, recorded, never served."""
        r = self._new_adapter(self.a, f"{self.a}-tampered")
        self._wait_routable([r])
        ticket = self.ticket(r)
        weights = self.registry.store.path(r.digest) / "adapter_model.safetensors"
        os.chmod(weights, 0o644)  # what an attacker with disk access does first
        raw = bytearray(weights.read_bytes())
        raw[-1] ^= 0x01
        weights.write_bytes(bytes(raw))
        os.chmod(weights, 0o444)
        for proto, url in (("http", self.t.http_url), ("grpc", self.t.grpc_url)):
            try:
                g = generate(url, "Hello", ticket, protocol=proto, max_tokens=2)
                self.report.check(cat, f"tampered-store/{proto}", False,
                                  f"served {g.adapter_digest}")
            except TritonRefused as e:
                self.report.check(cat, f"tampered-store/{proto}",
                                  "could not be served" in e.message
                                  and r.digest not in e.message, e.message)
        ledger = self._ledger()
        loads = ledger.loads(r.digest)
        self.report.check(cat, "tampered-load-failure-recorded",
                          bool(loads) and all(x.outcome == "failed" for x in loads),
                          str([x.outcome for x in loads]))
        served = [x for x in ledger.query(adapter=r.digest) if x.outcome == "ok"]
        self.report.check(cat, "tampered-never-served", not served)

    def case_faults(self) -> None:
        """kill -9 of a gateway (its own subprocess, on the same home and database)."""
        cat = "faults"
        port = free_port()
        with gateway_process(self.t.settings, port) as proc:
            url = f"http://127.0.0.1:{port}"
            route = self.routes["a1"]
            results: list[int] = []

            def client(_i: int) -> int:
                try:
                    return request_ticket(url, self.keys[self.a], route.alias)[0]
                except (OSError, ValueError):
                    return -1

            with ThreadPoolExecutor(8) as pool:
                futures = [pool.submit(client, i) for i in range(64)]
                time.sleep(0.05)
                os.kill(proc.pid, signal.SIGKILL)
                for f in futures:
                    try:
                        results.append(f.result(timeout=30))
                    except Exception:
                        results.append(-2)  # a hang
            self.report.check(cat, "gateway-kill9-no-hang", -2 not in results,
                              f"{results.count(-2)} clients hung")
            self.report.check(cat, "gateway-kill9-answers-or-errors",
                              all(s in (200, -1) for s in results), str(set(results)))
        with gateway_process(self.t.settings, port):
            status, body = request_ticket(url, self.keys[self.a], route.alias)
            ok = status == 200 and generate(self.t.http_url, "Hi", body["ticket"],
                                            max_tokens=2).adapter_digest == route.digest
            self.report.check(cat, "gateway-restarted-serves", ok, str(status))

    def case_attribution(self) -> None:
        """Many concurrent clients over mixed adapters: every answer and row is its own."""
        cat = "attribution"
        routes = [self.routes["a1"], self.routes["a2"], self.routes["b1"]]
        tickets = {r.digest: self.ticket(r) for r in routes}
        jobs = [(routes[i % len(routes)], f"[{i:05d}] {('Hello', 'Tell me', 'Open')[i % 3]}",
                 "http" if i % 4 else "grpc") for i in range(self.attribution_requests)]

        def call(job: tuple[Route, str, str]) -> Generation | str:
            r, prompt, proto = job
            url = self.t.http_url if proto == "http" else self.t.grpc_url
            try:
                return generate(url, prompt, tickets[r.digest], protocol=proto,
                                max_tokens=MAX_TOKENS)
            except TritonRefused as e:
                return e.message

        with ThreadPoolExecutor(self.clients) as pool:
            results = list(pool.map(call, jobs))
        ledger = self._ledger()
        seen: set[str] = set()
        for (r, _prompt, _), g in zip(jobs, results, strict=True):
            if not isinstance(g, Generation):
                self.report.check(cat, "request", False, g)
                continue
            row = ledger.get(g.request_id)
            ok = (g.adapter_digest == r.digest and g.request_id not in seen and row is not None
                  and row.outcome == "ok" and row.adapter_digest == r.digest
                  and row.tenant == r.tenant)
            seen.add(g.request_id)
            self.report.check(cat, "request", ok, f"want {r.digest} got {g.adapter_digest}")
        # Outputs: a sample replayed one at a time must equal what the burst answered.
        for (r, prompt, _), g in list(zip(jobs, results, strict=True))[:: max(1, len(jobs) // 24)]:
            if isinstance(g, Generation):
                alone = generate(self.t.http_url, prompt, tickets[r.digest],
                                 max_tokens=MAX_TOKENS).text
                self.report.check(cat, "output-equals-alone", alone == g.text,
                                  f"{prompt!r}: {g.text!r} != {alone!r}")


# -- ticket forgeries ---------------------------------------------------------------------------

def _b64e(b: bytes) -> str:
    return base64.urlsafe_b64encode(b).rstrip(b"=").decode()


def _b64d(s: str) -> bytes:
    return base64.urlsafe_b64decode(s + "=" * (-len(s) % 4))


def _alter_claim(token: str, claim: str, value: object) -> str:
    """Change one claim in a signed token without re-signing it."""
    head, purpose, body, footer = token.split(".")
    raw = _b64d(body)
    claims = json.loads(raw[:-64])
    claims[claim] = value
    new = json.dumps(claims, separators=(",", ":")).encode()
    return ".".join((head, purpose, _b64e(new + raw[-64:]), footer))


def _wire_claims(claims: dict[str, Any]) -> dict[str, Any]:
    now = int(time.time())
    c = {k: v for k, v in claims.items() if k != "ttl_s"}
    return {**c, "iat": now, "exp": now + 300, "jti": secrets.token_hex(8)}


def _hs256(signer: TicketSigner, claims: dict[str, Any]) -> str:
    """A JWS whose HMAC key is the control plane's public key (algorithm confusion)."""
    head = _b64e(json.dumps({"alg": "HS256", "kid": signer.kid}).encode())
    body = _b64e(json.dumps({**_wire_claims(claims), "kid": signer.kid}).encode())
    sig = hmac.new(signer.public_raw, f"{head}.{body}".encode(), hashlib.sha256).digest()
    return f"{head}.{body}.{_b64e(sig)}"


def _alg_none(claims: dict[str, Any]) -> str:
    head = _b64e(json.dumps({"alg": "none"}).encode())
    return f"{head}.{_b64e(json.dumps(_wire_claims(claims)).encode())}."


def _v4_local(signer: TicketSigner, claims: dict[str, Any]) -> str:
    import pyseto

    key = pyseto.Key.new(version=4, purpose="local", key=signer.public_raw)
    return pyseto.encode(key, json.dumps({**_wire_claims(claims), "kid": signer.kid}).encode(),
                         footer=json.dumps({"kid": signer.kid}).encode()).decode()


# -- plumbing -----------------------------------------------------------------------------------

def _http(url: str, method: str, key: str | None, body: object) -> tuple[int, str]:
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    data = json.dumps(body).encode() if body is not None and method == "POST" else None
    req = urllib.request.Request(url, data=data, headers=headers, method=method)
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return int(r.status), r.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as e:
        return int(e.code), e.read().decode("utf-8", "replace")
    except (urllib.error.URLError, OSError) as e:
        return 0, type(e).__name__


def _generate_with_headers(http_url: str, ticket: str, params: dict[str, Any],
                           headers: dict[str, str]) -> Generation:
    import numpy as np
    import tritonclient.http as mod
    from tritonclient.utils import InferenceServerException

    t = mod.InferInput("text_input", [1, 1], "BYTES")
    t.set_data_from_numpy(np.array([[b"Hello"]], dtype=np.object_))
    m = mod.InferInput("max_tokens", [1, 1], "INT32")
    m.set_data_from_numpy(np.array([[MAX_TOKENS]], dtype=np.int32))
    client = mod.InferenceServerClient(http_url)
    try:
        res = client.infer("lora_llm", [t, m], parameters={**params, "lora_ticket": ticket},
                           headers=headers or None)
    except InferenceServerException as e:
        raise TritonRefused(str(e.status()), e.message() or "") from None
    finally:
        client.close()

    def first(name: str) -> str:
        v = res.as_numpy(name).reshape(-1)[0]
        return v.decode() if isinstance(v, bytes) else str(v)

    return Generation(first("text_output"), first("request_id"), first("adapter_digest"))


@contextmanager
def gateway_process(settings: Settings, port: int) -> Iterator[subprocess.Popen[bytes]]:
    """A gateway in its own process (``python -m control.selftest gateway``), stopped after."""
    env = {**os.environ, "LORAPLANE_HOME": str(settings.home), "LORAPLANE_DB_URL": settings.db_url}
    proc = subprocess.Popen([sys.executable, "-m", "control.selftest", "gateway", str(port)],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            if proc.poll() is not None:
                raise RuntimeError("the selftest gateway exited at start")
            time.sleep(0.1)
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def _serve_gateway(port: int) -> None:
    """Serve only the ticket gateway on ``port`` until killed (for the gateway fault case)."""
    from aiohttp import web

    from control.db import make_engine
    from control.gateway import make_app
    from control.ticket_office import TicketOffice
    from projections.route_cache import CachedRoutingView

    s = Settings.from_env()
    signer, _ = TicketSigner.load_or_create(s.keys_dir)
    web.run_app(make_app(TicketOffice(s, CachedRoutingView(make_engine(s.db_url)), signer)),
                host="127.0.0.1", port=port, print=None)


Progress = Callable[[str], None]


def run_hostile(target: Target, *, categories: tuple[str, ...] = CATEGORIES,
                attribution_requests: int = 1000, clients: int = 32) -> Report:
    """Run the hostile suite against ``target``; the report counts every case."""
    return HostileSuite(target, attribution_requests=attribution_requests,
                        clients=clients).run(categories)


if __name__ == "__main__":  # python -m control.selftest gateway PORT
    if len(sys.argv) == 3 and sys.argv[1] == "gateway":
        _serve_gateway(int(sys.argv[2]))
    else:
        sys.exit("usage: python -m control.selftest gateway PORT")
