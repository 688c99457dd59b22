"""Reading safetensors bytes as views (``backend.serving.safetensors_views``), checked against the
format's own library: every file it writes reads back as the same tensors without a copy, and
bytes it refuses (mutations of a valid file, files built to break one rule each) are refused here
too, with a message that names the rule and never echoes the file."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import SafetensorError
from safetensors.torch import load as reference_load
from safetensors.torch import save

from backend.serving.safetensors_views import SafetensorsFormatError, tensor_views

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int8,
          torch.uint8, torch.bool]

shapes = st.lists(st.integers(0, 5), min_size=0, max_size=3)


@st.composite
def tensor_dicts(draw: st.DrawFn) -> dict[str, torch.Tensor]:
    names = draw(st.lists(st.text("abcxyz._", min_size=1, max_size=8), min_size=0, max_size=6,
                          unique=True))
    out = {}
    for name in names:
        dtype = draw(st.sampled_from(DTYPES))
        shape = draw(shapes)
        out[name] = (torch.randint(0, 2, shape).to(dtype) if dtype == torch.bool
                     else (torch.randn(shape) * 10).to(dtype))
    return out


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and a[k].shape == b[k].shape
        and torch.equal(a[k].view(-1).view(torch.uint8) if a[k].numel() else a[k],
                        b[k].view(-1).view(torch.uint8) if b[k].numel() else b[k])
        for k in a)


@settings(max_examples=150, deadline=None)
@given(tensors=tensor_dicts(), metadata=st.none() | st.dictionaries(st.text(max_size=5),
                                                                    st.text(max_size=5)))
def test_what_the_library_writes_reads_back_the_same(tensors: dict[str, torch.Tensor],
                                                     metadata: dict[str, str] | None) -> None:
    if not tensors and metadata == {}:
        metadata = None  # safetensors 0.8 writes `{},"__metadata__":{}}` for this: not JSON
    data = save(tensors, metadata=metadata)
    assert _same(tensor_views(data), reference_load(data))


def test_the_tensors_are_views_of_the_bytes_not_copies() -> None:
    data = save({"a": torch.randn(64, 32), "b": torch.randn(32, 64).to(torch.bfloat16)})
    views = tensor_views(data)
    base = torch.frombuffer(data, dtype=torch.uint8).data_ptr()
    for t in views.values():
        assert base <= t.data_ptr() < base + len(data)
        assert t.untyped_storage().data_ptr() == base


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tensors=tensor_dicts(), data=st.data())
def test_a_mutated_file_is_refused_whenever_the_library_refuses_it(
        tensors: dict[str, torch.Tensor], data: st.DataObject) -> None:
    """Differential: flip, cut or extend a valid file's bytes; where the format's library
    refuses the result, so does the reader, and where it accepts, both read the same tensors.
    (The reader may refuse more: a duplicate name, a metadata value that is not a string.)"""
    raw = bytearray(save(tensors))
    how = data.draw(st.sampled_from(["flip", "cut", "extend", "header_len"]))
    if how == "flip" and raw:
        at = data.draw(st.integers(0, len(raw) - 1))
        raw[at] ^= data.draw(st.integers(1, 255))
    elif how == "cut":
        del raw[data.draw(st.integers(0, len(raw))):]
    elif how == "extend":
        raw += bytes(data.draw(st.integers(1, 16)))
    else:
        raw[:8] = struct.pack("<Q", data.draw(st.integers(0, 2**64 - 1)))
    mutated = bytes(raw)
    try:
        expected = reference_load(mutated)
    except (SafetensorError, ValueError, TypeError, RuntimeError, OverflowError):
        expected = None
    try:
        got = tensor_views(mutated)
    except SafetensorsFormatError:
        got = None
    if expected is None:
        assert got is None
    elif got is not None:
        assert _same(got, expected)


def _file(header: object, data: bytes = b"", raw_header: bytes | None = None) -> bytes:
    text = raw_header if raw_header is not None else json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + data


SECRET = "tenant-b-secret-adapter-name"


@pytest.mark.parametrize(("blob", "rule"), [
    (b"\x01\x00", "8-byte header length"),
    (struct.pack("<Q", 2**40) + b"{}", "header length"),
    (_file(None, raw_header=b'{"a": 1, "a": 2}'), "strict JSON"),
    (_file(None, raw_header=b"\xff\xfe"), "strict JSON"),
    (_file([1, 2]), "not a JSON object"),
    (_file({SECRET: {"dtype": "F32", "shape": [2]}}), "exactly dtype, shape and data_offsets"),
    (_file({SECRET: {"dtype": "Q99", "shape": [1], "data_offsets": [0, 4]}}, bytes(4)),
     "dtype this reader does not know"),
    (_file({SECRET: {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, bytes(4)),
     "non-negative integers"),
    (_file({SECRET: {"dtype": "F32", "shape": [True], "data_offsets": [0, 4]}}, bytes(4)),
     "non-negative integers"),
    (_file({SECRET: {"dtype": "F32", "shape": [1], "data_offsets": [4, 0]}}, bytes(4)),
     "begin <= end"),
    (_file({SECRET: {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, bytes(4)),
     "shape times"),
    (_file({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
            SECRET: {"dtype": "F32", "shape": [1], "data_offsets": [8, 12]}}, bytes(12)),
     "gap or overlap"),
    (_file({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
            SECRET: {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, bytes(8)),
     "gap or overlap"),
    (_file({SECRET: {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, bytes(8)),
     "does not end"),
    (_file({SECRET: {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, bytes(4)),
     "does not end"),
    (_file({"__metadata__": {"k": 1}}), "__metadata__"),
])
def test_each_broken_rule_is_named_and_nothing_of_the_file_is_echoed(blob: bytes,
                                                                      rule: str) -> None:
    with pytest.raises(SafetensorsFormatError) as err:
        tensor_views(blob)
    assert rule in str(err.value)
    assert SECRET not in str(err.value)


def test_a_tensor_not_aligned_to_its_dtype_is_copied_and_still_right() -> None:
    """A writer that does not pad its header leaves a float32 tensor at an odd offset: it
    cannot be a view of another dtype there, so it is copied."""
    values = torch.arange(6, dtype=torch.float32)
    header = json.dumps({"w": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]}})
    header += " " * ((8 - (8 + len(header)) % 8) % 8 + 1)  # one byte past alignment
    blob = _file(None, values.numpy().tobytes(), raw_header=header.encode())
    got = tensor_views(blob)["w"]
    assert torch.equal(got, values.view(2, 3))
