"""Resident adapters as stacked slots: one A and one B tensor per target module for all of them.

Slot 0 is all zero and never handed out: base rows use it, so no index value a batch can hold
selects a real adapter unless the engine put that adapter's slot there from a verified ticket.
Ranks are padded with zeros to ``max_rank``; zero rows of A and zero columns of B add exactly
nothing. The adapter's scaling is folded into B at placement. The banks keep PEFT's own layouts,
A ``[rank, in]`` and B ``[out, rank]``: the matmuls read them transposed at no cost, while
transposing a 4,096-wide adapter on the host cost a cold load more than reading its file.

The engine builds one ``SlottedLinear`` per target module when it starts, each allocating its banks
for every slot at once (``backend.serving.memory`` says why and how many slots); a load only
copies into a slot.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from backend.serving.lora_ops import SlotBatch, apply_gather, apply_segment
from backend.serving.memory import BaseShapes


class SlotsFull(RuntimeError):
    """Every slot holds an adapter; one must be unloaded first."""


@dataclass
class SlotContext:
    """Shared by every ``SlottedLinear``: the rows of the forward pass in progress."""

    batch: SlotBatch | None = None


class SlottedLinear(nn.Module):
    """A base ``nn.Linear`` plus per-row deltas read from stacked slot tensors."""

    def __init__(self, base: nn.Linear, context: SlotContext, a: torch.Tensor,
                 b: torch.Tensor) -> None:
        """``a`` ``[slots, max_rank, in]`` and ``b`` ``[slots, out, max_rank]``: this module's
        banks, views of the engine's :class:`SlotBanks` (PEFT's layouts, see the module notes;
        slot 0 stays zero)."""
        super().__init__()
        self.base = base
        self.context = context
        self.a, self.b = a, b
        self.occupied: set[int] = set()

    @property
    def in_features(self) -> int:
        return self.base.in_features

    @property
    def out_features(self) -> int:
        return self.base.out_features

    def slot_nbytes(self) -> int:
        """Bytes one slot of this module occupies (A and B, padded rank)."""
        return (self.a[0].numel() + self.b[0].numel()) * self.a.element_size()

    def banks(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole A and B banks, every slot (memory accounting)."""
        return self.a, self.b

    def place(self, slot: int, a: torch.Tensor, b: torch.Tensor, b_scaling: float = 1.0,
              ) -> None:
        """Copy one adapter's prepared pair into ``slot``: ``a`` = A [rank, in], ``b`` =
        B [out, rank], in the banks' dtype, scaled already or, with ``b_scaling`` not 1,
        scaled here in the slot (float32 banks only: the one rounding is then the product's,
        as when it was scaled before the copy).

        A free slot is all zero (the banks start zero and ``clear`` zeroes a slot when it is
        freed), so only the adapter's own rank columns are written: the padding stays zero.
        From pinned host memory the copies are asynchronous; CUDA orders them before the next
        forward pass on the same stream.
        """
        rank = a.shape[0]
        self.a[slot, :rank].copy_(a, non_blocking=True)
        self.b[slot, :, :rank].copy_(b, non_blocking=True)
        if b_scaling != 1.0:
            if self.b.dtype != torch.float32:
                raise ValueError("B may be scaled in the slot only in float32 banks")
            self.b[slot, :, :rank].mul_(b_scaling)
        self.occupied.add(slot)

    def vacate(self, slot: int) -> None:
        """``slot`` holds nothing of this module any more (``SlotBanks.clear`` zeroed it)."""
        self.occupied.discard(slot)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        batch = self.context.batch
        if batch is None or batch.path == "none" or not self.occupied:
            return out
        if batch.path == "segment":
            segs = tuple(s for s in batch.segments if s[0] in self.occupied)
            if segs:
                apply_segment(out, x, self.a, self.b, segs)
            return out
        key = id(self)
        pair = batch.gathered.get(key)
        if pair is None:
            # once per batch composition, reused by every decode step until rows change
            pair = (self.a.index_select(0, batch.slots), self.b.index_select(0, batch.slots))
            batch.gathered[key] = pair
        apply_gather(out, x, *pair)
        return out


@dataclass(frozen=True)
class SlotIdentity:
    """What one slot holds: an adapter digest and the load that put it there.

    ``generation`` is unique per load (a counter over the table's life), so a slot emptied and
    filled again, even with the same digest, never looks unchanged to a sequence admitted on the
    earlier load.
    """

    slot: int
    digest: str
    generation: int


class SlotTable:
    """Which slot each resident adapter digest holds; slot 0 is reserved for the base."""

    def __init__(self, max_adapters: int) -> None:
        if max_adapters < 1:
            raise ValueError("max_adapters must be >= 1")
        self.capacity = max_adapters
        self._free = list(range(max_adapters, 0, -1))  # pop() hands out 1 first
        self._by_digest: dict[str, SlotIdentity] = {}
        self._by_slot: dict[int, SlotIdentity] = {}
        self._generations = 0

    @property
    def num_slots(self) -> int:
        return self.capacity + 1

    def slot_of(self, digest: str) -> int | None:
        found = self._by_digest.get(digest)
        return found.slot if found is not None else None

    def identity_of(self, digest: str) -> SlotIdentity | None:
        return self._by_digest.get(digest)

    def holder(self, slot: int) -> SlotIdentity | None:
        """What ``slot`` holds now, or None when it is free."""
        return self._by_slot.get(slot)

    def allocate(self, digest: str) -> SlotIdentity:
        if not self._free:
            raise SlotsFull(f"all {self.capacity} adapter slots are in use")
        self._generations += 1
        ident = SlotIdentity(self._free.pop(), digest, self._generations)
        self._by_digest[digest] = self._by_slot[ident.slot] = ident
        return ident

    def release(self, digest: str) -> int:
        ident = self._by_digest.pop(digest)
        del self._by_slot[ident.slot]
        self._free.append(ident.slot)
        return ident.slot

    def digests(self) -> list[str]:
        return list(self._by_digest)


class SlotBanks:
    """Every target module's A and B banks as views of one buffer ``[slots, per_slot]``: one
    slot's weights, all modules, are one contiguous region.

    So what is done to a whole slot is one operation: zeroing it when it is freed, and summing
    it for the weight fingerprint (``backend.serving.fingerprint``), where each was two per
    module (64 small operations a slot for 4 modules over 8 layers, hundreds at a 7B model's 224
    modules, each a kernel launch on a GPU, under the engine's lock). Within the region each
    module's A and B keep their own layouts, contiguous, so the LoRA kernels read a slot's
    ``a[slot]`` and ``b[slot]`` as before."""

    def __init__(self, dims: list[tuple[int, int]], num_slots: int, max_rank: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        """``dims``: (in, out) of each module, in the order :meth:`views` is asked."""
        self.max_rank = max_rank
        per_slot = sum(max_rank * (i + o) for i, o in dims)
        self.flat = torch.zeros((num_slots, per_slot), dtype=dtype, device=device)
        self._dims, self._next = dims, 0

    def views(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Module ``index``'s A ``[slots, max_rank, in]`` and B ``[slots, out, max_rank]``."""
        r = self.max_rank
        start = sum(r * (i + o) for i, o in self._dims[:index])
        i, o = self._dims[index]
        a = self.flat[:, start:start + r * i].unflatten(1, (r, i))
        b = self.flat[:, start + r * i:start + r * (i + o)].unflatten(1, (o, r))
        return a, b

    def region(self, slot: int) -> torch.Tensor:
        """``slot``'s weights, every module's, as one contiguous vector."""
        return self.flat[slot]

    def clear(self, slot: int) -> None:
        self.flat[slot].zero_()


def wrap_targets(model: nn.Module, shapes: BaseShapes, context: SlotContext, num_slots: int,
                 max_rank: int, dtype: torch.dtype,
                 ) -> tuple[dict[str, SlottedLinear], SlotBanks]:
    """Replace every target Linear of ``model`` by a ``SlottedLinear`` whose banks for
    ``num_slots`` are views of one :class:`SlotBanks`; (module name -> its wrapper, the banks).
    ValueError when the model's target modules are not the ones the memory plan's ``shapes``
    counted (the plan would count memory the model does not have, or miss some it has)."""
    dims = shapes.target_dims()
    targets = [(name, m) for name, m in model.named_modules()
               if isinstance(m, nn.Linear) and name.rsplit(".", 1)[-1] in dims]
    if len(targets) != len(dims) * shapes.layers:
        raise ValueError(f"expected {len(dims)} target modules in each of {shapes.layers} "
                         f"layers, found {len(targets)}")
    for name, module in targets:
        want = dims[name.rsplit(".", 1)[-1]]
        if (module.in_features, module.out_features) != want:
            raise ValueError(f"module {name!r} is {module.in_features}->{module.out_features}, "
                             f"the config says {want[0]}->{want[1]}")
    banks = SlotBanks([(m.in_features, m.out_features) for _name, m in targets], num_slots,
                      max_rank, dtype, targets[0][1].weight.device)
    wrapped: dict[str, SlottedLinear] = {}
    for index, (name, module) in enumerate(targets):
        wrapper = SlottedLinear(module, context, *banks.views(index))
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, wrapper)
        wrapped[name] = wrapper
    return wrapped, banks
