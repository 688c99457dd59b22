"""A tenant's policy: the limits and the signature rule checked at registration and promotion."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from control.contracts.config import PLACEMENT_NAME_RE, SHARED_POOL
from control.contracts.digests import DIGEST_RE
from control.domain.errors import DomainError
from control.domain.names import NAME_RE

SHARED = SHARED_POOL
DEDICATED = "dedicated:"


@dataclass(frozen=True)
class TenantPolicy:
    """Per-tenant rules checked at registration and promotion.

    ``None`` means "no tenant-specific limit" (the deployment's defaults still apply).
    ``allowed_target_modules`` maps a base digest to the module names adapters on that base may
    target; a base missing from the map is unrestricted. ``trusted_keys`` are PEM public keys
    (or CA certificates) that may sign this tenant's adapters.
    """

    require_signature: bool = False
    max_adapters: int | None = None
    max_file_bytes: int | None = None
    max_rank: int | None = None
    allowed_target_modules: dict[str, list[str]] = field(default_factory=dict)
    trusted_keys: list[str] = field(default_factory=list)
    # Placement (issue 25): ``shared``, or ``dedicated:<pool>``: the tenant's adapters and
    # prompts run only on hosts of that pool; ``regions``: where they may run (empty: anywhere).
    isolation: str = SHARED
    regions: list[str] = field(default_factory=list)
    # Fair sharing of each host's adapter cache (issue 24; None: the host's defaults,
    # LORAPLANE_TENANT_RESIDENT_SHARE and 120 loads a minute): the part of a host's adapter
    # memory this tenant's adapters may hold, counted by ownership, and the cold loads a minute
    # its requests may start on one host.
    resident_share: float | None = None
    loads_per_minute: float | None = None
    # How many Triton hosts may hold one of this tenant's adapters in a device slot at once
    # (issue 25; None: no bound). Claimed through ``control.contracts.replica_claims``.
    max_replicas: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_adapters", "max_file_bytes", "max_rank", "max_replicas"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise DomainError(f"policy {name} must be a positive integer")
        if not isinstance(self.allowed_target_modules, dict) or not all(
            isinstance(k, str) and DIGEST_RE.match(k) and isinstance(v, list) and v
            and all(isinstance(m, str) and NAME_RE.match(m) for m in v)
            for k, v in self.allowed_target_modules.items()
        ):
            raise DomainError("policy allowed_target_modules must map base digests to "
                              "non-empty lists of module names")
        if not all(isinstance(k, str) and "-----BEGIN " in k for k in self.trusted_keys):
            raise DomainError("policy trusted_keys must be PEM public keys or certificates")
        if self.isolation != SHARED and not (
                self.isolation.startswith(DEDICATED)
                and PLACEMENT_NAME_RE.match(self.isolation[len(DEDICATED):])):
            raise DomainError("policy isolation must be 'shared' or 'dedicated:<pool>' (a pool "
                              "name: lower-case letters, digits and dashes)")
        if not isinstance(self.regions, list) or not all(
                isinstance(r, str) and PLACEMENT_NAME_RE.match(r) for r in self.regions):
            raise DomainError("policy regions must be region names (lower-case letters, digits "
                              "and dashes)")
        if self.resident_share is not None and not (
                isinstance(self.resident_share, (int, float))
                and not isinstance(self.resident_share, bool)
                and 0.0 < self.resident_share <= 1.0):
            raise DomainError("policy resident_share must be above 0 and at most 1")
        if self.loads_per_minute is not None and not (
                isinstance(self.loads_per_minute, (int, float))
                and not isinstance(self.loads_per_minute, bool)
                and 0.0 < self.loads_per_minute <= 1e6):
            raise DomainError("policy loads_per_minute must be above 0 and at most 1000000")
        if self.require_signature and not self.trusted_keys:
            raise DomainError("a policy that requires signatures needs at least one trusted key")

    @property
    def pool(self) -> str | None:
        """The dedicated pool, or None for the shared one."""
        return self.isolation[len(DEDICATED):] if self.isolation != SHARED else None

    def to_json(self) -> dict[str, Any]:
        """The policy as recorded in a ``TenantPolicySet`` event."""
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any] | None) -> TenantPolicy:
        """The policy recorded as ``data`` (none recorded: the default policy)."""
        return cls(**(data or {}))
