"""What each slot's banks hold, as the weights themselves say: the engine's provenance record.

The slot table (``backend.serving.slots``) is bookkeeping about which load a slot was given; this
record is written where the weights are copied in and cleared where they are zeroed, apart from
that bookkeeping. Every forward pass reads it for each row (``Sequence.observed``), so a broken
generation check still cannot pass another adapter's answer as this one's; on a sample of passes
the weights are summed again (``backend.serving.fingerprint``) and a slot whose sums moved fails
its rows closed.
"""

from __future__ import annotations

from collections.abc import Sequence as Sequence_

import torch

from backend.serving.engine_types import Sequence
from backend.serving.fingerprint import CHECK_EVERY, WEIGHTS_CHANGED, BankFingerprints
from backend.serving.lease import Violations
from backend.serving.slots import SlotBanks


class SlotProvenance:
    """Slot -> the digest its banks hold (None: zero), the banks' fingerprints, and the passes
    that read them."""

    def __init__(self, banks: SlotBanks, num_slots: int, device: torch.device,
                 violations: Violations) -> None:
        self.violations = violations
        self.digests: list[str | None] = [None] * num_slots
        # The weights themselves, checked on a sample of passes (backend.serving.fingerprint).
        self.fingerprints = BankFingerprints(banks, num_slots, device)
        self.passes = 0

    def placed(self, slot: int, digest: str) -> None:
        """``digest``'s weights were just copied into ``slot``."""
        self.digests[slot] = digest
        self.fingerprints.record(slot)

    def cleared(self, slot: int) -> None:
        """``slot``'s banks were just zeroed."""
        self.digests[slot] = None
        self.fingerprints.clear(slot)

    def observe(self, seqs: Sequence_[Sequence], check_every: int = CHECK_EVERY) -> None:
        """One forward pass over ``seqs`` is about to run: each row observes what its slot holds
        now (the engine's lock keeps the weights in place until the pass returns); every
        ``check_every``-th pass (0: never) also checks the weights."""
        for s in seqs:
            s.observed.add(self.digests[s.slot])
        self.passes += 1
        if check_every and self.passes % check_every == 0:
            self.check_weights(seqs)

    def check_weights(self, seqs: Sequence_[Sequence]) -> None:
        """Rows whose slot's weights no longer sum what was placed fail closed (see
        ``backend.serving.fingerprint``)."""
        changed = set(self.fingerprints.changed(s.slot for s in seqs if s.slot))
        for s in seqs:
            if s.slot in changed:
                s.observed.add(WEIGHTS_CHANGED)
        if changed:
            self.violations.count("slot_weights", f"slots {sorted(changed)}")
