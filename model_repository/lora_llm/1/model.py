"""Triton entry point for lora_llm (unary): forwards to lora_llm_stream, see backend.front."""

import triton_python_backend_utils as pb_utils

from backend.front import Front


class TritonPythonModel:
    def initialize(self, args):
        self.front = Front(pb_utils)

    def execute(self, requests):
        self.front.execute(requests)
        return None  # answered through each request's response sender

    def finalize(self):
        self.front.pool.shutdown(wait=False)
