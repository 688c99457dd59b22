"""The ticket codec: round trip, every binding, and no malformed input accepted."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from control.tickets import (
    TicketRejected,
    TicketSigner,
    TicketVerifier,
    load_public_keys,
)

BASE = "sha256:" + "a" * 64
TOK = "sha256:" + "b" * 64
ADAPTER = "sha256:" + "c" * 64


@pytest.fixture()
def keys(tmp_path: Path) -> tuple[TicketSigner, TicketVerifier]:
    signer, created = TicketSigner.load_or_create(tmp_path)
    assert created
    again, created2 = TicketSigner.load_or_create(tmp_path)
    assert not created2 and again.kid == signer.kid
    verifier = TicketVerifier(load_public_keys(tmp_path / "public"), model="lora_llm",
                              base=BASE, tokenizer=TOK)
    return signer, verifier


def _issue(signer: TicketSigner, **over: object) -> str:
    kw: dict[str, object] = dict(tenant="acme", model="lora_llm", base=BASE, adapter=ADAPTER,
                                 tokenizer=TOK, ttl_s=60)
    kw.update(over)
    return signer.issue(**kw)[0]  # type: ignore[arg-type]


def test_round_trip_and_private_key_mode(keys: tuple[TicketSigner, TicketVerifier],
                                         tmp_path: Path) -> None:
    signer, verifier = keys
    claims = verifier.verify(_issue(signer))
    assert (claims.tenant, claims.adapter, claims.kid) == ("acme", ADAPTER, signer.kid)
    assert verifier.verify(_issue(signer, adapter=None)).adapter is None
    assert (tmp_path / "private" / "active.pem").stat().st_mode & 0o777 == 0o600
    assert not list((tmp_path / "public").glob("*.pem"))  # hosts get raw public keys only


@pytest.mark.parametrize(
    ("over", "reason"),
    [
        ({"model": "other"}, "model"),
        ({"base": "sha256:" + "d" * 64}, "base"),
        ({"tokenizer": "sha256:" + "d" * 64}, "tokenizer"),
        ({"ttl_s": -1}, "expired"),
        ({"now": time.time() + 3600}, "not_yet_valid"),
    ],
)
def test_bindings(keys: tuple[TicketSigner, TicketVerifier], over: dict[str, object],
                  reason: str) -> None:
    signer, verifier = keys
    with pytest.raises(TicketRejected) as e:
        verifier.verify(_issue(signer, **over))
    assert e.value.reason == reason


def test_other_key_refused(keys: tuple[TicketSigner, TicketVerifier], tmp_path: Path) -> None:
    _signer, verifier = keys
    other, _ = TicketSigner.load_or_create(tmp_path / "other")
    with pytest.raises(TicketRejected) as e:
        verifier.verify(_issue(other))
    assert e.value.reason == "unknown_key"


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.binary(max_size=600), st.text(max_size=600)))
def test_arbitrary_input_never_accepted(data: bytes | str) -> None:
    verifier = TicketVerifier({}, model="lora_llm", base=BASE, tokenizer=TOK)
    with pytest.raises(TicketRejected):
        verifier.verify(data)


@settings(max_examples=300, deadline=None)
@given(st.integers(min_value=0, max_value=10_000), st.integers(min_value=0, max_value=255))
def test_any_single_byte_change_is_refused(pos: int, byte: int) -> None:
    token = _TOKEN  # one key and token for all examples
    i = pos % len(token)
    if ord(token[i]) == byte:
        return
    mutated = token[:i] + chr(byte) + token[i + 1:]
    with pytest.raises(TicketRejected):
        _VERIFIER.verify(mutated)


def _setup() -> tuple[TicketSigner, TicketVerifier, str]:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    s = TicketSigner(Ed25519PrivateKey.generate())
    v = TicketVerifier({s.kid: s.public_raw}, model="lora_llm", base=BASE, tokenizer=TOK)
    return s, v, _issue(s)


_SIGNER, _VERIFIER, _TOKEN = _setup()
