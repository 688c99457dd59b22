"""Triton entry point for lora_llm_stream (decoupled): a thin shell around backend.triton_glue."""

import triton_python_backend_utils as pb_utils

from backend.triton_glue import TritonGlue


class TritonPythonModel:
    def initialize(self, args):
        self.glue = TritonGlue(pb_utils, args)

    def execute(self, requests):
        self.glue.execute(requests)
        return None  # decoupled: responses leave through each request's response sender

    def finalize(self):
        self.glue.close()
