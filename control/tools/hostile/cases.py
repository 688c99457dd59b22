"""The hostile cases of the control plane's edges: identity, tickets, artifacts and faults.

Each function takes the running :class:`control.tools.hostile.suite.HostileSuite` and counts its
cases in the suite's report. What they try:

- *identity*: tenant A asking, by every route the gateway serves, for tenant B's alias, digest,
  release or name; keys missing or made up; B's identifiers in what A can read (stats, metrics,
  the OpenAI model list); a revoked version; a ticket for a base this host does not serve; tickets
  issued while an alias flips between releases (each answered by the adapter it names, judged by
  its reference); clients hanging up mid-generation.
- *tickets*: forged, truncated, re-versioned, re-keyed and altered tickets, tickets bound to
  another model, tokenizer or time, two tickets in one request; none may load the adapter named.
- *artifacts*: every hostile adapter folder of ``control.tools.hostile.artifacts`` refused by its
  own check, naming no path; a stored file changed after registration refused at load.
- *faults*: SIGKILL of a gateway process of the suite's own mid-burst, then a fresh one serving.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from control.app.key_ring import held_seal_keys
from control.contracts.tickets import TicketSigner
from control.contracts.tickets import unverified_claims as open_claims
from control.contracts.wire import TICKET_HEADER
from control.domain import ValidationFailed
from control.ops.clients import Generation, TritonRefused, free_port, generate, request_ticket
from control.tools.hostile.artifacts import HOSTILE_ARTIFACTS, synth_adapter
from control.tools.hostile.suite import MAX_TOKENS
from control.tools.hostile.target import ACTOR, TicketRoute, short
from control.tools.hostile.wire import (
    alg_none,
    alter_claim,
    b64d,
    b64e,
    gateway_process,
    hang_up_mid_generation,
    hs256,
    http_call,
    raw_header_request,
    v4_local,
)

if TYPE_CHECKING:
    from control.tools.hostile.suite import HostileSuite


def identity(s: HostileSuite) -> None:
    """Tenant A reaching for B, by every route it has; revocations; alias moves; hang-ups."""
    cat, gw = "identity", s.t.gateway_url
    a_key, b1 = s.keys[s.a], s.routes["b1"]
    forbidden = request_ticket(gw, a_key, "no-such-alias-" + secrets.token_hex(4))
    for case, alias in (("b-alias", b1.alias), ("b-digest", b1.digest),
                        ("b-release", b1.digest.replace("sha256:", "sha256:0")[:71]),
                        ("b-tenant-name", b1.tenant), ("b-alias-case", b1.alias.upper())):
        status, body = request_ticket(gw, a_key, alias)
        text = json.dumps(body)
        s.report.check(cat, case, status in (400, 403) and not s.leaks(text, s.b)
                       and (status != 403 or (status, body) == forbidden),
                       f"{status} {text[:120]}")
    for case, method, path, key in (
            ("no-key", "POST", "/v1/tickets", None),
            ("bad-key", "POST", "/v1/tickets", "lp_" + secrets.token_urlsafe(32)),
            ("stats-no-key", "GET", "/v1/stats", None)):
        status, text = http_call(gw + path, method, key, {"alias": b1.alias})
        s.report.check(cat, case, status == 401 and not s.leaks(text, s.b),
                       f"{status} {text[:120]}")
    for case, path in (("stats", "/v1/stats"), ("gateway-metrics", "/metrics")):
        status, text = http_call(gw + path, "GET", a_key, None)
        s.report.check(cat, f"{case}-seen-by-a", status == 200
                       and not s.leaks(text, s.b),
                       f"{status} leaks={s.leaks(text, s.b)}")
    _openai_identity(s, cat)
    if s.t.metrics_url:
        status, text = http_call(s.t.metrics_url, "GET", None, None)
        s.report.check(cat, "triton-metrics", status == 200
                       and not s.leaks(text, s.b),
                       f"{status} leaks={s.leaks(text, s.b)}")
    else:
        s.report.not_tried(cat, "triton-metrics", "no --metrics given: Triton's metrics "
                           "were not searched for leaks")
    _revoked_version(s, cat)
    signer = s.signer()
    if signer is None:
        s.report.not_tried(cat, "other-base/http", s.signer_missing)
        s.report.not_tried(cat, "other-base/grpc", s.signer_missing)
    else:
        # A genuine ticket for a base this host does not serve.
        other_base = "sha256:" + hashlib.sha256(b"another base").hexdigest()
        token = signer.issue(**s.claims(s.routes["a1"].digest, base=other_base))[0]
        s.refused_by_triton(cat, "other-base", token)
    _concurrent_alias_moves(s)
    _client_disconnect(s, cat)


def _openai_identity(s: HostileSuite, cat: str) -> None:
    """Tenant A on the OpenAI routes, asking for B's alias or digest: the very answer an
    alias that does not exist gets, naming nothing of B."""
    gw, a_key, b1 = s.t.gateway_url, s.keys[s.a], s.routes["b1"]
    nobody = "no-such-alias-" + secrets.token_hex(4)

    def completion(model: str) -> dict[str, Any]:
        return {"model": model, "prompt": "Hi", "max_tokens": 2}

    def chat(model: str) -> dict[str, Any]:
        return {"model": model, "messages": [{"role": "user", "content": "Hi"}]}

    # (case, method, path, API key, body); a path or body naming B has a twin naming nobody
    probes: list[tuple[str, str, str, str | None, dict[str, Any] | None]] = [
        ("openai-models-list", "GET", "/v1/models", a_key, None),
        ("openai-no-key", "POST", "/v1/completions", None, completion(b1.alias)),
        ("openai-b-model", "GET", f"/v1/models/{b1.alias}", a_key, None)]
    for kind, path, make in (("completions", "/v1/completions", completion),
                             ("chat", "/v1/chat/completions", chat)):
        for what, model in (("alias", b1.alias), ("digest", b1.digest)):
            probes.append((f"openai-{kind}-b-{what}", "POST", path, a_key, make(model)))
    for case, method, path, key, body in probes:
        if s.openai_missing:
            s.report.not_applicable(cat, case, s.openai_missing)
            continue
        status, text = http_call(gw + path, method, key, body)
        leaked = s.leaks(text, s.b)
        if case == "openai-models-list":
            ok = status == 200 and not leaked
        elif case == "openai-no-key":
            ok = status == 401 and not leaked
        else:
            twin = http_call(gw + path.replace(b1.alias, nobody), method, key,
                             {**body, "model": nobody} if body else None)
            ok = status in (403, 404) and not leaked and (status, text) == twin
        s.report.check(cat, case, ok, f"{status} {text[:100]} leaks={leaked}")


def _revoked_version(s: HostileSuite, cat: str) -> None:
    """A revoked version: the old ticket is refused, a new one is not issued."""
    r = s.new_adapter(s.a, f"{s.a}-revoked")
    s.wait_routable([r])
    ticket = s.ticket(r)
    s.registry.revoke(r.digest, reason="selftest", actor=ACTOR)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            generate(s.t.http_url, "Hello", ticket, max_tokens=1)
        except TritonRefused:
            break
        time.sleep(0.05)
    s.refused_by_triton(cat, "revoked-version", ticket)
    s.report.check(cat, "revoked-no-new-ticket",
                   request_ticket(s.t.gateway_url, s.keys[s.a], r.alias)[0] == 403)


def _concurrent_alias_moves(s: HostileSuite) -> None:
    """Tickets issued while the alias flips between two releases: each is answered by the
    adapter its own ticket names (judged by the reference), and names one of the three."""
    cat = "identity"
    a1, a2 = s.routes["a1"], s.routes["a2"]
    alias = f"{s.a}-moving"
    first = s.new_adapter(s.a, alias)
    s.wait_routable([first])
    stop = threading.Event()
    targets = [a1.digest, a2.digest]
    prompt = s.telling_prompt([first.digest, *targets])
    expected = {d: s.expect(d, prompt) for d in (first.digest, *targets)}

    def mover() -> None:
        i = 0
        while not stop.is_set():
            try:
                s.registry.point_alias(alias, targets[i % 2], actor=ACTOR)
            except Exception as e:  # some lifecycles refuse a cross-alias point: fine
                s.report.check(cat, "alias-move", False, type(e).__name__)
                return
            i += 1
            time.sleep(0.02)

    def one(_i: int) -> tuple[str | None, Generation | str]:
        status, body = request_ticket(s.t.gateway_url, s.keys[s.a], alias)
        if status != 200:
            return None, f"ticket {status}"
        # the ticket's sealed arm, opened with the deployment's keys (a tenant cannot)
        named = open_claims(body["ticket"], held_seal_keys(s.t.settings.keys_dir)).get("adapter")
        try:
            return named, generate(s.t.http_url, prompt, body["ticket"],
                                   max_tokens=MAX_TOKENS)
        except TritonRefused as e:
            return named, e.message

    th = threading.Thread(target=mover)
    th.start()
    try:
        with ThreadPoolExecutor(8) as pool:
            results = list(pool.map(one, range(48)))
    finally:
        stop.set()
        th.join()
    ledger = s.ledger()
    for named, g in results:
        if not isinstance(g, Generation):
            s.report.check(cat, "alias-move-ticket", False, str(g))
        elif named not in expected:
            s.report.check(cat, "alias-move-ticket", False,
                           f"ticket named {short(named)}, never in the alias's history")
        else:
            s.judge_served(cat, "alias-move-ticket", g, TicketRoute(s.a, alias, named),
                           expected[named], ledger)


def _client_disconnect(s: HostileSuite, cat: str) -> None:
    """A client that hangs up mid-generation: no row stays running, service unaffected.

    This closes the socket before the answer, the nearest a unary client gets to cancelling.
    """
    ticket = s.ticket(s.routes["a1"])
    before = time.time()
    hang_up_mid_generation(s.t.http_url, ticket)
    deadline = time.monotonic() + 60
    running: list[Any] = []
    while time.monotonic() < deadline:
        running = [r for r in s.ledger().query(tenant=s.a, since=before)
                   if r.outcome == "running"]
        if not running:
            break
        time.sleep(0.2)
    s.report.check(cat, "client-disconnect-rows-closed", not running,
                   f"{len(running)} rows still running")
    try:
        ok = generate(s.t.http_url, "Hello", ticket,
                      max_tokens=2).adapter_digest == s.routes["a1"].digest
    except TritonRefused:
        ok = False
    s.report.check(cat, "client-disconnect-service-continues", ok)


def tickets(s: HostileSuite) -> None:
    """Forged, altered and misbound tickets: each refused with the one generic message, and
    none of them makes the host load the adapter it names."""
    cat = "tickets"
    unseen = s.new_adapter(s.a, f"{s.a}-unseen")
    s.wait_routable([unseen])
    # Genuine gateway tickets are the raw material: forgeries need no key of ours.
    good, real = s.ticket(unseen), s.ticket(s.routes["a1"])
    head, purpose, body, _footer = good.split(".")
    kid = json.loads(b64d(_footer))["kid"]
    impostor = TicketSigner(Ed25519PrivateKey.generate())
    impostor.kid = kid  # the deployment's key id on a key it never saw
    cases: dict[str, str | None] = {
        "missing": None, "garbage": "not-a-ticket", "truncated": good[:-10],
        "truncated-half": good[: len(good) // 2], "empty": "",
        "oversized": good + "A" * 5000,
        "padded-footer": good + "=",
        "wrong-version": good.replace("v4.public.", "v3.public.", 1),
        "v2-public": good.replace("v4.public.", "v2.public.", 1),
        "jws-alg-none": alg_none(s.claims(unseen.digest)),
        "unknown-key": TicketSigner(Ed25519PrivateKey.generate()).issue(
            **s.claims(unseen.digest))[0],
        "impostor-key-with-deployment-kid": impostor.issue(**s.claims(unseen.digest))[0],
        "footer-swapped": ".".join((head, purpose, body, b64e(b'{"kid":"0000000000000000"}'))),
    }
    for claim, value in (("tenant", s.b), ("model", "x"), ("base", "sha256:" + "d" * 64),
                         ("adapter", unseen.digest), ("tokenizer", "sha256:" + "d" * 64),
                         ("release", s.release_of(s.routes["b1"].digest)),
                         ("iat", 1), ("exp", 2**40), ("jti", "x"), ("kid", "0" * 16)):
        cases[f"altered-{claim}"] = alter_claim(real, claim, value)
    signer = s.signer()
    signed = ("v4-local-with-public-key", "jws-hs256-with-public-key", "expired",
              "not-yet-valid", "other-model", "other-tokenizer")
    if signer is None:
        for case in signed:
            for proto in ("http", "grpc"):
                s.report.not_tried(cat, f"{case}/{proto}", s.signer_missing)
    else:
        now = time.time()
        cases.update({
            "v4-local-with-public-key": v4_local(signer, s.claims(unseen.digest)),
            "jws-hs256-with-public-key": hs256(signer, s.claims(unseen.digest)),
            "expired": signer.issue(**s.claims(unseen.digest), now=now - 3600)[0],
            "not-yet-valid": signer.issue(**s.claims(unseen.digest), now=now + 3600)[0],
            "other-model": signer.issue(**s.claims(unseen.digest, model="other_llm"))[0],
            "other-tokenizer": signer.issue(**s.claims(
                unseen.digest, tokenizer="sha256:" + "e" * 64))[0]})
    for case, ticket in cases.items():
        s.refused_by_triton(cat, case, ticket)
    b_ticket = s.ticket(s.routes["b1"])
    # Two tickets at once: never guess which one counts. The header is a real header, which
    # Triton forwards because it matches x-lora-.*; the parameter twins reach the same code.
    s.refused_by_triton(cat, "param-and-header-differ", real, leak_of=s.b,
                        headers={TICKET_HEADER: b_ticket})
    s.refused_by_triton(cat, "two-ticket-params-differ", good,
                        parameters={TICKET_HEADER: real})
    s.refused_by_triton(cat, "ticket-param-names-differ-in-case", real, leak_of=s.b,
                        parameters={TICKET_HEADER.title(): b_ticket})  # X-Lora-Ticket
    for case, raw in (("non-utf8-header", b"v4.public.\xff\xfe\xc3("),
                      ("oversized-header", b"v4.public." + b"A" * 60_000)):
        status, text = raw_header_request(s.t.http_url, TICKET_HEADER, raw)
        s.report.check(cat, case, status != 200, f"{status} {text[:80]}")
    s.no_loads(cat, "refusals-loaded-nothing", unseen.digest)
    # The genuine ticket works, in the header as in the parameter (only now is it loaded).
    for case, header in (("genuine-still-served", False), ("genuine-in-header-served", True)):
        try:
            served: str = generate(s.t.http_url, "Hello", good, max_tokens=2,
                                   header=header).adapter_digest
        except TritonRefused as e:
            served = e.message
        s.report.check(cat, case, served == unseen.digest, served[:80])


def artifacts(s: HostileSuite) -> None:
    """Every hostile adapter folder refused by its own check, naming no path, storing nothing."""
    cat = "artifacts"
    src = synth_adapter(s.work / "artifact-src", s.shapes, s.base, seed=7,
                        targets=("q_proj", "v_proj"))
    stored = set(s.registry.store.digests())
    for h in HOSTILE_ARTIFACTS:
        dst = s.work / "hostile" / h.name
        h.build(src, dst)
        try:
            digest = s.registry.register_adapter(dst, tenant=s.a,
                                                 alias=f"{s.a}-hostile", actor=ACTOR)
        except ValidationFailed as e:
            leaked = [s for s in (str(s.work), str(s.t.settings.home), *s.secrets_of(
                s.b)) if s in e.message]
            s.report.check(cat, h.name, e.check == h.check and not leaked,
                           f"check {e.check} (expected {h.check}) leaks={leaked}")
        except Exception as e:  # a crash or another refusal type
            s.report.check(cat, h.name, False, f"{type(e).__name__}")
        else:
            s.made.append(digest)
            s.report.check(cat, h.name, False, "registered")
    s.report.check(cat, "nothing-stored", set(s.registry.store.digests()) == stored)
    _tampered_store(s, cat)


def _tampered_store(s: HostileSuite, cat: str) -> None:
    """A stored file changed after registration: refused at load, recorded, never served."""
    r = s.new_adapter(s.a, f"{s.a}-tampered")
    s.wait_routable([r])
    ticket = s.ticket(r)
    weights = s.registry.store.path(r.digest) / "adapter_model.safetensors"
    os.chmod(weights, 0o644)  # what an attacker with disk access does first
    raw = bytearray(weights.read_bytes())
    raw[-1] ^= 0x01
    weights.write_bytes(bytes(raw))
    os.chmod(weights, 0o444)
    for proto, url in (("http", s.t.http_url), ("grpc", s.t.grpc_url)):
        try:
            g = generate(url, "Hello", ticket, protocol=proto, max_tokens=2)
            s.report.check(cat, f"tampered-store/{proto}", False,
                           f"served {short(g.adapter_digest)}")
        except TritonRefused as e:
            s.report.check(cat, f"tampered-store/{proto}",
                           "could not be served" in e.message
                           and r.digest not in e.message, e.message)
    ledger = s.ledger()
    loads = ledger.loads(r.digest)
    s.report.check(cat, "tampered-load-failure-recorded",
                   bool(loads) and all(x.outcome == "failed" for x in loads),
                   str([x.outcome for x in loads]))
    served = [x for x in ledger.query(adapter=r.digest) if x.outcome == "ok"]
    s.report.check(cat, "tampered-never-served", not served)


def faults(s: HostileSuite) -> None:
    """kill -9 of a gateway (its own subprocess, on the same home and database)."""
    cat = "faults"
    port = free_port()
    with gateway_process(s.t.settings, port) as proc:
        url = f"http://127.0.0.1:{port}"
        route = s.routes["a1"]
        results: list[int] = []

        def client(_i: int) -> int:
            try:
                return request_ticket(url, s.keys[s.a], route.alias)[0]
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
        s.report.check(cat, "gateway-kill9-no-hang", -2 not in results,
                       f"{results.count(-2)} clients hung")
        s.report.check(cat, "gateway-kill9-answers-or-errors",
                       all(s in (200, -1) for s in results), str(set(results)))
    with gateway_process(s.t.settings, port):
        status, body = request_ticket(url, s.keys[s.a], route.alias)
        ok = status == 200 and generate(s.t.http_url, "Hi", body["ticket"],
                                        max_tokens=2).adapter_digest == route.digest
        s.report.check(cat, "gateway-restarted-serves", ok, str(status))
