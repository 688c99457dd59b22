"""Adapter files into slot-ready tensors: parse, validate against the base, convert.

The store hands over an adapter's files already checked against its digest; a verified file can
still be wrong, so every tensor is checked against the base module it targets, and any config
the adapter format (``control.contracts.adapter_format``, the rules registration applies too)
does not allow is refused, because an adapter can reach the engine without registration.
Nothing here touches a slot: :class:`HostAdapter` is the parsed adapter, :class:`PreparedAdapter`
the same in the slots' dtype and layout, made outside every lock (``backend.serving.engine``
places it).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import nn

from backend.serving.engine_types import AdapterLoadError
from backend.serving.memory import TARGET_MODULES
from backend.serving.safetensors_views import SafetensorsFormatError, tensor_views
from backend.serving.slots import SlottedLinear
from control.contracts.adapter_format import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    AdapterFormatError,
    LoraConfig,
    lora_pairs,
)

# An adapter directory, or its files in memory (relative path -> bytes).
AdapterSource = Path | Mapping[str, bytes]


@dataclass(frozen=True)
class HostAdapter:
    """One adapter parsed and validated on the host, ready to be placed in a slot."""

    rank: int
    scaling: float
    pairs: dict[str, tuple[torch.Tensor, torch.Tensor]]  # module -> (A [rank, in], B [out, rank])

    @property
    def nbytes(self) -> int:
        """Bytes of the host tensors (the host tier's accounting)."""
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size()
                   for a, b in self.pairs.values())


@dataclass(frozen=True)
class PreparedAdapter:
    """An adapter in the slots' dtype, ready to be copied into a free slot.

    Per module: A ``[rank, in]`` and B ``[out, rank]`` (the slots keep PEFT's layouts,
    ``backend.serving.slots``), with the adapter's scaling folded into B, or, where
    ``b_scaling`` is not 1, left for placement to apply in the slot (see :func:`prepared`). On a
    CUDA host they are in pinned memory, so the copy into the slot runs asynchronously. Made by
    :meth:`Engine.prepare` outside every lock: the conversion work is done while decoding goes
    on, and placing holds the engine's lock only for the copies.
    """

    rank: int
    pairs: dict[str, tuple[torch.Tensor, torch.Tensor]]  # module -> (A [r, in], B [out, r])
    b_scaling: float = 1.0  # what placement multiplies B by in the slot (1: already applied)

    @property
    def nbytes(self) -> int:
        """Bytes of the host tensors (the host tier's accounting)."""
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size()
                   for a, b in self.pairs.values())


def prepared(adapter: HostAdapter, dtype: torch.dtype, pin: bool) -> PreparedAdapter:
    """``adapter`` in the slots' dtype (``pin``: in pinned host memory, for asynchronous copies
    to a CUDA device).

    Each tensor is converted in one contiguous pass, in its own layout (no transposing: that
    was most of a 4,096-wide adapter's preparation). B's scaling is applied in float32 before
    the one rounding to the slots' dtype, as it always was, so the slots hold the same values.

    Float32 weights for float32 slots (the CPU engine's) need no conversion, so they are kept
    as they are, views of the verified file's bytes (``backend.serving.safetensors_views``), and
    B's scaling is applied in the slot after the copy: the same float32 product, rounded once.
    Copying them here put a second copy of every adapter in fresh memory, which is what a cold
    load spends most on where page faults are slow (half of its fresh pages, 6 of 17 ms a load
    on this machine on 2026-12-07).
    """
    if not pin and dtype == torch.float32 and all(
            t.dtype == torch.float32 for pair in adapter.pairs.values() for t in pair):
        return PreparedAdapter(rank=adapter.rank, pairs=dict(adapter.pairs),
                               b_scaling=adapter.scaling)
    pairs: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    with torch.inference_mode():
        for name, (a, b) in adapter.pairs.items():
            at = _empty(tuple(a.shape), dtype, pin).copy_(a)  # [rank, in]
            wide = torch.empty(tuple(b.shape), dtype=torch.float32).copy_(b)  # [out, rank]
            wide.mul_(adapter.scaling)
            bt = wide if dtype == torch.float32 and not pin else \
                _empty(tuple(b.shape), dtype, pin).copy_(wide)
            pairs[name] = (at, bt)
    return PreparedAdapter(rank=adapter.rank, pairs=pairs)


def _empty(shape: tuple[int, ...], dtype: torch.dtype, pin: bool) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, pin_memory=pin)


def validated_pairs(
    model: nn.Module, slotted: Mapping[str, SlottedLinear], tensors: dict[str, torch.Tensor],
    config: LoraConfig,
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Module name -> (A, B), each checked against the base's module and the config."""
    try:
        found_pairs = lora_pairs(tensors)  # the format's naming rule, both halves present
    except AdapterFormatError as e:
        raise AdapterLoadError(str(e)) from None

    pairs: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for module, (a, b) in found_pairs.items():
        target = slotted.get(module)  # a dict lookup; the base's tree is walked only to explain
        if target is None:
            _refuse_target(model, module)
        want_a = (config.rank, target.in_features)
        want_b = (target.out_features, config.rank)
        if tuple(a.shape) != want_a or tuple(b.shape) != want_b:
            raise AdapterLoadError(
                f"module {module!r}: expected lora_A {list(want_a)} and lora_B "
                f"{list(want_b)}, found {list(a.shape)} and {list(b.shape)}"
            )
        if not a.is_floating_point() or not b.is_floating_point():
            raise AdapterLoadError(f"module {module!r}: LoRA weights must be floating point")
        pairs[module] = (a, b)
    _check_finite(pairs)
    return pairs


def _refuse_target(model: nn.Module, module: str) -> NoReturn:
    """Why ``module``, which has no adapter slots, cannot take LoRA weights."""
    try:
        target = model.get_submodule(module)
    except AttributeError:
        raise AdapterLoadError(f"module {module!r} does not exist in the base") from None
    if not isinstance(target, (nn.Linear, SlottedLinear)):
        raise AdapterLoadError(
            f"module {module!r} is a {type(target).__name__}, expected a Linear layer"
        )
    raise AdapterLoadError(
        f"module {module!r} has no adapter slots: this engine serves LoRA on "
        f"{', '.join(TARGET_MODULES)}"
    )


def _check_finite(pairs: Mapping[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Refuse the adapter if any weight is NaN or infinite.

    One sum per tensor, then one test of all the sums: a NaN or an infinity anywhere makes its
    tensor's sum NaN or infinite, so no bad weight passes; that is a reduction per tensor where
    ``isfinite(t).all()`` wrote a mask of the whole tensor and reduced it (ten times the time
    at a 4,096-wide adapter). A sum can also overflow from finite weights; only then is each
    tensor tested element by element, to name the module or to find that all is finite."""
    tensors = [t for pair in pairs.values() for t in pair]
    if not tensors:
        return
    with torch.inference_mode():
        if bool(torch.isfinite(torch.stack([t.sum() for t in tensors])).all()):
            return
        for module, (a, b) in pairs.items():
            if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
                raise AdapterLoadError(f"module {module!r}: LoRA weights are not all finite")


def read_config(source: AdapterSource) -> LoraConfig:
    """The adapter's config, refused unless the adapter format allows it
    (``control.contracts.adapter_format``: the same rules registration applies)."""
    try:
        if isinstance(source, Mapping):
            if CONFIG_FILE not in source:
                raise FileNotFoundError(CONFIG_FILE)
            raw = source[CONFIG_FILE]
        else:
            raw = (Path(source) / CONFIG_FILE).read_bytes()
    except FileNotFoundError:
        raise AdapterLoadError(f"adapter has no {CONFIG_FILE}") from None
    try:
        return LoraConfig.from_json(raw)
    except AdapterFormatError as e:
        raise AdapterLoadError(f"{CONFIG_FILE}: {e}") from None


def read_tensors(source: AdapterSource) -> dict[str, torch.Tensor]:
    missing = AdapterLoadError(f"adapter has no {WEIGHTS_FILE} (only safetensors is served)")
    if isinstance(source, Mapping):
        if WEIGHTS_FILE not in source:
            raise missing
        try:  # views of the verified bytes, not copies (backend.serving.safetensors_views)
            return tensor_views(source[WEIGHTS_FILE])
        except SafetensorsFormatError as exc:
            raise AdapterLoadError(
                f"{WEIGHTS_FILE} is not a readable safetensors file: {exc}"
            ) from None
    path = Path(source) / WEIGHTS_FILE
    if not path.is_file():
        raise missing
    try:
        return load_file(path, device="cpu")
    except (SafetensorError, OSError, ValueError) as exc:
        raise AdapterLoadError(
            f"{WEIGHTS_FILE} is not a readable safetensors file: {exc}"
        ) from None
