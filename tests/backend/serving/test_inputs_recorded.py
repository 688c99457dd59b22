"""Every input gets a refusal that names the real reason, and a ledger row, in-process (the same
through the real tritonserver, 120 requests giving 120 rows, is
tests/integration/test_every_input_recorded.py).

A malformed input with a valid ticket is refused with a message naming the caller's own input
(never the generic ticket refusal, which would send a client hunting for a ticket problem),
and the ledger row carries the tenant and the reason. A ticket signed by a key that was never
recorded as an event is refused, even when its public key file sits in the host's key folder.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from backend.serving.messages import InvalidInput
from backend.serving.service import IncomingRequest, LoraService
from control.contracts.config import Settings
from control.contracts.db import make_engine
from control.contracts.ledger import Ledger
from control.contracts.ticket_seals import publish_seal
from control.contracts.tickets import GENERIC_REFUSAL, TicketSigner, write_public_key
from control.contracts.wire import TICKET_PARAM
from tests.serving_home import Home, Sink, provision_home


@pytest.fixture(scope="module")
def home(kit_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Home:
    root = tmp_path_factory.mktemp("inputs-home")
    return provision_home(Settings(home=root, db_url=f"sqlite:///{root / 'loraplane.db'}"),
                          kit_dir)


@pytest.fixture(scope="module")
def service(home: Home) -> Iterator[LoraService]:
    svc = home.service(host="inputs-host")
    try:
        yield svc
    finally:
        svc.close()


def _ask(service: LoraService, req: IncomingRequest) -> tuple[str, str, str]:
    """(message, status, request id) of a refused request."""
    sink = Sink()
    service.submit(req, sink)
    a = sink.wait()
    assert not a.ok, a
    return a.error, a.status, a.request_id


CASES = [
    # (prompt, extra, message starts with, ledger reason)
    (b"\xff\xfe not utf-8", {}, "invalid input text_input: is not valid UTF-8", "prompt_encoding"),
    (b"x" * 8193, {}, "invalid input text_input: is longer than 8192 characters", "prompt"),
    (None, {}, "invalid input text_input: must be one string", "prompt"),
    (b"Hi", {"problem": InvalidInput("max_tokens", "must hold exactly one value, found 2",
                                     "input_shape")},
     "invalid input max_tokens: must hold exactly one value", "input_shape"),
    (b"Hi", {"temperature": "hot"}, "invalid parameter temperature", "invalid_temperature"),
]


@pytest.mark.parametrize(("prompt", "extra", "message", "reason"), CASES)
def test_a_malformed_input_is_refused_for_what_it_is_and_recorded(
        home: Home, service: LoraService, prompt: bytes | None, extra: dict[str, object],
        message: str, reason: str) -> None:
    req = IncomingRequest(prompt, home.ticket("acme", "acme-alpha"), **extra)  # type: ignore[arg-type]
    error, status, rid = _ask(service, req)
    assert error.startswith(message) and error != GENERIC_REFUSAL
    assert status == "invalid_arg"
    for other in ("globex", "gamma", home.digests["gamma"], str(home.settings.home)):
        assert other not in error
    row = Ledger(make_engine(home.settings.db_url)).get(rid)
    assert row is not None
    assert (row.outcome, row.reason, row.tenant) == ("rejected", reason, "acme")
    assert row.adapter_digest == home.digests["alpha"]


def test_a_malformed_input_without_a_valid_ticket_gets_the_ticket_refusal(
        home: Home, service: LoraService) -> None:
    # The ticket is checked first: a caller without one learns nothing about its input.
    error, _status, rid = _ask(service, IncomingRequest(b"\xff", {TICKET_PARAM: "v4.public.x"}))
    assert error == GENERIC_REFUSAL
    row = Ledger(make_engine(home.settings.db_url)).get(rid)
    assert row is not None and row.tenant is None


@pytest.mark.parametrize("parameters", [
    '{"lora_ticket": "T", "lora_ticket": "T"}',  # duplicate keys: refused, even when equal
    '{"lora_ticket": "T", "x-lora-ticket": "U"}',
    '{"lora_front_refusal": "ambiguous"}',  # what the front forwards for such a request
])
def test_ambiguous_ticket_parameters_are_refused_with_a_row(
        home: Home, service: LoraService, parameters: str) -> None:
    ticket = str(home.ticket("acme", "acme-alpha")[TICKET_PARAM])
    error, _status, rid = _ask(service, IncomingRequest(
        b"Hi", parameters.replace('"T"', f'"{ticket}"')))
    assert error == GENERIC_REFUSAL
    row = Ledger(make_engine(home.settings.db_url)).get(rid)
    assert row is not None and row.reason in ("parameters", "ambiguous")


def test_a_key_file_on_the_host_is_not_trust_without_its_recorded_event(
        home: Home, service: LoraService) -> None:
    # A stranger's key: its public half is in the host's key folder (as if dropped there, or
    # left behind), but no SigningKeyRecorded event names it.
    stranger = TicketSigner(Ed25519PrivateKey.generate())
    write_public_key(home.settings.keys_dir / "public", stranger.public_raw)
    # and its seal published with a valid proof: the check under test is the recorded event
    publish_seal(make_engine(home.settings.db_url), stranger)
    claims = home.office.issue("acme", "acme-alpha").claims
    token, _ = stranger.issue(tenant="acme", model=claims.model, base=claims.base,
                              adapter=claims.adapter, tokenizer=claims.tokenizer,
                              release=claims.release, disclose=False, ttl_s=60)
    error, _status, rid = _ask(service, IncomingRequest(b"Hi", {TICKET_PARAM: token}))
    assert error == GENERIC_REFUSAL
    row = Ledger(make_engine(home.settings.db_url)).get(rid)
    assert row is not None and row.reason == "key_unrecorded"
    # The recorded key still works beside it.
    sink = Sink()
    service.submit(IncomingRequest(b"Hi", home.ticket("acme", "acme-alpha")), sink)
    assert sink.wait().ok
