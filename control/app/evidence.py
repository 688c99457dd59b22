"""The evidence a lifecycle move needs, read from the record: the registry's side of
``control.domain.evidence`` (the rules themselves are there).

- :func:`stable_basis_of`: on what basis a canary adapter may become stable now: a completed
  rollout of its release (read from the alias's ``Rollout`` aggregates), the alias's first
  release, or a break-glass pending in this transaction;
- :func:`break_glass`: the checks an operator's override must pass before ``BreakGlassUsed``
  is recorded on the adapter. The registry then takes the move and saves both together
  (``LifecycleDesk.break_glass``), so no break-glass is ever on the record without the move it
  allowed, nor a move without its break-glass.

Kept apart from the lifecycle desk (``control.app.lifecycle``) because it reads another family
of aggregates (rollouts) to decide a lifecycle move; it reaches the store only through the
registry's public surface it is given (:class:`Records`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, TypeVar
from uuid import UUID

from eventsourcing.domain import Aggregate

from control.domain import (
    CANARY,
    Adapter,
    Alias,
    Combination,
    DomainError,
    IllegalTransition,
    Rollout,
    RolloutStatus,
    rollout_id,
)
from control.domain.evidence import BreakGlassTarget, StableBasis, stable_basis

TAggregate = TypeVar("TAggregate", bound=Aggregate)


class Records(Protocol):
    """What these checks read of the registry (its public surface,
    ``control.app.unit_of_work.UnitOfWork``), named here so that this module does not import
    the registry back: the registry's lifecycle desk imports this one."""

    def alias_or_none(self, name: str) -> Alias | None: ...
    def exists(self, aggregate_id: UUID) -> bool: ...
    def load(self, cls: type[TAggregate], aggregate_id: UUID, what: str) -> TAggregate: ...


def stable_basis_of(reg: Records, adapter: Adapter, route: Alias | None) -> StableBasis:
    """On what basis the canary ``adapter`` may become stable now (``route``: its alias, as
    this transaction sees it); IllegalTransition when on none."""
    return stable_basis(
        release=adapter.release,
        alias_stable=route.stable if route is not None else None,
        alias_history=list(route.history) if route is not None else [],
        rollout_completed=_rollout_completed(reg, adapter),
        break_glass=adapter.break_glass_for == BreakGlassTarget.STABLE)


def break_glass(reg: Records, adapter: Adapter, *, to: str, reason: str, actor: str,
                canary_combination: Callable[[Adapter], Combination]) -> None:
    """Check and record (unsaved) an operator's override letting ``adapter`` move to ``to``;
    the move itself is the caller's, saved with it. ``canary_combination``: the base, tokenizer
    and chat template a canary release of an adapter is built on (``LifecycleDesk``'s).

    Into canary (from candidate) it overrides a failing gate report on the canary's
    combination; it is refused where there is nothing to override (a passing report: promote
    it) and where the gate never ran there (a break-glass overrides a verdict, it does not
    replace one). Into stable (from canary) it overrides the missing rollout; it is refused
    where a basis exists (promote it) and while a rollout of the alias runs (its controller
    would roll back the moved alias: let it finish or abort it)."""
    target = BreakGlassTarget(to) if to in tuple(BreakGlassTarget) else None
    if target is None:
        raise DomainError("a break-glass moves an adapter to canary or stable")
    if target == BreakGlassTarget.CANARY:
        combination = canary_combination(adapter)
        if adapter.passing_gate_report(combination) is not None:
            raise IllegalTransition("the gate passed this adapter on this base, tokenizer and "
                                    "chat template: nothing to override (adapter promote)")
        overrides = adapter.failing_gate_report(combination)
        if overrides is None:
            raise IllegalTransition(
                "no gate report on this base, tokenizer and chat template: a break-glass "
                "overrides the gate's verdict, it does not replace it; run loraplane adapter "
                "gate DIGEST first")
    else:
        if adapter.state == CANARY:
            route = reg.alias_or_none(adapter.alias)
            try:
                basis: StableBasis | None = stable_basis_of(reg, adapter, route)
            except IllegalTransition:
                basis = None
            if basis is not None:
                raise IllegalTransition(f"this adapter may become stable on its own basis "
                                        f"({basis.value}): nothing to override (adapter "
                                        "promote)")
        if _rollout_running(reg, adapter.alias):
            raise IllegalTransition("a rollout of this alias is in progress: let it finish or "
                                    "abort it first")
        overrides = "no_rollout"
    adapter.break_glass(target.value, overrides, reason, actor)


def _rollouts(reg: Records, alias: str) -> list[Rollout]:
    """The alias's rollouts, oldest first (numbered from 1)."""
    out: list[Rollout] = []
    while reg.exists(rollout_id(alias, len(out) + 1)):
        out.append(reg.load(Rollout, rollout_id(alias, len(out) + 1), "rollout"))
    return out


def _rollout_completed(reg: Records, adapter: Adapter) -> bool:
    """Whether a rollout of the adapter's canary release on its alias completed."""
    return adapter.release is not None and any(
        r.target == adapter.release and r.status == RolloutStatus.COMPLETED
        for r in _rollouts(reg, adapter.alias))


def _rollout_running(reg: Records, alias: str) -> bool:
    found = _rollouts(reg, alias)
    return bool(found) and not found[-1].finished


__all__ = ["break_glass", "stable_basis_of"]
