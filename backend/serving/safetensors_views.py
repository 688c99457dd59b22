"""A safetensors file held in memory, read as views of its own bytes.

A cold load reads the adapter's files into memory once, to check them against their digest
(``control.contracts.store.ArtifactStore.read_verified``). ``safetensors.torch.load`` then copied
every tensor into bytes of its own before wrapping it, one tensor at a time: a second copy of the
whole file in fresh memory, and a third of the loading's Python work (0.6 ms of 1.1 at the
bench's 64 tensors; fresh pages are what a cold load spends most on on a host whose page faults
are slow). Here the header is parsed and checked, and each tensor is a view of the verified
bytes: nothing is copied until ``backend.serving.adapter_files.prepared`` converts the weights to
the slots' layout.

The checks are the format's own (https://github.com/huggingface/safetensors, "Format"): an 8-byte
little-endian header length no larger than 100 MB, then a JSON object of
``name -> {dtype, shape, data_offsets}`` and an optional ``__metadata__`` of strings, parsed
strictly (no duplicate names: two parsers could disagree on which one wins); every dtype known,
every shape a list of non-negative integers, each tensor's byte length its shape's product times
its dtype's size, and the tensors' byte ranges, in order, tiling the data that follows the header
with no gap, overlap or trailing byte. Anything else is :class:`SafetensorsFormatError`, whose
message names the rule and never echoes the file's text.

The views are read-only in spirit (``bytes`` cannot be written; torch's note that the buffer is
not writable is silenced): nothing here or downstream writes an adapter's parsed weights.
"""

from __future__ import annotations

import math
import sys
import warnings

import torch

from control.contracts.adapter_format import strict_json

MAX_HEADER_BYTES = 100_000_000  # the format's own limit
METADATA = "__metadata__"

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}

# torch says this once per process, at whichever frombuffer of read-only bytes comes first; the
# filter is by message because the warning is raised from C++, with no module of ours to match.
warnings.filterwarnings("ignore", message="The given buffer is not writable")


class SafetensorsFormatError(ValueError):
    """The bytes are not a well-formed safetensors file."""


def tensor_views(data: bytes) -> dict[str, torch.Tensor]:
    """``{name: tensor}`` of the safetensors file ``data``, each a view of ``data`` (a tensor
    whose bytes are not aligned to its dtype is copied, as is one of zero elements)."""
    if sys.byteorder != "little":  # the format is little-endian; views would read it wrong
        raise SafetensorsFormatError("this host is big-endian: views cannot be used")
    if len(data) < 8:
        raise SafetensorsFormatError("shorter than the 8-byte header length")
    header_len = int.from_bytes(data[:8], "little")
    if header_len > MAX_HEADER_BYTES or 8 + header_len > len(data):
        raise SafetensorsFormatError("the header length runs past the file or the 100 MB limit")
    try:
        header = strict_json(data[8:8 + header_len].decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise SafetensorsFormatError("the header is not strict JSON in UTF-8") from None
    if not isinstance(header, dict):
        raise SafetensorsFormatError("the header is not a JSON object")
    start = 8 + header_len
    specs = _specs(header)
    end = start
    for _name, _dtype, _shape, (begin, stop) in specs:  # sorted by begin
        if start + begin != end:
            raise SafetensorsFormatError("tensor byte ranges leave a gap or overlap")
        end = start + stop
    if end != len(data):
        raise SafetensorsFormatError("the data does not end where the last tensor does")
    whole = torch.frombuffer(data, dtype=torch.uint8)
    typed: dict[torch.dtype, torch.Tensor] = {}  # the whole file as each dtype it holds
    views: dict[str, torch.Tensor] = {}
    for name, dtype, shape, (begin, stop) in specs:
        at = start + begin
        if begin == stop:
            views[name] = torch.empty(shape, dtype=dtype)
        elif at % dtype.itemsize:  # a view of another dtype must start aligned to it
            views[name] = whole[at:start + stop].clone().view(dtype).view(shape)
        else:
            # One operation a tensor: a strided view of the file read as its dtype (a slice,
            # a dtype view and a reshape each were three, a third of the reading's time).
            if dtype not in typed:
                typed[dtype] = whole[:len(data) - len(data) % dtype.itemsize].view(dtype)
            views[name] = typed[dtype].as_strided(shape, _contiguous(shape), at // dtype.itemsize)
    return views


def _contiguous(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for d in reversed(shape):
        strides.append(step)
        step *= max(d, 1)
    return tuple(reversed(strides))


def _specs(header: dict[str, object],
           ) -> list[tuple[str, torch.dtype, tuple[int, ...], tuple[int, int]]]:
    """Each tensor's (name, dtype, shape, (begin, end)) from the header, sorted by begin."""
    specs = []
    for name, entry in header.items():
        if name == METADATA:
            if not isinstance(entry, dict) or not all(isinstance(v, str)
                                                      for v in entry.values()):
                raise SafetensorsFormatError("__metadata__ must map names to strings")
            continue
        if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
            raise SafetensorsFormatError("a tensor entry must hold exactly dtype, shape and "
                                         "data_offsets")
        dtype = DTYPES.get(entry["dtype"]) if isinstance(entry["dtype"], str) else None
        if dtype is None:
            raise SafetensorsFormatError("a tensor has a dtype this reader does not know")
        shape, offsets = entry["shape"], entry["data_offsets"]
        if not isinstance(shape, list) or not all(_count(d) for d in shape):
            raise SafetensorsFormatError("a shape must be a list of non-negative integers")
        if (not isinstance(offsets, list) or len(offsets) != 2 or not all(map(_count, offsets))
                or offsets[0] > offsets[1]):
            raise SafetensorsFormatError("data_offsets must be [begin, end] with begin <= end")
        if math.prod(shape) * dtype.itemsize != offsets[1] - offsets[0]:
            raise SafetensorsFormatError("a tensor's byte length is not its shape times its "
                                         "dtype's size")
        specs.append((name, dtype, tuple(shape), (offsets[0], offsets[1])))
    specs.sort(key=lambda s: s[3])
    return specs


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
