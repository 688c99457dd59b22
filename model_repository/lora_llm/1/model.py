"""Triton entry point for lora_llm (unary): forwards to lora_llm_stream, see
backend.triton.front."""

import triton_python_backend_utils as pb_utils

from backend.triton.front import Front


class TritonPythonModel:
    def initialize(self, args):
        self.front = Front(pb_utils)

    async def execute(self, requests):
        return await self.front.execute(requests)

    def finalize(self):
        self.front.close()
