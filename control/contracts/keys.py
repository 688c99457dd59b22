"""Ed25519 private key files: the one way loraplane creates and loads them.

Used for the ticket signing key and the audit checkpoint key. A new key is written to a temporary
file created with mode 0600 (it never exists world-readable) and hard-linked into place, so when
two processes start at once the first writer wins and the other loads its key.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import secrets
from collections.abc import Callable, Iterator
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey


def load_ed25519(path: Path, what: str) -> Ed25519PrivateKey:
    """The Ed25519 private key at ``path`` (PEM, unencrypted); ValueError for any other key."""
    key = serialization.load_pem_private_key(path.read_bytes(), password=None)
    if not isinstance(key, Ed25519PrivateKey):
        raise ValueError(f"the {what} is not an Ed25519 key")
    return key


def write_new_ed25519(path: Path, key: Ed25519PrivateKey) -> None:
    """Write ``key`` to ``path``, which must not exist, created with mode 0600 from the start."""
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption())
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(pem)


def load_or_create_ed25519(
    path: Path,
    what: str,
    before_publish: Callable[[Ed25519PrivateKey], object] | None = None,
) -> tuple[Ed25519PrivateKey, bool]:
    """The key at ``path`` (created if absent); returns (key, created).

    ``before_publish`` runs for a new key before it becomes visible at ``path``, e.g. to write
    its public half first, so nothing can sign with a key that verifiers cannot find.

    Creation holds an exclusive lock on ``<path>.lock``: two processes (or threads) starting at
    once must not both publish a public half, or the loser's could overwrite the winner's and
    leave a public file that does not match the private key in use.
    """
    if path.exists():
        return load_ed25519(path, what), False
    with _creation_lock(path):
        if path.exists():  # created by whoever held the lock before us
            return load_ed25519(path, what), False
        key = Ed25519PrivateKey.generate()
        tmp = path.parent / f".{path.name}.{secrets.token_hex(4)}"
        write_new_ed25519(tmp, key)
        if before_publish is not None:
            before_publish(key)
        try:
            os.link(tmp, path)
        except FileExistsError:  # made meanwhile without the lock (by hand): use that one
            return load_ed25519(path, what), False
        finally:
            os.unlink(tmp)
    return key, True


@contextlib.contextmanager
def _creation_lock(path: Path) -> Iterator[None]:
    fd = os.open(path.parent / f".{path.name}.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def write_atomically(path: Path, data: bytes, mode: int = 0o644) -> None:
    """``path`` holds ``data``, put in place by one rename: a reader sees the old file or the
    whole new one, never a truncated one."""
    tmp = path.parent / f".{path.name}.{secrets.token_hex(4)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
