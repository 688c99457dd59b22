"""What the evaluation gate records, through the registry: golden task sets, gate policies, the
candidate's own release, gate reports, and the canary guard that reads them. One suite on SQLite
and PostgreSQL; the gate's run through real Triton is ``tests/integration/test_gate.py``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from eventsourcing.utils import get_topic

from control.app.audit import audit_log
from control.app.gate_desk import GateDesk
from control.app.registry import Registry
from control.app.releases import GATE_REPORT_FILE, REPORT_FILE
from control.contracts.config import Settings
from control.contracts.db import make_engine
from control.contracts.documents import document_digest
from control.contracts.golden import GOLDEN_KIND, GoldenSet
from control.domain import (
    CANARY,
    Adapter,
    Combination,
    DomainError,
    IllegalTransition,
)
from projections.follower import open_registry
from tests.fixtures_control import Artifacts, OnPostgres, OnSQLite, WithRegistry, close_registry

GOLDEN = GoldenSet.from_json({"kind": GOLDEN_KIND, "family": "chat", "tasks": [
    {"id": f"t{i}", "prompt": f"hello {i}", "checker": {"kind": "exact", "expected": " hi"}}
    for i in range(3)]})
FIGURES = {"success_rate": 1.0, "misattributions": 0}


def _events(registry: Registry) -> list[str]:
    return [e.event_type for e in audit_log(registry)]


class GateRecordsContract(WithRegistry):
    @pytest.fixture
    def digest(self, registry: Registry, artifacts: Artifacts) -> str:
        registry.register_base(artifacts.base, artifacts.tokenizer, name="tiny", actor="op")
        registry.create_tenant("acme", actor="op")
        d = registry.register_adapter(artifacts.adapters["alpha"], tenant="acme", alias="chat",
                                      actor="alice", golden=GOLDEN)
        registry.promote(d, actor="alice")  # -> candidate
        return d

    def test_a_golden_set_is_stored_and_recorded_with_the_registration(
            self, registry: Registry, digest: str) -> None:
        adapter = registry.adapter(digest)
        assert adapter.golden_set == GOLDEN.digest() and adapter.golden_tasks == 3
        assert registry.store.contains(GOLDEN.digest())
        assert GateDesk(registry).golden_set(adapter) == GOLDEN
        recorded = [e for e in audit_log(registry) if e.event_type == "GoldenSetRecorded"]
        assert [e.summary["golden_digest"] for e in recorded] == [GOLDEN.digest()]
        assert recorded[0].summary["tasks"] == 3
        # the same transaction as the registration, right after it
        kinds = _events(registry)
        assert kinds[kinds.index("AdapterRegistered") + 1:][:2] in (
            ["GoldenSetRecorded", "AliasCreated"], ["AliasCreated", "GoldenSetRecorded"])

    def test_a_later_golden_set_replaces_the_first(self, registry: Registry,
                                                   digest: str) -> None:
        desk = GateDesk(registry)
        other = GoldenSet("chat", GOLDEN.tasks[:1])
        assert desk.record_golden_set(digest, other, actor="alice") == other.digest()
        assert desk.golden_set(registry.adapter(digest)) == other

    def test_policy_events_set_the_tenant_default_and_the_adapter_override(
            self, registry: Registry, digest: str) -> None:
        desk = GateDesk(registry)
        assert desk.policy_for(registry.adapter(digest)).max_cold_load_p95_s == 8.0
        tenant_policy = desk.set_tenant_policy("acme", {"max_cold_load_p95_s": 4.0,
                                                        "max_success_rate_drop": 0.01},
                                               actor="op")
        assert tenant_policy.max_cold_load_p95_s == 4.0
        effective = desk.override_adapter_policy(digest, {"max_cold_load_p95_s": 12.0},
                                                 actor="alice")
        assert effective.max_cold_load_p95_s == 12.0 and effective.max_success_rate_drop == 0.01
        assert desk.policy_for(registry.adapter(digest)) == effective
        before = _events(registry)
        with pytest.raises(DomainError, match="unknown gate policy field"):
            desk.override_adapter_policy(digest, {"cold_load": 1}, actor="alice")
        with pytest.raises(DomainError, match="fraction"):
            desk.set_tenant_policy("acme", {"max_memory_accounting_error": 2}, actor="op")
        assert _events(registry) == before  # nothing half-recorded
        summaries = {e.event_type: e.summary for e in audit_log(registry)}
        assert summaries["GatePolicySet"]["policy"] == {"max_cold_load_p95_s": 4.0,
                                                        "max_success_rate_drop": 0.01}
        assert summaries["GatePolicyOverridden"]["overrides"] == {"max_cold_load_p95_s": 12.0}

    def test_the_gate_release_is_recorded_but_routed_by_no_alias(
            self, registry: Registry, digest: str, view: Any) -> None:
        desk = GateDesk(registry)
        release = desk.gate_release(registry.adapter(digest), actor="gate")
        manifest = registry.release_manifest(release).manifest
        assert (manifest.adapter_digest, manifest.evaluation_report_digest) == (digest, None)
        route = registry.alias("chat")
        assert route.stable is None and route.canary is None
        registry.grant("acme", "chat", actor="op")
        assert view.resolve("acme", "chat") is None  # no tenant is routed to it
        before = _events(registry)
        assert desk.gate_release(registry.adapter(digest), actor="gate") == release
        assert _events(registry) == before  # the same manifest: the same release, no event

    def test_canary_is_refused_without_a_passing_gate_report_and_accepted_with_one(
            self, registry: Registry, digest: str) -> None:
        desk = GateDesk(registry)
        combo = registry.canary_combination(registry.adapter(digest))
        with pytest.raises(IllegalTransition, match="evaluation report"):
            registry.promote(digest, actor="alice")
        failing = desk.record_gate_report(digest, {"passed": False, "figures": FIGURES},
                                          passed=False, figures=FIGURES, combination=combo,
                                          actor="gate")
        with pytest.raises(IllegalTransition, match="adapter gate DIGEST"):
            registry.promote(digest, actor="alice")
        elsewhere = Combination(combo.base, combo.tokenizer, "sha256:" + "d" * 64)
        desk.record_gate_report(digest, {"passed": True, "on": "another template"},
                                passed=True, figures=FIGURES, combination=elsewhere,
                                actor="gate")
        with pytest.raises(IllegalTransition, match="evaluation report"):
            registry.promote(digest, actor="alice")
        passing = desk.record_gate_report(digest, {"passed": True, "figures": FIGURES},
                                          passed=True, figures=FIGURES, combination=combo,
                                          actor="gate")
        assert failing != passing
        assert desk.gate_report(passing) == {"passed": True, "figures": FIGURES}
        assert passing == document_digest(GATE_REPORT_FILE, {"passed": True,
                                                             "figures": FIGURES})
        assert registry.promote(digest, actor="alice") == CANARY
        release = registry.release_manifest(registry.adapter(digest).release or "")
        assert release.evaluation_report_digest == passing
        recorded = [e.summary for e in audit_log(registry)
                    if e.event_type == "GateReportRecorded"]
        assert [r["passed"] for r in recorded] == [False, True, True]
        assert recorded[-1]["base"] == combo.base and recorded[-1]["template"] is None
        assert recorded[-1]["figures"] == FIGURES

    def test_an_external_report_is_accepted_only_with_the_flag(
            self, registry: Registry, digest: str, artifacts: Artifacts) -> None:
        report = {"suite": "outside", "passed": True, "producer": "eval-team"}
        before = _events(registry)
        with pytest.raises(IllegalTransition, match="--external"):
            registry.record_evaluation(digest, report, actor="eve")
        with pytest.raises(IllegalTransition, match="--external"):
            registry.advance(digest, evaluation=report, actor="eve")
        assert _events(registry) == before
        assert not registry.store.contains(document_digest(REPORT_FILE, report))
        with pytest.raises(IllegalTransition, match="evaluation report"):
            registry.advance(digest, actor="eve")  # nor without any report
        d = registry.record_evaluation(digest, report, actor="eve", external=True)
        recorded = [e.summary for e in audit_log(registry) if e.event_type == "EvaluationRecorded"]
        assert recorded == [{"digest": digest, "report_digest": d,
                             "summary": {"passed": True, "suite": "outside",
                                         "producer": "eval-team"},
                             "external": True}]
        assert registry.advance(digest, actor="eve") == "stable"  # the alias's first release
        release = registry.release_manifest(registry.adapter(digest).release or "")
        assert release.evaluation_report_digest == d
        # advance records and walks in one transaction, with the flag
        d2 = registry.register_adapter(artifacts.adapters["beta"], tenant="acme", alias="chat",
                                       actor="alice")
        assert registry.advance(d2, evaluation=report, external=True, to="canary",
                                actor="eve") == CANARY

    def test_evaluations_stored_before_the_gate_read_back_as_external(
            self, registry: Registry, digest: str, settings: Settings) -> None:
        registry.record_evaluation(digest, {"suite": "old", "passed": True}, actor="eve",
                                   external=True)
        topic = get_topic(Adapter.EvaluationRecorded)
        with make_engine(settings.db_url).begin() as conn:
            row = conn.execute(sa.text("SELECT id, state FROM registry_events WHERE topic = :t"),
                               {"t": topic}).one()
            state = json.loads(bytes(row.state))
            assert state.pop("external") is True and state.pop("class_version") == 2
            conn.execute(sa.text("UPDATE registry_events SET state = :s WHERE id = :i"),
                         {"s": json.dumps(state, separators=(",", ":")).encode(), "i": row.id})
        reopened = open_registry(settings, follow=False)
        try:
            adapter = reopened.adapter(digest)
            assert adapter.evaluation_report is not None
            old = [e.summary for e in audit_log(reopened) if e.event_type == "EvaluationRecorded"]
            assert old[0]["external"] is True
        finally:
            close_registry(reopened)


class TestGateRecordsSQLite(OnSQLite, GateRecordsContract):
    pass


class TestGateRecordsPostgres(OnPostgres, GateRecordsContract):
    pass


def test_cli_golden_policies_external_reports_and_a_gate_that_cannot_run(
        tmp_path: Path, artifacts: Artifacts) -> None:
    from typer.testing import CliRunner

    from control.cli.main import app

    home = tmp_path / "home"

    def cli(*args: str) -> tuple[int, Any]:
        res = CliRunner().invoke(app, ["--json", "--home", str(home), "--actor", "ops", *args],
                                 env={"LORAPLANE_DB_URL": ""})
        try:
            return res.exit_code, json.loads(res.stdout.strip().splitlines()[-1])
        except (ValueError, IndexError):
            return res.exit_code, res.stdout + res.stderr

    golden = tmp_path / "golden.json"
    golden.write_text(json.dumps(GOLDEN.document(), indent=2))
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({**GOLDEN.document(), "tasks": []}))
    assert cli("base", "register", str(artifacts.base), "--tokenizer", str(artifacts.tokenizer),
               "--name", "tiny")[0] == 0
    assert cli("tenant", "create", "acme")[0] == 0
    code, out = cli("adapter", "register", str(artifacts.adapters["alpha"]), "--tenant", "acme",
                    "--alias", "chat", "--golden", str(bad))
    assert code == 2 and "non-empty list" in out["error"]
    code, out = cli("adapter", "list")
    assert out == []  # the bad golden set was refused before anything was registered
    code, out = cli("adapter", "register", str(artifacts.adapters["alpha"]), "--tenant", "acme",
                    "--alias", "chat", "--golden", str(golden))
    assert code == 0 and out["golden_digest"] == GOLDEN.digest()
    d = out["digest"]
    code, out = cli("adapter", "golden", d, str(golden))
    assert code == 0 and out["tasks"] == 3 and out["golden_digest"] == GOLDEN.digest()

    code, out = cli("tenant", "gate-policy", "acme", "--set", "max_cold_load_p95_s=4")
    assert code == 0 and out["policy"]["max_cold_load_p95_s"] == 4
    code, out = cli("adapter", "gate-policy", d, "--set", "max_success_rate_drop=0.02",
                    "--set", "require_long_context=false")
    assert code == 0 and out["overrides"] == {"max_success_rate_drop": 0.02,
                                              "require_long_context": False}
    assert out["policy"]["max_cold_load_p95_s"] == 4  # the tenant's, under the override
    code, out = cli("adapter", "gate-policy", d, "--set", "nonsense=1")
    assert code == 2 and "unknown gate policy field" in out["error"]
    code, out = cli("adapter", "gate-policy", d, "--set", "max_misattributions")
    assert code == 2 and "FIELD=VALUE" in str(out)
    code, out = cli("adapter", "gate-policy", d, "--clear")
    assert code == 0 and out["overrides"] == {}

    report = tmp_path / "eval.json"
    report.write_text(json.dumps({"suite": "outside", "passed": True}))
    assert cli("adapter", "promote", d)[0] == 0  # -> candidate
    code, out = cli("adapter", "evaluate", d, str(report))
    assert code == 2 and "--external" in out["error"]
    code, out = cli("adapter", "release", d, "--evaluation", str(report))
    assert code == 2 and "--external" in out["error"]
    code, out = cli("adapter", "evaluate", d, str(report), "--external")
    assert code == 0 and out["external"] is True

    # The gate refuses to start where it cannot run, recording nothing: no golden set here.
    d2 = cli("adapter", "register", str(artifacts.adapters["beta"]), "--tenant", "acme",
             "--alias", "chat")[1]["digest"]
    code, out = cli("adapter", "gate", d2, "--http", "127.0.0.1:9", "--grpc", "127.0.0.1:9")
    assert code == 2 and "no golden task set" in out["error"]
    assert "sha256" not in out["error"]
