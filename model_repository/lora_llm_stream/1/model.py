"""Triton entry point for lora_llm_stream (decoupled): a thin shell around backend.triton.glue."""

import triton_python_backend_utils as pb_utils

from backend.triton.glue import TritonGlue
from control.app.serving_steps import RegistrySteps


class TritonPythonModel:
    def initialize(self, args):
        # The composition root: the registry's step log goes in here, so serving never imports it.
        self.glue = TritonGlue(pb_utils, args, steps=RegistrySteps)

    def execute(self, requests):
        self.glue.execute(requests)
        return None  # decoupled: responses leave through each request's response sender

    def finalize(self):
        self.glue.close()
