"""Preparing an adapter for the slots (``backend.serving.adapter_files.prepared``): float32 weights
for float32 slots are kept as views of the verified file's bytes and B is scaled in the slot,
which must leave exactly the values the converting path leaves, and copy nothing on the way."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save
from torch import nn
from torch.profiler import ProfilerActivity, profile

from backend.serving.adapter_files import HostAdapter, prepared
from backend.serving.safetensors_views import tensor_views
from backend.serving.slots import SlotContext, SlottedLinear

RANK, IN, OUT, MAX_RANK = 3, 16, 12, 4
SCALING = 2.0 / 3.0  # alpha / r with a product that rounds


def _adapter(dtype: torch.dtype = torch.float32) -> tuple[HostAdapter, bytes]:
    g = torch.Generator().manual_seed(3)
    a, b = torch.randn(RANK, IN, generator=g), torch.randn(OUT, RANK, generator=g)
    data = save({"a": a.to(dtype), "b": b.to(dtype)})
    views = tensor_views(data)
    return HostAdapter(rank=RANK, scaling=SCALING, pairs={"m": (views["a"], views["b"])}), data


def _module() -> SlottedLinear:
    a = torch.zeros(3, MAX_RANK, IN)
    b = torch.zeros(3, OUT, MAX_RANK)
    return SlottedLinear(nn.Linear(IN, OUT), SlotContext(), a, b)


def test_float32_slots_get_the_values_the_converting_path_gave() -> None:
    """The values the slots held before (B scaled in float32, then copied) against B copied
    and then scaled in the slot: equal bit for bit, and A untouched."""
    host, _ = _adapter()
    kept = prepared(host, torch.float32, pin=False)
    assert kept.b_scaling == SCALING
    module = _module()
    a, b = kept.pairs["m"]
    module.place(1, a, b, kept.b_scaling)
    folded = b.clone().mul_(SCALING)  # what prepared() computed before it kept views
    module.place(2, a, folded)
    assert torch.equal(module.a[1], module.a[2]) and torch.equal(module.b[1], module.b[2])
    assert torch.equal(module.b[1][:, :RANK], folded)
    assert not module.b[1][:, RANK:].any()  # the padded rank stays zero


def test_float32_weights_are_kept_as_views_of_the_file_not_copied() -> None:
    host, data = _adapter()
    base = torch.frombuffer(data, dtype=torch.uint8).data_ptr()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        kept = prepared(host, torch.float32, pin=False)
    for t in kept.pairs["m"]:
        assert t.untyped_storage().data_ptr() == base
    assert max((e.cpu_memory_usage for e in prof.events()), default=0) == 0


def test_weights_of_another_dtype_are_converted_with_b_scaled_first() -> None:
    host, _ = _adapter(torch.bfloat16)
    conv = prepared(host, torch.float32, pin=False)
    assert conv.b_scaling == 1.0
    a, b = conv.pairs["m"]
    assert a.dtype == b.dtype == torch.float32
    want = host.pairs["m"][1].float() * SCALING
    assert torch.equal(b, want)


def test_scaling_in_the_slot_is_refused_for_banks_that_would_round_twice() -> None:
    module = SlottedLinear(nn.Linear(IN, OUT), SlotContext(),
                           torch.zeros(3, MAX_RANK, IN, dtype=torch.bfloat16),
                           torch.zeros(3, OUT, MAX_RANK, dtype=torch.bfloat16))
    host, _ = _adapter()
    a, b = host.pairs["m"]
    with pytest.raises(ValueError, match="float32"):
        module.place(1, a.bfloat16(), b.bfloat16(), SCALING)
