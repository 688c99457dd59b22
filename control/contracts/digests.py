"""Content digests: the one digest function of loraplane.

A digest names the bytes of a whole directory (an adapter, a base model, a tokenizer) as
``sha256:<64 hex>``. Files are sorted by relative POSIX path; each file is hashed; the directory
digest is the SHA-256 of the lines ``<path>\\0<file sha256 hex>\\n`` in that order.

DESIGN.md first said "hash the concatenation of the per-file digests". Binding the relative path
as well means that renaming a file (say, swapping which file is the config) changes the digest,
which the bare concatenation would not notice.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Mapping
from pathlib import Path

DIGEST_RE = re.compile(r"^sha256:[0-9a-f]{64}$")
_CHUNK = 1 << 20


class DigestError(ValueError):
    """A digest string or a directory cannot be digested."""


def file_sha256(path: Path) -> str:
    """Hex SHA-256 of one file's bytes, read in chunks."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def list_files(root: Path) -> list[str]:
    """Relative POSIX paths of the regular files under ``root``, sorted.

    Symlinks are refused rather than followed: a digest must name bytes inside the directory.
    """
    if not root.is_dir():
        raise DigestError("not a directory")
    out: list[str] = []
    for p in root.rglob("*"):
        if p.is_symlink():
            raise DigestError(f"symlink not allowed: {p.relative_to(root).as_posix()}")
        if p.is_file():
            out.append(p.relative_to(root).as_posix())
    return sorted(out)


def _combine(file_digests: Iterable[tuple[str, str]]) -> str:
    h = hashlib.sha256()
    for rel, hexdigest in file_digests:
        h.update(rel.encode("utf-8") + b"\0" + hexdigest.encode("ascii") + b"\n")
    return "sha256:" + h.hexdigest()


def directory_digest(root: Path) -> str:
    """The digest of a directory, by the rule in the module docstring."""
    return _combine((rel, file_sha256(root / rel)) for rel in list_files(root))


def files_digest(files: Mapping[str, bytes]) -> str:
    """The same digest over files already in memory (relative POSIX path -> bytes).

    Lets a reader hash exactly the bytes it is about to parse, with no second read of the disk
    in between for an attacker to race.
    """
    return _combine((rel, hashlib.sha256(files[rel]).hexdigest()) for rel in sorted(files))


def check_digest(value: str) -> str:
    """Return ``value`` if it is a well-formed digest, else raise DigestError."""
    if not isinstance(value, str) or not DIGEST_RE.match(value):
        raise DigestError("malformed digest")
    return value


def short(digest: str) -> str:
    """First 12 hex characters, for tables meant for people."""
    return digest.removeprefix("sha256:")[:12]
