"""Routing tickets: the one ticket codec, signing on the control plane, verifying on Triton hosts.

A ticket is a PASETO v4.public token (Ed25519). Its payload holds the claims below, its footer
the key id, so hosts that hold several public keys (rotation) pick the right one without trying
all. The implicit assertion binds every ticket to this protocol, so a PASETO signed by the same key
for some other purpose is never a ticket.

The arm (the adapter and release the ticket routes to, and whether the client may be told the
adapter that served it) is sealed: the claim ``arm`` holds it AES-256-GCM encrypted under the seal
key of the signing key (HKDF-SHA256 of the private key, so it rotates and retires with it), in a
fixed-length binary layout, so neither the bytes nor their length tell a tenant which arm of a
canary split it landed on, or which adapter another tenant's alias runs. Hosts get seal keys
through ``control.contracts.ticket_seals``; the gateway's answer names no arm either.

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
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyseto
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from control.contracts.config import (
    DEFAULT_REGION,
    DEFAULT_TICKET_MAX_TTL_S,
    PLACEMENT_NAME_RE,
    SHARED_POOL,
)
from control.contracts.digests import DIGEST_RE
from control.contracts.keys import load_or_create_ed25519, write_atomically
from control.contracts.ticket_seals import proof_message

TOKEN_PREFIX = "v4.public."
MAX_TOKEN_BYTES = 4096
IMPLICIT_ASSERTION = b"loraplane-routing-ticket-v1"
CLOCK_SKEW_S = 30
GENERIC_REFUSAL = "request refused: invalid or unauthorised routing ticket"
_LE64_MASK = (1 << 63) - 1
ACTIVE_KEY_FILE = "active.pem"  # under <keys>/private: the key a gateway starts signing with
_B64URL_RE = re.compile(r"^[A-Za-z0-9_-]*$")
# Exactly these claims, no more, no fewer. The third claim set sealed ``adapter`` and ``release``
# into ``arm``: tickets signed before it are refused, which is fine because a ticket lives minutes.
_CLAIMS = ("tenant", "model", "base", "tokenizer", "arm", "pool", "regions", "iat", "exp", "jti",
           "kid")
# Claims a ticket may carry or not: ``affinity`` (issue 25) came after the third claim set, and
# tickets signed without it stay valid for their few minutes.
_OPTIONAL_CLAIMS = ("affinity",)
# ``control.contracts.placement.affinity_of``: 16 lowercase hex characters, one spelling.
AFFINITY_RE = re.compile(r"[0-9a-f]{16}")
MAX_REGIONS = 16
SEAL_INFO = b"loraplane-ticket-seal-v1"
_NONCE = 12
# The sealed arm: one flags byte, then the adapter's and the release's SHA-256 (zeros when
# absent), the same 65 bytes whatever the arm, so its length tells nothing either.
_ADAPTER, _RELEASE, _DISCLOSE = 1, 2, 4
_ARM_BYTES = 65
_ARM_CHARS = len(base64.urlsafe_b64encode(bytes(_NONCE + _ARM_BYTES + 16)).rstrip(b"="))


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
    # Whether the host may tell the client the adapter that served it (the answer's
    # ``adapter_digest``): the gateway sets it for the owner of the release only, so a tenant
    # granted another's alias never learns that tenant's adapter or rollout arm.
    disclose: bool = False
    # Where it may run (issue 25): hosts of this pool only, in these regions (empty: any).
    pool: str = SHARED_POOL
    regions: tuple[str, ...] = ()
    # The placement value of the alias the ticket was issued for (issue 25), signed so a host's
    # OpenAI route can check that a request's ``model`` names it, and publish it in its
    # placement metrics instead of the sealed adapter digest. None: a ticket signed without it.
    affinity: str | None = None

    def to_json(self) -> dict[str, Any]:
        """The claims as the host reads them, the arm opened (for operators' tools)."""
        out = dict(vars(self))  # fields in declaration order; asdict's deep copy costs more
        out["regions"] = list(self.regions)
        return out


def seal_key_of(private: Ed25519PrivateKey) -> bytes:
    """The seal key that goes with a signing key: HKDF-SHA256 of its private bytes."""
    raw = private.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw,
                                serialization.NoEncryption())
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=SEAL_INFO).derive(raw)


def _digest_bytes(digest: str | None) -> bytes:
    return bytes(32) if digest is None else bytes.fromhex(digest[len("sha256:"):])


def seal_arm(aead: AESGCM, jti: str, adapter: str | None, release: str | None,
             disclose: bool) -> str:
    """The ``arm`` claim: nonce and AES-GCM of the fixed-length arm, bound to the ticket id."""
    flags = ((_ADAPTER if adapter is not None else 0) | (_RELEASE if release is not None else 0)
             | (_DISCLOSE if disclose else 0))
    plain = bytes([flags]) + _digest_bytes(adapter) + _digest_bytes(release)
    nonce = os.urandom(_NONCE)  # 96 random bits per ticket: one key seals 2^32 safely
    sealed = nonce + aead.encrypt(nonce, plain, IMPLICIT_ASSERTION + jti.encode())
    return _b64url(sealed).decode("ascii")


def open_arm(aead: AESGCM, jti: str, arm: str) -> tuple[str | None, str | None, bool]:
    """(adapter, release, disclose) of a sealed ``arm``, else TicketRejected("seal")."""
    if len(arm) != _ARM_CHARS or not _canonical_b64url(arm):
        raise TicketRejected("claims")
    raw = _b64url_decode(arm)
    try:
        plain = aead.decrypt(raw[:_NONCE], raw[_NONCE:], IMPLICIT_ASSERTION + jti.encode())
    except InvalidTag:
        raise TicketRejected("seal") from None
    flags = plain[0]
    if len(plain) != _ARM_BYTES or flags & ~(_ADAPTER | _RELEASE | _DISCLOSE):
        raise TicketRejected("seal")

    def digest(present: int, raw32: bytes) -> str | None:
        if flags & present:
            return "sha256:" + raw32.hex()
        if raw32 != bytes(32):
            raise TicketRejected("seal")
        return None

    return (digest(_ADAPTER, plain[1:33]), digest(_RELEASE, plain[33:65]),
            bool(flags & _DISCLOSE))


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
        self.seal_key = seal_key_of(private)
        self._aead = AESGCM(self.seal_key)

    def seal_proof(self) -> bytes:
        """This key's signature of its own seal key (``control.contracts.ticket_seals``)."""
        return self._private.sign(proof_message(self.kid, self.seal_key))

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
        disclose: bool,
        ttl_s: int,
        pool: str = SHARED_POOL,
        regions: tuple[str, ...] = (),
        affinity: str | None = None,
        now: float | None = None,
    ) -> tuple[str, TicketClaims]:
        """Sign a ticket; returns (token, claims).

        ``release`` and ``disclose`` have no default on purpose: every issuer must say which
        release it resolved (or None for a base without one), and whether the caller owns it.
        ``affinity``: the alias's placement value (``affinity_of``), signed in the clear.
        """
        if affinity is not None and not AFFINITY_RE.fullmatch(affinity):
            raise ValueError("affinity must be 16 lowercase hex characters")
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
            disclose=disclose,
            pool=pool,
            regions=tuple(sorted(set(regions))),
            affinity=affinity,
        )
        wire: dict[str, Any] = {
            "tenant": tenant, "model": model, "base": base, "tokenizer": tokenizer,
            "arm": seal_arm(self._aead, claims.jti, adapter, release, disclose),
            "pool": pool, "regions": list(claims.regions),
            "iat": claims.iat, "exp": claims.exp, "jti": claims.jti, "kid": self.kid}
        if affinity is not None:  # absent rather than null: one spelling per ticket
            wire["affinity"] = affinity
        token = encode_v4_public(self._private, json.dumps(wire, separators=(",", ":")).encode(),
                                 self._footer)
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
        seal_keys: Mapping[str, bytes],
        model: str,
        base: str,
        tokenizer: str,
        max_ttl_s: int = DEFAULT_TICKET_MAX_TTL_S,
        pool: str = SHARED_POOL,
        region: str = DEFAULT_REGION,
    ) -> None:
        """``seal_keys``: kid -> the seal key that opens the arm of that key's tickets
        (``control.contracts.ticket_seals.load``). ``max_ttl_s``: the longest lifetime
        (``exp - iat``) accepted, in seconds."""
        if type(max_ttl_s) is not int or max_ttl_s <= 0:
            raise ValueError(f"max_ttl_s must be a positive whole number of seconds, "
                             f"not {max_ttl_s!r}")
        self.model = model
        self.base = base
        self.tokenizer = tokenizer
        self.max_ttl_s = max_ttl_s
        self.pool, self.region = pool, region  # where this host sits (Settings)
        self._keys: dict[str, Any] = {}
        for kid, raw in public_keys.items():
            pem = _raw_public_to_pem(raw)
            self._keys[kid] = pyseto.Key.new(version=4, purpose="public", key=pem)
        self._seals = {kid: AESGCM(bytes(k)) for kid, k in seal_keys.items()}

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
        data = _parse_claims(decoded.payload, kid)
        aead = self._seals.get(kid)
        if aead is None:  # a key whose seal was not published yet (a reload may find it)
            raise TicketRejected("unknown_seal")
        adapter, release, disclose = open_arm(aead, data["jti"], data.pop("arm"))
        data["regions"] = tuple(data["regions"])
        claims = TicketClaims(adapter=adapter, release=release, disclose=disclose, **data)
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
        if claims.pool != self.pool or (claims.regions and self.region not in claims.regions):
            raise TicketRejected("placement")  # another pool's, or not for this region
        return claims


def unverified_claims(token: str, seal_keys: Mapping[str, bytes] | None = None
                      ) -> dict[str, Any]:
    """A ticket's claims, read WITHOUT verifying its signature, the arm opened with
    ``seal_keys`` when given (else left sealed): for operators' tools and tests that hold the
    signing keys and need the release a gateway resolved. Never a basis for serving anything:
    hosts verify (:class:`TicketVerifier`)."""
    payload = _b64url_decode(token.split(".")[2])
    data = dict(json.loads(payload[:-64]))  # the last 64 bytes: the Ed25519 signature
    seal = (seal_keys or {}).get(data.get("kid", ""))
    if seal is not None:
        adapter, release, disclose = open_arm(AESGCM(bytes(seal)), data["jti"], data.pop("arm"))
        data.update(adapter=adapter, release=release, disclose=disclose)
    return data


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


def _parse_claims(payload: object, kid: str) -> dict[str, Any]:
    try:
        data = json.loads(payload) if isinstance(payload, (bytes, str)) else None
    except ValueError:
        data = None
    if not isinstance(data, dict) or set(data).difference(_OPTIONAL_CLAIMS) != set(_CLAIMS):
        raise TicketRejected("claims")
    if "affinity" in data and not (isinstance(data["affinity"], str)
                                   and AFFINITY_RE.fullmatch(data["affinity"])):
        raise TicketRejected("claims")
    strs = ("tenant", "model", "base", "tokenizer", "arm", "jti", "kid")
    if not all(isinstance(data[k], str) and data[k] for k in strs):
        raise TicketRejected("claims")
    if not all(type(data[k]) is int for k in ("iat", "exp")):
        raise TicketRejected("claims")
    # fullmatch: DIGEST_RE ends in ``$``, which ``match`` also lets match before a final "\n".
    if not (DIGEST_RE.fullmatch(data["base"]) and DIGEST_RE.fullmatch(data["tokenizer"])):
        raise TicketRejected("claims")
    if data["kid"] != kid:  # the signed kid must match the footer's
        raise TicketRejected("claims")
    regions = data["regions"]
    if not (isinstance(data["pool"], str) and PLACEMENT_NAME_RE.match(data["pool"])
            and isinstance(regions, list) and len(regions) <= MAX_REGIONS
            and all(isinstance(r, str) and PLACEMENT_NAME_RE.match(r) for r in regions)
            and regions == sorted(set(regions))):  # one spelling per ticket
        raise TicketRejected("claims")
    return data
