"""Host checkpoint keys: the Ed25519 key each host signs its ledger log's checkpoints with, and
the root of trust's statement that enrols it.

Before this, each host process made a new key at start and the control plane trusted whatever
key a host presented in ``ledger_host_keys``: anyone able to insert one row there (a host taken
over, or anyone with database access) could sign checkpoints over a rewritten log. Now:

- A host keeps one key, ``<keys>/ledger/<host>.pem`` (0600, created under the same lock as every
  other key, :func:`control.contracts.keys.load_or_create_ed25519`), so it survives restarts;
  its verifier key (``<name>+<hex id>+<base64 key>``) is written beside it as ``<host>.vkey``,
  the file an operator hands to ``loraplane host enroll``.
- The control plane verifies a checkpoint only with a key *enrolled* for that host: one whose
  ``enroll <host> <vkey>`` statement the root key signed (:func:`sign_enrollment`). The root's
  public half comes from configuration (``control.contracts.root_of_trust``), never from the
  database, so an enrolment forged through SQL does not verify. A development home enrols
  presented keys with its development root, as it vouches for signing keys.
"""

from __future__ import annotations

import base64
import binascii
import re
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from control.contracts.keys import load_or_create_ed25519, write_atomically
from control.contracts.tlog import NoteSigner, ProofError, Verifier

ENROLL = "enroll"
_DOMAIN = b"loraplane host-checkpoint-key statement v1\n"
LEDGER_KEYS_DIR = "ledger"  # under <home>/keys: the Triton user's own folder (triton_user.py)


def key_path(keys_dir: Path, host: str) -> Path:
    """Where ``host``'s checkpoint key lives (the host id made a safe file name)."""
    return keys_dir / LEDGER_KEYS_DIR / (re.sub(r"[^A-Za-z0-9_.-]", "_", host) + ".pem")


def vkey_path(keys_dir: Path, host: str) -> Path:
    return key_path(keys_dir, host).with_suffix(".vkey")


def load_or_create_signer(keys_dir: Path, host: str, name: str) -> NoteSigner:
    """``host``'s checkpoint key as a note signer named ``name`` (the log's origin), created on
    first use; its verifier key is written to :func:`vkey_path` before the key appears."""
    path = key_path(keys_dir, host)
    path.parent.mkdir(parents=True, exist_ok=True)

    def publish(key: Ed25519PrivateKey) -> None:
        write_atomically(vkey_path(keys_dir, host),
                         (NoteSigner(name, key).verifier.vkey() + "\n").encode())

    key, _created = load_or_create_ed25519(path, "host checkpoint key", before_publish=publish)
    signer = NoteSigner(name, key)
    if not vkey_path(keys_dir, host).is_file():  # removed by hand: the operator needs it
        publish(key)
    return signer


def read_vkey(text: str, name: str, where: str) -> str:
    """The verifier key in ``text`` (a ``.vkey`` line) for the log named ``name``; ValueError,
    saying what is wrong, for anything else."""
    line = text.strip()
    try:
        v = Verifier.parse(line)
    except (ProofError, binascii.Error, ValueError) as e:
        raise ValueError(f"{where} holds no host checkpoint key (a line "
                         f"<name>+<hex id>+<base64 key>, the host's keys/ledger/*.vkey): {e}"
                         ) from None
    if v.name != name:
        raise ValueError(f"{where} is the key of log {v.name!r}, not of {name!r}")
    return v.vkey()


def statement(host: str, vkey: str) -> bytes:
    """The bytes the root signs to enrol ``vkey`` as ``host``'s checkpoint key."""
    return _DOMAIN + f"{ENROLL}\n{host}\n{vkey}\n".encode()


def sign_enrollment(root: Ed25519PrivateKey, host: str, vkey: str) -> str:
    """The root's signature (base64) enrolling ``vkey`` for ``host``."""
    return base64.b64encode(root.sign(statement(host, vkey))).decode("ascii")


def enrolled(root: Ed25519PublicKey | None, signature_b64: str | None, host: str,
             vkey: str) -> bool:
    """Whether ``signature_b64`` is the root's enrolment of ``vkey`` for ``host`` (False
    without a root or signature)."""
    if root is None or not signature_b64:
        return False
    try:
        root.verify(base64.b64decode(signature_b64, validate=True), statement(host, vkey))
    except (InvalidSignature, binascii.Error, ValueError):
        return False
    return True
