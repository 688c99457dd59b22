"""The sampling contract: which sampling parameters a request may carry, said in one place.

A Triton host checks every request against it at admission (``backend.serving.service``), the
engine checks again before it pins a slot (``backend.serving.engine``), and the gateway's
OpenAI-compatible route refuses, with the same ranges, what a host would refuse
(``control.gateway.openai_api``). It imports no torch, so the gateway can use it.

Why ranges and not just "finite, >= 0": a temperature of 1e-39 (a float32 denormal) or 1e-30 is
finite and positive, yet ``logits / temperature`` overflows to inf and the softmax to nan. That
used to fail the whole decode step, and with it every tenant's rows on the host. So a request's
parameters must lie in ranges where the arithmetic is sound, and a value outside them is refused
with a message naming the parameter (:class:`InvalidParameter`). The sampler
(``backend.serving.sampling.sample``) still guards each row: whatever a row's logits hold, a row
that cannot be sampled fails alone, never the batch.

Ranges (documented in the README):

==============  =======================================================  ==============
parameter       accepted                                                  default
==============  =======================================================  ==============
``max_tokens``  integer in [1, 512]                                       16
``temperature`` 0 (greedy), or a finite number in [0.01, 10]               0
``top_p``       a finite number in [0.001, 1]                              1
``seed``        integer in [-2**63, 2**63 - 1] (Triton's INT64)            none (random)
==============  =======================================================  ==============

A ``stop`` input does not exist on the ``lora_llm`` models: Triton refuses unknown inputs itself.

The same ranges bound a release's inference defaults (:func:`check_defaults`: ``max_tokens``,
``temperature``, ``top_p``; what a request that omits one of them gets, on the Triton route and
the OpenAI route alike), and the OpenAI route (one deliberate difference, said here:
:data:`OPENAI_TEMPERATURE_MAX`, the OpenAI API's own ceiling of 2).
"""

from __future__ import annotations

import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass

from control.contracts.wire import MAX_TOKENS, SEED, TEMPERATURE, TOP_P

MAX_NEW_TOKENS = 512
DEFAULT_MAX_TOKENS = 16
TEMPERATURE_MIN = 0.01
TEMPERATURE_MAX = 10.0
TOP_P_MIN = 0.001
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1
# The OpenAI API documents temperature in [0, 2]: its route accepts the part of the host's range
# that lies there (0, or 0.01 to 2), the one difference between the surfaces.
OPENAI_TEMPERATURE_MAX = 2.0
# What a release may set as its inference defaults (a seed is per request, never a default).
DEFAULT_FIELDS = (MAX_TOKENS, TEMPERATURE, TOP_P)


def _float32(x: float) -> float:
    """``x`` rounded to float32: the model's inputs are FP32, and a client sending 0.01 as FP32
    sends 0.0099999998, which must count as the documented 0.01."""
    return float(struct.unpack("<f", struct.pack("<f", x))[0])


# The float32 rounding of a bound may lie on either side of it (0.01 rounds down, 0.001 up):
# the lower of the two is the bound, so both spellings of the documented minimum pass.
_T_MIN = min(TEMPERATURE_MIN, _float32(TEMPERATURE_MIN))
_P_MIN = min(TOP_P_MIN, _float32(TOP_P_MIN))


class InvalidParameter(ValueError):
    """A request parameter outside its documented range; the message names the parameter."""

    def __init__(self, name: str, why: str) -> None:
        super().__init__(f"invalid parameter {name}: {why}")
        self.name = name


@dataclass(frozen=True)
class SamplingParams:
    """Checked sampling parameters of one request."""

    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    seed: int | None = None


def _integer(name: str, value: object) -> int:
    # bool is an int subclass; a JSON true must not pass as 1
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidParameter(name, f"must be an integer, found {type(value).__name__}")
    return value


def _number(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidParameter(name, f"must be a number, found {type(value).__name__}")
    try:
        x = float(value)
    except OverflowError:  # an integer past float range (10**400 in a JSON body, say)
        raise InvalidParameter(name, "must be finite, found a number out of range") from None
    if not math.isfinite(x):
        raise InvalidParameter(name, f"must be finite, found {x!r}")
    return x


def check_sampling(max_tokens: object = None, temperature: object = None,
                   top_p: object = None, seed: object = None) -> SamplingParams:
    """The request's sampling parameters, defaults filled in; else :class:`InvalidParameter`."""
    # Errors name the parameter as the client sent it: the models' input name.
    n = DEFAULT_MAX_TOKENS if max_tokens is None else _integer(MAX_TOKENS, max_tokens)
    if not 1 <= n <= MAX_NEW_TOKENS:
        raise InvalidParameter(MAX_TOKENS, f"must be between 1 and {MAX_NEW_TOKENS}, found {n}")
    t = 0.0 if temperature is None else _number(TEMPERATURE, temperature)
    if t != 0.0 and not _T_MIN <= t <= TEMPERATURE_MAX:
        raise InvalidParameter(
            TEMPERATURE, f"must be 0 (greedy) or between {TEMPERATURE_MIN} and "
            f"{TEMPERATURE_MAX:g}, found {t!r}")
    p = 1.0 if top_p is None else _number(TOP_P, top_p)
    if not _P_MIN <= p <= 1.0:
        raise InvalidParameter(TOP_P, f"must be between {TOP_P_MIN} and 1, found {p!r}")
    s = None if seed is None else _integer(SEED, seed)
    if s is not None and not SEED_MIN <= s <= SEED_MAX:
        raise InvalidParameter(SEED, "must fit a signed 64-bit integer")
    return SamplingParams(n, t, p, s)


def check_defaults(defaults: Mapping[str, object]) -> dict[str, int | float]:
    """A release's inference defaults, each checked against the range a request's own value
    must lie in; InvalidParameter names the first that is not (or a field no model reads)."""
    unknown = sorted(set(defaults) - set(DEFAULT_FIELDS))
    if unknown:
        raise InvalidParameter(unknown[0], "is not a sampling parameter a release may default "
                               f"(one of {', '.join(DEFAULT_FIELDS)}; the models have no "
                               f"{unknown[0]!r} input)")
    given = {k: v for k, v in defaults.items() if v is not None}
    checked = check_sampling(given.get(MAX_TOKENS), given.get(TEMPERATURE), given.get(TOP_P))
    out: dict[str, int | float] = {}
    for name, value in ((MAX_TOKENS, checked.max_tokens), (TEMPERATURE, checked.temperature),
                        (TOP_P, checked.top_p)):
        if name in given:
            out[name] = value
    return out


def with_defaults(max_tokens: object, temperature: object, top_p: object,
                  defaults: Mapping[str, object]) -> tuple[object, object, object]:
    """A request's sampling values, each omitted one (None) taken from ``defaults`` (a
    release's, checked by :func:`check_defaults`); the request's own values always win."""
    return (defaults.get(MAX_TOKENS) if max_tokens is None else max_tokens,
            defaults.get(TEMPERATURE) if temperature is None else temperature,
            defaults.get(TOP_P) if top_p is None else top_p)
