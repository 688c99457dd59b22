"""The evaluation gate's rules: its thresholds (a policy), the figures a gate run measures, and
the judgement that turns figures into a verdict. Pure; the gate itself runs in
``control.tools.gate`` and its reports are recorded on the ``Adapter`` aggregate.

Why a policy and not constants: tenants differ in what they accept, and one adapter may need a
looser or stricter rule than its tenant's others. A tenant's default is recorded with
``Tenant.GatePolicySet``, an adapter's overrides with ``Adapter.GatePolicyOverridden``; the
effective policy is the defaults below, overlaid by the tenant's, overlaid by the adapter's.

Defaults (issue 12): authorization errors 0; golden success rate not lower than the stable
release the candidate would replace; cold-load p95 below 8 s; memory accounting error below 5 %;
0 misattributions among 32 mixed concurrent requests. Besides those, because a gate that
measured less must not pass: at least 50 golden tasks (a production release), the long-context
case served by the candidate, and no failed load.

Two rules judge the answers on their own, whether or not a stable release exists (issue 21): an
absolute floor (``min_success_rate``, 0.5) and the base alone as the control
(``min_gain_over_base``, 0.1: the candidate must pass at least ten points more of the golden
tasks than the base model answering them without any adapter). Without them a first release
that answers nothing right passed, because the only success rule compared with a stable release
that did not exist. Both are policy fields, so an operator can move them (recorded as events and
in every report), but never switch them off: the floor and the gain are fractions above zero.

A figure the gate could not measure is ``None``, and a rule over a missing figure fails: the
gate fails closed, and the verdict says what was missing.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from control.contracts.digests import DIGEST_RE
from control.domain.errors import DomainError


@dataclass(frozen=True)
class Combination:
    """What a gate report vouches for: one adapter on one base, tokenizer and chat template.

    A canary release is created for the same four, so its report must name them all (the
    adapter is the aggregate the report is recorded on)."""

    base: str
    tokenizer: str
    template: str | None  # None: the tokenizer has no chat template

    def __post_init__(self) -> None:
        for name in ("base", "tokenizer"):
            if not DIGEST_RE.match(getattr(self, name)):
                raise DomainError(f"a gate combination needs a {name} digest")
        if self.template is not None and not DIGEST_RE.match(self.template):
            raise DomainError("a gate combination's chat template is a digest or none")

    @property
    def key(self) -> str:
        """One string per combination (a key of the adapter's report table)."""
        return f"{self.base}|{self.tokenizer}|{self.template or 'none'}"


@dataclass(frozen=True)
class GatePolicy:
    """Thresholds a gate report must meet. Every field has the issue's default."""

    max_authorization_errors: int = 0
    # The candidate's golden success rate may be at most this far below the stable release's
    # (a fraction, 0.0: not lower). No stable release to replace: the rule has nothing to
    # compare and passes, saying so; the floor and the gain over the base still judge it.
    max_success_rate_drop: float = 0.0
    min_success_rate: float = 0.5  # an absolute floor (a fraction above 0), every release
    # The candidate's golden success rate must exceed the base alone's by at least this much
    # (a fraction above 0): an adapter that does no better than no adapter is not one.
    min_gain_over_base: float = 0.1
    max_cold_load_p95_s: float = 8.0  # strictly below
    max_memory_accounting_error: float = 0.05  # strictly below (a fraction)
    max_misattributions: int = 0
    mixed_requests: int = 32  # how many mixed concurrent requests the gate sends, at least
    min_golden_tasks: int = 50  # a production release's golden set
    max_load_failures: int = 0
    require_long_context: bool = True

    def __post_init__(self) -> None:
        for name in ("max_authorization_errors", "max_misattributions", "max_load_failures"):
            _whole(name, getattr(self, name), 0)
        _whole("mixed_requests", self.mixed_requests, 1, 1024)
        _whole("min_golden_tasks", self.min_golden_tasks, 1)
        _fraction("max_success_rate_drop", self.max_success_rate_drop)
        # Above zero: a floor or a gain of 0 would switch the rule off (see the module notes).
        _fraction("min_success_rate", self.min_success_rate, above_zero=True)
        _fraction("min_gain_over_base", self.min_gain_over_base, above_zero=True)
        _fraction("max_memory_accounting_error", self.max_memory_accounting_error)
        if not _number(self.max_cold_load_p95_s) or self.max_cold_load_p95_s <= 0:
            raise DomainError("gate policy max_cold_load_p95_s must be a positive number of "
                              "seconds")
        if not isinstance(self.require_long_context, bool):
            raise DomainError("gate policy require_long_context must be true or false")

    def to_json(self) -> dict[str, Any]:
        """The policy as a report and an event carry it."""
        return asdict(self)

    def overlaid(self, overrides: dict[str, Any]) -> GatePolicy:
        """This policy with ``overrides`` (field -> value) applied; checked like a new one."""
        return replace(self, **check_overrides(overrides))


POLICY_FIELDS = tuple(f.name for f in fields(GatePolicy))


def check_overrides(overrides: Any) -> dict[str, Any]:
    """``overrides`` if it names only policy fields with acceptable values; else DomainError."""
    if not isinstance(overrides, dict):
        raise DomainError("gate policy overrides are an object of policy fields")
    unknown = sorted(str(k) for k in overrides if k not in POLICY_FIELDS)
    if unknown:
        raise DomainError(f"unknown gate policy field {unknown[0]!r}; one of "
                          f"{', '.join(POLICY_FIELDS)}")
    GatePolicy(**overrides)  # every value checked by the policy's own rules
    return dict(overrides)


def effective_policy(tenant_overrides: dict[str, Any] | None,
                     adapter_overrides: dict[str, Any] | None) -> GatePolicy:
    """The defaults, overlaid by the tenant's recorded policy, then by the adapter's."""
    return GatePolicy().overlaid(tenant_overrides or {}).overlaid(adapter_overrides or {})


@dataclass(frozen=True)
class GateFigures:
    """What one gate run measured. ``None``: not measured (the rule over it then fails)."""

    golden_tasks: int
    success_rate: float | None  # the candidate's golden tasks passed / tasks
    base_success_rate: float | None  # the same tasks on the base alone (the control)
    stable_success_rate: float | None  # the stable release it would replace; None: none
    authorization_errors: int  # gate tickets refused + mismatched tickets served
    mismatch_tried: int
    mismatch_refused: int
    mixed_requests: int
    misattributions: int | None
    long_context_ok: bool | None  # served by the candidate, attributed to it
    cold_load_p95_s: float | None
    cold_loads: int
    load_failures: int
    memory_accounting_error: float | None
    has_stable: bool = False  # whether a stable release (of another adapter) was compared

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class RuleVerdict:
    """One rule's outcome: what was measured, the limit, and why it passed or failed."""

    rule: str
    passed: bool
    value: Any
    limit: Any
    why: str

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def judge(figures: GateFigures, policy: GatePolicy) -> list[RuleVerdict]:
    """Every rule of ``policy`` applied to ``figures``, in a fixed order."""
    f, p = figures, policy
    out = [
        _at_least("golden_tasks", f.golden_tasks, p.min_golden_tasks,
                  "golden tasks in the adapter's set"),
        _at_most("authorization_errors", f.authorization_errors, p.max_authorization_errors,
                 "gate tickets refused, or tickets naming a wrong base, tokenizer or release "
                 "served"),
        _success_vs_stable(f, p),
        _at_least("min_success_rate", f.success_rate, p.min_success_rate,
                  "golden success rate, the absolute floor every release must reach"),
        _gain_over_base(f, p),
    ]
    out += [
        _below("cold_load_p95_s", f.cold_load_p95_s, p.max_cold_load_p95_s,
               f"p95 of the candidate's {f.cold_loads} recorded cold loads, seconds"),
        _at_most("load_failures", f.load_failures, p.max_load_failures,
                 "failed loads of the candidate"),
        _below("memory_accounting_error", f.memory_accounting_error,
               p.max_memory_accounting_error,
               "relative difference between the host's resident bytes and its memory plan"),
        _at_least("mixed_requests", f.mixed_requests, p.mixed_requests,
                  "mixed concurrent requests sent"),
        _at_most("misattributions", f.misattributions, p.max_misattributions,
                 f"answers among {f.mixed_requests} mixed concurrent requests not computed by "
                 "the release their ticket named"),
    ]
    if p.require_long_context:
        ok = f.long_context_ok
        out.append(RuleVerdict("long_context", ok is True, ok, True,
                               "not measured" if ok is None else
                               "the long-context case was served and attributed to the candidate"
                               if ok else "the long-context case was not served by the candidate"))
    return out


def passed(verdicts: list[RuleVerdict]) -> bool:
    """A gate passes when every rule does."""
    return all(v.passed for v in verdicts)


def failures(verdicts: list[RuleVerdict]) -> list[str]:
    """One line per failed rule, for people."""
    return [f"{v.rule}: {v.why} (found {v.value}, limit {v.limit})"
            for v in verdicts if not v.passed]


def _success_vs_stable(f: GateFigures, p: GatePolicy) -> RuleVerdict:
    if f.success_rate is None:
        return RuleVerdict("success_rate", False, None, None, "not measured")
    if not f.has_stable:
        return RuleVerdict("success_rate", True, f.success_rate, None,
                           "no stable release of another adapter to replace: nothing to compare")
    if f.stable_success_rate is None:
        return RuleVerdict("success_rate", False, f.success_rate, None,
                           "the stable release it would replace could not be measured")
    limit = round(f.stable_success_rate - p.max_success_rate_drop, 6)
    ok = f.success_rate >= limit - 1e-9
    return RuleVerdict("success_rate", ok, f.success_rate, limit,
                       f"golden success rate against the stable release's "
                       f"{f.stable_success_rate:.3f}"
                       + ("" if ok else ": lower than the stable release it would replace"))


def _gain_over_base(f: GateFigures, p: GatePolicy) -> RuleVerdict:
    """The candidate against the base alone on the same tasks (the control)."""
    if f.success_rate is None or f.base_success_rate is None:
        return RuleVerdict("gain_over_base", False, None, p.min_gain_over_base,
                           "golden success rate of the candidate or of the base alone: "
                           "not measured")
    gain = round(f.success_rate - f.base_success_rate, 6)
    ok = gain >= p.min_gain_over_base - 1e-9
    return RuleVerdict("gain_over_base", ok, gain, p.min_gain_over_base,
                       f"golden success rate above the base alone's {f.base_success_rate:.3f}"
                       + ("" if ok else ": the adapter does not beat the base model by the "
                                        "margin"))


def _at_most(rule: str, value: int | None, limit: int, what: str) -> RuleVerdict:
    if value is None:
        return RuleVerdict(rule, False, None, limit, f"{what}: not measured")
    return RuleVerdict(rule, value <= limit, value, limit, what)


def _at_least(rule: str, value: float | None, limit: float, what: str) -> RuleVerdict:
    if value is None:
        return RuleVerdict(rule, False, None, limit, f"{what}: not measured")
    return RuleVerdict(rule, value >= limit, value, limit, what)


def _below(rule: str, value: float | None, limit: float, what: str) -> RuleVerdict:
    if value is None:
        return RuleVerdict(rule, False, None, limit, f"{what}: not measured")
    return RuleVerdict(rule, value < limit, value, limit, what)


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _whole(name: str, v: Any, low: int, high: int | None = None) -> None:
    if type(v) is not int or v < low or (high is not None and v > high):
        top = f" to {high}" if high is not None else " or more"
        raise DomainError(f"gate policy {name} must be a whole number from {low}{top}")


def _fraction(name: str, v: Any, *, above_zero: bool = False) -> None:
    if not _number(v) or not 0.0 <= v <= 1.0 or (above_zero and v <= 0.0):
        raise DomainError(f"gate policy {name} must be a fraction "
                          + ("above 0, at most 1" if above_zero else "from 0 to 1"))
