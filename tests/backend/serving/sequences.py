"""Sequences opened on an engine for one test and closed however it ends."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from backend.serving.engine import Engine, GenerationRequest, Sequence


@contextmanager
def opened(engine: Engine, *requests: GenerationRequest) -> Iterator[list[Sequence]]:
    """One open sequence per request (their slot pins held), closed on the way out."""
    seqs = [engine.open_sequence(r) for r in requests]
    try:
        yield seqs
    finally:
        for s in seqs:
            engine.close_sequence(s)
