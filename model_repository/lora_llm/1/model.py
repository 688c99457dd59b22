"""Triton entry point for lora_llm: a thin shell around backend.triton_glue."""

import triton_python_backend_utils as pb_utils

from backend.triton_glue import TritonGlue


class TritonPythonModel:
    def initialize(self, args):
        self.glue = TritonGlue(pb_utils, args)

    def execute(self, requests):
        return self.glue.execute(requests)

    def finalize(self):
        self.glue.close()
