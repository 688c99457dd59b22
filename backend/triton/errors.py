"""The Triton error a refused or failed request gets, for both models.

The engine (``backend.triton.glue``) answers with the status the service chose; the front
(``backend.triton.front``) restores the status from the engine's fixed message, because BLS
reports every error as INTERNAL. Both go through :func:`error_response`, so a status means the
same Triton code whichever model answers.

Triton's Python backend has no UNAUTHENTICATED code: ticket failures are INVALID_ARG (HTTP 400),
as DESIGN.md's "Errors" says. ``pb_utils`` is passed in, as everywhere in this package.
"""

from __future__ import annotations

from typing import Any


def error_code(pb: Any, status: str) -> Any:
    """The ``pb.TritonError`` code of a status (``invalid_arg``, ``unavailable``, ``cancelled``;
    anything else is INTERNAL). Where this Triton's stub has no CANCELLED code, a cancelled
    request reads as UNAVAILABLE: the client is gone or may retry, never at fault."""
    errors = pb.TritonError
    return {
        "invalid_arg": errors.INVALID_ARG,
        "unavailable": errors.UNAVAILABLE,
        "cancelled": getattr(errors, "CANCELLED", errors.UNAVAILABLE),
    }.get(status, errors.INTERNAL)


def error_response(pb: Any, message: str, status: str) -> Any:
    """An error response carrying ``message`` with the code of ``status``."""
    return pb.InferenceResponse(error=pb.TritonError(message, error_code(pb, status)))
