"""Weight fingerprints of the adapter slots: the banks still hold the weights that were placed.

The slot table says which digest a slot holds, and every forward pass reads the digest its rows'
slots hold (``Sequence.observed``). Both are bookkeeping. A fingerprint checks the weights
themselves: when an adapter is placed, its slot's region of the banks (every target module's A
and B, one contiguous vector, ``backend.serving.slots.SlotBanks``) is summed in ``max_rank``
consecutive parts (in float64) and kept; on a sample of forward passes (every
:data:`CHECK_EVERY`-th) one of the slots that pass uses is summed again, in turn, and a slot whose
weights no longer sum the same (a write into the wrong slot, a stray copy, a bug in slot reuse)
makes its rows fail closed as
``identity_mismatch`` (their ``observed`` gets :data:`WEIGHTS_CHANGED`) and is counted as the
broken invariant ``slot_weights``.

Cost: a check reads one slot's weights once, in one reduction (it was two per target module:
64 launches a slot at 4 modules over 8 layers); taken every 64th pass it is a small fraction of
decoding (``loraplane bench engine`` reports
``fingerprint_every_pass_vs_off``: decode throughput with a check on every pass against none).
The check sums exactly as placement did (the same reductions over the same slot), so the sums
are compared exactly.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from backend.serving.slots import SlotBanks

CHECK_EVERY = 64  # forward passes between checks; 0 turns the checks off
WEIGHTS_CHANGED = "weights_changed"  # what a row observes when its slot's weights moved


class BankFingerprints:
    """Per-slot sums of the slot's region of the banks, in parts (see the module notes)."""

    def __init__(self, banks: SlotBanks, num_slots: int, device: torch.device) -> None:
        self._banks = banks
        # [slots, max_rank] float64: zero for an empty slot (its banks are zero)
        self._placed = torch.zeros((num_slots, banks.max_rank), dtype=torch.float64,
                                   device=device)
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
        """[max_rank] float64: the sums of ``slot``'s region in ``max_rank`` consecutive parts
        (a view of the banks, no copy). The region's length is max_rank x the modules' in + out,
        so the parts are equal."""
        with torch.inference_mode():
            return self._banks.region(slot).view(self._banks.max_rank, -1).sum(
                dim=1, dtype=torch.float64)
