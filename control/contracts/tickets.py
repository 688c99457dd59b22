"""Routing tickets: the one ticket codec, signing on the control plane, verifying on Triton hosts.

A ticket is a PASETO v4.public token (Ed25519). Its payload holds the claims below, its footer
the key id, so hosts that hold several public keys (rotation) pick the right one without trying
all. The implicit assertion binds every ticket to this protocol, so a PASETO signed by the same key
for some other purpose is never a ticket.

Verification failures raise :class:`TicketRejected` with a short machine reason for the ledger and
metrics; what a client is told is always :data:`GENERIC_REFUSAL`, whatever the reason.

A ticket whose lifetime (``exp - iat``) exceeds the host's cap is refused (reason ``lifetime``)
even when its signature is good: a misconfigured gateway or a stolen key cannot mint tickets
that outlive a revocation of the key by more than the cap.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import os
import re
import struct
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyseto
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from control.contracts.config import DEFAULT_TICKET_MAX_TTL_S
from control.contracts.digests import DIGEST_RE
from control.contracts.keys import load_or_create_ed25519, write_atomically

TOKEN_PREFIX = "v4.public."
MAX_TOKEN_BYTES = 4096
IMPLICIT_ASSERTION = b"loraplane-routing-ticket-v1"
CLOCK_SKEW_S = 30
GENERIC_REFUSAL = "request refused: invalid or unauthorised routing ticket"
_LE64_MASK = (1 << 63) - 1
ACTIVE_KEY_FILE = "active.pem"  # under <keys>/private: the key a gateway starts signing with
_B64URL_RE = re.compile(r"^[A-Za-z0-9_-]*$")
# Exactly these claims, no more, no fewer. ``release`` joined in the second claim set: tickets
# signed before it (nine claims) are refused, which is fine because a ticket lives minutes.
_CLAIMS = ("tenant", "model", "base", "adapter", "tokenizer", "release", "iat", "exp", "jti",
           "kid")
_DIGEST_OR_NULL_CLAIMS = ("adapter", "release")


class TicketRejected(Exception):
    """A ticket failed verification; ``reason`` is for the ledger, never for the client."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class TicketClaims:
    tenant: str
    model: str
    base: str
    adapter: str | None  # None: the bare base model (still a ticket: default deny)
    tokenizer: str
    # The release manifest resolved at issue time, signed so the host can record which release
    # it served (the adapter digest alone does not say which manifest named it). None: a base
    # registered without a release.
    release: str | None
    iat: int
    exp: int
    jti: str
    kid: str

    def to_json(self) -> dict[str, Any]:
        return dict(vars(self))  # fields in declaration order; asdict's deep copy costs more


def key_id(public_raw: bytes) -> str:
    """Key id: the first 16 hex characters of the SHA-256 of the raw public key."""
    return hashlib.sha256(public_raw).hexdigest()[:16]


def _public_raw(private: Ed25519PrivateKey) -> bytes:
    return private.public_key().public_bytes(
        serialization.Encoding.Raw, serialization.PublicFormat.Raw
    )


class TicketSigner:
    """Signs tickets with the control plane's Ed25519 key (created on first use, mode 0600)."""

    def __init__(self, private: Ed25519PrivateKey) -> None:
        self._private = private
        self.public_raw = _public_raw(private)
        self.kid = key_id(self.public_raw)
        self._footer = json.dumps({"kid": self.kid}, separators=(",", ":")).encode()

    @property
    def public_b64(self) -> str:
        return base64.b64encode(self.public_raw).decode("ascii")

    @classmethod
    def load_or_create(cls, keys_dir: Path) -> tuple[TicketSigner, bool]:
        """The active signing key under ``keys_dir``; returns (signer, created)."""
        private_dir = keys_dir / "private"
        public_dir = keys_dir / "public"
        private_dir.mkdir(parents=True, exist_ok=True)
        public_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(private_dir, 0o700)
        key, created = load_or_create_ed25519(
            private_dir / ACTIVE_KEY_FILE,
            "active ticket signing key",
            # Hosts must know the public half before anything can be signed with the key.
            before_publish=lambda k: write_public_key(public_dir, _public_raw(k)),
        )
        return cls(key), created

    def issue(
        self,
        *,
        tenant: str,
        model: str,
        base: str,
        adapter: str | None,
        tokenizer: str,
        release: str | None,
        ttl_s: int,
        now: float | None = None,
    ) -> tuple[str, TicketClaims]:
        """Sign a ticket; returns (token, claims).

        ``release`` has no default on purpose: every issuer must say which release it resolved
        (or None for a base without one), never leave it out by accident.
        """
        iat = int(now if now is not None else time.time())
        claims = TicketClaims(
            tenant=tenant,
            model=model,
            base=base,
            adapter=adapter,
            tokenizer=tokenizer,
            release=release,
            iat=iat,
            exp=iat + ttl_s,
            jti=str(uuid.uuid4()),
            kid=self.kid,
        )
        token = encode_v4_public(
            self._private,
            json.dumps(claims.to_json(), separators=(",", ":")).encode(),
            self._footer,
        )
        return token, claims


def _pae(*pieces: bytes) -> bytes:
    """PASETO's pre-authentication encoding: the count, then each piece's length and bytes,
    lengths as little-endian 64-bit integers with the top bit clear."""
    out = [struct.pack("<Q", len(pieces) & _LE64_MASK)]
    for piece in pieces:
        out += [struct.pack("<Q", len(piece) & _LE64_MASK), piece]
    return b"".join(out)


def _b64url(raw: bytes) -> bytes:
    return base64.urlsafe_b64encode(raw).rstrip(b"=")


def encode_v4_public(private: Ed25519PrivateKey, payload: bytes, footer: bytes) -> str:
    """A PASETO v4.public token of ``payload`` with ``footer`` and our implicit assertion.

    The signing half of the spec, written out: pyseto's ``encode`` costs about 160 us per
    ticket against 45 us for the Ed25519 signature itself, and it is the gateway's hottest
    path. Ed25519 is deterministic, so the result is byte-for-byte pyseto's (a test checks);
    verification stays with pyseto.
    """
    header = TOKEN_PREFIX.encode()
    signature = private.sign(_pae(header, payload, footer, IMPLICIT_ASSERTION))
    token = header + _b64url(payload + signature)
    if footer:
        token += b"." + _b64url(footer)
    return token.decode("ascii")


def write_public_key(public_dir: Path, public_raw: bytes) -> Path:
    """Write ``<kid>.pub`` (the base64 raw key) where hosts load keys from; returns its path."""
    path = public_dir / f"{key_id(public_raw)}.pub"
    write_atomically(path, (base64.b64encode(public_raw).decode("ascii") + "\n").encode())
    return path


def load_public_keys(public_dir: Path) -> dict[str, bytes]:
    """kid -> raw Ed25519 public key, from ``<kid>.pub`` files (base64 raw keys)."""
    keys: dict[str, bytes] = {}
    if not public_dir.is_dir():
        return keys
    for p in sorted(public_dir.glob("*.pub")):
        raw = base64.b64decode(p.read_text().strip(), validate=True)
        keys[key_id(raw)] = raw
    return keys


class TicketVerifier:
    """Verifies tickets on a Triton host that serves one model on one base and tokenizer."""

    def __init__(
        self,
        public_keys: dict[str, bytes],
        *,
        model: str,
        base: str,
        tokenizer: str,
        max_ttl_s: int = DEFAULT_TICKET_MAX_TTL_S,
    ) -> None:
        """``max_ttl_s``: the longest lifetime (``exp - iat``) accepted, in seconds."""
        if type(max_ttl_s) is not int or max_ttl_s <= 0:
            raise ValueError(f"max_ttl_s must be a positive whole number of seconds, "
                             f"not {max_ttl_s!r}")
        self.model = model
        self.base = base
        self.tokenizer = tokenizer
        self.max_ttl_s = max_ttl_s
        self._keys: dict[str, Any] = {}
        for kid, raw in public_keys.items():
            pem = _raw_public_to_pem(raw)
            self._keys[kid] = pyseto.Key.new(version=4, purpose="public", key=pem)

    def verify(self, token: object, now: float | None = None) -> TicketClaims:
        """The claims of a valid ticket bound to this host, else TicketRejected."""
        if isinstance(token, bytes):
            try:
                token = token.decode("ascii")
            except UnicodeDecodeError:
                raise TicketRejected("encoding") from None
        if not isinstance(token, str) or not token:
            raise TicketRejected("missing")
        if len(token) > MAX_TOKEN_BYTES or not token.isascii():
            raise TicketRejected("encoding")
        if not token.startswith(TOKEN_PREFIX):
            raise TicketRejected("format")
        parts = token.split(".")
        if len(parts) != 4 or not all(_canonical_b64url(p) for p in parts[2:]):
            raise TicketRejected("format")
        try:
            footer = json.loads(_b64url_decode(parts[3]))
            kid = footer["kid"]
        except (ValueError, KeyError, TypeError, binascii.Error):
            raise TicketRejected("format") from None
        key = self._keys.get(kid) if isinstance(kid, str) else None
        if key is None:
            raise TicketRejected("unknown_key")
        try:
            decoded = pyseto.decode(key, token, implicit_assertion=IMPLICIT_ASSERTION)
        except Exception:  # pyseto raises several types for bad signatures and encodings
            raise TicketRejected("signature") from None
        claims = _parse_claims(decoded.payload, kid)
        t = time.time() if now is None else now
        if claims.exp <= t:
            raise TicketRejected("expired")
        if claims.iat > t + CLOCK_SKEW_S:
            raise TicketRejected("not_yet_valid")
        if claims.exp - claims.iat > self.max_ttl_s:
            raise TicketRejected("lifetime")
        if claims.model != self.model:
            raise TicketRejected("model")
        if claims.base != self.base:
            raise TicketRejected("base")
        if claims.tokenizer != self.tokenizer:
            raise TicketRejected("tokenizer")
        return claims


def unverified_claims(token: str) -> dict[str, Any]:
    """A ticket's claims, read WITHOUT verifying its signature: for tools and tests that hold
    their own tickets and need the release a gateway resolved (a v4.public payload is signed,
    not encrypted; the gateway's answer names no arm). Never a basis for serving anything:
    hosts verify (:class:`TicketVerifier`)."""
    payload = _b64url_decode(token.split(".")[2])
    return dict(json.loads(payload[:-64]))  # the last 64 bytes: the Ed25519 signature


def _raw_public_to_pem(raw: bytes) -> bytes:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    return Ed25519PublicKey.from_public_bytes(raw).public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )


def _b64url_decode(s: str) -> bytes:
    return base64.urlsafe_b64decode(s + "=" * (-len(s) % 4))


def _canonical_b64url(s: str) -> bool:
    """Unpadded base64url whose unused trailing bits are zero: one string per ticket.

    Decoders tolerate padding and stray low bits, so without this one signed ticket would have
    many spellings (fuzzing found a padded footer accepted).
    """
    if not _B64URL_RE.match(s):
        return False
    try:
        raw = _b64url_decode(s)
    except (ValueError, binascii.Error):
        return False
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode("ascii") == s


def _digest_or_null(value: object) -> bool:
    # fullmatch: DIGEST_RE ends in ``$``, which ``match`` also lets match before a final "\n".
    return value is None or (isinstance(value, str) and DIGEST_RE.fullmatch(value) is not None)


def _parse_claims(payload: object, kid: str) -> TicketClaims:
    try:
        data = json.loads(payload) if isinstance(payload, (bytes, str)) else None
    except ValueError:
        data = None
    if not isinstance(data, dict) or set(data) != set(_CLAIMS):
        raise TicketRejected("claims")
    strs = ("tenant", "model", "base", "tokenizer", "jti", "kid")
    if not all(isinstance(data[k], str) and data[k] for k in strs):
        raise TicketRejected("claims")
    if not all(type(data[k]) is int for k in ("iat", "exp")):
        raise TicketRejected("claims")
    if not all(_digest_or_null(data[k]) for k in _DIGEST_OR_NULL_CLAIMS):
        raise TicketRejected("claims")
    if not (DIGEST_RE.fullmatch(data["base"]) and DIGEST_RE.fullmatch(data["tokenizer"])):
        raise TicketRejected("claims")
    if data["kid"] != kid:  # the signed kid must match the footer's
        raise TicketRejected("claims")
    return TicketClaims(**data)
