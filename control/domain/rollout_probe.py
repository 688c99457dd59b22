"""What preloading and health-probing a rollout's target on the Triton hosts showed, before a step.

The controller's probe (``control.ops.rollout_controller.TritonProbe``) sends real requests on a
ticket for the alias owner and the target release; the report is recorded with the step it let
begin (``RolloutStepEntered``) or the failure it stopped (``RolloutProbeFailed``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class ProbeReport:
    """What preloading and probing the target on the hosts showed, before a step.

    ``requests``/``ok``: probe requests sent and answered ok by the target's own adapter (the
    answer's digest, read from the slot, equal to the target's); ``load_failures`` and
    ``identity_mismatches``: what the ledger recorded for the target while the probe ran;
    ``errors``: one short line per failed request (no tenant data: the probe is the owner's)."""

    hosts: list[str]
    requests: int
    ok: int
    load_failures: int = 0
    identity_mismatches: int = 0
    p95_latency_s: float | None = None
    errors: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return bool(self.hosts) and self.requests > 0 and self.ok == self.requests and not (
            self.load_failures or self.identity_mismatches)

    @property
    def decisive(self) -> bool:
        """It failed for the target's own fault (a load failure, a mismatch): no retry."""
        return bool(self.load_failures or self.identity_mismatches)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def reasons(self) -> list[str]:
        """Why the probe failed (empty when it passed)."""
        out = []
        if not self.hosts:
            out.append("no Triton host to probe")
        if self.load_failures:
            out.append(f"load failures: {self.load_failures} failed loads of the target")
        if self.identity_mismatches:
            out.append(f"identity mismatches: {self.identity_mismatches}")
        if self.hosts and self.ok < self.requests:
            out.append(f"probe answered {self.ok} of {self.requests} requests"
                       + (f": {self.errors[0]}" if self.errors else ""))
        return out
