"""Weight fingerprints of the adapter slots: the banks still hold the weights that were placed.

The slot table says which digest a slot holds, and every forward pass reads the digest its rows'
slots hold (``Sequence.observed``). Both are bookkeeping. A fingerprint checks the weights
themselves: when an adapter is placed, each target module's A and B of its slot are summed (in
float64) and kept; on a sample of forward passes (every :data:`CHECK_EVERY`-th) one of the slots
that pass uses is summed again, in turn, and a slot whose weights no longer sum the same (a write
into the wrong slot, a stray copy, a bug in slot reuse) makes its rows fail closed as
``identity_mismatch`` (their ``observed`` gets :data:`WEIGHTS_CHANGED`) and is counted as the
broken invariant ``slot_weights``.

Cost: a check reads one slot's weights once (two reductions per target module); taken every
64th pass it is a small fraction of decoding (``loraplane bench engine`` reports
``fingerprint_every_pass_vs_off``: decode throughput with a check on every pass against none).
The check sums exactly as placement did (the same reductions over the same slot), so the sums
are compared exactly.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from backend.serving.slots import SlottedLinear

CHECK_EVERY = 64  # forward passes between checks; 0 turns the checks off
WEIGHTS_CHANGED = "weights_changed"  # what a row observes when its slot's weights moved


class BankFingerprints:
    """Per-slot sums of every target module's A and B banks (see the module notes)."""

    def __init__(self, modules: Sequence[SlottedLinear], num_slots: int,
                 device: torch.device) -> None:
        self._modules = list(modules)
        # [slots, 2 * modules] float64: zero for an empty slot (its banks are zero)
        self._placed = torch.zeros((num_slots, 2 * len(self._modules)), dtype=torch.float64,
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
        """[2 * modules] float64: the sums of ``slot``'s A and B in each module (views, no
        copy of the banks)."""
        with torch.inference_mode():
            return torch.stack([x[slot].sum(dtype=torch.float64)
                                for m in self._modules for x in m.banks()])
