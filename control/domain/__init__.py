"""The control plane's domain: aggregates, their events and the rules between them. No I/O.

Every change is an event on one aggregate, and every event names the ``actor`` who caused it.
Aggregate ids are uuid5 of a natural key (``ids``), so two processes that try to create the same
thing collide on the event store's unique index instead of creating two; only a rejected
registration gets a random id (each rejection is its own record).

One aggregate per module:

- ``tenant.Tenant``: a name, the SHA-256 of its API key (never the key; rotated as a new hash,
  or revoked: then the tenant holds no working key) and its policy (``policy.TenantPolicy``:
  limits, signature requirement, trusted signing keys).
- ``base_model.BaseModel``: a registered base model: digest, tokenizer digest and the shapes of
  its Linear layers (what an adapter must fit). ``base_model.BaseName`` maps a base's name to
  its digest.
- ``adapter.Adapter``: a registered LoRA adapter, its registry metadata, its lifecycle state,
  its evaluation report and, once revoked, the serving side's drain/purge/unload steps.
- ``release.Release``: an immutable ``release.ReleaseManifest`` (adapter, base, tokenizer, chat
  template, inference defaults, evaluation report), named by its own digest. Routing points at
  releases.
- ``alias.Alias``: a global route name, owned by a tenant (or by the operator for base-only
  routes), pointing at a stable release plus an optional canary release at a percentage, with
  the history of its previous stable releases (for rollback) and the tenants granted to resolve
  it (a grant can be removed).
- ``signing_key.SigningKey``: a ticket-signing public key, by key id (a rotation is a new key);
  once retired, no gateway signs with it and no host trusts it.
- ``rejection.RegistrationRejection``: one refused registration, kept for the audit.
- ``rollout.Rollout``: one automatic canary of a target release on an alias: its steps, each
  window's figures and decision, pauses, and how it ended (completed or rolled back), with the
  rules that judge a window (``rollout.judge_window``, ``rollout.RolloutPolicy``).
- ``upgrade.BaseUpgrade``: one base-upgrade plan: every approved adapter of a base gated on a
  new base, the adapter x {old base, new base} matrix, and which adapters may move (only those
  that passed; the rest stay on their verified old combination).
- ``session.SessionPin``: the release one session (tenant, alias, session id) keeps until it
  ends or its pin expires; re-pinned, with the reason, when its release stops being servable
  (``session.Pin``: one pin as a value, what views and commands pass around).

Pure rules beside them: ``lifecycle`` (draft -> candidate -> canary -> stable -> deprecated;
revoked from any state, final; each move guarded by ``lifecycle_guard``; only canary and stable
releases are servable), ``canary`` (which release a session gets), ``names``, ``errors``,
``gate`` (the evaluation gate's thresholds, figures and judgement, and the base + tokenizer +
chat template combination a gate report vouches for), ``events`` (an event's payload) and
``fallback`` (what an alias serves after a revocation: its policy ``stable``, ``base`` or
``none``). ``topics`` keeps the topics of events stored before this package was split
resolving.

This module is the package's public face: import from ``control.domain``.
"""

from __future__ import annotations

from control.domain.adapter import Adapter, AdapterMetadata
from control.domain.alias import Alias
from control.domain.base_model import BaseModel, BaseName
from control.domain.canary import MAX_CANARY_PERCENT, canary_bucket, choose_release
from control.domain.errors import (
    AlreadyExists,
    Conflict,
    DomainError,
    IllegalTransition,
    NotFound,
    ValidationFailed,
)
from control.domain.events import event_fields
from control.domain.fallback import (
    DEFAULT_FALLBACK,
    FallbackOutcome,
    FallbackPolicy,
    check_policy,
    fall_back,
)
from control.domain.gate import (
    Combination,
    GateFigures,
    GatePolicy,
    RuleVerdict,
    check_overrides,
    effective_policy,
    judge,
)
from control.domain.ids import (
    NAMESPACE,
    adapter_id,
    alias_id,
    base_id,
    base_name_id,
    release_id,
    session_pin_id,
    signing_key_id,
    tenant_id,
)
from control.domain.lifecycle import (
    CANARY,
    CANDIDATE,
    DEPRECATED,
    DRAFT,
    LIFECYCLE,
    REVOKED,
    SERVABLE_STATES,
    SERVING_STEPS,
    STABLE,
    TRANSITIONS,
    AdapterState,
    Promotable,
    check_transition,
    is_servable,
    lifecycle_guard,
    next_state,
)
from control.domain.names import NAME_RE, check_actor, check_name
from control.domain.policy import TenantPolicy
from control.domain.rejection import RegistrationRejection
from control.domain.release import MANIFEST_KIND, Release, ReleaseManifest
from control.domain.rollout import (
    Decision,
    ProbeReport,
    Rollout,
    RolloutPolicy,
    RolloutStatus,
    Sessions,
    judge_window,
    rollout_id,
)
from control.domain.session import (
    SESSION_RE,
    Pin,
    RepinReason,
    SessionPin,
    check_session,
    effective_release,
    why_repin,
)
from control.domain.signing_key import SigningKey
from control.domain.tenant import Tenant, hash_api_key
from control.domain.topics import register_former_topics
from control.domain.upgrade import (
    BaseUpgrade,
    CellVerdict,
    NewSide,
    OldSide,
    PlanStatus,
    UpgradeCell,
    is_approved,
    upgrade_id,
)

# Events already stored name the classes by their former module (``control.domain:Tenant...``).
register_former_topics()

__all__ = [
    "CANARY",
    "CANDIDATE",
    "DEFAULT_FALLBACK",
    "DEPRECATED",
    "DRAFT",
    "LIFECYCLE",
    "MANIFEST_KIND",
    "MAX_CANARY_PERCENT",
    "NAMESPACE",
    "NAME_RE",
    "REVOKED",
    "SERVABLE_STATES",
    "SERVING_STEPS",
    "SESSION_RE",
    "STABLE",
    "TRANSITIONS",
    "Adapter",
    "AdapterMetadata",
    "AdapterState",
    "Alias",
    "AlreadyExists",
    "BaseModel",
    "BaseName",
    "BaseUpgrade",
    "CellVerdict",
    "Combination",
    "Conflict",
    "Decision",
    "DomainError",
    "FallbackOutcome",
    "FallbackPolicy",
    "GateFigures",
    "GatePolicy",
    "IllegalTransition",
    "NewSide",
    "NotFound",
    "OldSide",
    "Pin",
    "PlanStatus",
    "ProbeReport",
    "Promotable",
    "RegistrationRejection",
    "Release",
    "ReleaseManifest",
    "RepinReason",
    "Rollout",
    "RolloutPolicy",
    "RolloutStatus",
    "RuleVerdict",
    "SessionPin",
    "Sessions",
    "SigningKey",
    "Tenant",
    "TenantPolicy",
    "UpgradeCell",
    "ValidationFailed",
    "adapter_id",
    "alias_id",
    "base_id",
    "base_name_id",
    "canary_bucket",
    "check_actor",
    "check_name",
    "check_overrides",
    "check_policy",
    "check_session",
    "check_transition",
    "choose_release",
    "effective_policy",
    "effective_release",
    "event_fields",
    "fall_back",
    "hash_api_key",
    "is_approved",
    "is_servable",
    "judge",
    "judge_window",
    "lifecycle_guard",
    "next_state",
    "release_id",
    "rollout_id",
    "session_pin_id",
    "signing_key_id",
    "tenant_id",
    "upgrade_id",
    "why_repin",
]
