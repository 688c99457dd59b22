"""A signing key forged into the event store with SQL is refused by the real Triton end to end,
and ``audit verify`` names it (issue 23, "a root of trust for signing keys").

The forgery is what a taken-over host with the database credential could write before the root
existed: a copy of the genuine ``SigningKeyRecorded`` naming the attacker's key (the genuine
record's root signature copied along), its public half dropped into the host's key folder too. The
control plane's follower projects it like any event; what decides trust is the root signature,
checked by each reader against the root public key of its configuration.
"""

from __future__ import annotations

import json
import time
import uuid

import pytest
import sqlalchemy as sa
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from control.app.integrity import AuditSeal
from control.contracts.db import make_engine
from control.contracts.ledger import Ledger
from control.contracts.ticket_seals import publish_seal
from control.contracts.tickets import GENERIC_REFUSAL, TicketSigner, write_public_key
from control.contracts.wire import MODEL
from control.ops.clients import TritonRefused, generate
from projections.routing import RoutingView
from tests.integration.conftest import Stack

pytestmark = pytest.mark.triton

KEY_RECORDED = "%:SigningKey.SigningKeyRecorded"


def _claims(stack: Stack, adapter: str) -> dict[str, object]:
    row = RoutingView(make_engine(stack.settings.db_url)).adapter(adapter)
    assert row is not None and row.release_digest is not None
    return dict(tenant="acme", model=MODEL, base=stack.kit.base_digest, adapter=adapter,
                tokenizer=stack.kit.tokenizer_digest, release=row.release_digest,
                disclose=True, ttl_s=300)


def _forge_record(stack: Stack, evil: TicketSigner) -> int:
    """Insert a SigningKeyRecorded for ``evil`` with plain SQL; returns its position."""
    engine = make_engine(stack.settings.db_url)
    events = stack.registry.recorder.events_record_cls.__table__  # type: ignore[attr-defined]
    with engine.begin() as conn:
        row = conn.execute(sa.select(events.c.topic, events.c.state)
                           .where(events.c.topic.like(KEY_RECORDED))
                           .order_by(events.c.id.desc()).limit(1)).one()
        state = json.loads(bytes(row.state))
        assert state["root_signature"], "the genuine key is vouched for by the root"
        state.update(kid=evil.kid, public_key_b64=evil.public_b64)
        conn.execute(events.insert().values(originator_id=uuid.uuid4(), originator_version=1,
                                            topic=row.topic, state=json.dumps(state).encode()))
        return int(conn.execute(sa.select(sa.func.max(events.c.id))).scalar_one())


def test_a_forged_signing_key_is_refused_by_triton_and_named_by_audit(stack: Stack) -> None:
    alpha = stack.digests["alpha"]
    claims = _claims(stack, alpha)
    genuine = TicketSigner.load_or_create(stack.settings.keys_dir)[0]
    good, _ = genuine.issue(**claims)  # type: ignore[arg-type]
    assert generate(stack.http, "Hello", good, max_tokens=2).adapter_digest == alpha

    evil = TicketSigner(Ed25519PrivateKey.generate())
    position = _forge_record(stack, evil)
    view = RoutingView(make_engine(stack.settings.db_url))
    deadline = time.monotonic() + 15
    while evil.kid not in view.signing_keys():  # the serve process's follower projects it
        assert time.monotonic() < deadline, "the forged event was never projected"
        time.sleep(0.1)
    assert evil.kid not in view.vouched_signing_keys(stack.settings.keys_dir)

    ledger = Ledger(make_engine(stack.settings.db_url))
    before = {r.request_id for r in ledger.query(adapter=None)}
    forged, forged_claims = evil.issue(**claims)  # type: ignore[arg-type]
    # and its seal published, as whoever could insert the event could: the seal's proof is
    # the key's own, so only the root's say (the recorded, vouched key) keeps it out
    publish_seal(make_engine(stack.settings.db_url), evil)
    for proto, url in (("http", stack.http), ("grpc", stack.grpc)):
        # as a taken-over host would: its public half in the host's key folder (the control
        # plane's key sync removes it again, so put it back before each request)
        write_public_key(stack.settings.keys_dir / "public", evil.public_raw)
        with pytest.raises(TritonRefused) as e:
            generate(url, "Hello", forged, protocol=proto, max_tokens=2)
        assert e.value.message == GENERIC_REFUSAL
    new = [r for r in ledger.query(adapter=None) if r.request_id not in before]
    # Refused as unrecorded (verified with the dropped file, not vouched for), or as an unknown
    # key when the sync had removed the file first: never served.
    assert len(new) >= 2 and all(r.outcome == "rejected" for r in new), new
    assert {r.reason for r in new} <= {"key_unrecorded", "unknown_key"}, new
    assert all(r.ticket_id in (None, forged_claims.jti) for r in new)
    # the genuine key still serves
    assert generate(stack.grpc, "Hello", good, protocol="grpc",
                    max_tokens=2).adapter_digest == alpha

    report = AuditSeal.for_registry(stack.registry).verify()
    problems = {(p.kind, p.position) for p in report.problems}
    assert ("key", position) in problems and ("inserted", position) in problems
