"""The one digest rule, over a directory and over the same files in memory."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from control.contracts.digests import DigestError, directory_digest, files_digest
from control.contracts.store import ArtifactCorrupt, ArtifactStore


def _tree(root: Path) -> Path:
    (root / "sub").mkdir(parents=True)
    (root / "a.json").write_bytes(b'{"r": 8}')
    (root / "sub" / "b.bin").write_bytes(os.urandom(1000))
    return root


def test_memory_and_disk_agree_and_paths_are_bound(tmp_path: Path) -> None:
    root = _tree(tmp_path / "x")
    files = {"a.json": (root / "a.json").read_bytes(),
             "sub/b.bin": (root / "sub" / "b.bin").read_bytes()}
    assert files_digest(files) == directory_digest(root)
    renamed = {"b.json": files["a.json"], "sub/b.bin": files["sub/b.bin"]}
    assert files_digest(renamed) != files_digest(files)


def test_symlinks_refused(tmp_path: Path) -> None:
    root = _tree(tmp_path / "x")
    (root / "link").symlink_to(root / "a.json")
    with pytest.raises(DigestError):
        directory_digest(root)


def test_read_verified_hashes_the_bytes_it_returns(tmp_path: Path) -> None:
    store = ArtifactStore(tmp_path / "store")
    src = _tree(tmp_path / "x")
    digest = directory_digest(src)
    stored = store.put(src, digest)
    assert store.read_verified(digest)["a.json"] == b'{"r": 8}'
    target = stored / "a.json"
    os.chmod(stored, 0o755)
    os.chmod(target, 0o644)
    target.write_bytes(b'{"r": 9}')  # an attacker with disk access
    with pytest.raises(ArtifactCorrupt):
        store.read_verified(digest)
