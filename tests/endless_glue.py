"""Test-only Triton glue whose engine never stops a row at eos (tests.faults.EndlessEngine), for
the kill-switch test's own model repository (never the one ``serve`` runs): the kit's adapters
answer in a dozen tokens, too few for a stream to be running when a test revokes its adapter.
Everything else is production code: the glue, the service, its governance and its ledger.
"""

from __future__ import annotations

from typing import Any

from backend.serving.service import LoraService
from backend.triton.glue import TritonGlue
from control.contracts.config import Settings
from tests.faults import EndlessEngine, engine_for_host

MODEL_SOURCE = '''"""Kill-switch test engine model: production glue, an engine that ignores eos."""

import triton_python_backend_utils as pb_utils

from control.app.serving_steps import RegistrySteps
from tests.endless_glue import EndlessGlue


class TritonPythonModel:
    def initialize(self, args):
        self.glue = EndlessGlue(pb_utils, args, steps=RegistrySteps)

    def execute(self, requests):
        self.glue.execute(requests)
        return None

    def finalize(self):
        self.glue.close()
'''


class EndlessGlue(TritonGlue):
    def make_service(self, settings: Settings, base: str, **kw: Any) -> LoraService:
        return LoraService(settings, base,
                           engine=engine_for_host(EndlessEngine, settings, base), **kw)
