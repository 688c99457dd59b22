"""Test-only fault injection into the real engine. Never imported by production code.

:class:`FaultyEngine` is the real :class:`backend.serving.engine.Engine` with two faults a test can
provoke, either directly (``fail_steps``) or from a request's prompt, so the same faults reach the
engine through the real tritonserver in the chaos test's own model repository:

- a prompt holding :data:`POISON_ROW` gets non-finite logits for its row on every forward pass:
  a numerical failure that belongs to one row;
- a prompt holding :data:`FAIL_STEP` makes the first forward pass that includes its row raise: a
  decode-step failure that no row can be blamed for;
- a prompt holding :data:`FAIL_DECODE` does the same at the first pass after its prefill (its
  first decode step, in the same scheduler turn as its admission).
"""

from __future__ import annotations

import threading
from typing import Any, TypeVar

import torch

from backend.serving.engine import Engine
from backend.serving.engine import Sequence as EngineSequence
from control.contracts.config import Settings
from control.contracts.db import make_engine
from control.contracts.store import ArtifactStore
from projections.routing import RoutingView

E = TypeVar("E", bound=Engine)

POISON_ROW = "\u2620nan"
FAIL_STEP = "\u2620step"
FAIL_DECODE = "\u2620decode"


FIRED = "_injected_step_failure_fired"


class InjectedFault(RuntimeError):
    """An exception the test put there."""


class FaultyEngine(Engine):
    """The real engine, plus injected faults (see the module notes)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fail_steps = 0  # the next n forward passes raise
        self._fault_lock = threading.Lock()
        self.injected = 0

    def _forward(self, seqs: list[EngineSequence], *args: Any, **kwargs: Any) -> torch.Tensor:
        with self._fault_lock:
            # Marked on the sequence itself: ids of dead sequences are reused, so a set of ids
            # would let a later FAIL_STEP row through now and then.
            marked = [s for s in seqs if not getattr(s, FIRED, False) and (
                FAIL_STEP in s.request.prompt
                or (FAIL_DECODE in s.request.prompt and s.produced))]
            if self.fail_steps > 0 or marked:
                self.fail_steps = max(0, self.fail_steps - 1)
                for s in marked:
                    setattr(s, FIRED, True)
                self.injected += 1
                raise InjectedFault("injected decode-step failure")
        logits = super()._forward(seqs, *args, **kwargs)
        poisoned = [i for i, s in enumerate(seqs) if POISON_ROW in s.request.prompt]
        if poisoned:
            logits = logits.clone()
            logits[poisoned] = float("nan")
        return logits


class EndlessEngine(Engine):
    """The real engine, except that no row stops at eos: every request runs to its
    ``max_tokens``, so a stream is still running when a test revokes its adapter (the kit's
    adapters answer in a dozen tokens)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._eos_ids = frozenset()


def engine_for_host(kind: type[E], settings: Settings, base: str, **kw: Any) -> E:
    """An engine of ``kind`` over the registered base ``base`` and its tokenizer, read from the
    artifact store as a Triton host reads them (the test glues' engines)."""
    store = ArtifactStore(settings.store_dir)
    routing = RoutingView(make_engine(settings.db_url))
    tokenizer = next(b.tokenizer_digest for b in routing.bases() if b.digest == base)
    return kind(store.verify(base), store.verify(tokenizer), max_rank=settings.max_rank, **kw)
