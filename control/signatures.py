"""OpenSSF model-signing signatures, verified offline at registration.

A tenant's policy lists trusted PEM public keys (elliptic curve: P-256/P-384/P-521, the curves
``model_signing`` supports) or CA certificates. A signature is a Sigstore bundle written by
``model_signing`` (``model_signing sign key`` / ``certificate``, or its Python API) over the
adapter folder. It is verified with ``model_signing`` itself against the exact bytes that will be
stored (the registry's private staged copy), then its signed file manifest is checked against
loraplane's digest rule (DESIGN.md): the signed resources must be exactly the stored files, each
with its SHA-256, so that the signed manifest and the registered digest name the same bytes. A
signature that ignores a file, uses another hash or a sharded serialization is refused.

No network is used: key and certificate verification never contact Sigstore's transparency log.
"""

from __future__ import annotations

import base64
import hashlib
import json
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import serialization

from control.digests import directory_digest
from control.domain import ValidationFailed

MAX_SIGNATURE_BYTES = 1 << 20
METHOD_KEY = "model-signing/key"
METHOD_CERTIFICATE = "model-signing/certificate"


@dataclass(frozen=True)
class VerifiedSignature:
    """What registration records about a verified signature."""

    method: str
    key_fingerprint: str  # sha256 of the trusted key's (or CA certificate's) DER bytes
    signed_digest: str  # the adapter digest computed from the signed manifest

    def to_json(self) -> dict[str, Any]:
        return {"method": self.method, "key_fingerprint": self.key_fingerprint,
                "signed_digest": self.signed_digest}


def fingerprint(pem: str) -> str:
    """``sha256:<hex>`` of a PEM public key's or certificate's DER encoding."""
    data = pem.encode("ascii")
    if "BEGIN CERTIFICATE" in pem:
        der = x509.load_pem_x509_certificate(data).public_bytes(serialization.Encoding.DER)
    else:
        der = serialization.load_pem_public_key(data).public_bytes(
            serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return "sha256:" + hashlib.sha256(der).hexdigest()


def check_trusted_key(pem: str) -> str:
    """Validate a PEM public key or certificate for a policy; return it stripped."""
    pem = pem.strip() + "\n"
    try:
        fingerprint(pem)
    except Exception:
        raise ValueError("not a PEM public key or certificate") from None
    return pem


def _signed_manifest_digest(signature: Path) -> str:
    """Our digest rule applied to the file manifest inside a (verified) signature bundle."""
    bundle = json.loads(signature.read_text(encoding="utf-8"))
    statement = json.loads(base64.b64decode(bundle["dsseEnvelope"]["payload"]))
    predicate = statement["predicate"]
    serialization_ = predicate.get("serialization", {})
    if serialization_.get("method") != "files" or serialization_.get("hash_type") != "sha256":
        raise ValidationFailed("signature", "the signature must use model_signing's file "
                                            "serialization with sha256")
    lines = []
    for res in sorted(predicate["resources"], key=lambda r: str(r["name"])):
        if res.get("algorithm") != "sha256":
            raise ValidationFailed("signature", "every signed file must be hashed with sha256")
        lines.append(f"{res['name']}\0{res['digest']}\n".encode())
    return "sha256:" + hashlib.sha256(b"".join(lines)).hexdigest()


def verify_signature(adapter_dir: Path, signature: Path,
                     trusted: list[str]) -> VerifiedSignature:
    """Verify ``signature`` over ``adapter_dir`` with one of the ``trusted`` PEMs.

    Raises ValidationFailed(check="signature") when no trusted key verifies it, or when the
    signed manifest does not name exactly the folder's bytes.
    """
    try:
        from model_signing import verifying
    except ImportError:  # pragma: no cover - a dependency; kept for a clear message
        raise ValidationFailed("signature", "signature verification needs the model-signing "
                                            "package") from None
    if not signature.is_file() or signature.stat().st_size > MAX_SIGNATURE_BYTES:
        raise ValidationFailed("signature", "the signature must be a model_signing bundle file")
    if not trusted:
        raise ValidationFailed("signature", "your tenant has no trusted signing key")
    with tempfile.TemporaryDirectory(prefix="lp-sig-") as tmp:
        sig_copy = Path(tmp) / "signature.json"
        sig_copy.write_bytes(signature.read_bytes())  # verify what we parse, once read
        for i, pem in enumerate(trusted):
            pem_path = Path(tmp) / f"trusted-{i}.pem"
            pem_path.write_text(pem)
            config = verifying.Config()
            if "BEGIN CERTIFICATE" in pem:
                config.use_certificate_verifier(certificate_chain=[pem_path])
                method = METHOD_CERTIFICATE
            else:
                config.use_elliptic_key_verifier(public_key=pem_path)
                method = METHOD_KEY
            try:
                config.verify(adapter_dir, sig_copy)
            except Exception:  # model_signing raises several types for a failed verification
                continue
            try:
                signed = _signed_manifest_digest(sig_copy)
            except ValidationFailed:
                raise
            except (KeyError, TypeError, ValueError):
                raise ValidationFailed("signature", "the signature bundle is malformed") from None
            if signed != directory_digest(adapter_dir):
                raise ValidationFailed("signature", "the signature does not cover exactly the "
                                                    "adapter's files")
            return VerifiedSignature(method, fingerprint(pem), signed)
    raise ValidationFailed("signature", "the signature does not verify with any of your "
                                        "tenant's trusted keys for these exact files")
