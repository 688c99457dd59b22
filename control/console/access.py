"""Who may open the operator console: one operator credential, and the cookies made from it.

The credential is a random token in ``<home>/console/token`` (folder 0700, file 0600), apart
from tenant API keys (hashed in the registry) and from Triton's operator token: a leaked tenant
key never opens the console, and the console token opens nothing else. ``loraplane console
token`` prints it, ``--rotate`` replaces it.

A login trades the token for a session cookie ``<issued>.<nonce>.<mac>``, the MAC an HMAC keyed
by the token itself: sessions need no server-side store, survive a console restart, and all end
at once when the token is rotated (the MAC no longer verifies). Each session's CSRF token is
another HMAC of its nonce under the same key, so a form posted from another session, or forged
by another site, is refused.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import time
from dataclasses import dataclass
from pathlib import Path

TOKEN_PREFIX = "lpc_"  # tells a console token apart from a tenant key (lp_...) at a glance
SESSION_TTL_S = 12 * 3600
COOKIE = "lp_console"


def token_path(home: Path) -> Path:
    return home / "console" / "token"


def _write_private(path: Path, text: str) -> None:
    """Write ``text`` readable by the owner only: created 0600, never briefly wider."""
    path.parent.mkdir(parents=True, exist_ok=True)
    os.chmod(path.parent, 0o700)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text + "\n")
    os.replace(tmp, path)


def load_or_create_token(home: Path) -> str:
    """The console token of this home, made on first use."""
    path = token_path(home)
    if path.is_file():
        return path.read_text(encoding="utf-8").strip()
    return rotate_token(home)


def rotate_token(home: Path) -> str:
    """A new console token; every session made with the old one ends."""
    token = TOKEN_PREFIX + secrets.token_urlsafe(32)
    _write_private(token_path(home), token)
    return token


@dataclass(frozen=True)
class Session:
    nonce: str
    issued: int
    csrf: str


class Gatekeeper:
    """Checks credentials against the token file, re-read when it changes (a rotation while the
    console runs takes effect at the next request)."""

    def __init__(self, home: Path) -> None:
        self.path = token_path(home)
        self.home = home
        self._stamp: tuple[float, int] | None = None
        self._token = ""
        load_or_create_token(home)

    def _key(self) -> bytes:
        try:
            st = self.path.stat()
        except FileNotFoundError:  # removed while the console runs: a new one, sessions end
            load_or_create_token(self.home)
            st = self.path.stat()
        stamp = (st.st_mtime, st.st_ino)
        if stamp != self._stamp:
            self._token = self.path.read_text(encoding="utf-8").strip()
            self._stamp = stamp
        return self._token.encode()

    def _mac(self, purpose: str, value: str) -> str:
        return hmac.new(self._key(), f"{purpose}:{value}".encode(), hashlib.sha256).hexdigest()

    def is_token(self, offered: str) -> bool:
        """Whether ``offered`` is the console token (constant time)."""
        return bool(offered) and hmac.compare_digest(offered.strip().encode(), self._key())

    def new_session(self, now: float | None = None) -> str:
        """A session cookie value, made after a successful login."""
        issued = int(time.time() if now is None else now)
        nonce = secrets.token_urlsafe(16)
        body = f"{issued}.{nonce}"
        return f"{body}.{self._mac('session', body)}"

    def session(self, cookie: str | None, now: float | None = None) -> Session | None:
        """The session a cookie carries, or None (forged, expired, or from before a rotation)."""
        if not cookie or cookie.count(".") != 2:
            return None
        issued_s, nonce, mac = cookie.split(".")
        body = f"{issued_s}.{nonce}"
        if not issued_s.isdigit() or not hmac.compare_digest(mac, self._mac("session", body)):
            return None
        issued = int(issued_s)
        if (time.time() if now is None else now) - issued > SESSION_TTL_S:
            return None
        return Session(nonce=nonce, issued=issued, csrf=self._mac("csrf", nonce))

    @staticmethod
    def csrf_ok(session: Session, offered: str | None) -> bool:
        return bool(offered) and hmac.compare_digest(session.csrf, str(offered))
