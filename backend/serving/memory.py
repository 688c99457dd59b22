"""The memory plan: what one adapter slot costs on a base, and how many slots a budget holds.

Computed from the base model's shapes (its ``config.json``: hidden size, intermediate size,
attention and key/value heads, layers), the configured maximum rank, the serving dtype and the
adapter budget; nothing is allocated to compute it, so an 8B-shaped plan is checked on any CPU.

Slot banks are allocated in full when the engine is built: every module an adapter may target
(:data:`TARGET_MODULES` in every layer) gets ``a [slots + 1, in, max_rank]`` and
``b [slots + 1, max_rank, out]`` at once, slot 0 being the all-zero slot of base rows. In full
rather than lazily, because then:

- the memory is known before the first request: a configuration that cannot hold it is refused
  at start, instead of failing with an out-of-memory error under load;
- no adapter load ever allocates on the device (loads only copy into a slot);
- every resident adapter occupies exactly one slot whatever it targets, so the cache's byte
  accounting (:attr:`MemoryPlan.slot_bytes` per adapter) is what the device really holds.

The price is that an adapter on two projections occupies as much as one on all seven.

Budgets come from configuration (``control.contracts.config.Settings``):
``LORAPLANE_ADAPTER_BYTES`` (device
bytes for the banks; unset: :data:`DEFAULT_ADAPTER_FRACTION` of the device memory left after the
base weights: on CUDA the device's total memory, on a CPU the machine's physical memory),
``LORAPLANE_ADAPTER_SLOTS`` (a cap on slots) and ``LORAPLANE_MAX_RANK``. The rest of the device
is left to what grows with traffic: the KV cache of running sequences, the gather path's per-row
copies of A and B (up to one slot's bytes per row), the prefix cache and workspace.

This module imports torch only to ask a device for its memory, so ``loraplane serve`` checks the
plan before it launches Triton without loading anything.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from control.contracts.config import (
    ADAPTER_BYTES_ENV,
    ADAPTER_SLOTS_ENV,
    DEFAULT_ADAPTER_SLOTS,
    MAX_RANK_ENV,
    ConfigError,
    Settings,
)

# Every module an adapter may target, in each decoder layer of a Llama-architecture base.
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Unset LORAPLANE_ADAPTER_BYTES: this share of the device memory left after the base weights.
# The rest stays for the KV cache, the gather path's per-row copies, the prefix cache and the
# allocator: on an 80 GB GPU with an 8B base, 40 % is about 25 GB of banks (the default slot cap
# of 64 rank-64 adapters binds first) and leaves about 38 GB.
DEFAULT_ADAPTER_FRACTION = 0.4
# Kept free of weights, banks and KV: activations, the gather path's copies, the prefix cache
# and the allocator's slack.
KV_HEADROOM_FRACTION = 0.1
# The dtype the engine serves in on each device type; both the engine and the plan read it.
SERVING_DTYPES = {"cuda": "bfloat16"}
FALLBACK_DTYPE = "float32"
_ELEMENT_SIZES = {"bfloat16": 2, "float16": 2, "float32": 4}


class AdapterMemoryError(ConfigError):
    """The configuration cannot hold even one adapter of the maximum rank on this base."""


@dataclass(frozen=True)
class BaseShapes:
    """The shapes of a Llama-architecture base that memory depends on."""

    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    layers: int
    vocab: int
    tied_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False

    @classmethod
    def from_config(cls, config: Any) -> BaseShapes:
        """From a transformers ``LlamaConfig`` or the mapping its ``config.json`` holds."""

        def get(name: str, default: Any = None) -> Any:
            value = (config.get(name, default) if isinstance(config, Mapping)
                     else getattr(config, name, default))
            return default if value is None else value

        hidden, heads = int(get("hidden_size")), int(get("num_attention_heads"))
        return cls(
            hidden=hidden,
            intermediate=int(get("intermediate_size")),
            heads=heads,
            kv_heads=int(get("num_key_value_heads", heads)),
            head_dim=int(get("head_dim", hidden // heads)),
            layers=int(get("num_hidden_layers")),
            vocab=int(get("vocab_size")),
            tied_embeddings=bool(get("tie_word_embeddings", False)),
            attention_bias=bool(get("attention_bias", False)),
            mlp_bias=bool(get("mlp_bias", False)),
        )

    @classmethod
    def from_dir(cls, base_dir: Path) -> BaseShapes:
        """From a base model directory's ``config.json`` (no weights are read)."""
        path = Path(base_dir) / "config.json"
        try:
            return cls.from_config(json.loads(path.read_text(encoding="utf-8")))
        except (OSError, ValueError, TypeError) as exc:
            raise ConfigError(f"cannot read the base model's shapes from {path}: {exc}") from None

    def target_dims(self) -> dict[str, tuple[int, int]]:
        """(in_features, out_features) of each target module in one layer."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return {
            "q_proj": (self.hidden, q), "k_proj": (self.hidden, kv), "v_proj": (self.hidden, kv),
            "o_proj": (q, self.hidden), "gate_proj": (self.hidden, self.intermediate),
            "up_proj": (self.hidden, self.intermediate),
            "down_proj": (self.intermediate, self.hidden),
        }

    def weight_count(self) -> int:
        """Parameters of the base (embeddings, layers, norms, output head)."""
        dims = self.target_dims()
        biases = {"q_proj": self.attention_bias, "k_proj": self.attention_bias,
                  "v_proj": self.attention_bias, "o_proj": self.attention_bias,
                  "gate_proj": self.mlp_bias, "up_proj": self.mlp_bias,
                  "down_proj": self.mlp_bias}
        per_layer = sum(i * o + (o if biases[n] else 0) for n, (i, o) in dims.items())
        per_layer += 2 * self.hidden  # input and post-attention norms
        head = 0 if self.tied_embeddings else self.vocab * self.hidden
        return self.vocab * self.hidden + self.layers * per_layer + self.hidden + head

    def kv_bytes_per_token(self, element_size: int) -> int:
        """Bytes of keys and values one token holds across every layer."""
        return 2 * self.layers * self.kv_heads * self.head_dim * element_size


@dataclass(frozen=True)
class AdapterBudget:
    """What the operator configured: bank bytes (None: derived from the device) and a slot cap."""

    adapter_bytes: int | None = None
    max_slots: int = DEFAULT_ADAPTER_SLOTS

    @classmethod
    def from_settings(cls, settings: Settings) -> AdapterBudget:
        return cls(adapter_bytes=settings.adapter_bytes, max_slots=settings.adapter_slots)


@dataclass(frozen=True)
class MemoryPlan:
    """Slot bytes, slot count and bank bytes for one base, rank, dtype and budget."""

    shapes: BaseShapes
    max_rank: int
    element_size: int
    slots: int  # adapter slots; the all-zero base slot is extra
    budget_bytes: int  # what the budget gives the banks
    budget_source: str  # how the budget was set, for messages and logs
    # KV positions the running batch may hold at its peak (the scheduler admits by them): the
    # device memory left after the weights, the banks and KV_HEADROOM_FRACTION of the device,
    # over twice one position's bytes: decode steps write into room reserved in place
    # (backend.serving.kv_arena), but a join, a leave, or a step that runs out of room still holds
    # the old and the new buffers at once (the room is what the rows may still make).
    kv_tokens: int = 0

    @property
    def slot_bytes(self) -> int:
        """One slot: A and B of every target module in every layer, padded to ``max_rank``."""
        return slot_bytes(self.shapes, self.max_rank, self.element_size)

    @property
    def bank_bytes(self) -> int:
        """Everything the banks allocate: every adapter slot and the base slot."""
        return (self.slots + 1) * self.slot_bytes

    @property
    def adapter_capacity_bytes(self) -> int:
        """Device bytes the cache may fill with adapters: one slot each."""
        return self.slots * self.slot_bytes

    @property
    def kv_token_bytes(self) -> int:
        """One KV position: keys and values of every layer."""
        return self.shapes.kv_bytes_per_token(self.element_size)

    def describe(self) -> str:
        """One line for the start log."""
        return (f"adapter slot banks: {self.slots} slots of {_human(self.slot_bytes)} "
                f"(rank {self.max_rank}, {len(TARGET_MODULES)} modules x {self.shapes.layers} "
                f"layers) + the base slot = {_human(self.bank_bytes)}, within "
                f"{_human(self.budget_bytes)} ({self.budget_source}); the gather path copies up "
                f"to {_human(self.slot_bytes)} per row of a batch; KV budget: "
                f"{self.kv_tokens:,} positions of {_human(self.kv_token_bytes)} "
                f"({_human(self.kv_tokens * self.kv_token_bytes)}, twice that while rows join "
                f"or leave)")


def slot_bytes(shapes: BaseShapes, max_rank: int, element_size: int) -> int:
    """Bytes of one slot: ``(in + out) * max_rank`` per target module, over every layer."""
    per_layer = sum(i + o for i, o in shapes.target_dims().values())
    return shapes.layers * per_layer * max_rank * element_size


def slots_within(budget_bytes: int, one_slot: int, cap: int) -> int:
    """Adapter slots ``budget_bytes`` holds, next to the all-zero base slot, at most ``cap``."""
    return max(0, min(cap, budget_bytes // one_slot - 1))


def serving_dtype(device_type: str) -> str:
    """The dtype name the engine serves in on ``device_type`` (bf16 on CUDA, else fp32)."""
    return SERVING_DTYPES.get(device_type, FALLBACK_DTYPE)


def element_size(dtype_name: str) -> int:
    return _ELEMENT_SIZES[dtype_name]


def default_device() -> str:
    """The device the engine takes when none is named: CUDA when there is one."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def device_memory(device: str) -> int:
    """Total memory of ``device`` ("cuda", "cuda:1", "cpu"): the GPU's, or the machine's."""
    if device.startswith("cuda"):
        import torch

        index = int(device.split(":", 1)[1]) if ":" in device else torch.cuda.current_device()
        return int(torch.cuda.get_device_properties(index).total_memory)
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def plan_memory(shapes: BaseShapes, *, max_rank: int, element_size: int, budget: AdapterBudget,
                device_bytes: int, slots: int | None = None) -> MemoryPlan:
    """The plan for one base on one device; raises :class:`AdapterMemoryError` when it cannot
    hold one adapter of ``max_rank``, or when the banks would not fit the device.

    ``slots``: a fixed slot count (tests, benchmarks) instead of what the budget holds.
    """
    one = slot_bytes(shapes, max_rank, element_size)
    base = shapes.weight_count() * element_size
    left = max(0, device_bytes - base)
    if slots is not None:
        given, source = (slots + 1) * one, f"{slots} slots asked for"
    elif budget.adapter_bytes is not None:
        given, source = budget.adapter_bytes, f"{ADAPTER_BYTES_ENV}={budget.adapter_bytes}"
    else:
        given = int(DEFAULT_ADAPTER_FRACTION * left)
        source = (f"{ADAPTER_BYTES_ENV} unset: {DEFAULT_ADAPTER_FRACTION:.0%} of the "
                  f"{_human(left)} left on a {_human(device_bytes)} device after "
                  f"{_human(base)} of base weights")
    count = slots if slots is not None else slots_within(given, one, budget.max_slots)
    if count < 1:
        remedy = (f"raise {ADAPTER_BYTES_ENV}" if budget.adapter_bytes is not None
                  else f"set {ADAPTER_BYTES_ENV}, serve on a device with more memory")
        raise AdapterMemoryError(
            f"{source} gives adapter slot banks {_human(given)}, but one adapter of rank "
            f"{max_rank} needs {_human(2 * one)}: its slot ({_human(one)}: "
            f"{', '.join(TARGET_MODULES)} in {shapes.layers} layers) and the all-zero base "
            f"slot. {remedy[0].upper()}{remedy[1:]}, or lower {MAX_RANK_ENV}")
    plan = MemoryPlan(shapes, max_rank, element_size, count, given, source)
    if plan.bank_bytes > left:
        raise AdapterMemoryError(
            f"{source}: {plan.slots} slots of {_human(one)} need {_human(plan.bank_bytes)} of "
            f"slot banks, but the {_human(device_bytes)} device has {_human(left)} left after "
            f"{_human(base)} of base weights. Lower {ADAPTER_BYTES_ENV} or {ADAPTER_SLOTS_ENV}")
    kv_left = left - plan.bank_bytes - int(KV_HEADROOM_FRACTION * device_bytes)
    per_position = 2 * shapes.kv_bytes_per_token(element_size)  # old and new buffers as rows join
    return replace(plan, kv_tokens=max(0, kv_left // per_position))


def plan_for_host(base_dir: Path, settings: Settings, device: str | None = None) -> MemoryPlan:
    """The plan a Triton host started with ``settings`` will build for the base in
    ``base_dir`` on ``device`` (default: the one the engine would take). ``serve`` and
    ``triton-host`` call this before they launch Triton; the engine computes the same."""
    device = device or default_device()
    return plan_memory(BaseShapes.from_dir(base_dir), max_rank=settings.max_rank,
                       element_size=element_size(serving_dtype(device.split(":")[0])),
                       budget=AdapterBudget.from_settings(settings),
                       device_bytes=device_memory(device))


def _human(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"
