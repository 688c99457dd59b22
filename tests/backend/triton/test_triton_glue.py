"""The Triton glue's response sink, with a stand-in for ``pb_utils`` (unit level only: the
evidence that serving works comes from the integration tests against the real tritonserver)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from backend.serving.service import Answer, IncomingRequest
from backend.triton.glue import _ResponseSink


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


class Glue:
    pb = FakePb

    class telemetry:
        @staticmethod
        def batch_done(*_a: Any) -> None:
            pass


def _sink(sender: Sender, stream: bool) -> _ResponseSink:
    return _ResponseSink(Glue(), Request(sender), IncomingRequest(b"hi", None,  # type: ignore[arg-type]
                                                                  stream=stream))


def test_an_empty_ok_stream_still_names_its_request() -> None:
    sender = Sender()
    _sink(sender, stream=True).answer(Answer(ok=True, request_id="r1", adapter_digest="d"))
    [(response, flags)] = sender.sent
    assert flags == FakePb.TRITONSERVER_RESPONSE_COMPLETE_FINAL
    assert response.outputs == {"text_output": "", "request_id": "r1", "adapter_digest": "d"}


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
