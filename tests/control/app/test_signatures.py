"""Certificate-based OpenSSF model-signing signatures, verified offline at registration.

Certificates are made at run time with ``cryptography``: a self-signed root CA, an
intermediate, and leaf signing certificates (key usage digitalSignature, extended key usage
codeSigning, as ``model_signing`` and loraplane expect), plus deliberately unfit variants. Each
adapter folder is signed with ``model_signing``'s certificate signer and registered through the
Registry on SQLite.
"""

from __future__ import annotations

import datetime as dt
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from control.app.audit import AuditEntry, audit_log
from control.app.registry import Registry
from control.app.signatures import METHOD_CERTIFICATE, check_trusted_key, fingerprint
from control.domain import TenantPolicy, ValidationFailed
from projections.routing import RoutingView
from tests.fixtures_control import Artifacts, OnSQLite, WithRegistry

NOW = dt.datetime.now(dt.UTC)
DAY = dt.timedelta(days=1)
CODE, SERVER = ExtendedKeyUsageOID.CODE_SIGNING, ExtendedKeyUsageOID.SERVER_AUTH


@dataclass(frozen=True)
class Issued:
    key: ec.EllipticCurvePrivateKey
    cert: x509.Certificate

    @property
    def pem(self) -> str:
        return self.cert.public_bytes(serialization.Encoding.PEM).decode()


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _key_usage(*, digital_signature: bool = False, key_encipherment: bool = False,
               ca: bool = False) -> x509.KeyUsage:
    return x509.KeyUsage(digital_signature=digital_signature, content_commitment=False,
                         key_encipherment=key_encipherment, data_encipherment=False,
                         key_agreement=False, key_cert_sign=ca, crl_sign=ca,
                         encipher_only=False, decipher_only=False)


def _issue(cn: str, issuer: Issued | None = None, *, ca: bool = False,
           not_before: dt.datetime = NOW - DAY, not_after: dt.datetime = NOW + 30 * DAY,
           key_usage: x509.KeyUsage | None = None,
           eku: list[x509.ObjectIdentifier] | None = None) -> Issued:
    """A certificate for a new P-256 key; self-signed when ``issuer`` is None."""
    key = ec.generate_private_key(ec.SECP256R1())
    signer_key = issuer.key if issuer else key
    builder = (x509.CertificateBuilder()
               .subject_name(_name(cn))
               .issuer_name(issuer.cert.subject if issuer else _name(cn))
               .public_key(key.public_key())
               .serial_number(x509.random_serial_number())
               .not_valid_before(not_before)
               .not_valid_after(not_after)
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
               .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()),
                              critical=False)
               .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(
                   signer_key.public_key()), critical=False))
    if key_usage is not None:
        builder = builder.add_extension(key_usage, critical=True)
    if eku:
        builder = builder.add_extension(x509.ExtendedKeyUsage(eku), critical=False)
    return Issued(key, builder.sign(signer_key, hashes.SHA256()))


def _root(cn: str = "Acme Root CA", *, not_after: dt.datetime = NOW + 3650 * DAY) -> Issued:
    return _issue(cn, ca=True, key_usage=_key_usage(ca=True), not_before=NOW - 365 * DAY,
                  not_after=not_after)


def _intermediate(root: Issued, *, not_after: dt.datetime = NOW + 365 * DAY) -> Issued:
    return _issue("Acme Signing CA", root, ca=True, key_usage=_key_usage(ca=True),
                  not_before=NOW - 30 * DAY, not_after=not_after)


SIGNING_USAGE = _key_usage(digital_signature=True)


def _leaf(issuer: Issued, *, not_before: dt.datetime = NOW - DAY,
          not_after: dt.datetime = NOW + 30 * DAY,
          key_usage: x509.KeyUsage | None = SIGNING_USAGE,
          eku: list[x509.ObjectIdentifier] | None = None,
          cn: str = "model-signer@acme.example") -> Issued:
    """A signing certificate; extended key usage codeSigning unless ``eku`` is given."""
    return _issue(cn, issuer, not_before=not_before,
                  not_after=not_after, key_usage=key_usage,
                  eku=[CODE] if eku is None else eku)


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def _sign(folder: Path, leaf: Issued, chain: list[Issued], out: Path,
          ignore: list[str] | None = None) -> Path:
    """A model_signing certificate signature over ``folder``; ``chain`` goes in the bundle."""
    import model_signing

    work = out.parent / (out.name + ".d")
    work.mkdir()
    key = _write(work / "leaf.key", leaf.key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption()))
    cert = _write(work / "leaf.pem", leaf.pem.encode())
    chain_paths = [_write(work / f"chain-{i}.pem", c.pem.encode()) for i, c in enumerate(chain)]
    config = model_signing.signing.Config().use_certificate_signer(
        private_key=key, signing_certificate=cert, certificate_chain=chain_paths)
    if ignore:
        config.set_hashing_config(model_signing.hashing.Config().set_ignored_paths(
            paths=list(ignore)))
    config.sign(folder, out)
    return out


def _ec_public_pem() -> str:
    return ec.generate_private_key(ec.SECP256R1()).public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo).decode()


class TestCertificateSignatures(OnSQLite, WithRegistry):
    @pytest.fixture
    def base(self, registry: Registry, artifacts: Artifacts) -> str:
        digest = registry.register_base(artifacts.base, artifacts.tokenizer, name="tiny",
                                        actor="op", alias="tiny-base")
        registry.create_tenant("acme", actor="op")
        return digest

    @pytest.fixture
    def root(self, registry: Registry, base: str) -> Issued:
        """Acme's root CA, trusted (with an unrelated EC key) by a policy requiring signatures."""
        root = _root()
        registry.set_policy("acme", TenantPolicy(require_signature=True,
                                                 trusted_keys=[_ec_public_pem(), root.pem]),
                            actor="op")
        return root

    def _refused(self, registry: Registry, folder: Path, signature: Path) -> ValidationFailed:
        """Register ``folder`` with ``signature``, expecting a refusal that stores nothing and
        is recorded."""
        stored = registry.store.digests()
        rejected = self._rejections(registry)
        with pytest.raises(ValidationFailed) as info:
            registry.register_adapter(folder, tenant="acme", alias="a", actor="alice",
                                      signature=signature)
        assert info.value.check == "signature"
        assert str(signature.parent) not in info.value.message
        assert registry.store.digests() == stored
        after = self._rejections(registry)
        assert len(after) == len(rejected) + 1
        assert after[-1].summary["check"] == "signature"
        assert after[-1].summary["tenant"] == "acme"
        assert after[-1].summary["message"] == info.value.message
        return info.value

    @staticmethod
    def _rejections(registry: Registry) -> list[AuditEntry]:
        return [e for e in audit_log(registry) if e.event_type == "RegistrationRejected"]

    def test_certificate_signed_adapter_registers(
            self, registry: Registry, artifacts: Artifacts, root: Issued, tmp_path: Path,
            view: RoutingView) -> None:
        src = artifacts.adapters["alpha"]
        sig = _sign(src, _leaf(root), [root], tmp_path / "alpha.sig")
        d = registry.register_adapter(src, tenant="acme", alias="a", actor="alice",
                                      signature=sig)
        recorded = registry.adapter(d).signature
        assert recorded == {"method": METHOD_CERTIFICATE, "key_fingerprint": fingerprint(root.pem),
                            "signed_digest": d}
        assert recorded["method"] == "model-signing/certificate"
        assert registry.store.contains(d)
        assert registry.promote(d, actor="alice") == "candidate"
        row = view.adapter(d)
        assert row is not None and row.signature == METHOD_CERTIFICATE
        # Through an intermediate CA carried in the bundle: the root is still the anchor.
        inter = _intermediate(root)
        beta = artifacts.adapters["beta"]
        sig_b = _sign(beta, _leaf(inter), [inter, root], tmp_path / "beta.sig")
        d_b = registry.register_adapter(beta, tenant="acme", alias="b", actor="alice",
                                        signature=sig_b)
        assert registry.adapter(d_b).signature == {
            "method": METHOD_CERTIFICATE, "key_fingerprint": fingerprint(root.pem),
            "signed_digest": d_b}
        assert not self._rejections(registry)

    def test_untrusted_ca_is_refused(self, registry: Registry, artifacts: Artifacts,
                                     root: Issued, tmp_path: Path) -> None:
        src = artifacts.adapters["alpha"]
        # Another CA with the very same name, and a leaf that is otherwise perfect.
        impostor = _root(cn=root.cert.subject.rfc4514_string().removeprefix("CN="))
        assert impostor.cert.subject == root.cert.subject
        sig = _sign(src, _leaf(impostor), [impostor], tmp_path / "impostor.sig")
        failure = self._refused(registry, src, sig)
        assert "trusted keys" in failure.message
        # An intermediate signed by the untrusted CA does not help either.
        inter = _intermediate(impostor)
        sig = _sign(src, _leaf(inter), [inter, impostor], tmp_path / "impostor-inter.sig")
        self._refused(registry, src, sig)

    @pytest.mark.parametrize("case, expected", [
        ("expired leaf", "signing certificate expired"),
        ("future leaf", "signing certificate is not valid until"),
        ("expired intermediate", "certificate in the signature's chain expired"),
        ("expired root", "trusted CA certificate expired"),
    ])
    def test_certificates_must_be_valid_now(
            self, registry: Registry, artifacts: Artifacts, base: str, tmp_path: Path,
            case: str, expected: str) -> None:
        # model_signing 1.1.1 checks validity at the leaf's own notBefore, so each of these
        # verifies there; loraplane refuses them at registration.
        root = _root(not_after=NOW - DAY) if case == "expired root" else _root()
        registry.set_policy("acme", TenantPolicy(require_signature=True, trusted_keys=[root.pem]),
                            actor="op")
        src = artifacts.adapters["alpha"]
        if case == "expired intermediate":
            inter = _intermediate(root, not_after=NOW - DAY)
            leaf = _leaf(inter, not_before=NOW - 10 * DAY)
            chain = [inter, root]
        else:
            window = {"expired leaf": (NOW - 60 * DAY, NOW - DAY),
                      "future leaf": (NOW + DAY, NOW + 60 * DAY),
                      "expired root": (NOW - 60 * DAY, NOW + 30 * DAY)}[case]
            leaf = _leaf(root, not_before=window[0], not_after=window[1])
            chain = [root]
        sig = _sign(src, leaf, chain, tmp_path / "sig")
        failure = self._refused(registry, src, sig)
        assert expected in failure.message

    @pytest.mark.parametrize("case", [
        "no key usage, no extended key usage",  # model_signing refuses this itself
        "TLS server certificate",  # digitalSignature + serverAuth: model_signing accepts it
        "digitalSignature without extended key usage",  # model_signing accepts it
        "codeSigning with keyEncipherment only",  # model_signing accepts it
        "codeSigning, not a CA's subordinate",  # leaf signed by a non-CA certificate
    ])
    def test_leaf_must_be_a_code_signing_certificate(
            self, registry: Registry, artifacts: Artifacts, root: Issued, tmp_path: Path,
            case: str) -> None:
        src = artifacts.adapters["alpha"]
        chain = [root]
        if case == "no key usage, no extended key usage":
            leaf = _leaf(root, key_usage=None, eku=[])
        elif case == "TLS server certificate":
            leaf = _leaf(root, eku=[SERVER])
        elif case == "digitalSignature without extended key usage":
            leaf = _leaf(root, eku=[])
        elif case == "codeSigning with keyEncipherment only":
            leaf = _leaf(root, key_usage=_key_usage(key_encipherment=True))
        else:
            not_ca = _leaf(root, cn="team-signer")  # a leaf cannot issue certificates
            leaf = _leaf(not_ca)
            chain = [not_ca, root]
        sig = _sign(src, leaf, chain, tmp_path / "sig")
        failure = self._refused(registry, src, sig)
        if case in ("TLS server certificate", "digitalSignature without extended key usage"):
            assert "code-signing" in failure.message
        elif case == "codeSigning with keyEncipherment only":
            assert "key usage does not allow digital signatures" in failure.message

    def test_code_signing_leaf_without_key_usage_registers(
            self, registry: Registry, artifacts: Artifacts, root: Issued,
            tmp_path: Path) -> None:
        # Key usage is optional (RFC 5280); extended key usage codeSigning is what counts.
        src = artifacts.adapters["alpha"]
        sig = _sign(src, _leaf(root, key_usage=None), [root], tmp_path / "sig")
        d = registry.register_adapter(src, tenant="acme", alias="a", actor="alice",
                                      signature=sig)
        recorded = registry.adapter(d).signature
        assert recorded is not None and recorded["method"] == METHOD_CERTIFICATE

    def test_signature_must_cover_exactly_the_files(
            self, registry: Registry, artifacts: Artifacts, root: Issued,
            tmp_path: Path) -> None:
        src = artifacts.adapters["alpha"]
        leaf = _leaf(root)
        # A manifest that leaves adapter_config.json out: model_signing records the ignored
        # path and verifies, loraplane refuses.
        partial = _sign(src, leaf, [root], tmp_path / "partial.sig",
                        ignore=["adapter_config.json"])
        import model_signing

        model_signing.verifying.Config().use_certificate_verifier(
            certificate_chain=[_write(tmp_path / "root.pem", root.pem.encode())]
        ).verify(src, partial)
        failure = self._refused(registry, src, partial)
        assert "cover exactly" in failure.message
        # Another adapter's valid signature does not verify for these bytes.
        other = tmp_path / "other"
        shutil.copytree(artifacts.adapters["beta"], other)
        beta_sig = _sign(other, leaf, [root], tmp_path / "beta.sig")
        self._refused(registry, src, beta_sig)
        # Bytes changed after signing.
        tampered = tmp_path / "tampered"
        shutil.copytree(src, tampered)
        good = _sign(tampered, leaf, [root], tmp_path / "good.sig")
        config = tampered / "adapter_config.json"
        config.write_text(config.read_text().replace("\n", "\n ", 1))
        self._refused(registry, tampered, good)

    def test_intermediate_is_not_a_trust_anchor(
            self, registry: Registry, artifacts: Artifacts, base: str,
            tmp_path: Path) -> None:
        root = _root()
        inter = _intermediate(root)
        # model_signing anchors only at a self-signed certificate: trusting the intermediate
        # alone refuses every signature, so a policy may not name it.
        with pytest.raises(ValueError, match="self-signed"):
            check_trusted_key(inter.pem)
        registry.set_policy("acme", TenantPolicy(require_signature=True,
                                                 trusted_keys=[inter.pem]), actor="op")
        src = artifacts.adapters["alpha"]
        sig = _sign(src, _leaf(inter), [inter, root], tmp_path / "sig")
        self._refused(registry, src, sig)


def test_check_trusted_key() -> None:
    root = _root()
    assert check_trusted_key(root.pem) == root.pem.strip() + "\n"
    pub = _ec_public_pem()
    assert check_trusted_key("\n" + pub + "\n\n") == pub.strip() + "\n"
    with pytest.raises(ValueError, match="exactly one"):  # would trust both, record one
        check_trusted_key(root.pem + _root("Other Root").pem)
    with pytest.raises(ValueError, match="not a PEM"):
        check_trusted_key("-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n")
