"""Sequences opened on an engine for one test and closed however it ends."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from backend.serving.engine import DecodeBatch, Engine, GenerationRequest, Sequence


@contextmanager
def opened(engine: Engine, *requests: GenerationRequest) -> Iterator[list[Sequence]]:
    """One open sequence per request (their slot pins held), closed on the way out."""
    seqs = [engine.open_sequence(r) for r in requests]
    try:
        yield seqs
    finally:
        for s in seqs:
            engine.close_sequence(s)


def storages(ts: list[torch.Tensor]) -> list[int]:
    """Where each tensor's buffer is: equal lists mean nothing moved to a new buffer."""
    return [t.untyped_storage().data_ptr() for t in ts]


def decode_in_place(engine: Engine, batch: DecodeBatch, steps: int, what: str) -> list[int]:
    """Run ``steps`` decode steps on ``batch``, asserting that none moves its KV to new buffers
    (``what`` names the steps in the message); the buffers' places."""
    buffers = storages(batch.kv_tensors())
    for step in range(steps):
        engine.choose(batch)
        engine.advance(batch)
        assert storages(batch.kv_tensors()) == buffers, f"{what} {step} moved the KV"
    return buffers
