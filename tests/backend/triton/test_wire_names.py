"""The model repository declares the wire names of ``control.contracts.wire``, exactly.

config.pbtxt cannot import Python, so this parses both models' configurations with Triton's own
schema (``model_config.proto`` as ``tritonclient`` ships it) and compares them with the module.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from control.contracts import wire

REPOSITORY = Path(__file__).resolve().parents[3] / "model_repository"


def _config(model: str) -> mc.ModelConfig:
    text = (REPOSITORY / model / "config.pbtxt").read_text()
    return text_format.Parse(text, mc.ModelConfig())


def _datatype(code: int) -> str:
    # config.pbtxt spells a datatype TYPE_<name>; clients spell it <name>, and STRING as BYTES.
    name = mc.DataType.Name(code).removeprefix("TYPE_")
    return "BYTES" if name == "STRING" else name


def _declared(tensors: Iterable[Any]) -> list[wire.WireTensor]:
    # Outputs have no ``optional`` field: every answer carries all of them.
    return [wire.WireTensor(t.name, _datatype(t.data_type),
                            optional=bool(getattr(t, "optional", False))) for t in tensors]


@pytest.mark.parametrize("model", [wire.MODEL, wire.ENGINE_MODEL])
def test_each_model_declares_exactly_the_wire_inputs_and_outputs(model: str) -> None:
    config = _config(model)
    assert config.name == model
    assert _declared(config.input) == list(wire.INPUTS)
    assert _declared(config.output) == list(wire.OUTPUTS)
    # inputs of any length reach the model (which refuses all but one value, with a row)
    assert all(list(t.dims) == [-1] for t in config.input)
    assert all(list(t.dims) == [1] for t in config.output)


def test_the_engine_is_the_decoupled_model_and_the_front_is_not() -> None:
    assert wire.ENGINE_MODEL == wire.MODEL + wire.ENGINE_SUFFIX
    assert _config(wire.ENGINE_MODEL).model_transaction_policy.decoupled
    assert not _config(wire.MODEL).model_transaction_policy.decoupled


def test_the_repository_holds_no_other_model() -> None:
    models = {p.parent.name for p in REPOSITORY.glob("*/config.pbtxt")}
    assert models == {wire.MODEL, wire.ENGINE_MODEL}


def test_the_ticket_header_is_one_triton_forwards() -> None:
    assert re.fullmatch(wire.FORWARDED_HEADERS, wire.TICKET_HEADER)
