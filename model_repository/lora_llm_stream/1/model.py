"""Triton entry point for lora_llm_stream (decoupled): a thin shell around backend.triton.glue."""

import triton_python_backend_utils as pb_utils

from backend.triton.glue import TritonGlue
from control.contracts.serving_reports import TableSteps


class TritonPythonModel:
    def initialize(self, args):
        # The composition root: the host reports its revocation steps into a table its database
        # role may insert into (never an event); the control plane folds them into events.
        self.glue = TritonGlue(pb_utils, args, steps=TableSteps)

    def execute(self, requests):
        self.glue.execute(requests)
        return None  # decoupled: responses leave through each request's response sender

    def finalize(self):
        self.glue.close()
