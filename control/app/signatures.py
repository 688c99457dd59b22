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

Certificates. ``model_signing`` 1.1.1 checks the chain (OpenSSL; intermediates must be CAs) from
the bundle's leaf to a trusted certificate, which must be a self-signed root (or the self-signed
leaf itself): an intermediate cannot be a trust anchor. It checks every certificate's validity
at the leaf's own ``notBefore`` rather than now, so an expired or not-yet-valid leaf, intermediate
or root passes; and it accepts a leaf whose key usage allows digital signatures *or* whose
extended key usage names code signing, so a TLS server certificate (digitalSignature,
serverAuth) from the same CA passes too. There is no trusted timestamp to prove an earlier
signing time, so loraplane also requires, at registration, that every certificate in the bundle
and the trusted certificate be valid now, and that the leaf be a code-signing certificate:
extended key usage ``codeSigning``, and key usage, if present, allowing digital signatures.
Revocation (CRL/OCSP) is not checked.
"""

from __future__ import annotations

import base64
import datetime as dt
import hashlib
import json
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.x509.oid import ExtendedKeyUsageOID

from control.contracts.digests import directory_digest
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
    """Validate a PEM public key or certificate for a policy; return it stripped.

    One key or certificate per entry (its fingerprint is what registration records); a
    certificate must be self-signed, since ``model_signing`` anchors a chain only at a root.
    """
    pem = pem.strip() + "\n"
    if pem.count("-----BEGIN ") != 1:
        raise ValueError("a trusted key must be exactly one PEM public key or certificate")
    try:
        fingerprint(pem)
    except Exception:
        raise ValueError("not a PEM public key or certificate") from None
    if "BEGIN CERTIFICATE" in pem:
        cert = x509.load_pem_x509_certificate(pem.encode("ascii"))
        try:
            cert.verify_directly_issued_by(cert)
        except Exception:
            raise ValueError("a trusted certificate must be a self-signed (root) CA "
                             "certificate; model_signing cannot anchor at an intermediate"
                             ) from None
    return pem


def _bundle_certificates(signature: Path) -> list[x509.Certificate]:
    """The certificates of a bundle's chain, leaf first, parsed as ``model_signing`` does."""
    bundle = json.loads(signature.read_text(encoding="utf-8"))
    chain = bundle["verificationMaterial"]["x509CertificateChain"]["certificates"]
    return [x509.load_der_x509_certificate(base64.b64decode(c["rawBytes"])) for c in chain]


def _certificate_problem(signature: Path, anchor: x509.Certificate,
                         now: dt.datetime) -> str | None:
    """What makes a chain ``model_signing`` accepted unfit for registration now, if anything.

    Every certificate in the bundle and the trusted ``anchor`` must be valid at ``now`` (the
    verified path is made of these), and the leaf must be a code-signing certificate.
    """
    try:
        certs = _bundle_certificates(signature)
    except (KeyError, TypeError, ValueError, IndexError):
        return "the signature bundle is malformed"
    if not certs:
        return "the signature bundle has no signing certificate"
    leaf = certs[0]
    named = [(leaf, "the signing certificate"), (anchor, "your tenant's trusted CA certificate")]
    named += [(c, "a certificate in the signature's chain") for c in certs[1:]]
    for cert, what in named:
        if now < cert.not_valid_before_utc:
            return f"{what} is not valid until {cert.not_valid_before_utc.isoformat()}"
        if now > cert.not_valid_after_utc:
            return f"{what} expired on {cert.not_valid_after_utc.isoformat()}"
    try:
        eku = leaf.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    except x509.ExtensionNotFound:
        eku = None
    if eku is None or ExtendedKeyUsageOID.CODE_SIGNING not in eku:
        return ("the signing certificate is not a code-signing certificate (its extended key "
                "usage must include codeSigning)")
    try:
        usage = leaf.extensions.get_extension_for_class(x509.KeyUsage).value
    except x509.ExtensionNotFound:
        usage = None
    if usage is not None and not usage.digital_signature:
        return "the signing certificate's key usage does not allow digital signatures"
    return None


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
    now = dt.datetime.now(dt.UTC)
    refusal = None  # why a signature that verified with some trusted certificate is unfit
    with tempfile.TemporaryDirectory(prefix="lp-sig-") as tmp:
        sig_copy = Path(tmp) / "signature.json"
        sig_copy.write_bytes(signature.read_bytes())  # verify what we parse, once read
        for i, pem in enumerate(trusted):
            pem_path = Path(tmp) / f"trusted-{i}.pem"
            anchor = None
            try:
                config = verifying.Config()
                if "BEGIN CERTIFICATE" in pem:
                    # Trust exactly the certificate whose fingerprint is recorded, not any
                    # further certificates the policy entry might hold.
                    anchor = x509.load_pem_x509_certificate(pem.encode("ascii"))
                    pem_path.write_bytes(anchor.public_bytes(serialization.Encoding.PEM))
                    config.use_certificate_verifier(certificate_chain=[pem_path])
                    method = METHOD_CERTIFICATE
                else:
                    pem_path.write_text(pem)
                    config.use_elliptic_key_verifier(public_key=pem_path)
                    method = METHOD_KEY
                config.verify(adapter_dir, sig_copy)
            except Exception:  # model_signing raises several types for a failed verification
                continue
            if anchor is not None:
                refusal = _certificate_problem(sig_copy, anchor, now)
                if refusal is not None:
                    continue  # another trusted certificate may still accept it
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
    if refusal is not None:
        raise ValidationFailed("signature", refusal)
    raise ValidationFailed("signature", "the signature does not verify with any of your "
                                        "tenant's trusted keys for these exact files")
