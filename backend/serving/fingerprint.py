"""Weight fingerprints of the adapter slots: the banks still hold the weights that were placed.

The slot table says which digest a slot holds, and every forward pass reads the digest its rows'
slots hold (``Sequence.observed``). Both are bookkeeping. A fingerprint checks the weights
themselves: when an adapter is placed, each target module's A and B of its slot are summed (in
float64) and kept; on a sample of forward passes (every :data:`CHECK_EVERY`-th) the sums of the
slots that pass uses are taken again, and a slot whose weights no longer sum the same (a write
into the wrong slot, a stray copy, a bug in slot reuse) makes its rows fail closed as
``identity_mismatch`` (their ``observed`` gets :data:`WEIGHTS_CHANGED`) and is counted as the
broken invariant ``slot_weights``.

Cost: a check reads the banks of the slots in the pass once (one reduction per module and bank,
over every slot at once), so it costs about one pass over those weights; taken every 64th pass it
is a small fraction of decoding (``loraplane bench engine`` reports ``fingerprint_cost``: decode
throughput with a check on every pass against none, and the sampled rate's share follows from
it). Sums are compared with a relative tolerance of 1e-9: reductions may add in another order
than at placement, and another adapter's weights differ by far more.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from backend.serving.slots import SlottedLinear

CHECK_EVERY = 64  # forward passes between checks; 0 turns the checks off
WEIGHTS_CHANGED = "weights_changed"  # what a row observes when its slot's weights moved
_RTOL = 1e-9


class BankFingerprints:
    """Per-slot sums of every target module's A and B banks (see the module notes)."""

    def __init__(self, modules: Sequence[SlottedLinear], num_slots: int,
                 device: torch.device) -> None:
        self._modules = list(modules)
        # [slots, 2 * modules] float64: zero for an empty slot (its banks are zero)
        self._placed = torch.zeros((num_slots, 2 * len(self._modules)), dtype=torch.float64,
                                   device=device)
        self.checks = 0

    def record(self, slot: int) -> None:
        """Remember what ``slot`` holds now (just after an adapter was copied in)."""
        self._placed[slot] = self._sums([slot])[0]

    def clear(self, slot: int) -> None:
        """``slot`` was zeroed."""
        self._placed[slot] = 0.0

    def changed(self, slots: Iterable[int]) -> list[int]:
        """Those of ``slots`` whose weights no longer sum what was placed."""
        wanted = sorted(set(slots))
        if not wanted:
            return []
        self.checks += 1
        now = self._sums(wanted)
        same = torch.isclose(now, self._placed[wanted], rtol=_RTOL, atol=0.0).all(dim=1)
        return [s for s, ok in zip(wanted, same.tolist(), strict=True) if not ok]

    def _sums(self, slots: list[int]) -> torch.Tensor:
        """[len(slots), 2 * modules] float64 sums, one reduction per module and bank over
        every slot, then the wanted rows (no copy of the banks)."""
        cols = []
        with torch.inference_mode():
            for m in self._modules:
                a, b = m.banks()
                cols += [a.sum(dim=(1, 2), dtype=torch.float64),
                         b.sum(dim=(1, 2), dtype=torch.float64)]
        return torch.stack(cols, dim=1)[slots]
