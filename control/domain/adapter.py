"""The ``Adapter`` aggregate: a registered LoRA adapter and where it stands in its lifecycle.

It carries its registry metadata, its golden task set, its gate policy overrides, its gate
reports (one per base + tokenizer + chat template combination it was gated on), any evaluation
report written outside the gate, the release manifest it entered canary with and, once revoked,
the serving side's drain/purge/unload steps per host. The moves themselves are ruled by
``control.domain.lifecycle``; what a gate report must show, by ``control.domain.gate``.

Entering canary needs evidence: a passing gate report for the exact combination the canary
release is built on, or a report written outside the gate, which is accepted only when its
caller says so (``external=True``) and is recorded as external (``EvaluationRecorded.external``).
An external report never overrides a failing gate report on that combination: only an
operator's break-glass does (``BreakGlassUsed``, recorded with the move it allows, in the same
transaction). What each move needs is ``control.domain.evidence``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any
from uuid import UUID

from eventsourcing.domain import Aggregate, event

from control.domain.errors import AlreadyExists, DomainError, IllegalTransition
from control.domain.evidence import BreakGlassTarget, check_reason
from control.domain.gate import Combination, check_overrides
from control.domain.ids import adapter_id
from control.domain.lifecycle import (
    CANARY,
    CANDIDATE,
    DEPRECATED,
    DRAFT,
    REVOKED,
    SERVING_STEPS,
    STABLE,
    AdapterState,
    lifecycle_guard,
)
from control.domain.names import NAME_RE, check_actor, check_name
from control.domain.policy import TenantPolicy


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
        """The metadata as recorded in an ``AdapterRegistered`` event."""
        return asdict(self)


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
        """A report written outside the gate, accepted because its caller said so."""

        digest: str
        report_digest: str
        summary: dict[str, Any]
        external: bool
        actor: str

        # Version 2 added ``external``. Every report recorded before the gate existed was
        # written outside it: read back as external.
        class_version = 2

        @staticmethod
        def upcast_v1_v2(state: dict[str, Any]) -> None:
            state["external"] = True

    class GoldenSetRecorded(Aggregate.Event):
        """The adapter's golden task set (``control.contracts.golden``), by digest."""

        digest: str
        golden_digest: str
        family: str
        tasks: int
        actor: str

    class GatePolicyOverridden(Aggregate.Event):
        """Gate thresholds for this adapter only, over its tenant's (``control.domain.gate``)."""

        digest: str
        overrides: dict[str, Any]
        actor: str

    class GateReportRecorded(Aggregate.Event):
        """A report the gate wrote (content-addressed), for one base + tokenizer + template."""

        digest: str
        report_digest: str
        passed: bool
        figures: dict[str, Any]
        base: str
        tokenizer: str
        template: str | None
        actor: str

    class BreakGlassUsed(Aggregate.Event):
        """An operator's override of the evidence a move needs (``control.domain.evidence``):
        ``to`` the state it lets the adapter into, ``overrides`` what it overrides (the failing
        gate report's digest, or ``"no_rollout"``), ``reason`` why. The move follows in the
        same transaction; the override allows that one move only."""

        digest: str
        to: str
        overrides: str
        reason: str
        actor: str

    class AdapterPromoted(Aggregate.Event):
        digest: str
        from_state: str
        to: str
        release: str | None
        actor: str

    class AdapterRevoked(Aggregate.Event):
        """Revoked; ``immediate``: the operator's kill switch (a security or licence event):
        hosts also end the requests and streams already running on the digest, instead of
        letting them drain. A second event with ``immediate`` escalates a draining revocation.
        """

        digest: str
        reason: str
        actor: str
        immediate: bool

        # Version 2 added ``immediate``. Every revocation recorded before it drained.
        class_version = 2

        @staticmethod
        def upcast_v1_v2(state: dict[str, Any]) -> None:
            state["immediate"] = False

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
        self.state: AdapterState = DRAFT
        self.had_canary = False
        self.evaluation_report: str | None = None  # the latest external report
        self.golden_set: str | None = None
        self.golden_tasks = 0
        self.gate_overrides: dict[str, Any] = {}
        # combination key -> {"report": digest, "passed": bool}: the latest gate report on each
        self.gate_reports: dict[str, dict[str, Any]] = {}
        self.release: str | None = None
        # The move a break-glass recorded in this transaction allows (None: none pending).
        self.break_glass_for: str | None = None
        self.revoke_reason: str | None = None
        self.revoked_immediately = False
        self.serving_steps: dict[str, list[str]] = {}  # host -> steps done, in order

    @property
    def revoked(self) -> bool:
        return self.state == REVOKED

    def record_evaluation(self, report_digest: str, summary: dict[str, Any], actor: str, *,
                          external: bool = False) -> None:
        """Record an evaluation report written outside the gate (content-addressed); the
        latest one counts. Accepted only with ``external=True``: the caller says it is not a
        gate report, and it is recorded as external."""
        if not external:
            raise IllegalTransition(
                "a report written outside the gate is accepted only as external (--external, "
                "external=True); or let the gate write one (adapter gate DIGEST)")
        if self.state in (REVOKED, DEPRECATED, STABLE):
            raise IllegalTransition(
                f"an adapter in state {self.state.value!r} takes no evaluation")
        self._evaluated(digest=self.digest, report_digest=report_digest, summary=summary,
                        external=True, actor=check_actor(actor))

    @event(EvaluationRecorded)
    def _evaluated(self, digest: str, report_digest: str, summary: dict[str, Any],
                   external: bool, actor: str) -> None:
        self.evaluation_report = report_digest

    def record_golden_set(self, golden_digest: str, family: str, tasks: int,
                          actor: str) -> None:
        """Record the golden task set the gate judges this adapter by (the latest counts)."""
        if self.state in (REVOKED, DEPRECATED):
            raise IllegalTransition(
                f"an adapter in state {self.state.value!r} takes no golden task set")
        if type(tasks) is not int or tasks < 1:
            raise DomainError("a golden task set holds at least one task")
        self._golden_recorded(digest=self.digest, golden_digest=golden_digest,
                              family=check_name("golden family", family), tasks=tasks,
                              actor=check_actor(actor))

    @event(GoldenSetRecorded)
    def _golden_recorded(self, digest: str, golden_digest: str, family: str, tasks: int,
                         actor: str) -> None:
        self.golden_set = golden_digest
        self.golden_tasks = tasks

    def override_gate_policy(self, overrides: dict[str, Any], actor: str) -> None:
        """Replace this adapter's gate policy overrides (``{}``: its tenant's policy alone)."""
        if self.state == REVOKED:
            raise IllegalTransition("a revoked adapter takes no gate policy")
        self._gate_policy(digest=self.digest, overrides=check_overrides(overrides),
                          actor=check_actor(actor))

    @event(GatePolicyOverridden)
    def _gate_policy(self, digest: str, overrides: dict[str, Any], actor: str) -> None:
        self.gate_overrides = overrides

    def record_gate_report(self, report_digest: str, passed: bool, figures: dict[str, Any],
                           combination: Combination, actor: str) -> None:
        """Record a gate report on ``combination``; the latest report on it counts."""
        if self.state in (REVOKED, DEPRECATED):
            raise IllegalTransition(
                f"an adapter in state {self.state.value!r} takes no gate report")
        self._gate_reported(digest=self.digest, report_digest=report_digest,
                            passed=bool(passed), figures=figures, base=combination.base,
                            tokenizer=combination.tokenizer, template=combination.template,
                            actor=check_actor(actor))

    @event(GateReportRecorded)
    def _gate_reported(self, digest: str, report_digest: str, passed: bool,
                       figures: dict[str, Any], base: str, tokenizer: str,
                       template: str | None, actor: str) -> None:
        key = Combination(base, tokenizer, template).key
        self.gate_reports[key] = {"report": report_digest, "passed": passed}

    def passing_gate_report(self, combination: Combination) -> str | None:
        """The digest of the latest gate report on ``combination`` if it passed, else None."""
        latest = self.gate_reports.get(combination.key)
        return str(latest["report"]) if latest and latest["passed"] else None

    def verified_on(self, combination: Combination) -> bool:
        """Whether a release of this adapter on ``combination`` is a verified one: the base and
        tokenizer it was registered on (registration checked it against them, and its canary
        entry had its evidence), or any other combination a passing gate report vouches for (a
        base upgrade's, ``control.domain.upgrade``)."""
        if (combination.base, combination.tokenizer) == (self.base_digest,
                                                         self.tokenizer_digest):
            return True
        return self.passing_gate_report(combination) is not None

    def failing_gate_report(self, combination: Combination | None) -> str | None:
        """The digest of the latest gate report on ``combination`` if it failed, else None."""
        latest = self.gate_reports.get(combination.key) if combination is not None else None
        return str(latest["report"]) if latest and not latest["passed"] else None

    def canary_evidence(self, combination: Combination | None) -> str | None:
        """The report that lets this adapter into canary on ``combination``: a passing gate
        report on it; else, unless the latest gate report on it failed, an external report;
        None when there is neither. A failing gate report is overridden only by a break-glass
        pending for canary: then it is the report the release names (what it was released
        despite; ``BreakGlassUsed`` says why)."""
        if combination is not None:
            gated = self.passing_gate_report(combination)
            if gated is not None:
                return gated
            failed = self.failing_gate_report(combination)
            if failed is not None:
                return failed if self.break_glass_for == BreakGlassTarget.CANARY else None
        return self.evaluation_report

    def check_canary(self, combination: Combination | None) -> None:
        """IllegalTransition naming the failing gate report when only an external report
        stands against it (the lifecycle guard's own message says nothing of the gate's
        verdict); otherwise nothing: the guard decides."""
        failed = self.failing_gate_report(combination)
        if (failed is not None and self.canary_evidence(combination) is None
                and self.evaluation_report is not None):
            raise IllegalTransition(
                f"the latest gate report on this base, tokenizer and chat template failed "
                f"({failed}): an external report does not override the gate; gate it again, "
                "or override with loraplane adapter break-glass DIGEST --to canary --reason ...")

    def break_glass(self, to: str, overrides: str, reason: str, actor: str) -> None:
        """Record an operator's override allowing the move to ``to`` (canary or stable) that
        follows in the same transaction (see ``control.domain.evidence``)."""
        target = BreakGlassTarget(to) if to in tuple(BreakGlassTarget) else None
        if target is None:
            raise DomainError("a break-glass moves an adapter to canary or stable")
        expected = {BreakGlassTarget.CANARY: CANDIDATE, BreakGlassTarget.STABLE: CANARY}[target]
        if self.state != expected:
            raise IllegalTransition(f"a break-glass to {target.value!r} needs an adapter in "
                                    f"state {expected.value!r}, not {self.state.value!r}")
        if not overrides:
            raise DomainError("a break-glass names what it overrides")
        self._broke_glass(digest=self.digest, to=target.value, overrides=overrides,
                          reason=check_reason(reason), actor=check_actor(actor))

    @event(BreakGlassUsed)
    def _broke_glass(self, digest: str, to: str, overrides: str, reason: str,
                     actor: str) -> None:
        self.break_glass_for = to

    def promote(self, to: str, actor: str, policy: TenantPolicy | None = None,
                release: str | None = None, combination: Combination | None = None) -> None:
        """Move along the lifecycle; raise IllegalTransition (recording nothing) if the table
        or the move's guard does not allow it. Entering canary names the release manifest and
        the ``combination`` (base, tokenizer, chat template) it is built on, which a gate
        report must vouch for unless an external report was recorded (and no gate report on it
        failed, short of a break-glass)."""
        if to == CANARY and self.state == CANDIDATE:
            self.check_canary(combination)
        lifecycle_guard(self, to, policy or TenantPolicy(), combination)
        if to == CANARY and release is None:
            raise DomainError("entering canary needs a release manifest")
        # Events carry the states as plain strings (what is stored), the aggregate the enum.
        self._promoted(digest=self.digest, from_state=self.state.value, to=AdapterState(to).value,
                       release=release if to == CANARY else None, actor=check_actor(actor))

    @event(AdapterPromoted)
    def _promoted(self, digest: str, from_state: str, to: str, release: str | None,
                  actor: str) -> None:
        self.state = AdapterState(to)
        self.break_glass_for = None  # a break-glass allows the one move that follows it
        if to == CANARY:
            self.had_canary = True
            self.release = release

    def revoke(self, reason: str, actor: str, *, immediate: bool = False) -> None:
        """Revoke from any state. ``immediate`` also ends admitted work on the digest (the kill
        switch); it may escalate a revocation that is draining. Anything else twice is refused.
        """
        if self.state == REVOKED and not (immediate and not self.revoked_immediately):
            raise IllegalTransition("adapter is already revoked" + (
                " with --immediate" if self.revoked_immediately else
                "; only --immediate may follow, to end its running requests too"))
        if not reason.strip():
            raise DomainError("a revocation needs a reason")
        self._revoked(digest=self.digest, reason=reason, actor=check_actor(actor),
                      immediate=bool(immediate))

    @event(AdapterRevoked)
    def _revoked(self, digest: str, reason: str, actor: str, immediate: bool) -> None:
        if self.state != REVOKED:  # an escalation keeps the first revocation's reason
            self.revoke_reason = reason
        self.state = REVOKED
        self.revoked_immediately = self.revoked_immediately or immediate

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
