"""The unary front model ``lora_llm``: forwards each request to the engine model over BLS.

Triton 2.51 answers HTTP ``/infer`` and unary gRPC ``infer`` only for models that are not
decoupled, while continuous batching and streaming need a decoupled model. So ``lora_llm`` (not
decoupled) forwards every request, parameters and forwarded headers included, to
``lora_llm_stream`` (decoupled), the one model that holds the weights, verifies tickets and writes
the ledger. ``execute`` forwards a whole dynamic batch concurrently on the stub's event loop;
several front instances keep several batches in flight.

This module imports no torch: the front's stub stays small. It trusts nothing it forwards; the
engine checks everything.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

from backend.serving.messages import INTERNAL_MESSAGE, status_of
from backend.triton.errors import error_response
from control.contracts.wire import ENGINE_MODEL, OUTPUT_NAMES, STREAM

log = logging.getLogger("loraplane.backend.front")

# While the engine model is still loading, a forwarded request waits this long for it.
ENGINE_WAIT_S = 300.0
_NOT_READY = ("is not ready", "unknown model", "not found")


class Front:
    """Forwards requests; one per front model instance.

    Everything runs on the stub's own event loop (``async def execute`` with ``async_exec``, the
    pattern of Triton's BLS examples). An earlier version forwarded from a pool of worker threads
    and answered through response senders; under a few thousand concurrent requests that crashed
    the Python backend (a shared-memory lock exception in tritonserver), so no thread here ever
    touches a Triton object.
    """

    def __init__(self, pb_utils: Any) -> None:
        self.pb = pb_utils

    async def execute(self, requests: list[Any]) -> list[Any]:
        """Forward a batch concurrently; one response per request, in order."""
        return list(await asyncio.gather(*(self._forward(r) for r in requests)))

    async def _forward(self, request: Any) -> Any:
        try:
            return await self._call_engine(request)
        except Exception:
            log.exception("forwarding to the engine model failed")
            return _error(self.pb, INTERNAL_MESSAGE)

    async def _call_engine(self, request: Any) -> Any:
        pb = self.pb
        raw = request.parameters() or "{}"
        params = json.loads(raw) if isinstance(raw, str) else dict(raw)
        inputs = [t for t in request.inputs() if t.name() != STREAM]  # unary: never stream
        deadline = time.monotonic() + ENGINE_WAIT_S
        while True:
            bls = pb.InferenceRequest(model_name=ENGINE_MODEL, inputs=inputs,
                                      requested_output_names=list(OUTPUT_NAMES),
                                      parameters=params)
            last = None
            try:
                responses = await bls.async_exec(decoupled=True)
            except Exception as e:  # the engine model is still loading
                if (any(s in str(e).lower() for s in _NOT_READY)
                        and time.monotonic() < deadline):
                    await asyncio.sleep(0.5)
                    continue
                raise
            for r in responses:
                if r.has_error():
                    message = r.error().message()
                    if (any(s in message.lower() for s in _NOT_READY)
                            and time.monotonic() < deadline):
                        last = "retry"
                        break
                    # BLS reports every error as INTERNAL: restore the status from the message.
                    return _error(pb, message)
                if r.output_tensors():
                    last = r
            if last == "retry":
                await asyncio.sleep(0.5)
                continue
            if last is None:
                return _error(pb, INTERNAL_MESSAGE)
            return pb.InferenceResponse(output_tensors=[
                pb.Tensor(name, pb.get_output_tensor_by_name(last, name).as_numpy())
                for name in OUTPUT_NAMES
            ])


def _error(pb: Any, message: str) -> Any:
    status = status_of(message)
    # Only the engine's fixed messages pass through; anything else becomes the generic one.
    text = message if status != "internal" else INTERNAL_MESSAGE
    return error_response(pb, text, status)
