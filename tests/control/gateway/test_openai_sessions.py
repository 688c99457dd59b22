"""Which session an OpenAI-compatible request belongs to: ``x-session-id``, else ``user``."""

from __future__ import annotations

import pytest
from aiohttp import web
from aiohttp.test_utils import make_mocked_request

from control.domain import SESSION_RE
from control.gateway.openai_api import SESSION_HEADER, _session
from control.gateway.openai_request import ApiError


def _req(headers: dict[str, str] | None = None) -> web.Request:
    return make_mocked_request("POST", "/v1/chat/completions", headers=headers or {})


def test_the_header_names_the_session_and_wins_over_user() -> None:
    assert _session(_req({SESSION_HEADER: "chat-7"}), "alice") == "chat-7"
    with pytest.raises(ApiError) as refused:
        _session(_req({SESSION_HEADER: "has space"}), "alice")
    assert refused.value.status == 400


def test_user_is_the_session_without_the_header() -> None:
    assert _session(_req(), "alice") == "alice"
    assert _session(_req(), None) is None
    assert _session(_req(), "") is None
    # A user that is not a string is a malformed request, not "no session" (OpenAI types it).
    with pytest.raises(ApiError) as refused:
        _session(_req(), 42)
    assert refused.value.status == 400 and refused.value.param == "user"
    # Any user keeps one release: a name a session id cannot hold is named by its hash.
    odd = _session(_req(), "Zoë Smith")
    assert odd is not None and SESSION_RE.match(odd) and odd == _session(_req(), "Zoë Smith")
    assert odd != _session(_req(), "Zoe Smith")
