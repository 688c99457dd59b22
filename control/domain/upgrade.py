"""The ``BaseUpgrade`` aggregate: one compatibility plan of every approved adapter of a base on a
new base, and the rules that say what moves.

The unit of rollout and rollback is a verified base + adapter combination, a release manifest
(adapter, base, tokenizer, chat template). An adapter is registered on one base; a base upgrade
asks, adapter by adapter, whether it is verified on the new base too:

- **approved** adapters are the base's canary and stable ones (``SERVABLE_STATES``); revoked
  and deprecated ones are not planned for;
- an adapter whose shapes, rank or target modules do not fit the new base is ``incompatible``
  (registration's own checks, run against the new base) and is not gated;
- one without a golden task set is ``not_gated`` (the gate has nothing to judge it by), and so
  is one the gate could not run on (the reason is kept);
- the others are gated on the new base on a shadow host that serves no tenant: ``passed`` or
  ``failed``, each with its gate report's digest.

Only a ``passed`` cell gets a release manifest on the new combination (its gate report is the
manifest's evaluation report), which an operator may then point the adapter's alias at with the
existing commands (``alias point``, ``alias canary``, ``alias rollout``). Every other adapter
stays on its verified old combination: nothing of it moves, nothing new of it is routable. Why
a plan moves no alias itself: an upgrade needs hosts serving the new base first, and each alias
owner's rollout is its own decision; the plan is the evidence those decisions rest on.

A plan is numbered per (old base, new base) pair (``upgrade_id``, from 1). Its events:
``UpgradePlanStarted`` (the bases, the adapters to plan for, the shadow host's ledger id),
then ``UpgradePlanRecorded`` (the matrix: one cell per adapter, old and new side) or, when the
run broke off, ``UpgradePlanAbandoned``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any
from uuid import UUID, uuid5

from eventsourcing.domain import Aggregate, event

from control.contracts.digests import DIGEST_RE
from control.domain.errors import DomainError, IllegalTransition
from control.domain.gate import Combination
from control.domain.ids import NAMESPACE
from control.domain.lifecycle import SERVABLE_STATES
from control.domain.names import check_actor, check_name


class CellVerdict(StrEnum):
    """Where one adapter stands on the new base after a plan."""

    PASSED = "passed"  # gated on the new base and passed: a release on the new combination
    FAILED = "failed"  # gated and failed: stays on its old combination
    INCOMPATIBLE = "incompatible"  # does not fit the new base: not gated, stays
    NOT_GATED = "not_gated"  # no golden set, or the gate could not run: stays


def is_approved(state: str) -> bool:
    """Whether an adapter in ``state`` is planned for: canary or stable (never revoked or
    deprecated)."""
    return state in SERVABLE_STATES


@dataclass(frozen=True)
class OldSide:
    """The verified combination an adapter serves on today (what it stays on unless it passes)."""

    release: str | None  # its release on the old base (the one the new one would replace)
    evidence: str | None  # that release's evaluation report digest (a gate or external report)
    external: bool  # whether that evidence was written outside the gate
    success_rate: float | None = None  # its golden success measured in this plan (live host)


@dataclass(frozen=True)
class NewSide:
    """What the plan found on the new base."""

    verdict: CellVerdict
    report: str | None = None  # the gate report digest on the new combination (gated cells)
    success_rate: float | None = None
    failures: list[str] = field(default_factory=list)  # failed rules, or why it was not gated
    release: str | None = None  # the release on the new combination (passed cells only)


@dataclass(frozen=True)
class UpgradeCell:
    """One adapter's row of the matrix: the old side and the new side."""

    adapter: str
    tenant: str
    alias: str
    state: str
    old: OldSide
    new: NewSide

    def __post_init__(self) -> None:
        if not DIGEST_RE.match(self.adapter):
            raise DomainError("an upgrade cell names an adapter digest")
        gated = self.new.verdict in (CellVerdict.PASSED, CellVerdict.FAILED)
        if gated and self.new.report is None:
            raise DomainError("a gated cell names its gate report")
        if not gated and self.new.report is not None:
            raise DomainError("a cell that was not gated has no gate report")
        # The rule the whole plan rests on: only a passing gate report makes a new release.
        if self.new.release is not None and self.new.verdict != CellVerdict.PASSED:
            raise DomainError("only a cell that passed on the new base gets a release there")

    @property
    def moves(self) -> bool:
        """Whether the adapter may be moved to the new base (its alias pointed there)."""
        return self.new.verdict == CellVerdict.PASSED and self.new.release is not None

    def to_json(self) -> dict[str, Any]:
        """The cell as the plan's event carries it (plain JSON)."""
        out = asdict(self)
        out["new"]["verdict"] = self.new.verdict.value
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> UpgradeCell:
        """Read what ``to_json`` wrote."""
        new = dict(data["new"])
        new["verdict"] = CellVerdict(new["verdict"])
        return cls(adapter=data["adapter"], tenant=data["tenant"], alias=data["alias"],
                   state=data["state"], old=OldSide(**data["old"]), new=NewSide(**new))


def upgrade_id(from_base: str, to_base: str, number: int) -> UUID:
    """The id of the ``number``-th plan (from 1) of upgrading ``from_base`` to ``to_base``:
    two processes starting the same one collide on the event store's unique index."""
    return uuid5(NAMESPACE, f"base-upgrade:{from_base}>{to_base}#{number}")


class PlanStatus(StrEnum):
    RUNNING = "running"
    RECORDED = "recorded"
    ABANDONED = "abandoned"


class BaseUpgrade(Aggregate):
    """One plan of upgrading the adapters of ``from_base`` to ``to_base`` (see the module)."""

    class UpgradePlanStarted(Aggregate.Created):
        from_base: str
        to_base: str
        number: int
        tokenizer: str  # the new base's tokenizer digest
        template: str | None  # its chat template digest (None: none)
        adapters: list[str]  # the approved adapters of the old base, in plan order
        shadow_host: str  # the ledger's host id of the shadow engine (it serves no tenant)
        actor: str

    class UpgradePlanRecorded(Aggregate.Event):
        """The matrix: one cell per planned adapter (``UpgradeCell.to_json``)."""

        from_base: str
        to_base: str
        number: int
        cells: list[dict[str, Any]]
        shadow: dict[str, Any]  # the shadow host: id, address, started and stopped
        actor: str

    class UpgradePlanAbandoned(Aggregate.Event):
        from_base: str
        to_base: str
        number: int
        reason: str
        actor: str

    @staticmethod
    def create_id(from_base: str, to_base: str, number: int) -> UUID:
        return upgrade_id(from_base, to_base, number)

    @event(UpgradePlanStarted)
    def __init__(self, from_base: str, to_base: str, number: int, tokenizer: str,
                 template: str | None, adapters: list[str], shadow_host: str,
                 actor: str) -> None:
        self.from_base = from_base
        self.to_base = to_base
        self.number = number
        self.tokenizer = tokenizer
        self.template = template
        self.adapters = list(adapters)
        self.shadow_host = shadow_host
        self.status = PlanStatus.RUNNING
        self.cells: list[dict[str, Any]] = []
        self.shadow: dict[str, Any] = {}
        self.reason: str | None = None

    @classmethod
    def start(cls, *, from_base: str, to_base: str, number: int, combination: Combination,
              adapters: list[str], shadow_host: str, actor: str) -> BaseUpgrade:
        """A new plan; refused when the bases are one, or the new combination is not the new
        base's."""
        for name, value in (("from", from_base), ("to", to_base)):
            if not DIGEST_RE.match(value):
                raise DomainError(f"an upgrade plan's {name} base is a digest")
        if from_base == to_base:
            raise DomainError("an upgrade goes to another base than the one it starts from")
        if combination.base != to_base:
            raise DomainError("the plan's combination is the new base's")
        if type(number) is not int or number < 1:
            raise DomainError("plans are numbered from 1")
        if len(set(adapters)) != len(adapters):
            raise DomainError("an adapter is planned for once")
        return cls(from_base=from_base, to_base=to_base, number=number,
                   tokenizer=combination.tokenizer, template=combination.template,
                   adapters=list(adapters), shadow_host=check_name("host", shadow_host),
                   actor=check_actor(actor))

    @property
    def combination(self) -> Combination:
        """The new combination every gated cell was judged on."""
        return Combination(self.to_base, self.tokenizer, self.template)

    def record(self, cells: list[UpgradeCell], shadow: dict[str, Any], actor: str) -> None:
        """Record the matrix: exactly one cell per planned adapter, in plan order."""
        self._running()
        if [c.adapter for c in cells] != self.adapters:
            raise DomainError("the matrix has one cell per planned adapter, in plan order")
        self._recorded(from_base=self.from_base, to_base=self.to_base, number=self.number,
                       cells=[c.to_json() for c in cells], shadow=dict(shadow),
                       actor=check_actor(actor))

    @event(UpgradePlanRecorded)
    def _recorded(self, from_base: str, to_base: str, number: int, cells: list[dict[str, Any]],
                  shadow: dict[str, Any], actor: str) -> None:
        self.cells = cells
        self.shadow = shadow
        self.status = PlanStatus.RECORDED

    def abandon(self, reason: str, actor: str) -> None:
        """The run broke off before its matrix was complete: recorded as such."""
        self._running()
        if not reason.strip():
            raise DomainError("an abandoned plan says why")
        self._abandoned(from_base=self.from_base, to_base=self.to_base, number=self.number,
                        reason=reason[:500], actor=check_actor(actor))

    @event(UpgradePlanAbandoned)
    def _abandoned(self, from_base: str, to_base: str, number: int, reason: str,
                   actor: str) -> None:
        self.status = PlanStatus.ABANDONED
        self.reason = reason

    def _running(self) -> None:
        if self.status != PlanStatus.RUNNING:
            raise IllegalTransition(f"the plan is already {self.status.value}")

    def matrix(self) -> list[UpgradeCell]:
        """The recorded cells (empty until the plan is recorded)."""
        return [UpgradeCell.from_json(c) for c in self.cells]
