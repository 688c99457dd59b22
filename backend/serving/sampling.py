"""The sampler: one token per row, by temperature and nucleus (top-p) sampling.

Which parameters a request may carry is the sampling contract's (``control.contracts.sampling``,
re-exported here for the engine and the service); this module only samples, per row, so that a
row whose probabilities are not a distribution fails alone (``sample`` returns None).
"""

from __future__ import annotations

import torch

from control.contracts.sampling import (
    DEFAULT_MAX_TOKENS,
    MAX_NEW_TOKENS,
    InvalidParameter,
    SamplingParams,
    check_sampling,
)

__all__ = ["DEFAULT_MAX_TOKENS", "MAX_NEW_TOKENS", "InvalidParameter", "SamplingParams",
           "check_sampling", "sample"]


def sample(
    logits: torch.Tensor,  # [vocab] float32, finite
    temperature: float,
    top_p: float,
    generator: torch.Generator,
) -> int | None:
    """One token id by temperature and nucleus (top-p) sampling; None when the row's
    probabilities are not a distribution (nan, inf or no mass), so the row fails alone."""
    probs = torch.softmax(logits / temperature, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        # keep the smallest prefix whose mass reaches top_p (always at least one token)
        drop = sorted_probs.cumsum(-1) - sorted_probs >= top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(0, order, sorted_probs)
    if not bool(torch.isfinite(probs).all()) or float(probs.sum()) <= 0.0:
        return None
    return int(torch.multinomial(probs, 1, generator=generator)[0])
