"""Adapter residency: which adapter holds which stacked slot, and the pins of live rows on them.

Every target ``nn.Linear`` of the base is wrapped, once, by a ``SlottedLinear`` holding A/B for
all slots (``backend.serving.slots``); slot 0 is the all-zero base slot. Placing an adapter copies
its validated, prepared pairs (``backend.serving.adapter_files``) into a free slot; unloading
zeroes it. A slot pinned by a live sequence is never unloaded or handed to another adapter: a
free slot that is still pinned is a broken invariant (``pinned_unload``), and a pin given back
on a slot that was refilled meanwhile is counted (``stale_slot``). The weights each slot holds are
recorded apart from this bookkeeping (``backend.serving.provenance``).

The engine (``backend.serving.engine``) owns one of these and shares its lock with it.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence as Sequence_

import torch
from transformers import LlamaForCausalLM

from backend.serving.adapter_files import (
    AdapterSource,
    HostAdapter,
    PreparedAdapter,
    prepared,
    read_config,
    read_tensors,
    validated_pairs,
)
from backend.serving.engine_types import (
    AdapterBusyError,
    AdapterLoadError,
    EngineError,
    Sequence,
    UnknownAdapterError,
)
from backend.serving.lease import Violations
from backend.serving.memory import MemoryPlan
from backend.serving.provenance import SlotProvenance
from backend.serving.slots import (
    SlotBanks,
    SlotContext,
    SlotIdentity,
    SlotsFull,
    SlotTable,
    SlottedLinear,
    wrap_targets,
)
from control.contracts.config import MAX_RANK_ENV


class SlotResidency:
    """The slot banks of one base model: placing, unloading and pinning adapters in them."""

    def __init__(self, model: LlamaForCausalLM, plan: MemoryPlan, lock: threading.RLock,
                 violations: Violations, *, device: torch.device, dtype: torch.dtype,
                 max_rank: int) -> None:
        self.model, self.plan, self.lock, self.violations = model, plan, lock, violations
        self.device, self.dtype, self.max_rank = device, dtype, max_rank
        self.context = SlotContext()
        self.table = SlotTable(plan.slots)
        # module name -> its wrapper; the banks of every module, one region a slot
        self.slotted, self.banks = self._wrap_targets()
        self.provenance = SlotProvenance(self.banks, self.table.num_slots, device, violations)
        self.modules: dict[str, list[str]] = {}  # digest -> modules it targets
        self.active: dict[int, int] = {}  # slot -> pins held by live sequences

    def _wrap_targets(self) -> tuple[dict[str, SlottedLinear], SlotBanks]:
        """Wrap every target Linear in slot banks for all slots (``slots.wrap_targets``)."""
        try:
            return wrap_targets(self.model, self.plan.shapes, self.context,
                                self.table.num_slots, self.max_rank, self.dtype)
        except ValueError as e:
            raise EngineError(str(e)) from None

    # -- loading ----------------------------------------------------------------------------

    def read_adapter(self, source: AdapterSource) -> HostAdapter:
        """Parse and validate an adapter on the host; nothing becomes resident."""
        config = read_config(source)
        if config.rank > self.max_rank:
            raise AdapterLoadError(f"adapter rank {config.rank} exceeds this engine's max_rank "
                                   f"{self.max_rank} ({MAX_RANK_ENV})")
        pairs = validated_pairs(self.model, self.slotted, read_tensors(source), config)
        return HostAdapter(rank=config.rank, scaling=config.scaling, pairs=pairs)

    def prepare(self, adapter: HostAdapter) -> PreparedAdapter:
        """The adapter in the slots' dtype and layout; takes no lock."""
        return prepared(adapter, self.dtype, pin=self.device.type == "cuda")

    def place(self, digest: str, adapter: PreparedAdapter) -> int:
        """Put a prepared adapter in a free slot; return its resident device bytes."""
        with self.lock:
            if self.table.slot_of(digest) is not None:
                return self.resident_adapters()[digest]
            modules = sorted(adapter.pairs)
            wrapped = [self.slotted[name] for name in modules]
            try:
                slot = self.table.allocate(digest).slot
            except SlotsFull as e:
                raise AdapterLoadError(str(e)) from None
            if self.active.get(slot, 0):
                # A free slot with pins means a lease outlived its load: never reuse it.
                self.table.release(digest)
                self.violations.raise_("pinned_unload", f"slot {slot} is free but pinned")
            with torch.inference_mode():
                for module, name in zip(wrapped, modules, strict=True):
                    a, b = adapter.pairs[name]
                    module.place(slot, a, b, adapter.b_scaling)
            self.provenance.placed(slot, digest)
            self.modules[digest] = modules
            return self.plan.slot_bytes

    def unload(self, digest: str) -> None:
        """Drop a resident adapter and zero its slot (see ``Engine.unload_adapter``)."""
        with self.lock:
            slot = self.table.slot_of(digest)
            if slot is None:
                raise UnknownAdapterError(f"adapter not resident: {digest}")
            if self.active.get(slot, 0):
                # The cache unloads only unreferenced adapters, so this is a broken invariant
                # when it comes from the cache; counted either way.
                self.violations.count("pinned_unload", f"slot {slot}")
                raise AdapterBusyError("adapter is serving running sequences")
            self.banks.clear(slot)  # every module's part of the slot, in one operation
            for name in self.modules.pop(digest):
                self.slotted[name].vacate(slot)
            self.provenance.cleared(slot)
            self.table.release(digest)

    # -- reading ----------------------------------------------------------------------------

    def resident_adapters(self) -> dict[str, int]:
        """Resident adapter digests and their bytes on the device."""
        with self.lock:
            return {d: self.plan.slot_bytes for d in self.table.digests()}

    def slot_of(self, digest: str) -> int | None:
        with self.lock:
            return self.table.slot_of(digest)

    def identity_of(self, digest: str) -> SlotIdentity | None:
        with self.lock:
            return self.table.identity_of(digest)

    def base_tensors(self) -> list[torch.Tensor]:
        """The base model's parameters and buffers (memory accounting)."""
        return [*self.model.parameters(), *self.model.buffers()]

    def slot_tensors(self, digest: str) -> list[torch.Tensor]:
        """The tensor views an adapter's whole slot occupies, in every target module."""
        with self.lock:
            slot = self.table.slot_of(digest)
            if slot is None:
                return []
            out: list[torch.Tensor] = []
            for m in self.slotted.values():
                out += [m.a[slot], m.b[slot]]
            return out

    def bank_tensors(self) -> list[torch.Tensor]:
        """Every slot bank, A and B of every target module (memory accounting)."""
        return [t for m in self.slotted.values() for t in m.banks()]

    def base_slot_is_zero(self) -> bool:
        """Slot 0 (base rows) is all zero in every module: no sentinel reaches an adapter."""
        with self.lock:
            return all(
                not m.a[0].any() and not m.b[0].any()
                for m in self.model.modules() if isinstance(m, SlottedLinear)
            )

    # -- pins -------------------------------------------------------------------------------

    def pin(self, holder: SlotIdentity) -> None:
        """A live sequence runs on ``holder``'s slot (the caller holds the lock)."""
        self.active[holder.slot] = self.active.get(holder.slot, 0) + 1

    def unpin(self, holder: SlotIdentity) -> None:
        with self.lock:
            left = self.active.get(holder.slot, 0) - 1
            if left < 0:
                self.violations.raise_("negative_pin", f"slot {holder.slot}")
            if left:
                self.active[holder.slot] = left
            else:
                self.active.pop(holder.slot, None)
            if self.table.holder(holder.slot) != holder:
                # The slot was emptied or refilled under a live pin: a row may have been served
                # by other weights. The scheduler checks before every step; this is the backstop.
                self.violations.count("stale_slot", f"slot {holder.slot} at unpin")

    def pins(self) -> dict[int, int]:
        with self.lock:
            return dict(self.active)

    def stale_rows(self, seqs: Sequence_[Sequence]) -> list[int]:
        """Indices of ``seqs`` whose slot no longer holds the load they were admitted on."""
        with self.lock:
            return [i for i, s in enumerate(seqs)
                    if s.holder is not None and self.table.holder(s.holder.slot) != s.holder]
