"""One sampling contract, three surfaces: the OpenAI route, a Triton host's admission and a
release's inference defaults accept and refuse exactly the same values
(``control.contracts.sampling``), but for the one difference the contract states: the OpenAI
route takes temperatures up to 2 (OpenAI's own range), not 10.

Before, temperature was allowed in 0..2 at the gateway, 0 or 0.01..10 on the host and 0..5 in a
release's defaults, so a release could default to a temperature every host refused.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from backend.serving.sampling import InvalidParameter, check_sampling
from control.app.releases import parse_defaults
from control.contracts.sampling import OPENAI_TEMPERATURE_MAX
from control.domain import DomainError
from control.gateway.openai_request import ApiError, sampling_of

VALUES = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=3),
    st.sampled_from([0, 0.0, 0.01, 0.0099999998, 0.001, 1, 1.0, 2, 2.0, 2.5, 5, 10, 10.5, 512,
                     513, 1e-39, -0.0, 16, 7]),
)


def _host(name: str, value: Any) -> bool:
    try:
        check_sampling(**{name: value})
        return True
    except InvalidParameter:
        return False


def _release(name: str, value: Any) -> bool:
    try:
        parse_defaults({name: value})
        return True
    except DomainError:
        return False


def _gateway(name: str, value: Any) -> bool:
    try:
        sampling_of({name: value})
        return True
    except ApiError:
        return False


@settings(max_examples=400, deadline=None)
@given(name=st.sampled_from(["max_tokens", "temperature", "top_p"]), value=VALUES)
def test_three_surfaces_accept_and_refuse_the_same_values(name: str, value: Any) -> None:
    host = _host(name, value)
    if value is not None:  # a release default of null means "no default", not a value
        assert _release(name, value) == host, (name, value)
    gateway = _gateway(name, value)
    if name == "temperature" and host and isinstance(value, (int, float)) \
            and not isinstance(value, bool) and math.isfinite(value) \
            and value > OPENAI_TEMPERATURE_MAX:
        assert not gateway  # the one stated difference: OpenAI's range ends at 2
    else:
        assert gateway == host, (name, value)


def test_a_release_cannot_default_what_no_model_reads() -> None:
    for defaults in ({"stop": ["\n"]}, {"seed": 3}, {"temperture": 0.5}):
        with pytest.raises(DomainError, match="not a sampling parameter a release may default"):
            parse_defaults(defaults)
    assert parse_defaults({"temperature": 0, "max_tokens": 7}) == {"temperature": 0.0,
                                                                   "max_tokens": 7}
