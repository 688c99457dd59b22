"""Sampling parameter ranges, as a client sends them (Python floats or the model's FP32)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from backend.serving.sampling import InvalidParameter, check_sampling, sample


@pytest.mark.parametrize("as_sent", [float, lambda x: float(np.float32(x))],
                         ids=["float64", "float32"])
def test_documented_bounds_pass_in_either_precision(as_sent: object) -> None:
    conv = as_sent  # type: ignore[assignment]
    p = check_sampling(max_tokens=512, temperature=conv(0.01), top_p=conv(0.001))  # type: ignore[operator]
    assert p.max_tokens == 512 and p.temperature > 0 and p.top_p > 0
    assert check_sampling(temperature=conv(10.0), top_p=conv(1.0)).temperature == 10.0  # type: ignore[operator]


@pytest.mark.parametrize(("name", "kwargs"), [
    ("temperature", {"temperature": 0.0099}), ("temperature", {"temperature": 1e-39}),
    ("temperature", {"temperature": 10.01}), ("temperature", {"temperature": math.nan}),
    ("top_p", {"top_p": 0.00099}), ("top_p", {"top_p": 1.0001}), ("top_p", {"top_p": -math.inf}),
    ("max_tokens", {"max_tokens": 0}), ("max_tokens", {"max_tokens": 1.0}),
    ("seed", {"seed": -(2**63) - 1}),
])
def test_out_of_range_values_name_their_parameter(name: str, kwargs: dict[str, object]) -> None:
    with pytest.raises(InvalidParameter, match=f"^invalid parameter {name}: "):
        check_sampling(**kwargs)  # type: ignore[arg-type]


def test_a_row_that_cannot_be_sampled_gives_none_not_an_exception() -> None:
    import torch

    g = torch.Generator().manual_seed(1)
    assert sample(torch.full((8,), -math.inf), 1.0, 1.0, g) is None  # no mass
    assert sample(torch.tensor([0.0, math.nan]), 1.0, 1.0, g) is None
    assert sample(torch.tensor([0.0, 5.0, 1.0]), 0.5, 0.9, g) == 1


def test_an_integer_past_float_range_is_an_invalid_parameter_not_a_crash() -> None:
    for name in ("temperature", "top_p"):
        with pytest.raises(InvalidParameter, match=name):
            check_sampling(**{name: 10**400})
