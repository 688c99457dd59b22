"""Converts between Triton's Python-backend objects and :mod:`backend.service`.

``pb_utils`` is passed in rather than imported, so unit tests can hand in a stand-in; the evidence
that serving works comes from the integration tests against the real ``tritonserver``.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import numpy as np

from backend.service import Answer, IncomingRequest, LoraService
from control.config import Settings

log = logging.getLogger("loraplane.backend")

BASE_DIGEST_ENV = "LORAPLANE_BASE_DIGEST"


def _scalar(pb_utils: Any, request: Any, name: str) -> Any:
    t = pb_utils.get_input_tensor_by_name(request, name)
    if t is None:
        return None
    arr = t.as_numpy().reshape(-1)
    if arr.size != 1:
        raise ValueError(f"input {name} must hold exactly one value")
    return arr[0].item() if hasattr(arr[0], "item") else arr[0]


class TritonGlue:
    """Owns the service for one model instance."""

    def __init__(self, pb_utils: Any, args: dict[str, Any] | None = None) -> None:
        self.pb = pb_utils
        logging.basicConfig(level=os.environ.get("LORAPLANE_LOG_LEVEL", "INFO"))
        base = os.environ.get(BASE_DIGEST_ENV)
        if not base:
            raise RuntimeError(f"{BASE_DIGEST_ENV} is not set: which base model should I serve?")
        self.service = LoraService(Settings.from_env(), base)

    def _incoming(self, request: Any) -> IncomingRequest:
        pb = self.pb
        text = _scalar(pb, request, "text_input")
        try:
            return IncomingRequest(
                text=text,
                parameters=request.parameters(),
                max_tokens=_scalar(pb, request, "max_tokens"),
                temperature=_scalar(pb, request, "temperature"),
                top_p=_scalar(pb, request, "top_p"),
                seed=_scalar(pb, request, "seed"),
            )
        except ValueError:
            # A malformed optional input: the service refuses an empty prompt type generically.
            return IncomingRequest(text=None, parameters=request.parameters())

    def _response(self, a: Answer) -> Any:
        pb = self.pb
        if not a.ok:
            code = {
                "invalid_arg": pb.TritonError.INVALID_ARG,
                "unavailable": pb.TritonError.UNAVAILABLE,
            }.get(a.status, pb.TritonError.INTERNAL)
            return pb.InferenceResponse(error=pb.TritonError(a.error, code))

        def out(name: str, value: str) -> Any:
            return pb.Tensor(name, np.array([[value.encode("utf-8")]], dtype=np.object_))

        return pb.InferenceResponse(
            output_tensors=[
                out("text_output", a.text),
                out("request_id", a.request_id),
                out("adapter_digest", a.adapter_digest),
            ]
        )

    def execute(self, requests: list[Any]) -> list[Any]:
        incoming = [self._incoming(r) for r in requests]
        return [self._response(a) for a in self.service.handle(incoming)]

    def close(self) -> None:
        log.info("lora_llm instance finalised")
