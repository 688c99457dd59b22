"""Test-only Triton glue for the chaos test's own model repository (never the one serve runs).

The engine model of that repository builds :class:`ChaosGlue`: the production glue and service,
with the engine replaced by :class:`tests.faults.FaultyEngine` (prompt-triggered poisoned rows and
decode-step failures), only :data:`SLOTS` device slots so that eviction never stops, and a load
rate high enough that loads are refused only for want of room.
"""

from __future__ import annotations

from typing import Any

from backend.serving.cache import CacheQuota
from backend.serving.service import LoraService
from backend.triton.glue import TritonGlue
from control.contracts.config import Settings
from tests.faults import FaultyEngine, engine_for_host

SLOTS = 4

MODEL_SOURCE = '''"""Chaos test engine model: the production glue over a fault-injecting engine."""

import triton_python_backend_utils as pb_utils

from control.app.serving_steps import RegistrySteps
from tests.chaos_glue import ChaosGlue


class TritonPythonModel:
    def initialize(self, args):
        self.glue = ChaosGlue(pb_utils, args, steps=RegistrySteps)

    def execute(self, requests):
        self.glue.execute(requests)
        return None

    def finalize(self):
        self.glue.close()
'''


class ChaosGlue(TritonGlue):
    def make_service(self, settings: Settings, base: str, **kw: Any) -> LoraService:
        engine = engine_for_host(FaultyEngine, settings, base, max_adapters=SLOTS)
        quota = CacheQuota(resident_share=1.0, loads_per_minute=60_000.0, load_burst=10_000)
        return LoraService(settings, base, engine=engine, quota=quota, **kw)
