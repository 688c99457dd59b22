"""The sampler: one token per row, by temperature and nucleus (top-p) sampling, for a whole batch.

Which parameters a request may carry is the sampling contract's (``control.contracts.sampling``,
re-exported here for the engine and the service); this module only picks tokens.

:func:`choose_tokens` picks every row's token on the logits' device and reads nothing back: the
caller moves the answer to the host once per decode step, because each device-to-host read
stalls the GPU. A row whose probabilities are not a distribution gets :data:`FAILED`, so it
fails alone. Sampled rows use the exponential race (the Gumbel-max trick): the argmax over
tokens of ``p_i / E_i`` with ``E_i ~ Exp(1)`` is token ``i`` with probability ``p_i / sum(p)``,
the same distribution ``torch.multinomial`` draws from, but one batched argmax for all rows.
Each row's noise comes from its own generator, and every step is row-wise, so a row's tokens
depend only on its own logits and seed: never on which other tenants share the batch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from control.contracts.sampling import (
    DEFAULT_MAX_TOKENS,
    MAX_NEW_TOKENS,
    InvalidParameter,
    SamplingParams,
    check_sampling,
)

__all__ = ["DEFAULT_MAX_TOKENS", "FAILED", "MAX_NEW_TOKENS", "InvalidParameter", "RowSampling",
           "SamplingParams", "check_sampling", "choose_tokens", "sample"]

FAILED = -1  # the id of a row that fails alone: its logits or probabilities are not usable


@dataclass(frozen=True)
class RowSampling:
    """How one row picks its token: greedy (argmax) without a generator, else sampled."""

    temperature: float
    top_p: float
    generator: torch.Generator | None  # the request's own, seeded per request; None: greedy


def choose_tokens(logits: torch.Tensor, rows: Sequence[RowSampling]) -> torch.Tensor:
    """``[rows]`` long on ``logits``' device: each row's next token, :data:`FAILED` where the
    row's logits are not finite or its probabilities are not a distribution (nan, inf, no mass).

    ``logits`` is ``[rows, vocab]`` float. Nothing here reads the device (no ``.tolist()``,
    ``.item()`` or ``bool()`` of a tensor); the caller reads the result once."""
    if len(rows) != logits.shape[0]:
        raise ValueError(f"{len(rows)} rows of parameters for {logits.shape[0]} rows of logits")
    # contiguous: each row's kernels see the same layout whatever the batch around it
    logits = logits.contiguous()
    ok = torch.isfinite(logits).all(dim=-1)
    chosen = logits.argmax(dim=-1)  # greedy rows: exactly the argmax, as PEFT's greedy decoding
    if any(r.generator is not None for r in rows):  # decided on the host: no device read
        drawn, sampled, distribution = _race(logits, rows)
        chosen = torch.where(sampled, drawn, chosen)
        ok = ok & (distribution | ~sampled)
    return torch.where(ok, chosen, torch.full_like(chosen, FAILED))


def sample(logits: torch.Tensor, temperature: float, top_p: float,
           generator: torch.Generator) -> int | None:
    """One row's token (``logits`` ``[vocab]``) by :func:`choose_tokens`; None when the row
    fails. Reads the device once: for one-off use, not the decode loop."""
    token = int(choose_tokens(logits[None], [RowSampling(temperature, top_p, generator)])[0])
    return None if token == FAILED else token


def _race(logits: torch.Tensor, rows: Sequence[RowSampling]
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(the drawn token, whether the row is sampled, whether its probabilities are a
    distribution), each ``[rows]``; greedy rows go through at temperature 1 and are ignored."""
    # Per row: temperature (0 marks a greedy row) and the top-p cut (inf: keep every token, so
    # that top_p = 1 drops nothing even where the running sum rounds past 1).
    params = _to_device(logits.device, [
        (r.temperature, r.top_p if r.top_p < 1.0 else math.inf) if r.generator is not None
        else (0.0, math.inf) for r in rows])
    temperature, cut = params[:, :1].to(logits.dtype), params[:, 1:]
    sampled = temperature[:, 0] > 0
    probs = torch.softmax(logits / torch.where(sampled[:, None], temperature, 1.0), dim=-1)
    if any(r.generator is not None and r.top_p < 1.0 for r in rows):
        probs = _nucleus(probs, cut)
    distribution = torch.isfinite(probs).all(dim=-1) & (probs.sum(dim=-1) > 0)
    noise = torch.ones_like(probs)
    for i, r in enumerate(rows):
        if r.generator is not None:
            # the row's own generator, a fixed vocab-sized draw per step: its stream never
            # depends on the other rows, their order or their number
            noise[i].exponential_(generator=r.generator)
    # A draw of exactly 0 would make p/0 = inf (or nan for p = 0): the smallest normal float
    # keeps every kept token's score positive and finite and every dropped token's at 0.
    noise.clamp_min_(torch.finfo(noise.dtype).tiny)
    return (probs / noise).argmax(dim=-1), sampled, distribution


def _nucleus(probs: torch.Tensor, cut: torch.Tensor) -> torch.Tensor:
    """``probs`` with each row's tail dropped: keep the smallest prefix of tokens sorted by
    probability whose mass reaches the row's ``cut`` ``[rows, 1]`` (always at least one)."""
    # stable: tied probabilities keep vocab order, so which one the cut keeps is fixed by the
    # row alone, not by the sort kernel the batch's shape selects
    sorted_probs, order = probs.sort(dim=-1, descending=True, stable=True)
    # the running mass in float64: a one-row batch may take another cumsum kernel (another
    # summation order) than a wider one, and float64 shrinks the rounding that could move the
    # cut past a token to far below anything a row's probabilities resolve
    before = sorted_probs.double().cumsum(dim=-1) - sorted_probs.double()
    drop_sorted = before >= cut
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return probs.masked_fill(drop, 0.0)


def _to_device(device: torch.device, values: list[tuple[float, float]]) -> torch.Tensor:
    """Small per-row parameters (float64, as the request gave them) on ``device`` without
    waiting on it: a plain host-to-CUDA copy synchronises the stream, a non-blocking copy from
    pinned memory does not."""
    host = torch.tensor(values, dtype=torch.float64, pin_memory=device.type == "cuda")
    return host.reshape(len(values), 2).to(device, non_blocking=True)
