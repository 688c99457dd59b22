"""Reading request bodies on the gateway: whole, bounded, and parsed strictly.

Every gateway route that takes a body reads it through :func:`read_json_object`, with the
route's own limit (``TICKET_BODY_LIMIT`` for tickets and feedback, ``OPENAI_BODY_LIMIT`` for
the OpenAI-compatible routes).

Why a helper: ``request.content.read(n)`` returns what happens to be buffered, up to ``n``
bytes, not the body; a body that arrived in two TCP writes was cut at the first. Here the
reader loops until the end of the body, and stops one byte past the limit, so a client cannot
make the gateway hold more than ``limit + 1`` bytes of a body (plus aiohttp's own read buffer),
whatever Content-Length says or whether the body is chunked. A Content-Length above the limit is
refused before any of the body is read.

Parsing is strict because the body decides what is signed and forwarded: a key given twice
(``{"model": "a", "model": "b"}``) is refused rather than resolved by whichever one the parser
keeps, and ``NaN``/``Infinity`` (which Python's ``json`` accepts, and JSON does not) are refused.
"""

from __future__ import annotations

import asyncio
import json
import math
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

TICKET_BODY_LIMIT = 4096  # {"alias", "session"} or {"request_id", "success"}: small
OPENAI_BODY_LIMIT = 64 * 1024  # a prompt or a chat history
# A body must be complete within this long of the handler asking for it: slow senders are
# served, a sender that never finishes does not hold a connection and a handler forever.
BODY_TIMEOUT_S = 30.0


class BodyError(Exception):
    """The body cannot be used; ``status`` is the HTTP answer, the message says why (it names
    nothing but the limit or the JSON fault, never what the body held)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def too_large(limit: int) -> BodyError:
    return BodyError(413, f"request body too large: at most {limit} bytes")


async def read_body(request: web.Request, limit: int, timeout_s: float | None = None) -> bytes:
    """The whole request body, at most ``limit`` bytes; else :class:`BodyError` (413 over the
    limit, 400 when it ends early, 408 when it does not arrive within ``timeout_s``, default
    ``BODY_TIMEOUT_S``).

    Reads in a loop until the end of the body: one read returns only what is buffered."""
    declared = request.content_length
    if declared is not None and declared > limit:
        raise too_large(limit)  # refused before reading any of it
    try:
        async with asyncio.timeout(BODY_TIMEOUT_S if timeout_s is None else timeout_s):
            return await _read_bounded(request, limit)
    except TimeoutError:
        raise BodyError(408, "request body not received in time") from None


async def _read_bounded(request: web.Request, limit: int) -> bytes:
    buf = bytearray()
    while True:
        try:
            # Never ask for more than one byte past the limit: that byte proves "too large".
            chunk = await request.content.read(limit + 1 - len(buf))
        except (ConnectionError, HttpProcessingError) as e:
            # The client went away mid-body, or the chunked framing was broken: nobody may
            # be left to answer, but the handler ends here rather than with a traceback.
            raise BodyError(400, "request body incomplete") from e
        if not chunk:
            return bytes(buf)
        buf += chunk
        if len(buf) > limit:
            raise too_large(limit)


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``object_pairs_hook``: an object naming a key twice is refused, at any depth."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r}")
        out[key] = value
    return out


def _no_constant(name: str) -> Any:
    """``parse_constant``: NaN, Infinity and -Infinity are not JSON."""
    raise ValueError(f"{name} is not a JSON value")


def _finite(text: str) -> float:
    """``parse_float``: a number too large for a double (``1e999``) would become infinity."""
    x = float(text)
    if not math.isfinite(x):
        raise ValueError("a number is too large")
    return x


def parse_json(raw: bytes) -> Any:
    """``raw`` as strict JSON (UTF-8, no duplicate keys, no NaN/Infinity, no number that
    overflows a double); ValueError else."""
    text = raw.decode("utf-8")  # UnicodeDecodeError is a ValueError
    return json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_no_constant,
                      parse_float=_finite)


async def read_json_object(request: web.Request, limit: int) -> dict[str, Any]:
    """The body as a JSON object, read whole within ``limit``; :class:`BodyError` else (400
    for anything but an object, with the parser's reason: it describes only the caller's own
    bytes)."""
    raw = await read_body(request, limit)
    try:
        body = parse_json(raw)
    except RecursionError:  # nesting deeper than the parser's stack (a body of 64 KiB "[")
        raise BodyError(400, "body must be a JSON object: nested too deeply") from None
    except ValueError as e:
        raise BodyError(400, f"body must be a JSON object: {_reason(e)}") from None
    if not isinstance(body, dict):
        raise BodyError(400, "body must be a JSON object")
    return body


def _reason(e: ValueError) -> str:
    """A short reason for a parse failure (a duplicate key names the caller's own key)."""
    if isinstance(e, UnicodeDecodeError):
        return "not UTF-8"
    if isinstance(e, json.JSONDecodeError):
        return e.msg if e.msg else "not JSON"
    return str(e)
