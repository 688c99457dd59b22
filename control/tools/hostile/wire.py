"""What the hostile self-test puts on the wire: forged tickets, raw requests, a gateway to kill.

Forgeries are built by hand (changed claims without re-signing, algorithm confusion, ``alg:
none``, a v4.local token keyed with the public key) because no honest library would make them.
Requests go through stock ``tritonclient`` (``control.ops.clients.generate``, the one call every
client of this project makes) wherever it can say what a hostile client wants to say (any
parameter, any header, any sampling input), and through raw ``http.client`` here where it cannot
(a header that is not UTF-8, a socket closed mid-answer).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import http.client
import json
import os
import secrets
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from control.contracts.config import Settings
from control.contracts.db import make_engine
from control.contracts.tickets import TicketSigner
from control.contracts.wire import MAX_TOKENS, MODEL, TEXT_INPUT, TICKET_PARAM
from control.gateway.server import make_app
from control.gateway.ticket_office import TicketOffice
from projections.route_cache import CachedRoutingView

# -- tickets ------------------------------------------------------------------------------------

def b64e(b: bytes) -> str:
    return base64.urlsafe_b64encode(b).rstrip(b"=").decode()


def b64d(s: str) -> bytes:
    return base64.urlsafe_b64decode(s + "=" * (-len(s) % 4))


def unverified_claims(token: str) -> dict[str, Any]:
    """The claims a PASETO v4.public token carries, read without checking its signature.

    The self-test reads what its own tickets name (the adapter it must be answered by) this way,
    never from the gateway's JSON beside the ticket.
    """
    body = b64d(token.split(".")[2])
    return dict(json.loads(body[:-64]))  # the payload ends with the 64-byte Ed25519 signature


def alter_claim(token: str, claim: str, value: object) -> str:
    """Change one claim in a signed token without re-signing it."""
    head, purpose, body, footer = token.split(".")
    raw = b64d(body)
    claims = json.loads(raw[:-64])
    claims[claim] = value
    new = json.dumps(claims, separators=(",", ":")).encode()
    return ".".join((head, purpose, b64e(new + raw[-64:]), footer))


def _wire_claims(claims: dict[str, Any]) -> dict[str, Any]:
    now = int(time.time())
    c = {k: v for k, v in claims.items() if k != "ttl_s"}
    return {**c, "iat": now, "exp": now + 300, "jti": secrets.token_hex(8)}


def hs256(signer: TicketSigner, claims: dict[str, Any]) -> str:
    """A JWS whose HMAC key is the control plane's public key (algorithm confusion)."""
    head = b64e(json.dumps({"alg": "HS256", "kid": signer.kid}).encode())
    body = b64e(json.dumps({**_wire_claims(claims), "kid": signer.kid}).encode())
    sig = hmac.new(signer.public_raw, f"{head}.{body}".encode(), hashlib.sha256).digest()
    return f"{head}.{body}.{b64e(sig)}"


def alg_none(claims: dict[str, Any]) -> str:
    head = b64e(json.dumps({"alg": "none"}).encode())
    return f"{head}.{b64e(json.dumps(_wire_claims(claims)).encode())}."


def v4_local(signer: TicketSigner, claims: dict[str, Any]) -> str:
    """A v4.local token encrypted with the public key as if it were a symmetric key."""
    import pyseto

    key = pyseto.Key.new(version=4, purpose="local", key=signer.public_raw)
    return pyseto.encode(key, json.dumps({**_wire_claims(claims), "kid": signer.kid}).encode(),
                         footer=json.dumps({"kid": signer.kid}).encode()).decode()


# -- requests -----------------------------------------------------------------------------------

def http_call(url: str, method: str, key: str | None, body: object) -> tuple[int, str]:
    """One gateway request; (status, body text), status 0 when no answer came."""
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    data = json.dumps(body).encode() if body is not None and method == "POST" else None
    req = urllib.request.Request(url, data=data, headers=headers, method=method)
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return int(r.status), r.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as e:
        return int(e.code), e.read().decode("utf-8", "replace")
    except (urllib.error.URLError, OSError) as e:
        return 0, type(e).__name__


def raw_header_request(http_url: str, header: str, value: bytes) -> tuple[int, str]:
    """POST /generate with one header whose bytes tritonclient would not send as they are."""
    host, port = http_url.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    body = json.dumps({TEXT_INPUT: "Hello", MAX_TOKENS: 2}).encode()
    try:
        conn.putrequest("POST", f"/v2/models/{MODEL}/generate")
        conn.putheader("Content-Type", "application/json")
        conn.putheader("Content-Length", str(len(body)))
        conn.putheader(header, value)
        conn.endheaders(body)
        resp = conn.getresponse()
        return resp.status, resp.read().decode("utf-8", "replace")
    except (OSError, http.client.HTTPException) as e:
        return 0, type(e).__name__  # the server hung up: refused too
    finally:
        conn.close()


def hang_up_mid_generation(http_url: str, ticket: str, times: int = 4) -> None:
    """Send long generations and close the socket before any answer can come."""
    host, port = http_url.rsplit(":", 1)
    body = json.dumps({TEXT_INPUT: "Tell me a long story", MAX_TOKENS: 64,
                       "parameters": {TICKET_PARAM: ticket}}).encode()
    for _ in range(times):
        conn = http.client.HTTPConnection(host, int(port), timeout=0.05)
        try:
            conn.request("POST", f"/v2/models/{MODEL}/generate", body,
                         {"Content-Type": "application/json"})
            conn.getresponse().read()
        except (TimeoutError, OSError, http.client.HTTPException):
            pass
        finally:
            conn.close()


# -- a gateway of the self-test's own -----------------------------------------------------------

@contextmanager
def gateway_process(settings: Settings, port: int) -> Iterator[subprocess.Popen[bytes]]:
    """A gateway in its own process (``python -m control.tools.hostile.wire gateway``), stopped
    after."""
    env = {**os.environ, "LORAPLANE_HOME": str(settings.home), "LORAPLANE_DB_URL": settings.db_url}
    argv = [sys.executable, "-m", "control.tools.hostile.wire", "gateway", str(port)]
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            if proc.poll() is not None:
                raise RuntimeError("the selftest gateway exited at start")
            time.sleep(0.1)
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def _serve_gateway(port: int) -> None:
    """Serve only the ticket gateway on ``port`` until killed (for the gateway fault case)."""
    from aiohttp import web


    s = Settings.from_env()
    signer, _ = TicketSigner.load_or_create(s.keys_dir)
    web.run_app(make_app(TicketOffice(s, CachedRoutingView(make_engine(s.db_url)), signer)),
                host="127.0.0.1", port=port, print=None)


if __name__ == "__main__":  # python -m control.tools.hostile.wire gateway PORT
    if len(sys.argv) == 3 and sys.argv[1] == "gateway":
        _serve_gateway(int(sys.argv[2]))
    else:
        sys.exit("usage: python -m control.tools.hostile.wire gateway PORT")
