"""Weight fingerprints of the adapter slots: the banks still hold the weights that were placed.

The slot table says which digest a slot holds, and every forward pass reads the digest its rows'
slots hold (``Sequence.observed``). Both are bookkeeping. A fingerprint checks the weights
themselves: when an adapter is placed, its slot's region of the banks (every target module's A
and B, one contiguous vector, ``backend.serving.slots.SlotBanks``) is summed in ``max_rank``
consecutive parts and kept; on a sample of forward passes (every
:data:`CHECK_EVERY`-th) one of the slots that pass uses is summed again, in turn, and a slot whose
weights no longer sum the same (a write into the wrong slot, a stray copy, a bug in slot reuse)
makes its rows fail closed as
``identity_mismatch`` (their ``observed`` gets :data:`WEIGHTS_CHANGED`) and is counted as the
broken invariant ``slot_weights``.

Cost: a check reads one slot's weights once, in one reduction (it was two per target module:
64 launches a slot at 4 modules over 8 layers); taken every 64th pass it is a small fraction of
decoding (``loraplane bench engine`` reports
``fingerprint_every_pass_vs_off``: decode throughput with a check on every pass against none).
The sums are of the weights' bit patterns read as integers of the same width, wrapping (mod
2^32 for float32 banks): integer addition is exact and does not depend on the order the
reduction takes, so a check on the serving thread with its thread count equals the sum made on
a load worker with one, and any changed weight changes its part's sum (short of changes made to
cancel out). They were float64 sums of the weights; ``sum(dtype=float64)`` first casts its input,
so every placement wrote a fresh float64 copy of the slot (10 MB at the bench's shapes, 134 MB
at a 7B model's), and on a host whose page faults are slow the copy's fresh pages were most of a
cold load: 12 ms of the fingerprint's 12.6 (about 2,400 page faults), against 0.2 ms for the
same sums in the banks' own width (2026-12-07, hidden 512, this machine).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from backend.serving.slots import SlotBanks

CHECK_EVERY = 64  # forward passes between checks; 0 turns the checks off
WEIGHTS_CHANGED = "weights_changed"  # what a row observes when its slot's weights moved
# The signed integer of each float width the banks may have (bf16 and fp16: 2 bytes).
_BITS = {2: torch.int16, 4: torch.int32, 8: torch.int64}


class BankFingerprints:
    """Per-slot sums of the slot's region of the banks, in parts (see the module notes)."""

    def __init__(self, banks: SlotBanks, num_slots: int, device: torch.device) -> None:
        self._banks = banks
        self._bits = _BITS[banks.flat.element_size()]  # the integer view of the weights
        # [slots, max_rank]: zero for an empty slot (its banks are zero, and so are their bits)
        self._placed = torch.zeros((num_slots, banks.max_rank), dtype=self._bits, device=device)
        self._turn = 0
        self.checks = 0

    def record(self, slot: int) -> None:
        """Remember what ``slot`` holds now (just after an adapter was copied in)."""
        self._placed[slot] = self._sums(slot)

    def clear(self, slot: int) -> None:
        """``slot`` was zeroed."""
        self._placed[slot] = 0.0

    def changed(self, slots: Iterable[int]) -> list[int]:
        """Check one of ``slots`` (each in turn, over successive calls); the checked slot when
        its weights no longer sum what was placed, else nothing."""
        wanted = sorted(set(slots))
        if not wanted:
            return []
        slot = wanted[self._turn % len(wanted)]
        self._turn += 1
        self.checks += 1
        return [] if torch.equal(self._sums(slot), self._placed[slot]) else [slot]

    def _sums(self, slot: int) -> torch.Tensor:
        """[max_rank]: the wrapping integer sums of ``slot``'s region's bit patterns in
        ``max_rank`` consecutive parts (views of the banks: nothing is copied or converted; the
        sum accumulates wider and the result wraps to the bits' width). The region's length is
        max_rank x the modules' in + out, so the parts are equal."""
        with torch.inference_mode():
            parts = self._banks.region(slot).view(self._bits).view(self._banks.max_rank, -1)
            return parts.sum(dim=1, dtype=self._bits)
