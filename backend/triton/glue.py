"""Converts between Triton's Python-backend objects and :mod:`backend.serving.service`.

The engine model (``lora_llm_stream``, decoupled) hands every request to the service and returns
at once; answers and streamed tokens go back later through each request's response sender, from
the service's threads. See ``model_repository/README.md`` for why there are two models.

``pb_utils`` is passed in rather than imported, so unit tests can hand in a stand-in; the evidence
that serving works comes from the integration tests against the real ``tritonserver``.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from backend.serving.host_report import HostReporter
from backend.serving.messages import InvalidInput
from backend.serving.service import (
    PREFIX_CACHE_BYTES,
    Answer,
    IncomingRequest,
    LoraService,
    RevocationSteps,
)
from backend.triton.errors import error_response
from backend.triton.metrics import Telemetry
from control.contracts.config import BASE_DIGEST_ENV, HOST_ID_ENV, Settings
from control.contracts.wire import (
    ADAPTER_DIGEST,
    MAX_TOKENS,
    REQUEST_ID,
    SEED,
    STREAM,
    TEMPERATURE,
    TEXT_INPUT,
    TEXT_OUTPUT,
    TOP_P,
)

log = logging.getLogger("loraplane.backend")

PREFIX_CACHE_ENV = "LORAPLANE_PREFIX_CACHE_BYTES"  # 0 turns the prompt cache off


def _scalar(pb_utils: Any, request: Any, name: str) -> Any:
    """The one value of input ``name`` (None when the request leaves it out); InvalidInput when
    the tensor holds more or fewer than one value (a client's own batch of prompts: the ledger
    keeps one row per request, so a request carries one prompt)."""
    t = pb_utils.get_input_tensor_by_name(request, name)
    if t is None:
        return None
    arr = t.as_numpy().reshape(-1)
    if arr.size != 1:
        raise InvalidInput(name, f"must hold exactly one value, found {arr.size} (send one "
                                 "prompt per request)", "input_shape")
    return arr[0].item() if hasattr(arr[0], "item") else arr[0]


def outputs(pb: Any, text: str, request_id: str, adapter_digest: str) -> list[Any]:
    """The three output tensors of every answer and streamed piece."""

    def out(name: str, value: str) -> Any:
        return pb.Tensor(name, np.array([[value.encode("utf-8")]], dtype=np.object_))

    return [out(TEXT_OUTPUT, text), out(REQUEST_ID, request_id),
            out(ADAPTER_DIGEST, adapter_digest)]


class _ResponseSink:
    """One request's response sender, as the service's ``AnswerSink``."""

    def __init__(self, glue: TritonGlue, request: Any, incoming: IncomingRequest) -> None:
        self.glue = glue
        self.request = request
        self.incoming = incoming
        self.sender = request.get_response_sender()
        self.started = time.time_ns()
        self.gone = False  # a send failed: the client is gone, its request ends
        self.pieces_sent = 0

    def cancelled(self) -> bool:
        return self.gone or bool(self.request.is_cancelled())

    def piece(self, text: str, request_id: str, adapter_digest: str) -> None:
        pb = self.glue.pb
        try:
            self.sender.send(pb.InferenceResponse(output_tensors=outputs(pb, text, request_id,
                                                                         adapter_digest)))
            self.pieces_sent += 1
        except Exception:
            # Only this request ends (the scheduler sees cancelled() next step); raising would
            # reach the decode loop that serves every other row.
            log.info("a streamed piece could not be sent (client gone?)", exc_info=True)
            self.gone = True

    def answer(self, a: Answer) -> None:
        pb = self.glue.pb
        final = pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        try:
            if a.ok and self.incoming.stream and self.pieces_sent:
                self.sender.send(flags=final)  # every piece went already
            elif a.ok and self.incoming.stream:
                # Nothing was generated (eos first): the final response still carries the
                # request id and digest, so the client can find the request's ledger row.
                self.sender.send(pb.InferenceResponse(
                    output_tensors=outputs(pb, "", a.request_id, a.adapter_digest)),
                    flags=final)
            elif a.ok:
                self.sender.send(pb.InferenceResponse(
                    output_tensors=outputs(pb, a.text, a.request_id, a.adapter_digest)),
                    flags=final)
            else:
                self.sender.send(error_response(pb, a.error, a.status), flags=final)
        except Exception:
            log.warning("could not send a response (client gone?)", exc_info=True)
        self.glue.telemetry.batch_done([self.incoming], [a], self.started)


class TritonGlue:
    """Owns the service for one engine model instance (decoupled)."""

    def __init__(self, pb_utils: Any, args: dict[str, Any] | None = None, *,
                 steps: Callable[[Settings], RevocationSteps]) -> None:
        """``steps``: where this host records its revocation steps (the model's entry point
        passes ``control.app.serving_steps.RegistrySteps``; serving never imports it)."""
        self.pb = pb_utils
        logging.basicConfig(level=os.environ.get("LORAPLANE_LOG_LEVEL", "INFO"))
        base = os.environ.get(BASE_DIGEST_ENV)
        if not base:
            raise RuntimeError(f"{BASE_DIGEST_ENV} is not set: which base model should I serve?")
        settings = Settings.from_env()
        self.service = self.make_service(
            settings, base, host=os.environ.get(HOST_ID_ENV) or None,
            prefix_cache_bytes=int(os.environ.get(PREFIX_CACHE_ENV, PREFIX_CACHE_BYTES)),
            steps=steps)
        self.telemetry = Telemetry.for_service(pb_utils, self.service)
        # the host's slots, tiers and load queue, for the operator console (host_status)
        self.reporter = HostReporter.into(settings.db_url, self.service).start()

    def make_service(self, settings: Settings, base: str, **kw: Any) -> LoraService:
        """The service this instance serves through. Test and benchmark model repositories
        (never the one ``serve`` launches) subclass the glue to wrap it."""
        return LoraService(settings, base, **kw)

    def _incoming(self, request: Any) -> IncomingRequest:
        """The request as the service takes it. Never raises: whatever is malformed is carried
        as ``problem``, so the service refuses it with a ledger row like any other request."""
        pb = self.pb
        values: dict[str, Any] = {}
        problem: InvalidInput | None = None
        for name in (TEXT_INPUT, MAX_TOKENS, TEMPERATURE, TOP_P, SEED, STREAM):
            try:
                values[name] = _scalar(pb, request, name)
            except InvalidInput as e:
                problem = problem or e
                values[name] = None
            except Exception:  # an input Triton handed over that numpy cannot read
                log.warning("unreadable input %s", name, exc_info=True)
                problem = problem or InvalidInput(name, "could not be read", "input_unreadable")
                values[name] = None
        try:
            parameters = request.parameters()
        except Exception:
            log.warning("unreadable request parameters", exc_info=True)
            parameters = None
        stream = values[STREAM]
        return IncomingRequest(
            text=values[TEXT_INPUT],
            parameters=parameters,
            max_tokens=values[MAX_TOKENS],
            temperature=values[TEMPERATURE],
            top_p=values[TOP_P],
            seed=values[SEED],
            stream=stream is True,  # the BOOL input; anything else never starts a stream
            problem=problem,
        )

    def execute(self, requests: list[Any]) -> None:
        """Hand every request to the service; answers leave later through response senders."""
        for r in requests:
            incoming = self._incoming(r)  # never raises: a malformed input is refused, with a row
            self.service.submit(incoming, _ResponseSink(self, r, incoming))

    def close(self) -> None:
        self.reporter.close()
        self.service.close()
        self.telemetry.close()
        log.info("lora_llm engine instance finalised")
