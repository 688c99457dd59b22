"""The Triton glue, with a stand-in for ``pb_utils``: the engine model's requests reaching the
service, its response sink, and the front's forwarded errors (unit level only: the evidence that
serving works comes from the integration tests against the real tritonserver)."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

from backend.serving.messages import (
    BUSY_MESSAGE,
    FAILURE_MESSAGE,
    INTERNAL_MESSAGE,
    LIMITS_MESSAGE,
    PARAMETER_PREFIX,
)
from backend.serving.service import Answer, IncomingRequest
from backend.triton.errors import error_code
from backend.triton.front import Front
from backend.triton.glue import TritonGlue, _ResponseSink
from backend.triton.metrics import Telemetry
from control.contracts.config import BASE_DIGEST_ENV, HOST_ID_ENV
from control.contracts.tickets import GENERIC_REFUSAL
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


class FakePb:
    TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1

    class TritonError:
        INVALID_ARG, UNAVAILABLE, INTERNAL, CANCELLED = 1, 2, 3, 4

        def __init__(self, message: str, code: int) -> None:
            self.message, self.code = message, code

    class Tensor:
        def __init__(self, name: str, value: np.ndarray) -> None:
            self.name, self.value = name, value

    class InferenceResponse:
        def __init__(self, output_tensors: list[Any] | None = None,
                     error: Any = None) -> None:
            self.outputs = {t.name: t.value.reshape(-1)[0].decode() for t in
                            output_tensors or []}
            self.error = error


class Sender:
    def __init__(self, fail: bool = False) -> None:
        self.sent: list[tuple[Any, int]] = []
        self.fail = fail

    def send(self, response: Any = None, flags: int = 0) -> None:
        if self.fail:
            raise RuntimeError("stream closed")
        self.sent.append((response, flags))


class Request:
    def __init__(self, sender: Sender) -> None:
        self.sender = sender

    def get_response_sender(self) -> Sender:
        return self.sender

    def is_cancelled(self) -> bool:
        return False


class OldPb(FakePb):
    """A stub whose TritonError has no CANCELLED code."""

    class TritonError:
        INVALID_ARG, UNAVAILABLE, INTERNAL = 1, 2, 3

        def __init__(self, message: str, code: int) -> None:
            self.message, self.code = message, code


class Glue:
    pb: type = FakePb

    class telemetry:
        @staticmethod
        def batch_done(*_a: Any) -> None:
            pass


def _sink(sender: Sender, stream: bool, pb: type = FakePb) -> _ResponseSink:
    glue = Glue()
    glue.pb = pb
    return _ResponseSink(glue, Request(sender), IncomingRequest(b"hi", None,  # type: ignore[arg-type]
                                                                stream=stream))


def test_an_empty_ok_stream_still_names_its_request() -> None:
    sender = Sender()
    _sink(sender, stream=True).answer(Answer(ok=True, request_id="r1", adapter_digest="d"))
    [(response, flags)] = sender.sent
    assert flags == FakePb.TRITONSERVER_RESPONSE_COMPLETE_FINAL
    assert response.outputs == {TEXT_OUTPUT: "", REQUEST_ID: "r1", ADAPTER_DIGEST: "d"}


def test_a_stream_with_pieces_ends_with_a_bare_final_flag() -> None:
    sender = Sender()
    sink = _sink(sender, stream=True)
    sink.piece("he", "r1", "d")
    sink.answer(Answer(ok=True, request_id="r1", adapter_digest="d"))
    assert [f for _r, f in sender.sent] == [0, FakePb.TRITONSERVER_RESPONSE_COMPLETE_FINAL]
    assert sender.sent[-1][0] is None


@pytest.mark.parametrize("stream", [True, False])
def test_a_failed_send_marks_the_client_gone_instead_of_raising(stream: bool) -> None:
    sink = _sink(Sender(fail=True), stream=stream)
    assert not sink.cancelled()
    sink.piece("he", "r1", "d")  # must not raise into the decode loop
    assert sink.cancelled()


# -- errors: one status-to-code mapping for the engine and the front ---------------------------

E = FakePb.TritonError
STATUS_CODES = [("invalid_arg", E.INVALID_ARG), ("unavailable", E.UNAVAILABLE),
                ("cancelled", E.CANCELLED), ("internal", E.INTERNAL), ("", E.INTERNAL),
                ("no_such_status", E.INTERNAL)]


@pytest.mark.parametrize(("status", "code"), STATUS_CODES)
def test_the_engine_answers_each_status_with_its_triton_code(status: str, code: int) -> None:
    sender = Sender()
    _sink(sender, stream=False).answer(Answer(ok=False, request_id="r1", error="refused",
                                              status=status))
    [(response, flags)] = sender.sent
    assert flags == FakePb.TRITONSERVER_RESPONSE_COMPLETE_FINAL
    assert (response.error.message, response.error.code) == ("refused", code)
    assert error_code(FakePb, status) == code


def test_a_stub_without_cancelled_answers_a_cancelled_request_unavailable() -> None:
    sender = Sender()
    _sink(sender, stream=True, pb=OldPb).answer(Answer(ok=False, request_id="r1",
                                                       error="cancelled", status="cancelled"))
    [(response, _flags)] = sender.sent
    assert response.error.code == OldPb.TritonError.UNAVAILABLE
    assert error_code(OldPb, "invalid_arg") == OldPb.TritonError.INVALID_ARG


class _BlsError:
    def __init__(self, message: str) -> None:
        self._message = message

    def message(self) -> str:
        return self._message


class _BlsResponse:
    """The engine's answer as BLS hands it to the front: an error, whose code is INTERNAL."""

    def __init__(self, message: str) -> None:
        self._error = _BlsError(message)

    def has_error(self) -> bool:
        return True

    def error(self) -> _BlsError:
        return self._error

    def output_tensors(self) -> list[Any]:
        return []


class _UnaryRequest:
    def __init__(self, parameters: str = "{}") -> None:
        self._parameters = parameters

    def parameters(self) -> str:
        return self._parameters

    def inputs(self) -> list[Any]:
        return []


def _front_answer(engine_message: str, parameters: str = "{}") -> tuple[Any, list[Any]]:
    """The front's response when the engine refused with ``engine_message``, and the parameters
    of every BLS request the front sent."""
    sent: list[Any] = []

    class Pb(FakePb):
        class InferenceRequest:
            def __init__(self, **kw: Any) -> None:
                sent.append(kw["parameters"])

            def exec(self, decoupled: bool) -> list[_BlsResponse]:
                assert decoupled
                return [_BlsResponse(engine_message)]

            async def async_exec(self, decoupled: bool) -> list[_BlsResponse]:
                # python_backend#439: its callback's use-after-free; the front must not use it
                raise AssertionError("the front forwards with exec on its own threads")

    front = Front(Pb, failures=_failures)  # type: ignore[arg-type]
    try:
        [response] = asyncio.run(front.execute([_UnaryRequest(parameters)]))
    finally:
        front.close()
    return response, sent


class _RecordedFailures:
    """Stands in for the front's ledger of requests the engine never answered."""

    def __init__(self) -> None:
        self.details: list[str] = []

    def record_failure(self, detail: str) -> str:
        self.details.append(detail)
        return "r-front"


_failures = _RecordedFailures()


@pytest.mark.parametrize(("message", "status"), [
    (GENERIC_REFUSAL, "invalid_arg"), (LIMITS_MESSAGE, "invalid_arg"),
    (PARAMETER_PREFIX + "temperature: must be finite, found nan", "invalid_arg"),
    (FAILURE_MESSAGE, "unavailable"), (BUSY_MESSAGE, "unavailable"),
    (INTERNAL_MESSAGE, "internal")])
def test_the_front_restores_the_engines_code_from_its_fixed_message(message: str,
                                                                     status: str) -> None:
    response, _ = _front_answer(message)
    assert response.error.message == message
    # the very code the engine's own answer carried for that status
    sender = Sender()
    _sink(sender, stream=False).answer(Answer(ok=False, error=message, status=status))
    assert response.error.code == sender.sent[0][0].error.code == error_code(FakePb, status)


def test_the_front_turns_any_other_engine_error_into_the_generic_internal_one() -> None:
    # (no "not found" or "is not ready" in it: those mean the engine is still loading)
    before = len(_failures.details)
    response, _ = _front_answer("Traceback: KeyError in /srv/store/sha256/ab12 of tenant globex")
    assert (response.error.message, response.error.code) == (INTERNAL_MESSAGE, E.INTERNAL)
    # not one of the engine's answers, so the engine wrote no row: the front records it
    assert len(_failures.details) == before + 1


def test_the_front_records_a_request_the_engine_stub_never_answered() -> None:
    before = len(_failures.details)
    response, _ = _front_answer("Stub process 'lora_llm_stream_0_0' is not healthy.")
    assert (response.error.message, response.error.code) == (INTERNAL_MESSAGE, E.INTERNAL)
    assert _failures.details[before:] == ["Stub process 'lora_llm_stream_0_0' is not healthy."]
    # an answer of the engine's own (it wrote the row) is not recorded again
    _front_answer(INTERNAL_MESSAGE)
    _front_answer(BUSY_MESSAGE)
    assert len(_failures.details) == before + 1


@pytest.mark.parametrize(("parameters", "forwarded"), [
    ('{"lora_ticket": "T", "traceparent": "tp", "other": 1.5}',
     {"lora_ticket": "T", "traceparent": "tp"}),
    ('{"lora_ticket": "T", "x-lora-ticket": "T"}', {"lora_ticket": "T"}),
    ('{"x-lora-ticket": "T"}', {"lora_ticket": "T"}),
    # what a generate body with two lora_ticket keys arrives as: refused, never the first one
    ('{"lora_ticket": "T", "lora_ticket": "U"}', {"lora_front_refusal": "parameters"}),
    ('{"lora_ticket": "T", "x-lora-ticket": "U"}', {"lora_front_refusal": "ambiguous"}),
    ('{"lora_ticket": 7}', {"lora_front_refusal": "encoding"}),
    ("{}", {"lora_front_refusal": "missing"}),
    ("not json", {"lora_front_refusal": "parameters"}),
    ('{"lora_front_refusal": "missing", "lora_ticket": "T"}',
     {"lora_front_refusal": "missing"}),
])
def test_the_front_forwards_what_the_one_ticket_parser_found(parameters: str,
                                                              forwarded: dict[str, Any]) -> None:
    _response, sent = _front_answer(GENERIC_REFUSAL, parameters)
    assert sent == [forwarded]


# -- the engine model's glue: requests in, the service's submissions out ---------------------


class Input:
    def __init__(self, value: np.ndarray) -> None:
        self.value = value

    def as_numpy(self) -> np.ndarray:
        return self.value


class PbWithInputs(FakePb):
    @staticmethod
    def get_input_tensor_by_name(request: InferRequest, name: str) -> Input | None:
        value = request.inputs.get(name)
        return None if value is None else Input(value)


class InferRequest(Request):
    """A Triton request as the stub sees it: input tensors by name and a parameters string."""

    def __init__(self, inputs: dict[str, np.ndarray], parameters: str = "{}") -> None:
        super().__init__(Sender())
        self.inputs = inputs
        self._parameters = parameters

    def parameters(self) -> str:
        return self._parameters


class RecordingService:
    def __init__(self, settings: Any, base: str, **kw: Any) -> None:
        self.base, self.kw = base, kw
        self.submitted: list[tuple[IncomingRequest, Any]] = []
        self.closed = False

    def submit(self, incoming: IncomingRequest, sink: Any) -> None:
        self.submitted.append((incoming, sink))

    def close(self) -> None:
        self.closed = True


class RecordingGlue(TritonGlue):
    def make_service(self, settings: Any, base: str, **kw: Any) -> Any:
        return RecordingService(settings, base, **kw)


class NoTelemetry:
    def batch_done(self, *_a: Any) -> None:
        pass

    def close(self) -> None:
        pass


def steps(_settings: Any) -> Any:
    raise AssertionError("the glue only hands the steps on; the service opens them")


@pytest.fixture
def glue(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> RecordingGlue:
    monkeypatch.setenv("LORAPLANE_HOME", str(tmp_path))
    monkeypatch.setenv(BASE_DIGEST_ENV, "sha256:" + "b" * 64)
    monkeypatch.setenv(HOST_ID_ENV, "host-7")
    monkeypatch.setattr(Telemetry, "for_service", classmethod(lambda cls, pb, s: NoTelemetry()))
    return RecordingGlue(PbWithInputs, steps=steps)


def test_the_glue_serves_the_base_its_host_was_started_for(glue: RecordingGlue) -> None:
    service = glue.service
    assert isinstance(service, RecordingService)
    assert service.base == "sha256:" + "b" * 64
    assert service.kw["host"] == "host-7" and service.kw["steps"] is steps


def test_a_glue_without_a_base_digest_refuses_to_start(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(BASE_DIGEST_ENV, raising=False)
    with pytest.raises(RuntimeError, match=BASE_DIGEST_ENV):
        RecordingGlue(PbWithInputs, steps=steps)


def test_every_request_reaches_the_service_with_its_inputs_and_parameters(
        glue: RecordingGlue) -> None:
    full = InferRequest({
        TEXT_INPUT: np.array([b"Hello"], dtype=object), MAX_TOKENS: np.array([7], np.int32),
        TEMPERATURE: np.array([0.5], np.float32), TOP_P: np.array([0.9], np.float32),
        SEED: np.array([42], np.int64), STREAM: np.array([True])},
        parameters='{"lora_ticket": "T"}')
    bare = InferRequest({TEXT_INPUT: np.array([b"Hi"], dtype=object)})
    glue.execute([full, bare])
    service = glue.service
    assert isinstance(service, RecordingService)
    (first, first_sink), (second, _) = service.submitted
    assert (first.text, first.parameters, first.max_tokens, first.seed, first.stream) == (
        b"Hello", '{"lora_ticket": "T"}', 7, 42, True)
    assert first.temperature == pytest.approx(0.5) and first.top_p == pytest.approx(0.9)
    assert (second.text, second.max_tokens, second.temperature, second.stream) == (
        b"Hi", None, None, False)
    # Each answer goes back through the sender of the request it belongs to.
    first_sink.answer(Answer(ok=True, text="x", request_id="r1"))
    assert [r.outputs[REQUEST_ID] for r, _ in full.sender.sent] == ["r1"]
    assert bare.sender.sent == []


@pytest.mark.parametrize("name", [TEXT_INPUT, MAX_TOKENS, TEMPERATURE, SEED, STREAM])
def test_an_input_holding_more_than_one_value_reaches_the_service_as_a_problem(
        glue: RecordingGlue, name: str) -> None:
    inputs = {TEXT_INPUT: np.array([b"Hello"], dtype=object), MAX_TOKENS: np.array([4], np.int32),
              TEMPERATURE: np.array([0.5], np.float32), SEED: np.array([1], np.int64),
              STREAM: np.array([True])}
    inputs[name] = np.concatenate([inputs[name], inputs[name]])  # a batch of two in one request
    glue.execute([InferRequest(inputs, parameters="{}"),
                  InferRequest({TEXT_INPUT: np.array([b"Hi"], dtype=object)})])
    service = glue.service
    assert isinstance(service, RecordingService)
    # Both requests reach the service (before, the first raised out of execute() and neither
    # got a ledger row); the malformed one carries its problem, which the service refuses.
    (incoming, _), (other, _) = service.submitted
    assert incoming.problem is not None
    assert (incoming.problem.name, incoming.problem.reason) == (name, "input_shape")
    assert str(incoming.problem).startswith("invalid input " + name)
    assert incoming.stream is (name != STREAM)  # a malformed stream input never streams
    assert other.problem is None and other.text == b"Hi"


def test_closing_the_glue_closes_its_service(glue: RecordingGlue) -> None:
    glue.close()
    service = glue.service
    assert isinstance(service, RecordingService) and service.closed
