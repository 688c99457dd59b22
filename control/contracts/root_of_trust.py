"""The root of trust for ticket-signing keys: an offline operator key (Ed25519) that signs each
signing key's record, rotation and retirement.

Before this, hosts and gateways trusted every ``SigningKeyRecorded`` event in the event store, so
anyone who could write one event (a compromised host holding the database credential) could add a
signing key and mint tickets for any tenant. Now a recorded key is trusted only if the root key
signed the statement ``record <kid> <public key>``; a retirement carries the root's signature over
``retire <kid> <public key>`` too. The root's PUBLIC half reaches hosts and gateways from their
configuration, never from the database:

- ``LORAPLANE_ROOT_PUBKEY``: the raw 32-byte key in base64, or the path of a file holding it
  (base64, or a PEM public key);
- else ``<keys>/root.pub`` in the deployment's home (written by ``loraplane key root init``).

The private half lives where the operator keeps it (``key root init --out FILE``, then
``--root-key FILE`` on the signing-key commands). A home with no root configured at all gets a
development root under ``<keys>/root/`` on first use (:func:`dev_root`), so a demo or a test home
works out of the box; ``key root init`` is how a deployment moves it offline.

A retirement only ever removes trust, so readers honour every retirement (a forged one can deny
service, not grant it); recording is what the root guards.
"""

from __future__ import annotations

import base64
import binascii
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from control.contracts.keys import (
    load_ed25519,
    load_or_create_ed25519,
    write_atomically,
    write_new_ed25519,
)

ROOT_ENV = "LORAPLANE_ROOT_PUBKEY"
RECORD = "record"
RETIRE = "retire"
_DOMAIN = b"loraplane signing-key statement v1\n"


class RootError(ValueError):
    """The root of trust is missing, unreadable, or does not vouch for what was asked."""


def root_pub_path(keys_dir: Path) -> Path:
    return keys_dir / "root.pub"


def dev_root_path(keys_dir: Path) -> Path:
    return keys_dir / "root" / "private.pem"


def public_b64(key: Ed25519PublicKey) -> str:
    raw = key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return base64.b64encode(raw).decode("ascii")


def parse_public(text: str | bytes, where: str) -> Ed25519PublicKey:
    """An Ed25519 public key from base64 of its 32 raw bytes, or a PEM public key."""
    data = text.encode() if isinstance(text, str) else text
    if b"-----BEGIN" in data:
        try:
            key = serialization.load_pem_public_key(data)
        except ValueError as e:
            raise RootError(f"the root public key in {where} is not a PEM public key") from e
        if not isinstance(key, Ed25519PublicKey):
            raise RootError(f"the root public key in {where} is not an Ed25519 key")
        return key
    try:
        raw = base64.b64decode(data.strip(), validate=True)
    except (binascii.Error, ValueError) as e:
        raise RootError(f"the root public key in {where} is not base64") from e
    if len(raw) != 32:
        raise RootError(f"the root public key in {where} is not a raw 32-byte Ed25519 key")
    return Ed25519PublicKey.from_public_bytes(raw)


def root_public_key(keys_dir: Path | None, env: dict[str, str] | None = None
                    ) -> Ed25519PublicKey | None:
    """The configured root public key (see the module notes), or None when none is configured.

    A configured but unreadable key raises :class:`RootError`: a host must not fall back to
    trusting nothing silently, nor to anything else."""
    value = (os.environ if env is None else env).get(ROOT_ENV, "").strip()
    if value:
        path = Path(value)
        if not value.startswith("-----") and len(value) < 4096 and path.is_file():
            return parse_public(path.read_bytes(), str(path))
        return parse_public(value, ROOT_ENV)
    if keys_dir is not None and root_pub_path(keys_dir).is_file():
        return parse_public(root_pub_path(keys_dir).read_bytes(), str(root_pub_path(keys_dir)))
    return None


def statement(action: str, kid: str, public_key_b64: str) -> bytes:
    """The bytes the root signs: what is done (record or retire) to which key."""
    if action not in (RECORD, RETIRE):
        raise ValueError(f"unknown signing-key action {action!r}")
    return _DOMAIN + f"{action}\n{kid}\n{public_key_b64}\n".encode()


def sign(root: Ed25519PrivateKey, action: str, kid: str, public_key_b64: str) -> str:
    """The root's signature (base64) over ``statement(action, kid, public_key_b64)``."""
    return base64.b64encode(root.sign(statement(action, kid, public_key_b64))).decode("ascii")


def vouches(root: Ed25519PublicKey | None, signature_b64: str | None, action: str, kid: str,
            public_key_b64: str) -> bool:
    """Whether ``signature_b64`` is the root's over that statement (False without a root)."""
    if root is None or not signature_b64:
        return False
    try:
        root.verify(base64.b64decode(signature_b64, validate=True),
                    statement(action, kid, public_key_b64))
    except (InvalidSignature, binascii.Error, ValueError):
        return False
    return True


def load_root_private(path: Path) -> Ed25519PrivateKey:
    """The root private key the operator keeps offline (PEM, from ``key root init``)."""
    try:
        return load_ed25519(path, "root key")
    except FileNotFoundError:
        raise RootError(f"no root key file at {path}") from None
    except (ValueError, TypeError) as e:
        raise RootError(f"{path} is not an Ed25519 private key (PEM): {e}") from None


@dataclass(frozen=True)
class RootInit:
    private_path: Path
    public_path: Path
    public_b64: str


def init_root(out: Path, keys_dir: Path) -> RootInit:
    """A new root keypair: the private key to ``out`` (0600, never overwritten), its public half
    to ``<keys>/root.pub`` (what hosts and gateways of this home trust; set ``ROOT_ENV`` on
    machines that do not share the home). Refused if ``out`` exists."""
    if out.exists():
        raise RootError(f"{out} exists: a root key is never overwritten")
    out.parent.mkdir(parents=True, exist_ok=True)
    key = Ed25519PrivateKey.generate()
    write_new_ed25519(out, key)
    pub = public_b64(key.public_key())
    keys_dir.mkdir(parents=True, exist_ok=True)
    # The development root stops vouching: keys it signed are no longer trusted, so rotate
    # (``key rotate --root-key FILE``) right after this.
    dev_root_path(keys_dir).unlink(missing_ok=True)
    tmp = keys_dir / f".root.pub.{os.getpid()}"
    tmp.write_text(pub + "\n")
    os.replace(tmp, root_pub_path(keys_dir))
    return RootInit(out, root_pub_path(keys_dir), pub)


def dev_root(keys_dir: Path) -> Ed25519PrivateKey:
    """The home's development root (created, with its ``root.pub``, on first use)."""
    path = dev_root_path(keys_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    os.chmod(path.parent, 0o700)

    def publish(k: Ed25519PrivateKey) -> None:
        write_atomically(root_pub_path(keys_dir), (public_b64(k.public_key()) + "\n").encode())

    key, _created = load_or_create_ed25519(path, "root key", before_publish=publish)
    return key


def signing_root(keys_dir: Path, root_key: Path | None = None) -> Ed25519PrivateKey:
    """The root private key to sign a signing-key statement with.

    ``root_key`` (the operator's offline file) when given; else the home's development root when
    it exists, or when no root is configured at all (a fresh demo or test home). A deployment
    whose root was moved offline (``root.pub`` or ``ROOT_ENV`` set, no development root here)
    must pass the file: RootError says so."""
    configured = root_public_key(keys_dir)
    if root_key is not None:
        key = load_root_private(root_key)
    elif dev_root_path(keys_dir).is_file() or configured is None:
        key = dev_root(keys_dir)
    else:
        raise RootError("signing keys are vouched for by the offline root key: pass its file "
                        "(--root-key FILE)")
    configured = root_public_key(keys_dir)
    if configured is not None and public_b64(configured) != public_b64(key.public_key()):
        raise RootError("that root key is not the root this deployment trusts "
                        f"({ROOT_ENV} or {root_pub_path(keys_dir)})")
    return key
