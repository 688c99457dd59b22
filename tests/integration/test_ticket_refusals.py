"""Forged, altered, expired, foreign and revoked tickets: refused by Triton, nothing loaded."""

from __future__ import annotations

import base64
import json
import time
import uuid
from pathlib import Path

import pyseto
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from control.app.audit import audit_log
from control.contracts.db import make_engine
from control.contracts.ledger import Ledger
from control.contracts.tickets import GENERIC_REFUSAL, IMPLICIT_ASSERTION, TicketSigner
from control.contracts.wire import MODEL, TICKET_HEADER
from control.ops.clients import TritonRefused, generate
from projections.routing import RoutingView
from tests.artifacts import perturbed_copy
from tests.fuzzing import pyseto_key
from tests.integration.conftest import ACTOR, Stack

pytestmark = pytest.mark.triton


def _register(stack: Stack, tmp: Path, name: str, alias: str, factor: float) -> str:
    src = stack.kit_dir / stack.kit.adapters["alpha"].path
    digest = stack.registry.register_adapter(perturbed_copy(src, tmp / name, factor),
                                             tenant="acme", alias=alias, actor=ACTOR)
    stack.registry.advance(digest, external=True, evaluation={"suite": "smoke", "passed": True},
                           actor=ACTOR)
    stack.registry.grant("acme", alias, actor=ACTOR)
    return digest


def _signer(stack: Stack) -> TicketSigner:
    return TicketSigner.load_or_create(stack.settings.keys_dir)[0]


def _release(stack: Stack, adapter: str) -> str:
    row = RoutingView(make_engine(stack.settings.db_url)).adapter(adapter)
    assert row is not None and row.release_digest is not None
    return row.release_digest


def _claims(stack: Stack, adapter: str, **over: object) -> dict[str, object]:
    c: dict[str, object] = dict(tenant="acme", model=MODEL, base=stack.kit.base_digest,
                                adapter=adapter, tokenizer=stack.kit.tokenizer_digest,
                                release=_release(stack, adapter), disclose=True, ttl_s=300)
    c.update(over)
    return c


def _signed_without(signer: TicketSigner, claims: dict[str, object], claim: str) -> str:
    """A ticket genuinely signed by ``signer`` whose payload lacks ``claim`` (for ``release``:
    a ticket in the nine-claim format of earlier releases)."""
    now = int(time.time())
    payload = {k: v for k, v in claims.items() if k not in ("ttl_s", claim)}
    payload.update(iat=now, exp=now + 300, jti=str(uuid.uuid4()), kid=signer.kid)
    return pyseto.encode(pyseto_key(signer), json.dumps(payload, separators=(",", ":")).encode(),
                         footer=json.dumps({"kid": signer.kid}).encode(),
                         implicit_assertion=IMPLICIT_ASSERTION).decode()


def _b64d(s: str) -> bytes:
    return base64.urlsafe_b64decode(s + "=" * (-len(s) % 4))


def _b64e(b: bytes) -> str:
    return base64.urlsafe_b64encode(b).rstrip(b"=").decode()


def _alter_claim(token: str, claim: str, value: object) -> str:
    """Change one claim in a signed token without re-signing it."""
    head, purpose, body, footer = token.split(".")
    raw = _b64d(body)
    msg, sig = raw[:-64], raw[-64:]
    claims = json.loads(msg)
    claims[claim] = value
    new = json.dumps(claims, separators=(",", ":")).encode()
    return ".".join((head, purpose, _b64e(new + sig), footer))


def _foreign_signer(kid: str | None = None) -> TicketSigner:
    s = TicketSigner(Ed25519PrivateKey.generate())
    if kid is not None:
        s.kid = kid  # claims the control plane's key id, signs with its own key
    return s


def _refused(stack: Stack, ticket: str | None, **kw: object) -> None:
    for proto, url in (("http", stack.http), ("grpc", stack.grpc)):
        with pytest.raises(TritonRefused) as e:
            generate(url, "Hello", ticket, protocol=proto, max_tokens=4, **kw)  # type: ignore[arg-type]
        assert e.value.status in ("400", "StatusCode.INVALID_ARGUMENT"), e.value
        assert e.value.message == GENERIC_REFUSAL


def test_every_bad_ticket_is_refused_and_loads_nothing(stack: Stack, tmp_path: Path) -> None:
    unseen = _register(stack, tmp_path, "delta", "acme-delta", 1.02)
    signer = _signer(stack)
    good, _ = signer.issue(**_claims(stack, unseen))  # type: ignore[arg-type]
    other_base = stack.kit.base_b_digest
    now = time.time()
    bad: dict[str, str | None] = {
        "missing": None,
        "garbage": "not-a-ticket",
        "truncated": good[:-10],
        "wrong_version": good.replace("v4.public.", "v3.public.", 1),
        "expired": signer.issue(**_claims(stack, unseen), now=now - 3600)[0],  # type: ignore[arg-type]
        "not_yet_valid": signer.issue(**_claims(stack, unseen), now=now + 3600)[0],  # type: ignore[arg-type]
        "other_base": signer.issue(**_claims(stack, unseen, base=other_base))[0],  # type: ignore[arg-type]
        "other_model": signer.issue(**_claims(stack, unseen, model="other_llm"))[0],  # type: ignore[arg-type]
        "other_tokenizer": signer.issue(**_claims(stack, unseen, tokenizer=other_base))[0],  # type: ignore[arg-type]
        "unknown_key": _foreign_signer().issue(**_claims(stack, unseen))[0],  # type: ignore[arg-type]
        "impersonated_kid": _foreign_signer(signer.kid).issue(**_claims(stack, unseen))[0],  # type: ignore[arg-type]
        # Another release named, re-signed by a key the hosts do not hold.
        "release_by_unknown_key": _foreign_signer().issue(**_claims(  # type: ignore[arg-type]
            stack, unseen, release=_release(stack, stack.digests["gamma"])))[0],
        "release_missing": _signed_without(signer, _claims(stack, unseen), "release"),
    }
    # Every claim altered in a genuinely signed ticket (for an adapter the caller may not use).
    alpha = stack.digests["alpha"]
    real, _ = signer.issue(**_claims(stack, alpha))  # type: ignore[arg-type]
    for claim, value in (("tenant", "globex"), ("model", "x"), ("base", other_base),
                         ("adapter", unseen), ("tokenizer", other_base),
                         ("release", _release(stack, unseen)), ("iat", 1), ("exp", 2**40),
                         ("jti", "x"), ("kid", "0" * 16)):
        bad[f"altered_{claim}"] = _alter_claim(real, claim, value)
    for case, ticket in bad.items():
        try:
            _refused(stack, ticket)
        except AssertionError as e:
            raise AssertionError(f"case {case}: {e}") from None
    # Different tickets in the parameter and the header at once.
    _refused(stack, good, parameters={TICKET_HEADER: real})

    ledger = Ledger(make_engine(stack.settings.db_url))
    assert ledger.loads(unseen) == []  # no refused ticket made the adapter resident
    assert [r for r in ledger.query(adapter=unseen) if r.outcome != "rejected"] == []
    # Refusals before verification record no claim of the ticket, its release neither.
    assert all(r.release_digest is None for r in ledger.query(adapter=None)
               if r.outcome == "rejected" and r.ticket_id is None)
    # The genuine ticket still works, and only then is the adapter loaded.
    served = generate(stack.http, "Hello", good, max_tokens=4)
    assert served.adapter_digest == unseen
    assert [load.outcome for load in ledger.loads(unseen)] == ["loaded"]
    row = ledger.get(served.request_id)
    assert row is not None and row.release_digest == _release(stack, unseen)


def test_revoked_digest_refused_within_a_second(stack: Stack, tmp_path: Path) -> None:
    digest = _register(stack, tmp_path, "epsilon", "acme-epsilon", 1.03)
    ticket = stack.ticket("acme", "acme-epsilon")
    assert generate(stack.grpc, "Hello", ticket, protocol="grpc").adapter_digest == digest
    stack.registry.revoke(digest, reason="test", actor=ACTOR)
    t0 = time.monotonic()
    while True:
        try:
            generate(stack.http, "Hello", ticket, max_tokens=2)
        except TritonRefused as e:
            assert e.message == GENERIC_REFUSAL
            break
        assert time.monotonic() - t0 < 1.0, "revocation not enforced within 1 s"
        time.sleep(0.02)
    _refused(stack, ticket)
    ledger = Ledger(make_engine(stack.settings.db_url))
    assert "unloaded" in [load.outcome for load in ledger.loads(digest)]
    status_refused = [r for r in ledger.query(adapter=digest) if r.reason == "revoked"]
    assert status_refused, "refusals for a revoked digest are on the ledger"
    # The serving side's revocation work is on the record: drained, purged, unloaded, in order.
    deadline = time.monotonic() + 20
    steps: list[str] = []
    while time.monotonic() < deadline:
        entries = [e for e in audit_log(stack.registry)
                   if e.summary.get("digest") == digest and e.actor.startswith("host:")]
        steps = [e.event_type for e in entries]
        if len(steps) >= 3:
            break
        time.sleep(0.2)
    assert steps == ["AdapterDrained", "AdapterPurged", "AdapterUnloaded"]
