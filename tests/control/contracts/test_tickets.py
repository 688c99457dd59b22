"""The ticket codec: round trip, every binding, and no malformed input accepted."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from control.contracts.tickets import (
    IMPLICIT_ASSERTION,
    TicketRejected,
    TicketSigner,
    TicketVerifier,
    encode_v4_public,
    load_public_keys,
)
from tests.fuzzing import CASES, FUZZ_EXAMPLES, fuzz, pyseto_key

BASE = "sha256:" + "a" * 64
TOK = "sha256:" + "b" * 64
ADAPTER = "sha256:" + "c" * 64
RELEASE = "sha256:" + "e" * 64
# The claim sets, written out here rather than read from the code under test: what a host reads
# once the arm is opened, and what travels (the arm sealed).
CLAIMS = {"tenant", "model", "base", "adapter", "tokenizer", "release", "iat", "exp", "jti",
          "kid", "disclose", "pool", "regions", "affinity"}
WIRE = {"tenant", "model", "base", "tokenizer", "arm", "pool", "regions", "iat", "exp", "jti",
        "kid"}


def _seal_of(signer: TicketSigner) -> dict[str, bytes]:
    """The seal key of ``signer``, derived here as the contract says (HKDF-SHA256 of the raw
    private key, info ``loraplane-ticket-seal-v1``), not read from the signer."""
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF

    raw = signer._private.private_bytes(serialization.Encoding.Raw,
                                        serialization.PrivateFormat.Raw,
                                        serialization.NoEncryption())
    key = HKDF(algorithm=hashes.SHA256(), length=32, salt=None,
               info=b"loraplane-ticket-seal-v1").derive(raw)
    return {signer.kid: key}


@pytest.fixture()
def keys(tmp_path: Path) -> tuple[TicketSigner, TicketVerifier]:
    signer, created = TicketSigner.load_or_create(tmp_path)
    assert created
    again, created2 = TicketSigner.load_or_create(tmp_path)
    assert not created2 and again.kid == signer.kid
    verifier = TicketVerifier(load_public_keys(tmp_path / "public"), seal_keys=_seal_of(signer),
                              model="lora_llm", base=BASE, tokenizer=TOK)
    return signer, verifier


def _issue(signer: TicketSigner, **over: object) -> str:
    kw: dict[str, object] = dict(tenant="acme", model="lora_llm", base=BASE, adapter=ADAPTER,
                                 tokenizer=TOK, release=RELEASE, disclose=False, ttl_s=60)
    kw.update(over)
    return signer.issue(**kw)[0]  # type: ignore[arg-type]


def test_round_trip_and_private_key_mode(keys: tuple[TicketSigner, TicketVerifier],
                                         tmp_path: Path) -> None:
    signer, verifier = keys
    claims = verifier.verify(_issue(signer))
    assert (claims.tenant, claims.adapter, claims.kid) == ("acme", ADAPTER, signer.kid)
    assert claims.release == RELEASE
    assert set(claims.to_json()) == CLAIMS
    assert verifier.verify(_issue(signer, adapter=None)).adapter is None
    assert verifier.verify(_issue(signer, release=None)).release is None  # base without one
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


def test_lifetime_above_the_cap_refused(keys: tuple[TicketSigner, TicketVerifier]) -> None:
    """Default cap 5 minutes: a validly signed ticket that lives longer is refused, whoever
    signed it and whatever its expiry."""
    signer, verifier = keys
    assert verifier.max_ttl_s == 300
    assert verifier.verify(_issue(signer, ttl_s=300)).exp - verifier.verify(
        _issue(signer, ttl_s=300)).iat == 300  # exactly the cap is fine
    now = int(time.time())
    forged = [
        _issue(signer, ttl_s=301),  # a gateway misconfigured by one second
        _issue(signer, ttl_s=86_400),  # a day-long ticket
        _sign_payload(signer, {**_genuine_payload(signer), "iat": now - 3600, "exp": now + 60}),
    ]
    for token in forged:
        with pytest.raises(TicketRejected) as e:
            verifier.verify(token)
        assert e.value.reason == "lifetime"
    longer = TicketVerifier({signer.kid: signer.public_raw}, seal_keys=_seal_of(signer),
                            model="lora_llm", base=BASE, tokenizer=TOK, max_ttl_s=86_400)
    assert longer.verify(forged[1]).tenant == "acme"
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="max_ttl_s"):
            TicketVerifier({}, seal_keys={}, model="lora_llm", base=BASE, tokenizer=TOK,
                           max_ttl_s=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize(("env", "message"), [
    ({"LORAPLANE_TICKET_TTL_S": "600"}, "above the ticket lifetime cap"),
    ({"LORAPLANE_TICKET_TTL_S": "120", "LORAPLANE_TICKET_MAX_TTL_S": "60"}, "above"),
    ({"LORAPLANE_TICKET_TTL_S": "0"}, "LORAPLANE_TICKET_TTL_S must be a positive"),
    ({"LORAPLANE_TICKET_TTL_S": "-5"}, "LORAPLANE_TICKET_TTL_S must be a positive"),
    ({"LORAPLANE_TICKET_TTL_S": "5m"}, "LORAPLANE_TICKET_TTL_S must be a whole number"),
    ({"LORAPLANE_TICKET_MAX_TTL_S": "0"}, "LORAPLANE_TICKET_MAX_TTL_S must be a positive"),
    ({"LORAPLANE_TICKET_MAX_TTL_S": "86400"}, "at most 3600"),
])
def test_ticket_lifetime_settings_refused_at_start(
        env: dict[str, str], message: str, monkeypatch: pytest.MonkeyPatch,
        tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from control.cli.main import app
    from control.contracts.config import ConfigError, Settings

    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match=message):
        Settings.from_env(tmp_path)
    # Every verb reads the settings first: one clear line, a non-zero exit, nothing started.
    res = CliRunner().invoke(app, ["--json", "--home", str(tmp_path / "home"), "tenant", "list"])
    assert res.exit_code == 2 and message in res.stdout
    assert not (tmp_path / "home").exists()


def test_ticket_lifetime_settings(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from control.contracts.config import ConfigError, Settings

    s = Settings.from_env(tmp_path)
    assert (s.ticket_ttl_s, s.ticket_max_ttl_s) == (300, 300)
    monkeypatch.setenv("LORAPLANE_TICKET_TTL_S", "900")
    monkeypatch.setenv("LORAPLANE_TICKET_MAX_TTL_S", "900")
    s = Settings.from_env(tmp_path)
    assert (s.ticket_ttl_s, s.ticket_max_ttl_s) == (900, 900)
    with pytest.raises(ConfigError):  # built in code, not only from the environment
        Settings(home=tmp_path, db_url="sqlite://", ticket_ttl_s=301)


def _sign_payload(signer: TicketSigner, payload: dict[str, object]) -> str:
    """Any payload, genuinely signed by ``signer`` (what only a buggy or old issuer would sign)."""
    import json

    import pyseto

    from control.contracts.tickets import IMPLICIT_ASSERTION

    return pyseto.encode(pyseto_key(signer), json.dumps(payload).encode(),
                         footer=json.dumps({"kid": signer.kid}).encode(),
                         implicit_assertion=IMPLICIT_ASSERTION).decode()


def _arm(signer: TicketSigner, jti: str = "j", adapter: str | None = ADAPTER,
         release: str | None = RELEASE, disclose: bool = False) -> str:
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    from control.contracts.tickets import seal_arm

    return seal_arm(AESGCM(_seal_of(signer)[signer.kid]), jti, adapter, release, disclose)


def _genuine_payload(signer: TicketSigner) -> dict[str, object]:
    now = int(time.time())
    return dict(tenant="acme", model="lora_llm", base=BASE, tokenizer=TOK, arm=_arm(signer),
                pool="shared", regions=[], iat=now, exp=now + 60, jti="j", kid=signer.kid)


def _open_payload(token: str) -> bytes:
    import base64

    body = token.split(".")[2]
    return base64.urlsafe_b64decode(body + "=" * (-len(body) % 4))[:-64]


def test_no_arm_is_readable_from_a_ticket(keys: tuple[TicketSigner, TicketVerifier]) -> None:
    """Issue 21: a client holding its ticket cannot tell which adapter or release it routes
    to: neither digest appears in the token's payload (in hex or raw), and tickets of the two
    arms of a split, and of the base alone, are the same length."""
    import base64
    import json

    signer, verifier = keys
    canary, stable = "sha256:" + "1" * 64, "sha256:" + "2" * 64
    tokens = {name: _issue(signer, adapter=adapter, release=release)
              for name, adapter, release in (("canary", ADAPTER, canary),
                                             ("stable", "sha256:" + "3" * 64, stable),
                                             ("base", None, None))}
    for token in tokens.values():
        payload = _open_payload(token)
        assert set(json.loads(payload)) == WIRE
        for digest in (ADAPTER, canary, stable, "sha256:" + "3" * 64):
            hexpart = digest.split(":")[1]
            assert hexpart.encode() not in payload and bytes.fromhex(hexpart) not in payload
            assert bytes.fromhex(hexpart) not in base64.urlsafe_b64decode(
                json.loads(payload)["arm"] + "==")
        assert "sha256:" not in token
    assert len({len(t) for t in tokens.values()}) == 1
    opened = verifier.verify(tokens["canary"])
    assert (opened.adapter, opened.release, opened.disclose) == (ADAPTER, canary, False)
    base = verifier.verify(tokens["base"])
    assert (base.adapter, base.release) == (None, None)
    assert verifier.verify(_issue(signer, disclose=True)).disclose is True


def test_arm_must_open_under_the_signers_seal(keys: tuple[TicketSigner, TicketVerifier],
                                              tmp_path: Path) -> None:
    """The arm is opened with the seal key of the key that signed the ticket, bound to the
    ticket's id: an arm from another ticket, another key's seal, or bytes that are not a seal
    are refused even when the ticket is genuinely signed."""
    signer, verifier = keys
    assert verifier.verify(_sign_payload(signer, _genuine_payload(signer))).release == RELEASE
    other, _ = TicketSigner.load_or_create(tmp_path / "other")
    good = _arm(signer)
    flipped = good[:-2] + ("A" if good[-2] != "A" else "B") + good[-1]
    cases = {
        "seal": [_arm(signer, jti="another ticket"), _arm(other), flipped],
        "claims": [good + "A", good[:-1], "", "sha256:" + "e" * 64, 1, None, True, [good]],
    }
    for reason, arms in cases.items():
        for arm in arms:
            with pytest.raises(TicketRejected) as e:
                verifier.verify(_sign_payload(signer, {**_genuine_payload(signer), "arm": arm}))
            assert e.value.reason == reason, arm
    unsealed = TicketVerifier(load_public_keys(tmp_path / "public"), seal_keys={},
                              model="lora_llm", base=BASE, tokenizer=TOK)
    with pytest.raises(TicketRejected) as e:
        unsealed.verify(_issue(signer))
    assert e.value.reason == "unknown_seal"


def test_a_ticket_runs_only_in_its_pool_and_regions(tmp_path: Path) -> None:
    """Issue 25: a host refuses a ticket of another pool, or one whose regions leave its own
    out, however genuine; placement claims have one spelling each."""
    signer, _ = TicketSigner.load_or_create(tmp_path)

    def host(pool: str, region: str) -> TicketVerifier:
        return TicketVerifier(load_public_keys(tmp_path / "public"), seal_keys=_seal_of(signer),
                              model="lora_llm", base=BASE, tokenizer=TOK, pool=pool,
                              region=region)

    shared, gold_eu, gold_us = host("shared", "eu"), host("gold", "eu"), host("gold", "us")
    gold = _issue(signer, pool="gold", regions=("us", "eu"))
    assert gold_eu.verify(gold).regions == ("eu", "us") and gold_us.verify(gold).pool == "gold"
    anywhere = _issue(signer)  # the shared pool, any region
    assert shared.verify(anywhere).pool == "shared"
    for verifier, token in ((shared, gold), (gold_eu, anywhere),
                            (gold_us, _issue(signer, pool="gold", regions=("eu",)))):
        with pytest.raises(TicketRejected) as e:
            verifier.verify(token)
        assert e.value.reason == "placement"
    for over in ({"pool": "Gold"}, {"pool": ""}, {"pool": None}, {"regions": ["us", "eu"]},
                 {"regions": ["eu", "eu"]}, {"regions": "eu"}, {"regions": ["EU"]},
                 {"regions": [f"r{i}" for i in range(17)]}):
        with pytest.raises(TicketRejected) as e:
            shared.verify(_sign_payload(signer, {**_genuine_payload(signer), **over}))
        assert e.value.reason == "claims", over


def test_affinity_claim_signed_and_optional(keys: tuple[TicketSigner, TicketVerifier]) -> None:
    """Issue 25: the alias's placement value travels signed in the clear (the host's OpenAI
    route and metrics read it); a ticket without it (signed before it existed) stays valid; a
    malformed value is refused like any malformed claim, and the signer will not sign one."""
    import hashlib
    import json

    signer, verifier = keys
    value = hashlib.sha256(b"any alias").hexdigest()[:16]  # the shape affinity_of gives
    token = _issue(signer, affinity=value)
    assert verifier.verify(token).affinity == value
    assert json.loads(_open_payload(token))["affinity"] == value  # readable without keys
    older = _issue(signer)
    assert "affinity" not in json.loads(_open_payload(older))
    assert verifier.verify(older).affinity is None
    for bad in (value.upper(), value[:-1], value + "0", value + "\n", "", None, 1234, ["x"],
                "g" * 16):
        with pytest.raises(TicketRejected) as e:
            verifier.verify(_sign_payload(signer, {**_genuine_payload(signer), "affinity": bad}))
        assert e.value.reason == "claims", bad
    for bad in (value.upper(), value[:8], ""):
        with pytest.raises(ValueError):
            _issue(signer, affinity=bad)


def test_older_claim_sets_and_extra_claims_refused(
        keys: tuple[TicketSigner, TicketVerifier]) -> None:
    """Tickets of the earlier claim sets (adapter and release in the clear, with or without
    release) are refused, even by the right key; so is any extra claim."""
    signer, verifier = keys
    now = int(time.time())
    clear = dict(tenant="acme", model="lora_llm", base=BASE, adapter=ADAPTER, tokenizer=TOK,
                 release=RELEASE, iat=now, exp=now + 60, jti="j", kid=signer.kid)
    nine = {k: v for k, v in clear.items() if k != "release"}
    for payload in (clear, nine, {**_genuine_payload(signer), "release_name": "x"},
                    {**_genuine_payload(signer), "adapter": ADAPTER}):
        with pytest.raises(TicketRejected) as e:
            verifier.verify(_sign_payload(signer, payload))
        assert e.value.reason == "claims"


def test_altered_release_refused(keys: tuple[TicketSigner, TicketVerifier],
                                 tmp_path: Path) -> None:
    """Another release named in a genuine ticket (tampered), or signed by an unknown key."""
    import base64
    import json

    signer, verifier = keys
    head, purpose, body, footer = _issue(signer).split(".")
    raw = base64.urlsafe_b64decode(body + "=" * (-len(body) % 4))
    claims = json.loads(raw[:-64])
    claims["arm"] = _arm(signer, jti=claims["jti"], release="sha256:" + "f" * 64)
    forged_body = base64.urlsafe_b64encode(json.dumps(claims, separators=(",", ":")).encode()
                                           + raw[-64:]).rstrip(b"=").decode()
    with pytest.raises(TicketRejected) as e:
        verifier.verify(".".join((head, purpose, forged_body, footer)))
    assert e.value.reason == "signature"
    other, _ = TicketSigner.load_or_create(tmp_path / "other")
    with pytest.raises(TicketRejected) as e:
        verifier.verify(_issue(other, release="sha256:" + "f" * 64))
    assert e.value.reason == "unknown_key"


@given(payload=st.binary(max_size=600), footer=st.binary(max_size=80))
@settings(max_examples=200, deadline=None)
def test_our_encoder_is_byte_for_byte_pyseto(payload: bytes, footer: bytes) -> None:
    """The signer writes tokens itself (the gateway's hot path); Ed25519 is deterministic, so
    every token must equal the reference implementation's, bytes and all."""
    import pyseto

    ours = encode_v4_public(_SIGNER._private, payload, footer)
    reference = pyseto.encode(pyseto_key(_SIGNER), payload, footer=footer,
                              implicit_assertion=IMPLICIT_ASSERTION).decode("ascii")
    assert ours == reference


def test_other_key_refused(keys: tuple[TicketSigner, TicketVerifier], tmp_path: Path) -> None:
    _signer, verifier = keys
    other, _ = TicketSigner.load_or_create(tmp_path / "other")
    with pytest.raises(TicketRejected) as e:
        verifier.verify(_issue(other))
    assert e.value.reason == "unknown_key"


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.binary(max_size=600), st.text(max_size=600)))
def test_arbitrary_input_never_accepted(data: bytes | str) -> None:
    verifier = TicketVerifier({}, seal_keys={}, model="lora_llm", base=BASE, tokenizer=TOK)
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
    v = TicketVerifier({s.kid: s.public_raw}, seal_keys=_seal_of(s), model="lora_llm",
                       base=BASE, tokenizer=TOK)
    return s, v, _issue(s)


_SIGNER, _VERIFIER, _TOKEN = _setup()


# -- fuzzing (tests/fuzzing.py sets the case count: 10,000 by default) -------------------------

def _b64e(b: bytes) -> str:
    import base64

    return base64.urlsafe_b64encode(b).rstrip(b"=").decode()


def _hs256_with_public_key(claims: dict[str, object]) -> str:
    """Algorithm confusion: a JWS 'signed' with HMAC, using the public key as the secret."""
    import hashlib
    import hmac
    import json

    head = _b64e(json.dumps({"alg": "HS256", "typ": "JWT", "kid": _SIGNER.kid}).encode())
    body = _b64e(json.dumps(claims).encode())
    sig = hmac.new(_SIGNER.public_raw, f"{head}.{body}".encode(), hashlib.sha256).digest()
    return f"{head}.{body}.{_b64e(sig)}"


def _local_with_public_key() -> str:
    """Algorithm confusion: v4.local (symmetric) keyed with the public key's bytes."""
    import json

    import pyseto

    key = pyseto.Key.new(version=4, purpose="local", key=_SIGNER.public_raw)
    return pyseto.encode(key, json.dumps(_VALID_CLAIMS).encode(),
                         footer=json.dumps({"kid": _SIGNER.kid}).encode()).decode()


_VALID_CLAIMS = dict(json.loads(_open_payload(_TOKEN)))  # the wire claims, the arm sealed
_OPENED = _VERIFIER.verify(_TOKEN).to_json()
_PARTS = _TOKEN.split(".")
_KIDS = st.sampled_from([_SIGNER.kid, "0" * 16, "", "../../keys/private/active.pem"])


@st.composite
def _forged(draw: st.DrawFn) -> str | bytes:
    kind = draw(st.integers(0, 7))
    if kind == 0:
        return draw(st.binary(max_size=5000))
    if kind == 1:
        return draw(st.text(max_size=5000))
    if kind == 2:  # well-formed envelope, random body and footer
        prefix = draw(st.sampled_from(["v4.public.", "v4.local.", "v2.public.", "v3.public.",
                                       "V4.PUBLIC.", "v4.public"]))
        footer = json_dumps({"kid": draw(_KIDS)}) if draw(st.booleans()) else draw(st.text())
        return prefix + _b64e(draw(st.binary(max_size=400))) + "." + _b64e(footer.encode())
    if kind == 3:  # one edit of the genuine token
        i = draw(st.integers(0, len(_TOKEN) - 1))
        op = draw(st.sampled_from(["replace", "delete", "insert"]))
        c = draw(st.characters())
        if op == "replace":
            return _TOKEN[:i] + c + _TOKEN[i + 1:]
        if op == "delete":
            return _TOKEN[:i] + _TOKEN[i + 1:]
        return _TOKEN[:i] + c + _TOKEN[i:]
    if kind == 4:  # truncated or extended
        n = draw(st.integers(0, len(_TOKEN) - 1))
        return _TOKEN[:n] if draw(st.booleans()) else _TOKEN + draw(st.text(min_size=1))
    if kind == 5:  # genuine parts recombined with a forged footer (kid is not signed alone)
        return ".".join([*_PARTS[:3], _b64e(json_dumps({"kid": draw(_KIDS)}).encode())])
    if kind == 6:
        claims = dict(_VALID_CLAIMS)
        claims[draw(st.sampled_from(sorted(claims)))] = draw(_json_values)
        return _hs256_with_public_key(claims)
    return _local_with_public_key()


def json_dumps(obj: object) -> str:
    import json

    return json.dumps(obj, separators=(",", ":"))


_json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=80),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner,
                                                                max_size=3),
    max_leaves=6,
)


@fuzz
@given(_forged())
def _fuzz_forged(token: str | bytes) -> None:
    CASES["ticket-forged"] += 1
    if token == _TOKEN:
        return
    with pytest.raises(TicketRejected):
        _VERIFIER.verify(token)


def test_fuzz_forged_tickets_never_accepted() -> None:
    before = CASES["ticket-forged"]
    _fuzz_forged()
    assert CASES["ticket-forged"] - before >= FUZZ_EXAMPLES


def _oracle_accepts(claims: dict[str, object], now: float) -> bool:
    """What a valid ticket for this host is, written independently of the decoder."""
    from control.contracts.digests import DIGEST_RE

    if set(claims) - {"affinity"} != WIRE:
        return False
    if "affinity" in claims and not (type(claims["affinity"]) is str and len(
            claims["affinity"]) == 16 and set(claims["affinity"]) <= set("0123456789abcdef")):
        return False
    if not all(type(claims[k]) is str and claims[k] for k in
               ("tenant", "model", "base", "tokenizer", "arm", "jti", "kid")):
        return False
    if not all(type(claims[k]) is int for k in ("iat", "exp")):
        return False
    if not all(DIGEST_RE.fullmatch(str(claims[k])) for k in ("base", "tokenizer")):
        return False
    if claims["pool"] != "shared" or claims["regions"] not in ([], ["local"]):
        return False  # this host: pool shared, region local; the only spellings it accepts
    # the arm opens only as sealed for its own ticket id (AES-GCM, the id as associated data)
    if (claims["arm"], claims["jti"]) != (_VALID_CLAIMS["arm"], _VALID_CLAIMS["jti"]):
        return False
    return (claims["kid"] == _SIGNER.kid and claims["model"] == "lora_llm"
            and claims["base"] == BASE and claims["tokenizer"] == TOK
            and claims["exp"] > now and claims["iat"] <= now + 30  # type: ignore[operator]
            and claims["exp"] - claims["iat"] <= 300)  # type: ignore[operator]


@st.composite
def _signed_claims(draw: st.DrawFn) -> dict[str, object]:
    claims: dict[str, object] = dict(_VALID_CLAIMS)
    for _ in range(draw(st.integers(0, 3))):
        op = draw(st.integers(0, 3))
        key = draw(st.sampled_from(sorted({*_VALID_CLAIMS, "affinity"})))
        if op == 0:
            claims.pop(key, None)
        elif op == 1:
            claims[key] = draw(_json_values)
        elif op == 2:
            claims[draw(st.text(max_size=10))] = draw(_json_values)
        else:
            claims[key] = draw(st.sampled_from([
                True, 1.5, "", "lora_llm", BASE, TOK, ADAPTER, RELEASE, None,
                "sha256:" + "A" * 64, "sha256:" + "e" * 64 + "\n", "0123456789abcdef",
                "0123456789ABCDEF",
                int(time.time()) - 10, int(time.time()) + 3600, 2**70, -1, _SIGNER.kid]))
    return claims


@fuzz
@given(_signed_claims())
def _fuzz_signed(claims: dict[str, object]) -> None:
    """Tickets really signed by the host's key, with arbitrary claims: the schema must hold."""
    import pyseto

    from control.contracts.tickets import IMPLICIT_ASSERTION

    CASES["ticket-signed"] += 1
    token = pyseto.encode(pyseto_key(_SIGNER), json_dumps(claims).encode(),
                          footer=json_dumps({"kid": _SIGNER.kid}).encode(),
                          implicit_assertion=IMPLICIT_ASSERTION).decode()
    now = time.time()
    if _oracle_accepts(claims, now):
        opened = {k: v for k, v in claims.items() if k != "arm"}
        opened["regions"] = list(claims["regions"])  # type: ignore[call-overload]
        opened.update(adapter=_OPENED["adapter"], release=_OPENED["release"],
                      disclose=_OPENED["disclose"], affinity=claims.get("affinity"))
        assert _VERIFIER.verify(token, now=now).to_json() == opened
    else:
        with pytest.raises(TicketRejected):
            _VERIFIER.verify(token, now=now)


def test_fuzz_signed_tickets_with_arbitrary_claims() -> None:
    before = CASES["ticket-signed"]
    _fuzz_signed()
    assert CASES["ticket-signed"] - before >= FUZZ_EXAMPLES
