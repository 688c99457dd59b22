"""Where a request's routing ticket is: the one parser every route and protocol goes through.

A ticket travels as the request parameter :data:`~control.contracts.wire.TICKET_PARAM`, or as the
header :data:`~control.contracts.wire.TICKET_HEADER`, which Triton forwards to the model as a
parameter. Triton hands the engine model the parameters as one JSON string; the front model
(``backend.triton.front``), which forwards unary requests over BLS, receives the same string.
Both call :func:`ticket_from_parameters` on it, so a request means the same on ``infer``,
``generate``, ``generate_stream`` and gRPC, whichever model it reaches:

- duplicate keys anywhere in the JSON are refused (``parameters``), never resolved by whichever
  copy a parser keeps;
- the parameter and the header with different values are refused (``ambiguous``): a client must
  not smuggle a second ticket past a proxy that inspected the first;
- a ticket that is not a string is refused (``encoding``); none at all is ``missing``;
- JSON nested deeper than :data:`MAX_DEPTH` containers is refused (``parameters``) before it is
  parsed. The limit is a number, not the interpreter's stack: ``json`` alone fails at a depth that
  depends on how deep the caller's own stack is, so the same request could parse in one model and
  be refused in the other.

BLS takes parameters as a dictionary, so the raw string cannot cross from the front to the engine
as it arrived. The front therefore forwards what the parser found: the one ticket
(:func:`forwarded_parameters`), or the parser's refusal under :data:`FRONT_REFUSAL`, which the
engine turns into the same refusal, with its ledger row. A client that sends that key itself only
gets its own request refused.

Light on purpose (json only): the front model's stub imports no torch and no database driver.
"""

from __future__ import annotations

import json
import re
from typing import Any

from control.contracts.tickets import TicketClaims
from control.contracts.wire import TICKET_HEADER, TICKET_PARAM

# The key under which the front forwards the parser's refusal reason to the engine.
FRONT_REFUSAL = "lora_front_refusal"
# The reasons this parser gives; a forwarded reason outside them reads as ``parameters``.
REASONS = frozenset({"missing", "parameters", "encoding", "ambiguous"})
# Parameters the front forwards beside the ticket (W3C trace context for the engine's spans).
PASSED_ON = ("traceparent", "tracestate")
# Containers (objects and arrays) nested deeper than this are refused; the top-level object is 1.
# Tickets and trace context need 1; 32 leaves room for any client's extra parameters.
MAX_DEPTH = 32
# A JSON string literal, escapes included: brackets inside one do not nest anything.
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.DOTALL)
_BRACKETS = re.compile(r"[\[\]{}]")


class RequestRefused(Exception):
    """A request refused before anything was leased; ``reason`` goes to the ledger only.

    ``claims``: the verified ticket's claims when the refusal came after verification (a
    governance refusal), so the ledger row names the tenant and digest it refused.
    """

    def __init__(self, reason: str, claims: TicketClaims | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.claims = claims


def parameters_of(raw: str | dict[str, object] | None) -> dict[str, object]:
    """The request parameters as a dictionary; RequestRefused (``parameters``) when the JSON is
    malformed, holds a duplicate key at any depth, nests too deep, or is not an object."""
    if raw is None or raw == "":
        return {}
    if isinstance(raw, str):
        if _nesting(raw) > MAX_DEPTH:
            raise RequestRefused("parameters")
        try:
            params = json.loads(raw, object_pairs_hook=_unique_keys)
        except (ValueError, RecursionError):
            raise RequestRefused("parameters") from None
    else:
        params = raw
    if not isinstance(params, dict):
        raise RequestRefused("parameters")
    return params


def ticket_from_parameters(raw: str | dict[str, object] | None) -> str:
    """The ticket string from request parameters (or the forwarded header), else RequestRefused.

    See the module notes for what is refused and why.
    """
    return ticket_in(parameters_of(raw))


def ticket_in(params: dict[str, object]) -> str:
    """The one ticket that parsed parameters name, else RequestRefused."""
    if FRONT_REFUSAL in params:
        reason = params[FRONT_REFUSAL]
        raise RequestRefused(reason if isinstance(reason, str) and reason in REASONS
                             else "parameters")
    # Header names are case-insensitive: X-Lora-Ticket is the same header as x-lora-ticket.
    names = (TICKET_PARAM, TICKET_HEADER)
    found = [v for k, v in params.items() if isinstance(k, str) and k.lower() in names]
    if not found:
        raise RequestRefused("missing")
    if any(not isinstance(v, str) for v in found):
        raise RequestRefused("encoding")
    if len(set(found)) > 1:
        raise RequestRefused("ambiguous")
    return str(found[0])


def forwarded_parameters(raw: str | dict[str, object] | None) -> dict[str, Any]:
    """What the front forwards to the engine over BLS: the one ticket the parser found (and the
    trace context, when it is a string), or the parser's refusal under :data:`FRONT_REFUSAL`.

    Everything else the client sent is dropped: the engine reads nothing else, and BLS refuses
    values other than strings, integers and booleans, which would fail the forward before the
    engine could write the request's ledger row.
    """
    try:
        params = parameters_of(raw)
        ticket = ticket_in(params)
    except RequestRefused as e:
        return {FRONT_REFUSAL: e.reason}
    out: dict[str, Any] = {TICKET_PARAM: ticket}
    for name in PASSED_ON:
        value = params.get(name)
        if isinstance(value, str):
            out[name] = value
    return out


def _nesting(text: str) -> int:
    """The deepest container nesting in ``text``, outside string literals (linear, no recursion).

    On malformed JSON the count may be anything; such text is refused by the parser anyway.
    """
    depth = deepest = 0
    for bracket in _BRACKETS.findall(_STRING.sub("", text)):
        if bracket in "[{":
            depth += 1
            deepest = max(deepest, depth)
        else:
            depth -= 1
    return deepest


def _unique_keys(pairs: list[tuple[str, object]]) -> dict[str, object]:
    out = dict(pairs)
    if len(out) != len(pairs):
        raise ValueError("duplicate key")
    return out
