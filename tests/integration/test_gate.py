"""The evaluation gate through the real tritonserver: the kit's good new version of alpha passes,
its degraded version fails on its success rate, its floor and its gain over the base alone, and
each report's figures match the ledger: the success rate recomputed from the ledger's rows and
the golden set's own checkers, and every request on the synthetic tenant ``loraplane:gate``.

Runs on the integration ``stack`` (acme's ``acme-alpha`` serves alpha as its stable release):
the candidates are registered as drafts on that alias with the kit's alpha golden set, so the
stable release they would replace is alpha. Nothing here moves an alias for long: the one
canary promotion is deprecated again at once.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from control.app.gate_desk import GateDesk
from control.contracts.ledger import Ledger
from control.contracts.synthetic import GATE_TENANT
from control.domain import CANARY, IllegalTransition
from control.tools.gate import GateResult, GateTarget, run_gate
from tests.integration.conftest import ACTOR, Stack

pytestmark = pytest.mark.triton


@pytest.fixture(scope="module")
def candidates(stack: Stack) -> dict[str, str]:
    golden = stack.kit.golden_set(stack.kit_dir, "alpha")
    out = {}
    for name in ("alpha-v2", "alpha-degraded"):
        out[name] = stack.registry.register_adapter(
            stack.kit_dir / stack.kit.adapters[name].path, tenant="acme", alias="acme-alpha",
            actor=ACTOR, golden=golden)
    return out


@pytest.fixture(scope="module")
def target(stack: Stack) -> GateTarget:
    return GateTarget(stack.settings, stack.http, stack.grpc,
                      f"http://127.0.0.1:{stack.deployment.ports.metrics}/metrics")


@pytest.fixture(scope="module")
def gated(target: GateTarget, candidates: dict[str, str]) -> dict[str, GateResult]:
    return {name: run_gate(target, digest, actor=ACTOR) for name, digest in candidates.items()}


def _claims(ticket: str, keys_dir: Path | None = None) -> dict[str, Any]:
    """A ticket's claims, unverified; its sealed arm opened with the signing keys under
    ``keys_dir`` when given (the ticket tells a tenant no arm)."""
    from control.app.key_ring import held_seal_keys
    from control.contracts.tickets import unverified_claims

    return unverified_claims(ticket, held_seal_keys(keys_dir) if keys_dir else None)


def test_the_good_version_passes_every_rule(gated: dict[str, GateResult],
                                            stack: Stack) -> None:
    result = gated["alpha-v2"]
    f = result.report["figures"]
    print("alpha-v2 figures:", json.dumps(f, sort_keys=True))
    print("alpha-v2 run:", round(result.report["finished_at"] - result.report["started_at"], 1),
          "s; phases:", json.dumps(result.report["phases"], sort_keys=True),
          "; memory:", json.dumps(result.report["memory"], sort_keys=True))
    assert result.passed, result.failures
    assert f["golden_tasks"] == 60 and f["has_stable"]
    assert f["success_rate"] >= f["stable_success_rate"] > f["base_success_rate"]
    assert f["authorization_errors"] == 0
    assert f["mismatch_refused"] == f["mismatch_tried"] == 6
    assert f["mixed_requests"] == 32 and f["misattributions"] == 0
    assert f["long_context_ok"] is True
    assert f["cold_loads"] >= 1 and f["cold_load_p95_s"] < 8.0 and f["load_failures"] == 0
    assert f["memory_accounting_error"] < 0.05
    assert result.report["stable"]["adapter"] == stack.digests["alpha"]
    # most mixed answers were told apart by their text, not only by the digests
    mixed = result.report["phases"]["mixed"]
    assert mixed["indistinguishable"] < mixed["requests"]


def test_the_degraded_version_fails_on_its_success_rate(gated: dict[str, GateResult]) -> None:
    result = gated["alpha-degraded"]
    f = result.report["figures"]
    print("alpha-degraded figures:", json.dumps(f, sort_keys=True))
    assert not result.passed
    failed = {v["rule"] for v in result.report["verdicts"] if not v["passed"]}
    # below the stable release, below the floor, and no better than the base alone
    assert failed == {"success_rate", "min_success_rate", "gain_over_base"}
    assert f["success_rate"] == 0.0 < f["stable_success_rate"]
    why = next(line for line in result.failures if line.startswith("success_rate"))
    assert "lower than the stable release it would replace" in why
    assert all(not row["candidate"]["passed"] for row in result.report["tasks"])
    # the wrong marker, on every prompt of its training distribution
    assert {row["candidate"]["text"] for row in result.report["tasks"]
            if "in_distribution" in row["tags"]} == {" ALPHA sighs"}
    # its serving is sound: only the answers are wrong
    assert f["misattributions"] == 0 and f["authorization_errors"] == 0


def test_the_reports_figures_match_the_ledger(gated: dict[str, GateResult],
                                              stack: Stack) -> None:
    ledger = Ledger(stack.registry.follower.engine)
    for name, result in gated.items():
        report = result.report
        rows = ledger.query(since=report["started_at"] - 1, until=report["finished_at"] + 1)
        by_ticket = {r.ticket_id: r for r in rows if r.ticket_id}
        counted: dict[str, Counter[str]] = {}
        for sent in report["requests"]:
            row = by_ticket.get(sent["ticket_id"])
            if sent["route"] in ("wrong_base", "wrong_tokenizer"):
                assert row is None  # refused before its ticket was verified: no ticket id
                continue
            assert row is not None, (name, sent)
            counted.setdefault(sent["phase"], Counter())[row.outcome] += 1
            if sent["ok"]:
                assert row.request_id == sent["request_id"]
                assert row.served_digest == sent["expected"] == (sent["answer_digest"] or None)
        unverified = Counter(r.reason for r in rows if r.ticket_id is None and r.reason in (
            "base", "tokenizer") and report["started_at"] <= r.admitted_at)
        assert unverified == {"base": 2, "tokenizer": 2}, name
        counted["mismatch"]["rejected"] += sum(unverified.values())
        assert {p: dict(c) for p, c in counted.items()} == report["ledger"], name
        for phase, figures in report["phases"].items():
            if figures["requests"]:
                assert figures["ok"] == counted[phase].get("ok", 0), (name, phase)
                assert figures["refused"] == counted[phase].get("rejected", 0), (name, phase)
        assert report["figures"]["ledger_mismatches"] == 0
        # every one of the gate's rows is the control plane's own traffic
        assert {r.tenant for r in by_ticket.values()
                if r.ticket_id in {s["ticket_id"] for s in report["requests"]}} == {GATE_TENANT}
        # The golden success rate, recomputed apart from the gate's own tally: the golden set
        # as the kit wrote it, its checker on each answer, and the ledger's row of each
        # request (a task passes only on an ok row).
        golden = {t.id: t for t in stack.kit.golden_set(stack.kit_dir, "alpha").tasks}
        answered = {row["id"]: row["candidate"] for row in report["tasks"]}
        golden_rows = {s["task"]: by_ticket.get(s["ticket_id"]) for s in report["requests"]
                       if s["phase"] == "golden"}
        passing = sum(1 for task_id, task in golden.items()
                      if (r := golden_rows.get(task_id)) is not None and r.outcome == "ok"
                      and task.checker.check(answered[task_id]["text"]))
        assert report["figures"]["success_rate"] == round(passing / len(golden), 6), name
        # cold loads: the candidate's adapter_loads rows
        loads = [x.seconds for x in ledger.loads(report["adapter"]) if x.outcome == "loaded"]
        assert report["cold_loads_s"] == sorted(loads)


def test_the_candidate_is_never_routable_by_tenants(gated: dict[str, GateResult],
                                                    stack: Stack) -> None:
    claims = _claims(stack.ticket("acme", "acme-alpha"), stack.settings.keys_dir)
    assert claims["adapter"] == stack.digests["alpha"]
    for result in gated.values():
        assert claims["release"] != result.report["release"]
        assert stack.registry.alias("acme-alpha").canary is None


def test_canary_follows_the_gate_report(gated: dict[str, GateResult], stack: Stack,
                                        candidates: dict[str, str]) -> None:
    reg = stack.registry
    desk = GateDesk(reg)
    stored = desk.gate_report(gated["alpha-v2"].report_digest)
    assert stored["figures"] == gated["alpha-v2"].report["figures"]
    bad = candidates["alpha-degraded"]
    reg.promote(bad, actor=ACTOR)  # -> candidate
    with pytest.raises(IllegalTransition, match="evaluation report"):
        reg.promote(bad, actor=ACTOR)
    good = candidates["alpha-v2"]
    reg.promote(good, actor=ACTOR)
    try:
        assert reg.promote(good, actor=ACTOR) == CANARY
        release = reg.release_manifest(reg.adapter(good).release or "")
        assert release.evaluation_report_digest == gated["alpha-v2"].report_digest
    finally:
        reg.promote(good, to="deprecated", actor=ACTOR)  # the shared stack's alias as it was
    assert reg.alias("acme-alpha").canary is None


def test_the_cli_gate_applies_the_adapters_policy(stack: Stack, target: GateTarget,
                                                  candidates: dict[str, str],
                                                  gated: dict[str, GateResult]) -> None:
    from typer.testing import CliRunner

    from control.cli.main import app

    def cli(*args: str) -> tuple[int, Any]:
        res = CliRunner().invoke(app, ["--json", "--home", str(stack.settings.home), *args],
                                 env={"LORAPLANE_DB_URL": stack.settings.db_url})
        return res.exit_code, json.loads(res.stdout.strip().splitlines()[-1])

    d = candidates["alpha-degraded"]
    # an override that lets this adapter drop below the stable release: the policy decides
    # that rule, and the report records it; the floor and the base alone still judge it
    code, out = cli("adapter", "gate-policy", d, "--set", "max_success_rate_drop=1.0")
    assert code == 0 and out["policy"]["max_success_rate_drop"] == 1.0
    code, out = cli("adapter", "gate-policy", d, "--set", "min_success_rate=0")
    assert code == 2 and "above 0" in out["error"]  # the floor cannot be switched off
    code, out = cli("adapter", "gate", d, "--http", target.http_url, "--grpc", target.grpc_url,
                    "--metrics", target.metrics_url or "")
    assert code == 1 and out["passed"] is False, out
    assert [line.split(":")[0] for line in out["failures"]] == ["min_success_rate",
                                                                "gain_over_base"]
    assert out["report_digest"] != gated["alpha-degraded"].report_digest
    code, report = cli("adapter", "gate-report", out["report_digest"])
    assert code == 0 and report["policy"]["max_success_rate_drop"] == 1.0
    code, latest = cli("adapter", "gate-report", d)  # by adapter: its latest per combination
    assert code == 0 and [(r["report_digest"], r["passed"]) for r in latest] == [
        (out["report_digest"], False)]
    assert latest[0]["base"] == report["combination"]["base"]
    code, out = cli("adapter", "gate-policy", d, "--clear")
    assert code == 0 and out["policy"]["max_success_rate_drop"] == 0.0
