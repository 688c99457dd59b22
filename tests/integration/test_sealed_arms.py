"""Issue 21, through the real gateway and tritonserver: a tenant cannot learn which arm of
another tenant's rollout answered it, nor that tenant's adapter digest.

acme owns alias ``acme-shared`` with a stable release and a canary at 50 %, and grants it to
globex. For both tenants, over many sessions: the ticket's payload holds no adapter or release
digest and every ticket has the same length, whatever arm it landed on; the answer's
``adapter_digest`` is the digest that served (checked against the ledger, written by the host)
for acme, the owner, and empty for globex, on HTTP and gRPC, unary and streamed; globex's
``/v1/stats`` shows "granted", never acme's digests. What served each request stays on record:
the ledger names the adapter and release of globex's requests too.
"""

from __future__ import annotations

import base64
import json

import pytest

from control.contracts.db import make_engine
from control.contracts.ledger import Ledger
from control.contracts.placement import affinity_of
from control.domain import CANARY
from control.ops.clients import generate, request_ticket, stream_generate
from tests.artifacts import perturbed_copy
from tests.integration.conftest import ACTOR, Stack

pytestmark = pytest.mark.triton

ALIAS = "acme-shared"
SESSIONS = 16


@pytest.fixture(scope="module")
def arms(stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Register acme's two adapters on ALIAS (stable, canary 50 %) and grant globex."""
    tmp = tmp_path_factory.mktemp("sealed")
    src = stack.kit_dir / stack.kit.adapters["alpha"].path
    reg = stack.registry
    digests: dict[str, str] = {}
    # Perturbations no other test on the session's stack registers (the same bytes twice are
    # refused as already registered): the bytes are this module's.
    for name, factor in (("stable", 1.0631), ("canary", 1.0653)):
        digest = reg.register_adapter(perturbed_copy(src, tmp / name, factor), tenant="acme",
                                      alias=ALIAS, actor=ACTOR)
        reg.advance(digest, external=True, evaluation={"suite": "smoke", "passed": True},
                    actor=ACTOR, **({"to": CANARY} if name == "canary" else {}))
        digests[name] = digest
    reg.set_canary(ALIAS, digests["canary"], 50, actor=ACTOR)
    reg.grant("acme", ALIAS, actor=ACTOR)
    reg.grant("globex", ALIAS, actor=ACTOR)
    return digests


def _payload(ticket: str) -> bytes:
    body = ticket.split(".")[2]
    return base64.urlsafe_b64decode(body + "=" * (-len(body) % 4))[:-64]


def _hexes(*digests: str) -> list[bytes]:
    return [d.split(":")[1].encode() for d in digests]


def test_no_tenant_can_read_its_arm_and_only_the_owner_is_told_the_adapter(
        stack: Stack, arms: dict[str, str]) -> None:
    ledger = Ledger(make_engine(stack.settings.db_url))
    secret = _hexes(*arms.values())
    lengths: dict[str, set[int]] = {"acme": set(), "globex": set()}
    served: dict[str, set[str]] = {"acme": set(), "globex": set()}
    for tenant in ("acme", "globex"):
        for i in range(SESSIONS):
            status, body = request_ticket(stack.deployment.gateway_url, stack.api_keys[tenant],
                                          ALIAS, f"{tenant}-session-{i}")
            assert status == 200, body
            assert "ticket" in body and not {"release", "adapter_digest"} & set(body)
            ticket = str(body["ticket"])
            assert not any(h in _payload(ticket) for h in secret)
            claims = json.loads(_payload(ticket))
            assert set(claims) == {
                "tenant", "model", "base", "tokenizer", "arm", "pool", "regions", "iat", "exp",
                "jti", "kid", "affinity"}
            # the one clear claim added for placement hashes the tenant and the alias (the
            # owner bounds no replicas): equal on both arms, so it tells nothing of the arm
            assert claims["affinity"] == affinity_of(ALIAS, tenant) == body["affinity"]
            lengths[tenant].add(len(ticket))
            protocol = ("http", "grpc")[i % 2]
            url = stack.http if protocol == "http" else stack.grpc
            answer = generate(url, "Hello", ticket, protocol=protocol, max_tokens=3)
            row = ledger.get(answer.request_id)
            assert row is not None and row.served_digest in arms.values()
            served[tenant].add(str(row.served_digest))
            if tenant == "acme":  # the owner is told what served, as the engine recorded it
                assert answer.adapter_digest == row.served_digest
            else:
                assert answer.adapter_digest == ""
    # both arms' tickets are alike in size (per tenant: its own name is in them)
    assert all(len(sizes) == 1 for sizes in lengths.values()), lengths
    # both arms really answered both tenants (16 sessions at 50 %: all on one arm is 2^-15)
    assert served["acme"] == served["globex"] == set(arms.values())


def test_a_granted_tenants_stream_and_stats_name_no_adapter(
        stack: Stack, arms: dict[str, str]) -> None:
    ticket = stack.ticket("globex", ALIAS)
    theirs = stream_generate(stack.grpc, "Hello", ticket, max_tokens=3)
    assert theirs.pieces and theirs.adapter_digest == ""
    mine = stream_generate(stack.grpc, "Hello", stack.ticket("acme", ALIAS), max_tokens=3)
    assert mine.pieces and mine.adapter_digest in arms.values()
    status, body = _stats(stack, stack.api_keys["globex"])
    assert status == 200
    text = json.dumps(body)
    assert not any(h.decode() in text for h in _hexes(*arms.values()))
    assert "granted" in {d["adapter_digest"] for d in body["digests"]}


def _stats(stack: Stack, key: str) -> tuple[int, dict[str, object]]:
    import urllib.error
    import urllib.request

    req = urllib.request.Request(f"{stack.deployment.gateway_url}/v1/stats",
                                 headers={"Authorization": f"Bearer {key}"})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, {}


def test_tickets_name_no_arm_even_to_their_owner(stack: Stack, arms: dict[str, str]) -> None:
    """The owner is told what served after the fact; its ticket still names nothing before
    (so an owner's client cannot choose its arm by re-drawing sessions either)."""
    ticket = stack.ticket("acme", ALIAS)
    assert not any(h in _payload(ticket) for h in _hexes(*arms.values()))
