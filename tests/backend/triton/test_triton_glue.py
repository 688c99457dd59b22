"""The Triton glue's response sink and the front's forwarded errors, with a stand-in for
``pb_utils`` (unit level only: the evidence that serving works comes from the integration tests
against the real tritonserver)."""

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
from backend.triton.glue import _ResponseSink
from control.contracts.tickets import GENERIC_REFUSAL
from control.contracts.wire import ADAPTER_DIGEST, REQUEST_ID, TEXT_OUTPUT


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
    def parameters(self) -> str:
        return "{}"

    def inputs(self) -> list[Any]:
        return []


def _front_answer(engine_message: str) -> Any:
    """The front's response when the engine refused with ``engine_message``."""

    class Pb(FakePb):
        class InferenceRequest:
            def __init__(self, **_kw: Any) -> None:
                pass

            async def async_exec(self, decoupled: bool) -> list[_BlsResponse]:
                assert decoupled
                return [_BlsResponse(engine_message)]

    [response] = asyncio.run(Front(Pb).execute([_UnaryRequest()]))
    return response


@pytest.mark.parametrize(("message", "status"), [
    (GENERIC_REFUSAL, "invalid_arg"), (LIMITS_MESSAGE, "invalid_arg"),
    (PARAMETER_PREFIX + "temperature: must be finite, found nan", "invalid_arg"),
    (FAILURE_MESSAGE, "unavailable"), (BUSY_MESSAGE, "unavailable"),
    (INTERNAL_MESSAGE, "internal")])
def test_the_front_restores_the_engines_code_from_its_fixed_message(message: str,
                                                                     status: str) -> None:
    response = _front_answer(message)
    assert response.error.message == message
    # the very code the engine's own answer carried for that status
    sender = Sender()
    _sink(sender, stream=False).answer(Answer(ok=False, error=message, status=status))
    assert response.error.code == sender.sent[0][0].error.code == error_code(FakePb, status)


def test_the_front_turns_any_other_engine_error_into_the_generic_internal_one() -> None:
    # (no "not found" or "is not ready" in it: those mean the engine is still loading)
    response = _front_answer("Traceback: KeyError in /srv/store/sha256/ab12 of tenant globex")
    assert (response.error.message, response.error.code) == (INTERNAL_MESSAGE, E.INTERNAL)
