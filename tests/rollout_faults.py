"""Test-only identity mismatches through the real tritonserver, for the rollout tests. Never
imported by production code.

:class:`SwappingEngine` is the real engine, except that a row whose prompt holds :data:`SWAP`
is reported as one whose slot no longer holds the load it was admitted on: what the engine sees
when a slot is emptied and refilled under a running request. The production scheduler then
fails that row closed as ``identity_mismatch`` (reason ``stale_slot``), writes its ledger row
and answers the client with an error, exactly as for a real swap: only the cause is injected.
The rollout test's client puts the marker into its prompts when its ticket names the canary,
so every request the target serves mismatches and the baseline's do not.

The engine model of the test's own model repository (``MODEL_SOURCE``, built with
``control.ops.model_repositories.derived_repository``) serves through :class:`SwappingGlue`:
the production glue and service with this engine in place of the real one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from backend.serving.engine import Engine
from backend.serving.engine import Sequence as EngineSequence
from backend.serving.memory import AdapterBudget
from backend.serving.service import LoraService
from backend.triton.glue import TritonGlue
from control.contracts.config import Settings
from control.contracts.db import make_engine
from control.contracts.store import ArtifactStore
from projections.routing import RoutingView

SWAP = "\u2620swap"

MODEL_SOURCE = '''"""Rollout test engine model: production glue, an engine swapping marked rows."""

import triton_python_backend_utils as pb_utils

from control.app.serving_steps import RegistrySteps
from tests.rollout_faults import SwappingGlue


class TritonPythonModel:
    def initialize(self, args):
        self.glue = SwappingGlue(pb_utils, args, steps=RegistrySteps)

    def execute(self, requests):
        self.glue.execute(requests)
        return None

    def finalize(self):
        self.glue.close()
'''


class SwappingEngine(Engine):
    """The real engine; rows whose prompt holds :data:`SWAP` read as stale (see the notes)."""

    def stale_rows(self, seqs: Sequence[EngineSequence]) -> list[int]:
        stale = set(super().stale_rows(seqs))
        stale.update(i for i, s in enumerate(seqs) if SWAP in s.request.prompt)
        return sorted(stale)


class SwappingGlue(TritonGlue):
    def make_service(self, settings: Settings, base: str, **kw: Any) -> LoraService:
        store = ArtifactStore(settings.store_dir)
        routing = RoutingView(make_engine(settings.db_url))
        tokenizer = next(b.tokenizer_digest for b in routing.bases() if b.digest == base)
        engine = SwappingEngine(store.verify(base), store.verify(tokenizer),
                                max_rank=settings.max_rank,
                                budget=AdapterBudget.from_settings(settings))
        return LoraService(settings, base, engine=engine, **kw)
