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

import torch
from safetensors import SafetensorError
from safetensors.torch import load as safetensors_load
from safetensors.torch import load_file
from torch import nn

from backend.serving.engine_types import AdapterLoadError
from backend.serving.memory import TARGET_MODULES
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
    """An adapter in the slots' dtype and layout, ready to be copied into a free slot.

    Per module: A transposed, ``[in, rank]``, and B transposed with the adapter's scaling folded
    in, ``[rank, out]``; on a CUDA host, in pinned memory, so the copy into the slot runs
    asynchronously. Made by :meth:`Engine.prepare` outside every lock: the conversion work is
    done while decoding goes on, and placing holds the engine's lock only for the copies.
    """

    rank: int
    pairs: dict[str, tuple[torch.Tensor, torch.Tensor]]  # module -> (A^T [in, r], B^T [r, out])

    @property
    def nbytes(self) -> int:
        """Bytes of the host tensors (the host tier's accounting)."""
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size()
                   for a, b in self.pairs.values())


def prepared(adapter: HostAdapter, dtype: torch.dtype, pin: bool) -> PreparedAdapter:
    """``adapter`` in the slots' dtype and layout (``pin``: in pinned host memory, for
    asynchronous copies to a CUDA device)."""
    pairs: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    with torch.inference_mode():
        for name, (a, b) in adapter.pairs.items():
            at = a.t().to(dtype).contiguous()  # [in, rank]
            bt = (b.float() * adapter.scaling).t().to(dtype).contiguous()  # [rank, out]
            pairs[name] = (at.pin_memory(), bt.pin_memory()) if pin else (at, bt)
    return PreparedAdapter(rank=adapter.rank, pairs=pairs)


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
        try:
            target = model.get_submodule(module)
        except AttributeError:
            raise AdapterLoadError(f"module {module!r} does not exist in the base") from None
        if not isinstance(target, (nn.Linear, SlottedLinear)):
            raise AdapterLoadError(
                f"module {module!r} is a {type(target).__name__}, expected a Linear layer"
            )
        if module not in slotted:
            raise AdapterLoadError(
                f"module {module!r} has no adapter slots: this engine serves LoRA on "
                f"{', '.join(TARGET_MODULES)}"
            )
        want_a = (config.rank, target.in_features)
        want_b = (target.out_features, config.rank)
        if tuple(a.shape) != want_a or tuple(b.shape) != want_b:
            raise AdapterLoadError(
                f"module {module!r}: expected lora_A {list(want_a)} and lora_B "
                f"{list(want_b)}, found {list(a.shape)} and {list(b.shape)}"
            )
        if not a.is_floating_point() or not b.is_floating_point():
            raise AdapterLoadError(f"module {module!r}: LoRA weights must be floating point")
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise AdapterLoadError(f"module {module!r}: LoRA weights are not all finite")
        pairs[module] = (a, b)
    return pairs


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
        try:
            return safetensors_load(source[WEIGHTS_FILE])
        except (SafetensorError, ValueError) as exc:
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
