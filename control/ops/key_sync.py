"""A Triton host's ``keys/public`` folder kept equal to the vouched, unretired signing keys.

The host's ticket verifier trusts every ``*.pub`` file in that folder; this module is the only
writer of it (``serve`` runs :func:`sync_public_keys` at start and on every projection move).
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import logging
import os
import secrets
import shutil
from pathlib import Path

from control.contracts.config import Settings
from control.contracts.tickets import key_id
from projections.routing import RoutingView

log = logging.getLogger("loraplane.serve")


def sync_public_keys(settings: Settings, routing: RoutingView) -> int:
    """Make ``keys/public`` hold exactly the recorded, unretired signing public keys: one
    regular file ``<kid>.pub`` each, holding the recorded key. Returns how many files were
    written or removed.

    A Triton host trusts exactly the keys the control plane recorded as events, wherever the
    gateway that signs with them runs, and stops trusting a key once it is retired. The verifier
    (``load_public_keys``) trusts every ``*.pub`` in the folder and names each key by its
    content, not its file name, so everything else goes: a stranger's file, a recorded kid's file
    that holds another key (rewritten), a symlink (its target can change behind our back), a
    folder, a file under any other name, and ``keys/public`` itself when it is a symlink. A
    recorded key whose id is not the hash of its key is not written (the verifier would trust it
    under another id).

    Each step is one rename or one unlink, so the verifier, reading the folder at any moment,
    sees whole files only: never half a key, and a replaced key either old or new.
    """
    public_dir = settings.keys_dir / "public"
    changed = 0
    if public_dir.is_symlink():
        public_dir.unlink()
        changed += 1
    public_dir.mkdir(parents=True, exist_ok=True)
    wanted = _wanted_public_keys(routing, settings.keys_dir)
    stale: list[str] = []  # wanted files whose content is not the recorded key
    with os.scandir(public_dir) as it:
        entries = list(it)
    for entry in entries:
        raw = wanted.get(entry.name)
        if raw is not None and entry.is_file(follow_symlinks=False):
            if _holds_key(Path(entry.path), raw):
                del wanted[entry.name]
            else:
                stale.append(entry.name)  # replaced in one rename below, never left missing
            continue
        if entry.is_dir(follow_symlinks=False):
            shutil.rmtree(entry.path, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(entry.path)
        changed += 1
    for name, raw in wanted.items():
        _write_atomically(public_dir, name, base64.b64encode(raw).decode("ascii") + "\n")
        changed += 1
    if stale:
        log.warning("rewrote %d public key file(s) in %s whose content was not the recorded key",
                    len(stale), public_dir)
    return changed


def _wanted_public_keys(routing: RoutingView, keys_dir: Path) -> dict[str, bytes]:
    """File name -> raw key of every recorded, unretired signing key whose id is its hash and
    whose record the offline root vouches for (``control.contracts.root_of_trust``)."""
    retired = routing.retired_key_ids()
    wanted: dict[str, bytes] = {}
    for kid, b64 in routing.vouched_signing_keys(keys_dir).items():
        if kid in retired:
            continue
        try:
            raw = base64.b64decode(b64, validate=True)  # never a file the verifier cannot read
        except (binascii.Error, ValueError):
            log.warning("recorded signing key %s is not base64: not trusted", kid)
            continue
        if key_id(raw) != kid:
            log.warning("recorded signing key %s is not the hash of its key: not trusted", kid)
            continue
        wanted[f"{kid}.pub"] = raw
    return wanted


def _holds_key(path: Path, raw: bytes) -> bool:
    """Whether the file holds exactly ``raw``, as the verifier would read it."""
    try:
        with path.open("rb") as f:
            text = f.read(4096)
        return base64.b64decode(text.strip(), validate=True) == raw
    except (OSError, binascii.Error, ValueError):
        return False


def _write_atomically(folder: Path, name: str, text: str) -> None:
    """``folder/name`` holds ``text``, put in place by one rename (mode 0644). The temporary
    name does not end in ``.pub``, so the verifier never reads it."""
    tmp = folder / f".sync-{secrets.token_hex(8)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, folder / name)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
