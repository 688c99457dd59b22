"""The root of trust's statements, configuration and key files (control.contracts.root_of_trust)."""

from __future__ import annotations

import base64
import stat
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from control.contracts import root_of_trust as rot

KID, PUB = "abcd1234", base64.b64encode(b"k" * 32).decode()


def test_a_signature_vouches_for_exactly_its_statement() -> None:
    root = Ed25519PrivateKey.generate()
    sig = rot.sign(root, rot.RECORD, KID, PUB)
    assert rot.vouches(root.public_key(), sig, rot.RECORD, KID, PUB)
    # another action, key id, key or root: no
    assert not rot.vouches(root.public_key(), sig, rot.RETIRE, KID, PUB)
    assert not rot.vouches(root.public_key(), sig, rot.RECORD, "other", PUB)
    assert not rot.vouches(root.public_key(), sig, rot.RECORD, KID,
                           base64.b64encode(b"j" * 32).decode())
    assert not rot.vouches(Ed25519PrivateKey.generate().public_key(), sig, rot.RECORD, KID, PUB)
    # nothing, garbage, or no root configured: no
    for bad in ("", "not base64!", base64.b64encode(b"x" * 64).decode()):
        assert not rot.vouches(root.public_key(), bad, rot.RECORD, KID, PUB)
    assert not rot.vouches(None, sig, rot.RECORD, KID, PUB)
    with pytest.raises(ValueError):
        rot.statement("grant", KID, PUB)


def test_the_root_public_key_comes_from_configuration(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    assert rot.root_public_key(keys, env={}) is None
    root = Ed25519PrivateKey.generate()
    b64 = rot.public_b64(root.public_key())
    # the environment: base64, a file of base64, a PEM file
    assert rot.public_b64(rot.root_public_key(keys, env={rot.ROOT_ENV: b64})) == b64  # type: ignore[arg-type]
    f = tmp_path / "root.b64"
    f.write_text(b64 + "\n")
    assert rot.public_b64(rot.root_public_key(keys, env={rot.ROOT_ENV: str(f)})) == b64  # type: ignore[arg-type]
    pem = tmp_path / "root.pem"
    pem.write_bytes(root.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))
    assert rot.public_b64(rot.root_public_key(keys, env={rot.ROOT_ENV: str(pem)})) == b64  # type: ignore[arg-type]
    # a configured but unreadable root is an error, never "no root"
    for bad in ("zzz", base64.b64encode(b"short").decode()):
        with pytest.raises(rot.RootError):
            rot.root_public_key(keys, env={rot.ROOT_ENV: bad})
    # the home's root.pub when the environment names none
    keys.mkdir()
    rot.root_pub_path(keys).write_text(b64)
    assert rot.public_b64(rot.root_public_key(keys, env={})) == b64  # type: ignore[arg-type]


def test_root_init_writes_an_offline_key_and_the_public_half(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    dev = rot.dev_root(keys)  # a demo home's root, created on first use
    assert rot.dev_root_path(keys).is_file()
    out = tmp_path / "offline" / "root.pem"
    made = rot.init_root(out, keys)
    assert stat.S_IMODE(out.stat().st_mode) == 0o600
    assert not rot.dev_root_path(keys).exists()  # the development root no longer vouches
    offline = rot.load_root_private(out)
    assert made.public_b64 == rot.public_b64(offline.public_key()) != rot.public_b64(
        dev.public_key())
    assert rot.public_b64(rot.root_public_key(keys, env={})) == made.public_b64  # type: ignore[arg-type]
    with pytest.raises(rot.RootError, match="never overwritten"):
        rot.init_root(out, keys)
    # signing now needs the offline file, and only the configured root's file will do
    with pytest.raises(rot.RootError, match="--root-key"):
        rot.signing_root(keys)
    assert rot.public_b64(rot.signing_root(keys, out).public_key()) == made.public_b64
    other = tmp_path / "other.pem"
    rot.init_root(other, tmp_path / "elsewhere")
    with pytest.raises(rot.RootError, match="not the root this deployment trusts"):
        rot.signing_root(keys, other)
    with pytest.raises(rot.RootError, match="no root key file"):
        rot.signing_root(keys, tmp_path / "missing.pem")
