"""The ticket-signing keys a control plane holds: rotation, and choosing a key that may sign.

Layout under ``$LORAPLANE_HOME/keys``: ``private/<kid>.pem`` for every key this control plane
made, ``private/active.pem`` for the one a gateway starts signing with (a hard link to its
``<kid>.pem``; a key made before rotations existed lives under ``active.pem`` alone until the
first rotation files it under its kid), and ``public/<kid>.pub`` for the local Triton host.

Rotation makes a new key, records its public half as ``SigningKeyRecorded`` (through the
``record`` callable: this module knows files, not events) and only then makes it the active one,
so no gateway can sign with a key that hosts have no record of. The old key keeps working until
an operator retires it; a running gateway whose key is retired picks the newest key here that is
recorded and not retired (``pick_signer``), or issues nothing.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Callable
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from control.contracts.keys import load_ed25519, write_new_ed25519
from control.contracts.tickets import ACTIVE_KEY_FILE, TicketSigner, write_public_key

WHAT = "ticket signing key"


def _private_dir(keys_dir: Path) -> Path:
    return keys_dir / "private"


def active_signer(keys_dir: Path) -> TicketSigner | None:
    """The key in ``private/active.pem``, or None before the first one was made."""
    path = _private_dir(keys_dir) / ACTIVE_KEY_FILE
    return TicketSigner(load_ed25519(path, WHAT)) if path.is_file() else None


def held_signers(keys_dir: Path) -> list[TicketSigner]:
    """Every signing key held here: the active one first, then the others newest first."""
    private = _private_dir(keys_dir)
    if not private.is_dir():
        return []
    active = private / ACTIVE_KEY_FILE
    others = sorted((p for p in private.glob("*.pem") if p.name != ACTIVE_KEY_FILE),
                    key=lambda p: (p.stat().st_mtime_ns, p.name), reverse=True)
    out: dict[str, TicketSigner] = {}
    for path in ([active] if active.is_file() else []) + others:
        signer = TicketSigner(load_ed25519(path, WHAT))
        out.setdefault(signer.kid, signer)  # active.pem and its <kid>.pem are one key
    return list(out.values())


def held_seal_keys(keys_dir: Path) -> dict[str, bytes]:
    """kid -> seal key of every signing key held here: what opens the arm of the tickets this
    home's gateways signed (operators' tools; ``control.contracts.tickets.unverified_claims``)."""
    return {s.kid: s.seal_key for s in held_signers(keys_dir)}


def pick_signer(keys_dir: Path, usable: Callable[[str], bool]) -> TicketSigner | None:
    """The first held key (active, then newest) whose key id is ``usable``, else None."""
    return next((s for s in held_signers(keys_dir) if usable(s.kid)), None)


def rotate(keys_dir: Path, record: Callable[[TicketSigner], object]
           ) -> tuple[TicketSigner, str | None]:
    """Make a new signing key the active one; returns (new signer, previous active kid).

    ``record`` runs after the new key's files exist and before it becomes active; if it raises,
    the new files are removed and the active key stays as it was.
    """
    private, public = _private_dir(keys_dir), keys_dir / "public"
    private.mkdir(parents=True, exist_ok=True)
    public.mkdir(parents=True, exist_ok=True)
    os.chmod(private, 0o700)
    previous = active_signer(keys_dir)
    key = Ed25519PrivateKey.generate()
    signer = TicketSigner(key)
    key_path = private / f"{signer.kid}.pem"
    write_new_ed25519(key_path, key)
    pub_path = write_public_key(public, signer.public_raw)
    try:
        record(signer)
    except BaseException:
        key_path.unlink()
        # the host key sync may have removed the file already: it was never recorded
        pub_path.unlink(missing_ok=True)
        raise
    active = private / ACTIVE_KEY_FILE
    if previous is not None:
        # File the outgoing key under its kid, so it stays usable until it is retired.
        with contextlib.suppress(FileExistsError):
            os.link(active, private / f"{previous.kid}.pem")
    tmp = private / f".{ACTIVE_KEY_FILE}.{secrets.token_hex(4)}"
    os.link(key_path, tmp)
    os.replace(tmp, active)  # atomic: a starting gateway reads the old key or the new one
    return signer, previous.kid if previous is not None else None
