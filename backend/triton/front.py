"""The unary front model ``lora_llm``: forwards each request to the engine model over BLS.

Triton 2.51 answers HTTP ``/infer`` and unary gRPC ``infer`` only for models that are not
decoupled, while continuous batching and streaming need a decoupled model. So ``lora_llm`` (not
decoupled) forwards every request, with the ticket its parameters or forwarded header name, to
``lora_llm_stream`` (decoupled), the one model that holds the weights, verifies tickets and writes
the ledger. ``execute`` forwards a whole dynamic batch concurrently on the stub's event loop;
several front instances keep several batches in flight.

This module imports no torch: the front's stub stays small. It trusts nothing it forwards; the
engine checks everything, and writes every request's ledger row, except for a request it never
answered (its stub died under it): the front writes that row (``backend.triton.front_ledger``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from backend.serving.messages import INTERNAL_MESSAGE, from_engine, status_of
from backend.serving.ticket_param import forwarded_parameters
from backend.triton.errors import error_response
from backend.triton.front_ledger import FrontLedger
from control.contracts.wire import ENGINE_MODEL, OUTPUT_NAMES, STREAM

log = logging.getLogger("loraplane.backend.front")

# While the engine model is still loading, a forwarded request waits this long for it.
ENGINE_WAIT_S = 300.0
# Forwards in flight per front instance: one batch of the front's max_batch_size (config.pbtxt).
FORWARD_WORKERS = 32
_NOT_READY = ("is not ready", "unknown model", "not found")


class Front:
    """Forwards requests; one per front model instance.

    ``execute`` runs on the stub's own event loop (``async def execute``, the pattern of Triton's
    BLS examples) and forwards a batch concurrently. Each forward is a synchronous
    ``InferenceRequest.exec(decoupled=True)`` run on this instance's own worker threads, which is
    what ``async_exec`` does inside the stub, less its bug: before python_backend#439 (June
    2026) ``async_exec``'s callback held a reference to a local that was gone by the time it ran,
    a use-after-free that corrupted a front stub's heap under load once in this project's runs
    (``malloc(): unsorted double linked list corrupted``, then seconds of HTTP 500 answers). The
    bundled tritonserver 2.51 predates the fix. Only ``exec`` and the reading of its responses
    run on the worker threads; the answer is built on the event loop, and no thread here ever
    uses a response sender (an earlier version that answered through response senders from
    worker threads crashed the Python backend under a few thousand concurrent requests).
    """

    def __init__(self, pb_utils: Any, workers: int = FORWARD_WORKERS,
                 failures: FrontLedger | None = None) -> None:
        self.pb = pb_utils
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="forward")
        # Rows of requests the engine never answered (its stub died): written here, by the
        # model that survived, so that no request leaves the record (backend.triton.front_ledger)
        self.failures = failures or FrontLedger()

    async def execute(self, requests: list[Any]) -> list[Any]:
        """Forward a batch concurrently; one response per request, in order."""
        return list(await asyncio.gather(*(self._forward(r) for r in requests)))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def _forward(self, request: Any) -> Any:
        try:
            return await self._call_engine(request)
        except Exception as e:
            log.exception("forwarding to the engine model failed")
            return await self._unanswered(str(e))

    async def _unanswered(self, detail: str) -> Any:
        """The answer to a request the engine never answered, once its row is written."""
        await asyncio.get_running_loop().run_in_executor(
            self._pool, self.failures.record_failure, detail)
        return _error(self.pb, INTERNAL_MESSAGE)

    async def _call_engine(self, request: Any) -> Any:
        pb = self.pb
        # The one ticket parser (backend.serving.ticket_param): the engine sees the ticket the
        # client's parameters name, or the parser's refusal, never a guess between two.
        params = forwarded_parameters(request.parameters())
        inputs = [t for t in request.inputs() if t.name() != STREAM]  # unary: never stream
        loop = asyncio.get_running_loop()
        deadline = time.monotonic() + ENGINE_WAIT_S
        while True:
            bls = pb.InferenceRequest(model_name=ENGINE_MODEL, inputs=inputs,
                                      requested_output_names=list(OUTPUT_NAMES),
                                      parameters=params)
            last = None
            try:
                responses = await loop.run_in_executor(self._pool, _exec, bls)
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
                    if not from_engine(message):  # Triton's plumbing, not the engine
                        return await self._unanswered(message)
                    # BLS reports every error as INTERNAL: restore the status from the message.
                    return _error(pb, message)
                if r.output_tensors():
                    last = r
            if last == "retry":
                await asyncio.sleep(0.5)
                continue
            if last is None:
                return await self._unanswered("no answer from the engine model")
            return pb.InferenceResponse(output_tensors=[
                pb.Tensor(name, pb.get_output_tensor_by_name(last, name).as_numpy())
                for name in OUTPUT_NAMES
            ])


def _exec(bls: Any) -> list[Any]:
    """Run one BLS request to the decoupled engine and read every response it sends (on a worker
    thread: ``exec`` releases the GIL while it waits)."""
    return list(bls.exec(decoupled=True))


def _error(pb: Any, message: str) -> Any:
    status = status_of(message)
    # Only the engine's fixed messages pass through; anything else becomes the generic one.
    text = message if status != "internal" else INTERNAL_MESSAGE
    return error_response(pb, text, status)
