"""Base upgrades as registry commands: which adapters a plan covers, whether each fits the new
base (registration's own checks), what the recorded matrix holds, the release a passing
adapter gets on the new combination, and that aliases move to it, and only to it, with the
existing commands. One suite on SQLite and PostgreSQL; the plan's run through a real shadow
tritonserver is ``tests/integration/test_base_upgrade.py``."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from control.app.audit import audit_log
from control.app.gate_desk import GateDesk
from control.app.registry import Registry
from control.app.rollouts import RolloutDesk
from control.app.upgrades import UpgradeDesk
from control.contracts.golden import GOLDEN_KIND, GoldenSet
from control.domain import (
    CellVerdict,
    DomainError,
    IllegalTransition,
    NewSide,
    NotFound,
    OldSide,
    PlanStatus,
    RolloutPolicy,
    TenantPolicy,
    UpgradeCell,
)
from tests.fixtures_control import Artifacts, OnPostgres, OnSQLite, WithRegistry

GOLDEN = GoldenSet.from_json({"kind": GOLDEN_KIND, "family": "chat", "tasks": [
    {"id": f"t{i}", "prompt": f"hello {i}", "checker": {"kind": "exact", "expected": " hi"}}
    for i in range(3)]})
EVAL = {"suite": "smoke", "passed": True}


@pytest.fixture(scope="module")
def base_v2(artifacts: Artifacts, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The fixtures' base, further "trained": every weight nudged, the same shapes."""
    out = tmp_path_factory.mktemp("base-v2") / "base-v2"
    shutil.copytree(artifacts.base, out)
    weights = out / "model.safetensors"
    tensors = load_file(weights)
    gen = torch.Generator().manual_seed(7)
    save_file({k: v + 1e-3 * torch.randn(v.shape, generator=gen) for k, v in tensors.items()},
              weights, metadata={"format": "pt"})
    return out


def _cell(adapter: str, verdict: CellVerdict, report: str | None = None) -> UpgradeCell:
    return UpgradeCell(adapter=adapter, tenant="acme", alias="chat", state="stable",
                       old=OldSide(release=None, evidence=None, external=False),
                       new=NewSide(verdict, report=report))


class UpgradesContract(WithRegistry):
    @pytest.fixture
    def world(self, registry: Registry, artifacts: Artifacts,
              base_v2: Path) -> dict[str, str]:
        """Base ``tiny`` with alpha (stable on ``chat``, defaults set), beta (stable on
        ``other``) and gamma (a draft); bases ``tiny-v2`` (same shapes) and ``wide`` (another
        hidden size) registered."""
        out = {"old": registry.register_base(artifacts.base, artifacts.tokenizer, name="tiny",
                                             actor="op"),
               "new": registry.register_base(base_v2, artifacts.tokenizer, name="tiny-v2",
                                             actor="op"),
               "wide": registry.register_base(artifacts.base_b, artifacts.tokenizer,
                                              name="wide", actor="op")}
        registry.create_tenant("acme", actor="op")
        for name, alias in (("alpha", "chat"), ("beta", "other"), ("gamma", "drafts")):
            out[name] = registry.register_adapter(artifacts.adapters[name], tenant="acme",
                                                  alias=alias, actor="alice", golden=GOLDEN)
        registry.advance(out["alpha"], external=True, evaluation=EVAL, actor="alice",
                         inference_defaults={"max_tokens": 7})
        registry.advance(out["beta"], external=True, evaluation=EVAL, actor="alice")
        return out

    def _pass_on_new(self, registry: Registry, digest: str, new: str, passed: bool = True
                     ) -> str:
        """A gate report on ``new`` for ``digest``, as the gate records it."""
        gates = GateDesk(registry)
        return gates.record_gate_report(digest, {"kind": "test", "passed": passed},
                                        passed=passed, figures={"success_rate": 1.0},
                                        combination=gates.combination_on(new), actor="gate")

    def test_a_plan_covers_the_approved_adapters_of_the_old_base_only(
            self, registry: Registry, world: dict[str, str], artifacts: Artifacts) -> None:
        desk = UpgradeDesk(registry)
        every = [world["alpha"], world["beta"], world["gamma"]]
        assert [a.digest for a in desk.approved(every, world["old"])] == [world["alpha"],
                                                                         world["beta"]]
        registry.revoke(world["beta"], "leaked", actor="sec")
        assert [a.digest for a in desk.approved(every, world["old"])] == [world["alpha"]]
        assert desk.approved(every, world["new"]) == []  # registered on the old base

    def test_fit_is_registrations_check_against_the_new_base(
            self, registry: Registry, world: dict[str, str]) -> None:
        desk = UpgradeDesk(registry)
        alpha = registry.adapter(world["alpha"])
        assert desk.fits(alpha, world["new"]) == []
        why = desk.fits(alpha, world["wide"])
        assert len(why) == 1 and why[0].startswith("shapes: ") and "expected" in why[0]
        # the tenant's limits on the new base apply as they would at registration
        registry.set_policy("acme", TenantPolicy(
            allowed_target_modules={world["new"]: ["q_proj"]}), actor="op")
        assert desk.fits(alpha, world["new"])[0].startswith("limits: ")

    def test_a_plan_records_its_start_and_its_matrix_and_only_passing_adapters_move(
            self, registry: Registry, world: dict[str, str]) -> None:
        desk = UpgradeDesk(registry)
        new = world["new"]
        plan = desk.start(world["old"], new, [world["alpha"], world["beta"]],
                          shadow_host="upgrade-shadow-test", actor="op")
        assert (plan.number, plan.status) == (1, PlanStatus.RUNNING)
        good = self._pass_on_new(registry, world["alpha"], new)
        bad = self._pass_on_new(registry, world["beta"], new, passed=False)
        cells = [_cell(world["alpha"], CellVerdict.PASSED, good),
                 _cell(world["beta"], CellVerdict.FAILED, bad)]
        desk.record(plan, cells, {"host": "upgrade-shadow-test", "stopped": True}, actor="op")
        recorded = desk.get(world["old"], new)
        assert recorded.status == PlanStatus.RECORDED and recorded.number == 1
        matrix = recorded.matrix()
        assert [c.new.verdict for c in matrix] == [CellVerdict.PASSED, CellVerdict.FAILED]
        assert matrix[1].new.release is None and not matrix[1].moves
        release = registry.release_manifest(matrix[0].new.release or "")
        alpha = registry.adapter(world["alpha"])
        old = registry.release_manifest(alpha.release or "")
        # the verified new combination: the adapter, the new base, its tokenizer and template,
        # the replaced release's defaults, and the gate report that vouches for it
        assert (release.adapter_digest, release.base_digest, release.tokenizer_digest) == (
            alpha.digest, new, registry.base(new).tokenizer_digest)
        assert release.chat_template_digest == GateDesk(registry).combination_on(new).template
        assert release.evaluation_report_digest == good
        assert release.inference_defaults == old.inference_defaults == {"max_tokens": 7}
        # nothing moved: the aliases still serve the old combination
        assert registry.alias("chat").stable == old.digest
        assert registry.alias("other").stable == registry.adapter(world["beta"]).release
        kinds = [e.event_type for e in audit_log(registry)]
        assert kinds.count("UpgradePlanStarted") == kinds.count("UpgradePlanRecorded") == 1
        assert kinds[-2:] in (["ReleaseCreated", "UpgradePlanRecorded"],
                              ["UpgradePlanRecorded", "ReleaseCreated"])  # one transaction
        # a second plan of the same upgrade is number 2; the first stays as recorded
        again = desk.start(world["old"], new, [world["alpha"]], shadow_host="s2", actor="op")
        assert again.number == 2 and desk.get(world["old"], new, 1).cells == recorded.cells

    def test_a_passing_cell_must_name_the_latest_passing_report(
            self, registry: Registry, world: dict[str, str]) -> None:
        desk = UpgradeDesk(registry)
        plan = desk.start(world["old"], world["new"], [world["alpha"]], shadow_host="s",
                          actor="op")
        good = self._pass_on_new(registry, world["alpha"], world["new"])
        self._pass_on_new(registry, world["alpha"], world["new"], passed=False)  # later
        with pytest.raises(DomainError, match="latest passing gate report"):
            desk.record(plan, [_cell(world["alpha"], CellVerdict.PASSED, good)], {},
                        actor="op")

    def test_an_alias_moves_to_the_new_combination_and_back_with_the_existing_commands(
            self, registry: Registry, world: dict[str, str]) -> None:
        desk = UpgradeDesk(registry)
        new, alpha = world["new"], world["alpha"]
        old_release = registry.alias("chat").stable
        gate_release = GateDesk(registry).gate_release(
            registry.adapter(alpha), actor="gate",
            combination=GateDesk(registry).combination_on(new))
        # no passing report on the new combination yet: not a target for any move
        with pytest.raises(IllegalTransition, match="no passing gate report vouches"):
            registry.point_alias("chat", gate_release, actor="op")
        plan = desk.start(world["old"], new, [alpha], shadow_host="s", actor="op")
        report = self._pass_on_new(registry, alpha, new)
        desk.record(plan, [_cell(alpha, CellVerdict.PASSED, report)], {}, actor="op")
        upgraded = desk.get(world["old"], new).matrix()[0].new.release or ""
        assert registry.set_canary("chat", upgraded, 10, actor="op") == upgraded
        registry.clear_canary("chat", actor="op")
        assert registry.point_alias("chat", upgraded, actor="op") == upgraded
        assert registry.alias("chat").history[-1] == old_release
        # rollback is to the verified old combination, one event
        assert registry.rollback("chat", actor="op") == old_release
        # a rollout may target it too (the controller then probes the hosts serving it)
        rollout = RolloutDesk(registry).start("chat", upgraded, steps=[50, 100], window_s=5.0,
                                              policy=RolloutPolicy(), actor="op")
        assert rollout.target == upgraded
        # a later failing report on the new combination withdraws it as a target
        self._pass_on_new(registry, alpha, new, passed=False)
        with pytest.raises(IllegalTransition, match="no passing gate report vouches"):
            registry.point_alias("other", upgraded, actor="op")  # (also not beta's alias)

    def test_an_abandoned_plan_is_on_the_record(self, registry: Registry,
                                                world: dict[str, str]) -> None:
        desk = UpgradeDesk(registry)
        plan = desk.start(world["old"], world["new"], [], shadow_host="s", actor="op")
        desk.abandon(plan, "RuntimeError: tritonserver exited", actor="op")
        got = desk.get(world["old"], world["new"])
        assert got.status == PlanStatus.ABANDONED and "tritonserver" in (got.reason or "")
        with pytest.raises(NotFound):
            desk.get(world["new"], world["old"])
        with pytest.raises(NotFound):
            desk.start(world["old"], "sha256:" + "9" * 64, [], shadow_host="s", actor="op")


class TestUpgradesSQLite(OnSQLite, UpgradesContract):
    pass


class TestUpgradesPostgres(OnPostgres, UpgradesContract):
    pass
