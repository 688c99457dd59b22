"""The content-addressed artifact store: ``<root>/sha256/<hex>/``, read-only once written.

Directories enter the store only under the digest of their bytes. ``put`` copies into a private
temporary directory on the same filesystem, checks the copy's digest, makes it read-only (files
0444, directories 0555) and renames it into place, so a reader sees a whole artifact or none.
No method takes a path from a client: lookups are by digest, and digests are checked for form.
"""

from __future__ import annotations

import os
import shutil
import stat
import uuid
from pathlib import Path

from control.contracts.digests import check_digest, directory_digest, files_digest, list_files


class ArtifactMissing(KeyError):
    """No artifact with that digest is in the store."""

    def __str__(self) -> str:
        return "artifact not in store"


class ArtifactCorrupt(Exception):
    """The stored bytes no longer match their digest."""


def _make_writable(root: Path) -> None:
    # Read-only directories cannot be emptied; open them up before removing a temp copy.
    for dirpath, dirnames, _files in os.walk(root):
        os.chmod(dirpath, 0o755)
        for d in dirnames:
            os.chmod(os.path.join(dirpath, d), 0o755)


def _remove_tree(root: Path) -> None:
    if root.exists():
        _make_writable(root)
        shutil.rmtree(root, ignore_errors=True)


class ArtifactStore:
    """Read-only, content-addressed directories under ``root``."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self._objects = self.root / "sha256"
        self._tmp = self.root / ".tmp"

    def _dir(self, digest: str) -> Path:
        return self._objects / check_digest(digest).removeprefix("sha256:")

    def contains(self, digest: str) -> bool:
        """True if an artifact with ``digest`` is stored."""
        return self._dir(digest).is_dir()

    def path(self, digest: str) -> Path:
        """The stored directory for ``digest``; raise ArtifactMissing if absent."""
        d = self._dir(digest)
        if not d.is_dir():
            raise ArtifactMissing(digest)
        return d

    def verify(self, digest: str) -> Path:
        """The stored directory, after recomputing its digest; raise ArtifactCorrupt if changed."""
        d = self.path(digest)
        if directory_digest(d) != digest:
            raise ArtifactCorrupt("stored artifact does not match its digest")
        return d

    def read_verified(self, digest: str) -> dict[str, bytes]:
        """Every stored file of ``digest`` in memory, after checking those very bytes against
        the digest; raise ArtifactCorrupt if they changed. For adapters (small), not bases."""
        d = self.path(digest)
        files = {rel: (d / rel).read_bytes() for rel in list_files(d)}
        if files_digest(files) != digest:
            raise ArtifactCorrupt("stored artifact does not match its digest")
        return files

    def digests(self) -> list[str]:
        """Every stored digest, sorted."""
        if not self._objects.is_dir():
            return []
        out = []
        for p in self._objects.iterdir():
            candidate = "sha256:" + p.name
            try:
                check_digest(candidate)
            except ValueError:
                continue
            if p.is_dir():
                out.append(candidate)
        return sorted(out)

    def put(self, src_dir: Path, digest: str) -> Path:
        """Copy ``src_dir`` in under ``digest`` (idempotent); raise ArtifactCorrupt on mismatch."""
        final = self._dir(digest)
        if final.is_dir():
            return final
        self._objects.mkdir(parents=True, exist_ok=True)
        self._tmp.mkdir(parents=True, exist_ok=True)
        tmp = self._tmp / uuid.uuid4().hex
        try:
            tmp.mkdir()
            for rel in list_files(Path(src_dir)):
                dst = tmp / rel
                dst.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(Path(src_dir) / rel, dst)
            if directory_digest(tmp) != digest:
                raise ArtifactCorrupt("copied bytes do not match the expected digest")
            self._seal(tmp)
            try:
                os.rename(tmp, final)
            except OSError:
                # Another writer won the race with the same bytes.
                if final.is_dir():
                    return final
                raise
            os.chmod(final, 0o555)
            return final
        finally:
            _remove_tree(tmp)

    @staticmethod
    def _seal(root: Path) -> None:
        """Files 0444, subdirectories 0555; ``root`` itself stays writable until renamed."""
        ro_file = stat.S_IRUSR | stat.S_IRGRP | stat.S_IROTH
        for dirpath, dirnames, filenames in os.walk(root, topdown=False):
            for f in filenames:
                os.chmod(os.path.join(dirpath, f), ro_file)
            for d in dirnames:
                os.chmod(os.path.join(dirpath, d), 0o555)
