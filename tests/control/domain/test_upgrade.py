"""The base-upgrade rules, without a database: what a plan's cells may say, that only a passing
cell gets a release, how a plan is numbered and closed, and which releases of an adapter are
verified (``Adapter.verified_on``)."""

from __future__ import annotations

import pytest

from control.domain import (
    CANARY,
    CANDIDATE,
    DEPRECATED,
    DRAFT,
    REVOKED,
    STABLE,
    Adapter,
    BaseUpgrade,
    CellVerdict,
    Combination,
    DomainError,
    IllegalTransition,
    NewSide,
    OldSide,
    PlanStatus,
    UpgradeCell,
    is_approved,
    upgrade_id,
)


def _d(c: str) -> str:
    return "sha256:" + c * 64


OLD, NEW, TOK, TOK2, TPL = _d("a"), _d("b"), _d("c"), _d("d"), _d("e")
A1, A2 = _d("1"), _d("2")
OLD_SIDE = OldSide(release=_d("3"), evidence=_d("4"), external=True, success_rate=0.8)


def _cell(adapter: str, new: NewSide) -> UpgradeCell:
    return UpgradeCell(adapter=adapter, tenant="acme", alias="chat", state="stable",
                       old=OLD_SIDE, new=new)


def _plan(adapters: list[str] | None = None) -> BaseUpgrade:
    return BaseUpgrade.start(from_base=OLD, to_base=NEW, number=1,
                             combination=Combination(NEW, TOK, TPL),
                             adapters=[A1, A2] if adapters is None else adapters,
                             shadow_host="upgrade-shadow-1", actor="op")


def test_only_canary_and_stable_adapters_are_planned_for() -> None:
    assert [s for s in (DRAFT, CANDIDATE, CANARY, STABLE, DEPRECATED, REVOKED)
            if is_approved(s)] == [CANARY, STABLE]


def test_only_a_passing_cell_gets_a_release_on_the_new_base() -> None:
    passed = _cell(A1, NewSide(CellVerdict.PASSED, report=_d("5"), success_rate=0.9,
                               release=_d("6")))
    assert passed.moves
    with pytest.raises(DomainError, match="only a cell that passed"):
        _cell(A1, NewSide(CellVerdict.FAILED, report=_d("5"), release=_d("6")))
    with pytest.raises(DomainError, match="only a cell that passed"):
        _cell(A1, NewSide(CellVerdict.INCOMPATIBLE, failures=["shapes: ..."], release=_d("6")))
    # a passed cell before its release was made does not move yet
    assert not _cell(A1, NewSide(CellVerdict.PASSED, report=_d("5"))).moves


def test_a_gated_cell_names_its_report_and_an_ungated_one_none() -> None:
    for verdict in (CellVerdict.PASSED, CellVerdict.FAILED):
        with pytest.raises(DomainError, match="names its gate report"):
            _cell(A1, NewSide(verdict))
    for verdict in (CellVerdict.INCOMPATIBLE, CellVerdict.NOT_GATED):
        with pytest.raises(DomainError, match="no gate report"):
            _cell(A1, NewSide(verdict, report=_d("5")))
    with pytest.raises(DomainError, match="adapter digest"):
        _cell("alpha", NewSide(CellVerdict.NOT_GATED))


def test_a_cell_reads_back_as_it_was_written() -> None:
    cell = _cell(A1, NewSide(CellVerdict.FAILED, report=_d("5"), success_rate=0.5,
                             failures=["success_rate: lower"]))
    data = cell.to_json()
    assert data["new"]["verdict"] == "failed" and isinstance(data["new"]["verdict"], str)
    assert UpgradeCell.from_json(data) == cell


def test_a_plan_starts_on_two_bases_and_is_numbered() -> None:
    plan = _plan()
    assert plan.id == upgrade_id(OLD, NEW, 1) != upgrade_id(OLD, NEW, 2)
    assert upgrade_id(OLD, NEW, 1) != upgrade_id(NEW, OLD, 1)
    assert plan.status == PlanStatus.RUNNING and plan.combination == Combination(NEW, TOK, TPL)
    with pytest.raises(DomainError, match="another base"):
        BaseUpgrade.start(from_base=OLD, to_base=OLD, number=1,
                          combination=Combination(OLD, TOK, None), adapters=[],
                          shadow_host="s", actor="op")
    with pytest.raises(DomainError, match="new base's"):
        BaseUpgrade.start(from_base=OLD, to_base=NEW, number=1,
                          combination=Combination(OLD, TOK, None), adapters=[],
                          shadow_host="s", actor="op")
    with pytest.raises(DomainError, match="once"):
        _plan([A1, A1])
    with pytest.raises(DomainError, match="from 1"):
        BaseUpgrade.start(from_base=OLD, to_base=NEW, number=0,
                          combination=Combination(NEW, TOK, None), adapters=[],
                          shadow_host="s", actor="op")


def test_the_matrix_has_one_cell_per_planned_adapter_and_is_recorded_once() -> None:
    plan = _plan()
    one = _cell(A1, NewSide(CellVerdict.NOT_GATED, failures=["no golden task set"]))
    two = _cell(A2, NewSide(CellVerdict.FAILED, report=_d("5")))
    with pytest.raises(DomainError, match="one cell per planned adapter"):
        plan.record([one], {}, "op")
    with pytest.raises(DomainError, match="one cell per planned adapter"):
        plan.record([two, one], {}, "op")
    plan.record([one, two], {"host": "upgrade-shadow-1", "stopped": True}, "op")
    assert plan.status == PlanStatus.RECORDED and plan.matrix() == [one, two]
    assert plan.shadow["stopped"] is True
    with pytest.raises(IllegalTransition, match="already recorded"):
        plan.record([one, two], {}, "op")
    with pytest.raises(IllegalTransition, match="already recorded"):
        plan.abandon("late", "op")
    events = [type(e).__name__ for e in plan.collect_events()]
    assert events == ["UpgradePlanStarted", "UpgradePlanRecorded"]


def test_an_abandoned_plan_says_why_and_records_no_matrix() -> None:
    plan = _plan()
    with pytest.raises(DomainError, match="says why"):
        plan.abandon(" ", "op")
    plan.abandon("KeyboardInterrupt: ", "op")
    assert plan.status == PlanStatus.ABANDONED and plan.matrix() == []
    with pytest.raises(IllegalTransition):
        plan.record([], {}, "op")


def _adapter() -> Adapter:
    return Adapter(tenant="acme", digest=A1, base_digest=OLD, tokenizer_digest=TOK, rank=4,
                   target_modules=["q_proj"], alias="chat", metadata={}, signature=None,
                   actor="op")


def test_an_adapter_is_verified_on_its_own_base_and_where_a_passing_report_says() -> None:
    a = _adapter()
    assert a.verified_on(Combination(OLD, TOK, None))
    assert a.verified_on(Combination(OLD, TOK, TPL))  # the template follows the tokenizer
    on_new = Combination(NEW, TOK, TPL)
    assert not a.verified_on(on_new)
    assert not a.verified_on(Combination(OLD, TOK2, None))  # another tokenizer: not its own
    a.record_gate_report(_d("5"), True, {}, on_new, "gate")
    assert a.verified_on(on_new)
    assert not a.verified_on(Combination(NEW, TOK, None))  # exactly that combination
    # the latest report on a combination counts: a later failure withdraws it
    a.record_gate_report(_d("6"), False, {}, on_new, "gate")
    assert not a.verified_on(on_new)
