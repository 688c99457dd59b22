"""The control plane's domain: aggregates, their events and the rules between them. No I/O.

Every change is an event on one aggregate, and every event names the ``actor`` who caused it.
Aggregate ids are uuid5 of a natural key (tenant name, alias name, digest, key id), so two
processes that try to create the same thing collide on the event store's unique index instead of
creating two; only a rejected registration gets a random id (each rejection is its own record).

Aggregates:

- ``Tenant``: a name, the SHA-256 of its API key (never the key; rotated as a new hash, or
  revoked: then the tenant holds no working key) and its policy (limits, signature
  requirement, trusted signing keys).
- ``BaseModel``: a registered base model: digest, tokenizer digest and the shapes of its Linear
  layers (what an adapter must fit). ``BaseName`` maps a base's name to its digest.
- ``Adapter``: a registered LoRA adapter, its registry metadata, its lifecycle state, its
  evaluation report and, once revoked, the serving side's drain/purge/unload steps.
- ``Release``: an immutable release manifest (adapter, base, tokenizer, chat template, inference
  defaults, evaluation report), named by its own digest. Routing points at releases.
- ``Alias``: a global route name, owned by a tenant (or by the operator for base-only routes),
  pointing at a stable release plus an optional canary release at a percentage, with the
  history of its previous stable releases (for rollback) and the tenants granted to resolve it
  (a grant can be removed).
- ``SigningKey``: a ticket-signing public key, by key id (a rotation is a new key); once
  retired, no gateway signs with it and no host trusts it.
- ``RegistrationRejection``: one refused registration, kept for the audit.

Lifecycle: draft -> candidate -> canary -> stable -> deprecated; revoked from any state (final).
Each move has a guard (``lifecycle_guard``); only canary and stable releases are servable.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import asdict, dataclass, field
from typing import Any
from uuid import UUID, uuid5

from eventsourcing.domain import Aggregate, event

# Fixed namespace for deterministic aggregate ids. Never change it: ids derive from it.
NAMESPACE = UUID("6f1c1b2e-4d0a-5c57-9a3e-7c1f0e3b9d42")

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
_DIGEST_RE = re.compile(r"^sha256:[0-9a-f]{64}$")

# Adapter lifecycle: the table is the whole rule set for which moves exist; the guards below say
# what each move needs. "revoked" is reachable from every state (its own command) and is final.
DRAFT = "draft"
CANDIDATE = "candidate"
CANARY = "canary"
STABLE = "stable"
DEPRECATED = "deprecated"
REVOKED = "revoked"
LIFECYCLE = (DRAFT, CANDIDATE, CANARY, STABLE, DEPRECATED)
TRANSITIONS: dict[str, frozenset[str]] = {
    DRAFT: frozenset({CANDIDATE}),
    CANDIDATE: frozenset({CANARY, DEPRECATED}),
    CANARY: frozenset({STABLE, DEPRECATED}),  # a canary can be abandoned
    STABLE: frozenset({DEPRECATED}),
    DEPRECATED: frozenset(),
    REVOKED: frozenset(),
}
# Tickets resolve only to releases whose adapter is in one of these states.
SERVABLE_STATES = frozenset({CANARY, STABLE})
# The serving side's steps after a revocation, in order, per host.
SERVING_STEPS = ("drained", "purged", "unloaded")
MAX_CANARY_PERCENT = 100


class DomainError(Exception):
    """A command broke a rule; nothing was recorded."""


class NotFound(DomainError):
    """The named tenant, alias, base, adapter or release does not exist."""


class AlreadyExists(DomainError):
    """A tenant, base, adapter, alias or key with that identity exists already."""


class Conflict(DomainError):
    """Another command changed the same aggregate first; nothing was recorded. Retry."""


class IllegalTransition(DomainError):
    """The adapter's lifecycle (or an alias's state) does not allow that move."""


class ValidationFailed(DomainError):
    """An adapter failed the named validation ``check``.

    ``message`` is safe to show the registering tenant: it names the check and what was
    expected, never a store path or another tenant.
    """

    def __init__(self, check: str, message: str) -> None:
        super().__init__(f"{check}: {message}")
        self.check = check
        self.message = message


# ---------------------------------------------------------------------------------------------
# Pure rules


def check_name(kind: str, value: str) -> str:
    """Return ``value`` if it is a valid tenant/alias/base/key name, else raise DomainError."""
    if not isinstance(value, str) or not NAME_RE.match(value):
        raise DomainError(
            f"invalid {kind} name: use 1-64 characters from A-Z a-z 0-9 . _ -, "
            "starting with a letter or digit"
        )
    return value


def check_actor(actor: str) -> str:
    """Every event names who caused it; an empty actor is refused."""
    if not isinstance(actor, str) or not actor.strip():
        raise DomainError("actor is required")
    return actor


def hash_api_key(api_key: str) -> str:
    """The only form in which an API key is ever stored: hex SHA-256."""
    return hashlib.sha256(api_key.encode("utf-8")).hexdigest()


def check_transition(current: str, to: str) -> None:
    """Raise IllegalTransition unless the lifecycle table allows ``current`` -> ``to``."""
    if to == REVOKED:
        raise IllegalTransition("revocation is its own command (adapter revoke), not a promotion")
    if to not in TRANSITIONS:
        raise IllegalTransition(
            f"unknown state {to!r}; the lifecycle is {' -> '.join(LIFECYCLE)}")
    if to not in TRANSITIONS.get(current, frozenset()):
        allowed = sorted(TRANSITIONS.get(current, frozenset()))
        nexts = ", ".join(allowed) if allowed else "nothing"
        raise IllegalTransition(
            f"cannot move an adapter from {current!r} to {to!r} (from {current!r}: {nexts})")


def next_state(current: str) -> str:
    """The next state along the main line draft -> candidate -> canary -> stable -> deprecated."""
    if current in LIFECYCLE[:-1]:
        return LIFECYCLE[LIFECYCLE.index(current) + 1]
    raise IllegalTransition(f"an adapter in state {current!r} has no next state")


def is_servable(adapter_state: str | None) -> bool:
    """A release is servable when it is the base alone (``None``) or a canary/stable adapter."""
    return adapter_state is None or adapter_state in SERVABLE_STATES


def canary_bucket(tenant: str, session: str) -> int:
    """The bucket 0..99 of (tenant, session id): the same session always lands in one bucket."""
    h = hashlib.sha256(f"{tenant}\0{session}".encode()).digest()
    return int.from_bytes(h[:8], "big") % 100


def choose_release(stable: str | None, canary: str | None, percent: int,
                   bucket: int) -> list[str]:
    """The releases to try for one resolution, preferred first.

    The bucket picks the canary for ``percent`` per cent of sessions; with no stable release the
    canary takes every session. The other release follows as a fallback (used only when the
    preferred one is no longer servable, e.g. revoked).
    """
    if canary is not None and (stable is None or bucket < percent):
        order = [canary, stable]
    else:
        order = [stable, canary]
    return [r for r in order if r is not None]


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

    def __post_init__(self) -> None:
        for name in ("max_adapters", "max_file_bytes", "max_rank"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise DomainError(f"policy {name} must be a positive integer")
        if not isinstance(self.allowed_target_modules, dict) or not all(
            isinstance(k, str) and _DIGEST_RE.match(k) and isinstance(v, list) and v
            and all(isinstance(m, str) and NAME_RE.match(m) for m in v)
            for k, v in self.allowed_target_modules.items()
        ):
            raise DomainError("policy allowed_target_modules must map base digests to "
                              "non-empty lists of module names")
        if not all(isinstance(k, str) and "-----BEGIN " in k for k in self.trusted_keys):
            raise DomainError("policy trusted_keys must be PEM public keys or certificates")
        if self.require_signature and not self.trusted_keys:
            raise DomainError("a policy that requires signatures needs at least one trusted key")

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any] | None) -> TenantPolicy:
        return cls(**(data or {}))


@dataclass(frozen=True)
class AdapterMetadata:
    """Registry metadata an operator records with an adapter (created time is the event's)."""

    owner: str = ""
    training_data_version: str = ""
    allowed_tasks: list[str] = field(default_factory=list)
    licence: str = ""

    def __post_init__(self) -> None:
        for name in ("owner", "training_data_version", "licence"):
            v = getattr(self, name)
            if not isinstance(v, str) or len(v) > 200 or any(ord(c) < 32 for c in v):
                raise DomainError(f"{name} must be text of at most 200 printable characters")
        if not isinstance(self.allowed_tasks, list) or not all(
                isinstance(t, str) and NAME_RE.match(t) for t in self.allowed_tasks):
            raise DomainError("allowed_tasks must be task names (A-Z a-z 0-9 . _ -)")

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def lifecycle_guard(adapter: Adapter, to: str, policy: TenantPolicy) -> None:
    """Raise IllegalTransition unless ``adapter`` may move to ``to`` now.

    - candidate: validation passed (every registered adapter passed it; a refused one was never
      registered) and, where the tenant's policy demands one, a verified signature;
    - canary: an evaluation report is recorded;
    - stable: the adapter went through a canary phase (the table only allows canary -> stable).
    """
    check_transition(adapter.state, to)
    if to == CANDIDATE:
        if not adapter.validated:
            raise IllegalTransition("candidate needs a passed validation")
        if policy.require_signature and adapter.signature is None:
            raise IllegalTransition(
                "candidate needs a verified signature: the tenant's policy requires signed "
                "adapters (register it again with --signature)")
    elif to == CANARY:
        if adapter.evaluation_report is None:
            raise IllegalTransition(
                "canary needs a recorded evaluation report (adapter evaluate DIGEST REPORT.json)")
    elif to == STABLE and not adapter.had_canary:
        raise IllegalTransition("stable needs a canary phase first")


def _id(kind: str, key: str) -> UUID:
    return uuid5(NAMESPACE, f"{kind}:{key}")


def tenant_id(name: str) -> UUID:
    return _id("tenant", name)


def base_id(digest: str) -> UUID:
    return _id("base", digest)


def base_name_id(name: str) -> UUID:
    return _id("base-name", name)


def adapter_id(digest: str) -> UUID:
    return _id("adapter", digest)


def release_id(digest: str) -> UUID:
    return _id("release", digest)


def alias_id(name: str) -> UUID:
    return _id("alias", name)


def signing_key_id(kid: str) -> UUID:
    return _id("signing-key", kid)


# ---------------------------------------------------------------------------------------------
# Aggregates


class Tenant(Aggregate):
    class TenantCreated(Aggregate.Created):
        name: str
        api_key_hash: str
        actor: str

    class TenantPolicySet(Aggregate.Event):
        tenant: str
        policy: dict[str, Any]
        actor: str

    class ApiKeyRotated(Aggregate.Event):
        """The tenant's key is now the one hashed here; every earlier key stops working."""

        tenant: str
        api_key_hash: str
        actor: str

    class ApiKeysRevoked(Aggregate.Event):
        """Every key of the tenant stops working; a rotation issues the next one."""

        tenant: str
        reason: str
        actor: str

    @staticmethod
    def create_id(name: str) -> UUID:
        return tenant_id(name)

    @event(TenantCreated)
    def __init__(self, name: str, api_key_hash: str, actor: str) -> None:
        self.name = name
        self.api_key_hash: str | None = api_key_hash
        self.policy_json: dict[str, Any] = {}

    @classmethod
    def create(cls, name: str, api_key: str, actor: str) -> Tenant:
        """A new tenant; only the hash of ``api_key`` is recorded."""
        return cls(name=check_name("tenant", name), api_key_hash=hash_api_key(api_key),
                   actor=check_actor(actor))

    @property
    def policy(self) -> TenantPolicy:
        return TenantPolicy.from_json(getattr(self, "policy_json", {}))

    def set_policy(self, policy: TenantPolicy, actor: str) -> None:
        """Replace the tenant's policy (limits apply to later registrations)."""
        self._policy_set(tenant=self.name, policy=policy.to_json(), actor=check_actor(actor))

    @event(TenantPolicySet)
    def _policy_set(self, tenant: str, policy: dict[str, Any], actor: str) -> None:
        self.policy_json = policy

    def rotate_api_key(self, api_key: str, actor: str) -> None:
        """Replace the tenant's key by ``api_key`` (only its hash is recorded); also after a
        revocation, which is how a tenant gets a working key again."""
        self._key_rotated(tenant=self.name, api_key_hash=hash_api_key(api_key),
                          actor=check_actor(actor))

    @event(ApiKeyRotated)
    def _key_rotated(self, tenant: str, api_key_hash: str, actor: str) -> None:
        self.api_key_hash = api_key_hash

    def revoke_api_keys(self, reason: str, actor: str) -> None:
        """Withdraw every key of the tenant; refused when it holds none (nothing to record)."""
        if self.api_key_hash is None:
            raise IllegalTransition("the tenant holds no API key (rotate to issue one)")
        self._keys_revoked(tenant=self.name, reason=reason.strip(), actor=check_actor(actor))

    @event(ApiKeysRevoked)
    def _keys_revoked(self, tenant: str, reason: str, actor: str) -> None:
        self.api_key_hash = None


class BaseModel(Aggregate):
    class BaseRegistered(Aggregate.Created):
        name: str
        digest: str
        tokenizer_digest: str
        linear_shapes: dict[str, list[int]]
        actor: str

    @staticmethod
    def create_id(digest: str) -> UUID:
        return base_id(digest)

    @event(BaseRegistered)
    def __init__(
        self,
        name: str,
        digest: str,
        tokenizer_digest: str,
        linear_shapes: dict[str, list[int]],
        actor: str,
    ) -> None:
        self.name = name
        self.digest = digest
        self.tokenizer_digest = tokenizer_digest
        self.linear_shapes = linear_shapes

    @classmethod
    def register(
        cls,
        name: str,
        digest: str,
        tokenizer_digest: str,
        linear_shapes: dict[str, list[int]],
        actor: str,
    ) -> BaseModel:
        if not linear_shapes:
            raise DomainError("base model has no Linear weights")
        return cls(name=check_name("base", name), digest=digest,
                   tokenizer_digest=tokenizer_digest, linear_shapes=linear_shapes,
                   actor=check_actor(actor))


class BaseName(Aggregate):
    """Name -> digest index for base models (a name is taken once)."""

    class BaseNamed(Aggregate.Created):
        name: str
        digest: str
        actor: str

    @staticmethod
    def create_id(name: str) -> UUID:
        return base_name_id(name)

    @event(BaseNamed)
    def __init__(self, name: str, digest: str, actor: str) -> None:
        self.name = name
        self.digest = digest


class Adapter(Aggregate):
    class AdapterRegistered(Aggregate.Created):
        tenant: str
        digest: str
        base_digest: str
        tokenizer_digest: str
        rank: int
        target_modules: list[str]
        alias: str
        metadata: dict[str, Any]
        signature: dict[str, Any] | None
        actor: str

    # Later events repeat the natural key (digest, alias name) so that each event reads on its
    # own in the audit log and in projections.
    class EvaluationRecorded(Aggregate.Event):
        digest: str
        report_digest: str
        summary: dict[str, Any]
        actor: str

    class AdapterPromoted(Aggregate.Event):
        digest: str
        from_state: str
        to: str
        release: str | None
        actor: str

    class AdapterRevoked(Aggregate.Event):
        digest: str
        reason: str
        actor: str

    class AdapterDrained(Aggregate.Event):
        digest: str
        host: str
        actor: str

    class AdapterPurged(Aggregate.Event):
        digest: str
        host: str
        actor: str

    class AdapterUnloaded(Aggregate.Event):
        digest: str
        host: str
        actor: str

    @staticmethod
    def create_id(digest: str) -> UUID:
        return adapter_id(digest)

    @event(AdapterRegistered)
    def __init__(
        self,
        tenant: str,
        digest: str,
        base_digest: str,
        tokenizer_digest: str,
        rank: int,
        target_modules: list[str],
        alias: str,
        metadata: dict[str, Any],
        signature: dict[str, Any] | None,
        actor: str,
    ) -> None:
        self.tenant = tenant
        self.digest = digest
        self.base_digest = base_digest
        self.tokenizer_digest = tokenizer_digest
        self.rank = rank
        self.target_modules = target_modules
        self.alias = alias
        self.metadata = metadata
        self.signature = signature
        # Registration happens only after every validation check passed.
        self.validated = True
        self.state = DRAFT
        self.had_canary = False
        self.evaluation_report: str | None = None
        self.release: str | None = None
        self.revoke_reason: str | None = None
        self.serving_steps: dict[str, list[str]] = {}  # host -> steps done, in order

    @property
    def revoked(self) -> bool:
        return self.state == REVOKED

    def record_evaluation(self, report_digest: str, summary: dict[str, Any], actor: str) -> None:
        """Record an evaluation report (content-addressed); the latest one counts."""
        if self.state in (REVOKED, DEPRECATED, STABLE):
            raise IllegalTransition(f"an adapter in state {self.state!r} takes no evaluation")
        self._evaluated(digest=self.digest, report_digest=report_digest, summary=summary,
                        actor=check_actor(actor))

    @event(EvaluationRecorded)
    def _evaluated(self, digest: str, report_digest: str, summary: dict[str, Any],
                   actor: str) -> None:
        self.evaluation_report = report_digest

    def promote(self, to: str, actor: str, policy: TenantPolicy | None = None,
                release: str | None = None) -> None:
        """Move along the lifecycle; raise IllegalTransition (recording nothing) if the table
        or the move's guard does not allow it. Entering canary names the release manifest."""
        lifecycle_guard(self, to, policy or TenantPolicy())
        if to == CANARY and release is None:
            raise DomainError("entering canary needs a release manifest")
        self._promoted(digest=self.digest, from_state=self.state, to=to,
                       release=release if to == CANARY else None, actor=check_actor(actor))

    @event(AdapterPromoted)
    def _promoted(self, digest: str, from_state: str, to: str, release: str | None,
                  actor: str) -> None:
        self.state = to
        if to == CANARY:
            self.had_canary = True
            self.release = release

    def revoke(self, reason: str, actor: str) -> None:
        """Revoke from any state; revoking twice is refused."""
        if self.state == REVOKED:
            raise IllegalTransition("adapter is already revoked")
        if not reason.strip():
            raise DomainError("a revocation needs a reason")
        self._revoked(digest=self.digest, reason=reason, actor=check_actor(actor))

    @event(AdapterRevoked)
    def _revoked(self, digest: str, reason: str, actor: str) -> None:
        self.state = REVOKED
        self.revoke_reason = reason

    def record_serving_step(self, host: str, step: str, actor: str) -> None:
        """Record that ``host`` drained, purged or unloaded this revoked adapter, in that order.

        Repeating the last recorded step is refused (AlreadyExists) so retries stay visible.
        """
        if self.state != REVOKED:
            raise IllegalTransition("serving steps are recorded only for a revoked adapter")
        if step not in SERVING_STEPS:
            raise DomainError(f"unknown serving step {step!r}; one of {', '.join(SERVING_STEPS)}")
        check_name("host", host)
        done = self.serving_steps.get(host, [])
        if step in done:
            raise AlreadyExists(f"host {host!r} already reported {step!r}")
        expected = SERVING_STEPS[len(done)]
        if step != expected:
            raise IllegalTransition(f"host {host!r} must report {expected!r} before {step!r}")
        handler = {"drained": self._drained, "purged": self._purged,
                   "unloaded": self._unloaded}[step]
        handler(digest=self.digest, host=host, actor=check_actor(actor))

    @event(AdapterDrained)
    def _drained(self, digest: str, host: str, actor: str) -> None:
        self.serving_steps.setdefault(host, []).append("drained")

    @event(AdapterPurged)
    def _purged(self, digest: str, host: str, actor: str) -> None:
        self.serving_steps.setdefault(host, []).append("purged")

    @event(AdapterUnloaded)
    def _unloaded(self, digest: str, host: str, actor: str) -> None:
        self.serving_steps.setdefault(host, []).append("unloaded")


class Release(Aggregate):
    """An immutable release manifest; its id derives from the manifest's digest."""

    class ReleaseCreated(Aggregate.Created):
        digest: str
        tenant: str | None  # None: an operator's base-only release
        adapter_digest: str | None
        base_digest: str
        tokenizer_digest: str
        chat_template_digest: str | None
        inference_defaults: dict[str, Any]
        evaluation_report_digest: str | None
        actor: str

    @staticmethod
    def create_id(digest: str) -> UUID:
        return release_id(digest)

    @event(ReleaseCreated)
    def __init__(
        self,
        digest: str,
        tenant: str | None,
        adapter_digest: str | None,
        base_digest: str,
        tokenizer_digest: str,
        chat_template_digest: str | None,
        inference_defaults: dict[str, Any],
        evaluation_report_digest: str | None,
        actor: str,
    ) -> None:
        self.digest = digest
        self.tenant = tenant
        self.adapter_digest = adapter_digest
        self.base_digest = base_digest
        self.tokenizer_digest = tokenizer_digest
        self.chat_template_digest = chat_template_digest
        self.inference_defaults = inference_defaults
        self.evaluation_report_digest = evaluation_report_digest


class Alias(Aggregate):
    """A route name. ``owner`` is a tenant, or ``None`` for an operator's base-only alias.

    ``stable`` and ``canary`` are release manifest digests; ``history`` the stable releases it
    pointed at before, most recent last (rollback pops it).
    """

    class AliasCreated(Aggregate.Created):
        name: str
        owner: str | None
        release: str | None
        actor: str

    class AliasPointed(Aggregate.Event):
        alias: str
        release: str
        previous: str | None
        actor: str

    class AliasCanarySet(Aggregate.Event):
        alias: str
        release: str
        percent: int
        actor: str

    class AliasCanaryCleared(Aggregate.Event):
        alias: str
        actor: str

    class AliasRolledBack(Aggregate.Event):
        alias: str
        from_release: str | None
        to_release: str
        actor: str

    class AliasGranted(Aggregate.Event):
        alias: str
        tenant: str
        actor: str

    class AliasGrantRemoved(Aggregate.Event):
        alias: str
        tenant: str
        actor: str

    @staticmethod
    def create_id(name: str) -> UUID:
        return alias_id(name)

    @event(AliasCreated)
    def __init__(self, name: str, owner: str | None, release: str | None, actor: str) -> None:
        self.name = name
        self.owner = owner
        self.stable = release
        self.canary: str | None = None
        self.canary_percent = 0
        self.history: list[str] = []
        self.grants: list[str] = []

    @classmethod
    def create(cls, name: str, owner: str | None, release: str | None, actor: str) -> Alias:
        return cls(name=check_name("alias", name), owner=owner, release=release,
                   actor=check_actor(actor))

    def _check_release(self, release: Release, servable: bool, what: str) -> None:
        # "Not owned" is phrased without naming the release's tenant.
        if release.tenant is not None and release.tenant != self.owner:
            raise DomainError("release does not belong to the alias owner")
        if not servable:
            raise IllegalTransition(
                f"cannot point an alias's {what} at a release whose adapter is not servable "
                "(only canary and stable adapters are; revoked and deprecated never)")

    def point(self, release: Release, servable: bool, actor: str) -> None:
        """Make ``release`` the stable release (the previous one goes to the history)."""
        self._check_release(release, servable, "stable release")
        if release.digest == self.stable:
            raise IllegalTransition("the alias already points at that release")
        self._pointed(alias=self.name, release=release.digest, previous=self.stable,
                      actor=check_actor(actor))

    @event(AliasPointed)
    def _pointed(self, alias: str, release: str, previous: str | None, actor: str) -> None:
        if previous is not None:
            self.history.append(previous)
        self.stable = release
        if self.canary == release:  # the canary graduated
            self.canary = None
            self.canary_percent = 0

    def set_canary(self, release: Release, percent: int, servable: bool, actor: str) -> None:
        """Send ``percent`` per cent of sessions (by tenant+session hash) to ``release``."""
        self._check_release(release, servable, "canary")
        if not isinstance(percent, int) or isinstance(percent, bool) or not (
                0 < percent <= MAX_CANARY_PERCENT):
            raise DomainError("canary percent must be an integer from 1 to 100")
        if release.digest == self.stable:
            raise IllegalTransition("that release is already the alias's stable release")
        self._canary_set(alias=self.name, release=release.digest, percent=percent,
                         actor=check_actor(actor))

    @event(AliasCanarySet)
    def _canary_set(self, alias: str, release: str, percent: int, actor: str) -> None:
        self.canary = release
        self.canary_percent = percent

    def clear_canary(self, actor: str) -> None:
        """Stop the canary split: every session resolves to the stable release."""
        if self.canary is None:
            raise IllegalTransition("the alias has no canary")
        self._canary_cleared(alias=self.name, actor=check_actor(actor))

    @event(AliasCanaryCleared)
    def _canary_cleared(self, alias: str, actor: str) -> None:
        self.canary = None
        self.canary_percent = 0

    def rollback(self, previous_servable: bool, actor: str) -> None:
        """Point back at the previous stable release (one step of the history)."""
        if not self.history:
            raise IllegalTransition("the alias has no previous release to roll back to")
        if not previous_servable:
            raise IllegalTransition(
                "the previous release is no longer servable (revoked or deprecated); "
                "point the alias at a release explicitly")
        self._rolled_back(alias=self.name, from_release=self.stable,
                          to_release=self.history[-1], actor=check_actor(actor))

    @event(AliasRolledBack)
    def _rolled_back(self, alias: str, from_release: str | None, to_release: str,
                     actor: str) -> None:
        self.history.pop()
        self.stable = to_release

    def grant(self, tenant: str, actor: str) -> None:
        """Let ``tenant`` resolve this alias. The owner is not granted implicitly."""
        if tenant in self.grants:
            raise AlreadyExists("tenant is already granted this alias")
        self._granted(alias=self.name, tenant=tenant, actor=check_actor(actor))

    @event(AliasGranted)
    def _granted(self, alias: str, tenant: str, actor: str) -> None:
        self.grants.append(tenant)

    def remove_grant(self, tenant: str, actor: str) -> None:
        """Stop ``tenant`` resolving this alias (tickets already issued run out on their own)."""
        if tenant not in self.grants:
            raise NotFound("that tenant holds no grant of this alias")
        self._grant_removed(alias=self.name, tenant=tenant, actor=check_actor(actor))

    @event(AliasGrantRemoved)
    def _grant_removed(self, alias: str, tenant: str, actor: str) -> None:
        self.grants.remove(tenant)

    def may_resolve(self, tenant: str) -> bool:
        return tenant in self.grants


class SigningKey(Aggregate):
    class SigningKeyRecorded(Aggregate.Created):
        kid: str
        public_key_b64: str
        actor: str

    class SigningKeyRetired(Aggregate.Event):
        """No gateway signs with this key any more, and no host accepts tickets it signed."""

        kid: str
        reason: str
        actor: str

    @staticmethod
    def create_id(kid: str) -> UUID:
        return signing_key_id(kid)

    @event(SigningKeyRecorded)
    def __init__(self, kid: str, public_key_b64: str, actor: str) -> None:
        self.kid = kid
        self.public_key_b64 = public_key_b64
        self.retired = False

    def retire(self, reason: str, actor: str) -> None:
        """Retire the key for good (a key id is never reused); retiring twice is refused."""
        if self.retired:
            raise IllegalTransition(f"signing key {self.kid!r} is already retired")
        self._retired(kid=self.kid, reason=reason.strip(), actor=check_actor(actor))

    @event(SigningKeyRetired)
    def _retired(self, kid: str, reason: str, actor: str) -> None:
        self.retired = True


class RegistrationRejection(Aggregate):
    """One refused adapter registration (random id: every refusal is its own record)."""

    class RegistrationRejected(Aggregate.Created):
        check: str
        message: str
        tenant: str
        actor: str

    @event(RegistrationRejected)
    def __init__(self, check: str, message: str, tenant: str, actor: str) -> None:
        self.check = check
        self.message = message
        self.tenant = tenant


def event_fields(domain_event: Any) -> dict[str, Any]:
    """The payload of a domain event: its fields minus the library's bookkeeping."""
    skip = {"originator_id", "originator_version", "timestamp", "originator_topic"}
    return {k: v for k, v in domain_event.__dict__.items() if k not in skip}
