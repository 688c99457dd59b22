"""The OpenAI-compatible routes' request bodies, checked field by field before anything is signed
(``control.gateway.openai_api`` serves the routes): every field's JSON type, the sampling values
against the one contract (``control.contracts.sampling``), the prompt or the chat rendered with
the documented template; a refusal in OpenAI's error shape naming the field."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from control.contracts import wire
from control.contracts.sampling import (
    OPENAI_TEMPERATURE_MAX,
    TEMPERATURE_MAX,
    TEMPERATURE_MIN,
    InvalidParameter,
    check_sampling,
)

ROLES = ("system", "user", "assistant")
MODEL_NOT_FOUND = "The model does not exist or you do not have access to it."


class ApiError(Exception):
    """A refusal in OpenAI's error shape: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, kind: str, code: str | None = None,
                 param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.code = status, message, kind, code
        self.param = param

    def response(self) -> web.Response:
        return web.json_response({"error": {"message": self.message, "type": self.kind,
                                            "param": self.param, "code": self.code}},
                                 status=self.status)


def not_found() -> ApiError:
    return ApiError(404, MODEL_NOT_FOUND, "invalid_request_error", "model_not_found")


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, "invalid_request_error", code, param)


def wrong_type(param: str, expected: str, value: object) -> ApiError:
    """400 for a field of the wrong JSON type, naming the field (and what came: the caller's
    own value's JSON type, nothing else)."""
    return bad_request(f"invalid type for '{param}': expected {expected}, got {json_type(value)}",
                param, "invalid_type")


def json_type(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    return "an array" if isinstance(value, list) else "an object"


def optional_field(body: Mapping[str, Any], name: str, kind: type | tuple[type, ...],
              expected: str, param: str | None = None) -> Any:
    """``body[name]`` when present and of JSON type ``kind``; None when absent or null (OpenAI
    treats an explicit null as "not given"); else a 400 naming the field (``param``, default
    ``name``). A JSON boolean is never an integer or a number here, although Python's bool is
    an int."""
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) != (kind is bool) or not isinstance(v, kind):
        raise wrong_type(param or name, expected, v)
    return v


def prompt_of(body: Mapping[str, Any], chat: bool) -> str:
    """The text to complete: the rendered chat, or ``prompt`` (a string, or a list of exactly
    one string: token-id prompts and batches are not served)."""
    if chat:
        return render_chat(body.get("messages"))
    raw = body.get("prompt")
    if isinstance(raw, list) and len(raw) == 1:
        raw = raw[0]
    if not isinstance(raw, str):
        raise bad_request("'prompt' must be a string (or a list of one string)", "prompt",
                   "invalid_type")
    return raw


@dataclass(frozen=True)
class Generation:
    prompt: str
    max_tokens: int | None  # None: not given, the release's or the host's default applies
    temperature: float | None  # None: not given, the release's or the host's default applies
    top_p: float | None
    seed: int | None
    stream: bool
    include_usage: bool


def max_tokens_of(body: Mapping[str, Any]) -> tuple[str, int | None]:
    """Which of ``max_tokens`` / ``max_completion_tokens`` bounds the answer (the first given
    wins), with its value; both must be integers when given."""
    given = [(name, optional_field(body, name, int, "an integer"))
             for name in ("max_tokens", "max_completion_tokens")]
    for name, value in given:
        if value is not None:
            return name, value
    return "max_tokens", None


def real_field(body: Mapping[str, Any], name: str) -> float | None:
    """A number field as a float (None when not given). An integer too large for a double
    (``1e400`` written out in digits) is out of every range: refused here, since converting it
    would raise."""
    v = optional_field(body, name, (int, float), "a number")
    if v is None:
        return None
    try:
        return float(v)
    except OverflowError:
        raise bad_request(f"invalid parameter {name}: out of range", name,
                          "invalid_value") from None


def sampling_of(body: Mapping[str, Any]) -> tuple[int | None, float | None, float | None,
                                                 int | None]:
    """max_tokens, temperature, top_p and seed, checked against the sampling contract a Triton
    host applies (:mod:`control.contracts.sampling`), so what a host would refuse is refused
    here, before a ticket is signed, with a message naming the field.

    temperature: the contract allows 0 or 0.01..10, OpenAI documents 0..2: the gateway takes
    the intersection, 0 or 0.01..2. seed: the contract's signed 64-bit range (Triton's INT64
    input), negative seeds included."""
    limit_name, max_tokens = max_tokens_of(body)
    temperature = real_field(body, "temperature")
    top_p = real_field(body, "top_p")
    seed = optional_field(body, "seed", int, "an integer")
    try:
        checked = check_sampling(max_tokens, temperature, top_p, seed)
    except InvalidParameter as e:
        if e.name == wire.TEMPERATURE:
            raise temperature_refused(temperature) from None
        param = limit_name if e.name == wire.MAX_TOKENS else e.name
        message = str(e).replace(f"parameter {e.name}:", f"parameter {param}:", 1)
        raise bad_request(message, param, "invalid_value") from None
    if temperature is not None and checked.temperature > OPENAI_TEMPERATURE_MAX:
        raise temperature_refused(temperature)
    return (None if max_tokens is None else checked.max_tokens,
            None if temperature is None else checked.temperature,
            None if top_p is None else checked.top_p,
            checked.seed)


def temperature_refused(value: object) -> ApiError:
    """The refusal of a temperature outside 0 or 0.01..2, saying where that range comes from."""
    return bad_request(f"invalid parameter temperature: must be 0 (greedy) or between "
                f"{TEMPERATURE_MIN} and {OPENAI_TEMPERATURE_MAX:g}, found {value!r} (OpenAI's "
                f"range is 0 to {OPENAI_TEMPERATURE_MAX:g} and Triton hosts take 0 or "
                f"{TEMPERATURE_MIN} to {TEMPERATURE_MAX:g}: the gateway takes what both allow)",
                "temperature", "invalid_value")


def generation_of(body: Mapping[str, Any], prompt: str) -> Generation:
    """Every generation field of an OpenAI request, type- and range-checked (see the module
    notes): a 400 naming the first field that is wrong."""
    n = optional_field(body, "n", int, "an integer")
    if n is not None and n != 1:
        raise bad_request("only n=1 is supported", "n", "invalid_value")
    stream = optional_field(body, "stream", bool, "a boolean")
    opts = optional_field(body, "stream_options", dict, "an object") or {}
    include_usage = optional_field(opts, "include_usage", bool, "a boolean",
                              "stream_options.include_usage")
    max_tokens, temperature, top_p, seed = sampling_of(body)
    return Generation(prompt=prompt, max_tokens=max_tokens, temperature=temperature,
                      top_p=top_p, seed=seed, stream=bool(stream),
                      include_usage=bool(include_usage))


def render_chat(messages: object) -> str:
    """The role-prefixed chat template documented in this module's docstring."""
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty list", "messages")
    lines = []
    for m in messages:
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise bad_request(f"'messages': each message needs a role among {', '.join(ROLES)}",
                       "messages")
        content = m.get("content")
        if isinstance(content, list):  # content parts: text only
            if not all(isinstance(p, dict) and p.get("type") == "text"
                       and isinstance(p.get("text"), str) for p in content):
                raise bad_request("'messages': only text content parts are supported", "messages")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise bad_request("'messages': message content must be text", "messages")
        lines.append(f"{m['role']}: {content}\n")
    return "".join(lines) + "assistant:"


def model_of(body: Mapping[str, Any]) -> str:
    """The ``model`` field: a non-empty string (which alias it names is the routing's question,
    answered with the one 404 when the caller may not use it)."""
    model = body.get("model")
    if model is None or model == "":
        raise bad_request("'model' is required", "model", "missing_required_parameter")
    if not isinstance(model, str):
        raise wrong_type("model", "a string", model)
    return model
