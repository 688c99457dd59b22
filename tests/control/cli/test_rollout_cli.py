"""The rollout verbs: ``alias rollout`` records a rollout with its policy, ``rollout status``
reads it back (``--json`` and the human view), ``pause``/``resume``/``abort`` act on it, and none
of them imports torch, transformers or peft."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from typer.testing import CliRunner

from control.cli.main import app
from control.cli.rollouts import parse_duration, parse_steps
from control.contracts.config import Settings
from control.contracts.digests import directory_digest
from projections.follower import open_registry
from tests.control.cli.test_fast_cli import _run_verbs
from tests.fixtures_control import Artifacts, close_registry, sqlite_settings


def _cli(settings: Settings, *args: str) -> Any:
    return CliRunner().invoke(app, ["--home", str(settings.home), "--actor", "alice", *args],
                              env={"LORAPLANE_DB_URL": settings.db_url})


def _home(tmp_path: Path, artifacts: Artifacts) -> tuple[Settings, str]:
    """A home whose alias ``chat`` has alpha stable and beta canary; returns beta's digest."""
    s = sqlite_settings(tmp_path / "home")
    s.ensure_dirs()
    reg = open_registry(s)
    try:
        reg.register_base(artifacts.base, artifacts.tokenizer, name="tiny", actor="op")
        reg.create_tenant("acme", actor="op")
        digests = []
        for name, to in (("alpha", "stable"), ("beta", "canary")):
            d = reg.register_adapter(artifacts.adapters[name], tenant="acme", alias="chat",
                                     actor="op")
            reg.advance(d, evaluation={"suite": "smoke", "passed": True}, to=to, actor="op",
                        external=True)
            digests.append(d)
    finally:
        close_registry(reg)
    return s, digests[1]


def test_durations_and_steps_parse() -> None:
    assert [parse_duration(v) for v in ("60s", "1.5s", "500ms", "2m", "1h", "3")] == [
        60.0, 1.5, 0.5, 120.0, 3600.0, 3.0]
    assert parse_steps("1,10, 50,100") == [1, 10, 50, 100]


def test_a_rollout_is_started_watched_paused_resumed_and_aborted(
        tmp_path: Path, artifacts: Artifacts) -> None:
    s, beta = _home(tmp_path, artifacts)
    started = _cli(s, "--json", "alias", "rollout", "chat", beta, "--steps", "5,50,100",
                   "--window", "90s", "--min-requests", "30", "--sessions", "drain")
    assert started.exit_code == 0, started.output
    body = json.loads(started.stdout)
    assert (body["number"], body["status"], body["steps"], body["window_s"]) == (
        1, "running", [5, 50, 100], 90.0)
    assert (body["policy"]["min_requests"], body["policy"]["sessions"]) == (30, "drain")
    again = _cli(s, "alias", "rollout", "chat", beta)
    assert again.exit_code == 2 and "in progress" in again.output

    status = _cli(s, "--json", "rollout", "status", "chat")
    assert status.exit_code == 0, status.output
    data = json.loads(status.stdout)
    assert (data["status"], data["step"], data["windows"], data["ended"]) == (
        "running", 0, [], None)
    human = _cli(s, "rollout", "status", "chat")
    assert human.exit_code == 0 and "chat rollout #1" in human.output

    assert _cli(s, "rollout", "pause", "chat", "--reason", "look").exit_code == 0
    assert json.loads(_cli(s, "--json", "rollout", "status", "chat").stdout)[
        "status"] == "paused"
    assert _cli(s, "rollout", "resume", "chat").exit_code == 0
    aborted = _cli(s, "--json", "rollout", "abort", "chat", "--reason", "wrong target")
    assert aborted.exit_code == 0, aborted.output
    data = json.loads(_cli(s, "--json", "rollout", "status", "chat").stdout)
    assert data["status"] == "rolled_back"
    assert data["ended"]["event"] == "RolloutRolledBack"
    assert data["ended"]["sessions"] == "drain" and data["ended"]["actor"] == "alice"
    assert data["reasons"] == ["aborted by alice: wrong target"]
    shown = json.loads(_cli(s, "--json", "alias", "show", "chat").stdout)
    assert shown["canary"] is None  # abort rolled the canary back


def test_bad_arguments_are_refused_without_recording(tmp_path: Path,
                                                     artifacts: Artifacts) -> None:
    s, beta = _home(tmp_path, artifacts)
    for args, why in ((["--steps", "10,5,100"], "increase"), (["--steps", "a,b"], "per cents"),
                      (["--window", "soon"], "duration"), (["--sessions", "forget"], "repin"),
                      (["--window", "0.1s"], "window")):
        result = _cli(s, "alias", "rollout", "chat", beta, *args)
        assert result.exit_code == 2 and why in result.output, (args, result.output)
    assert _cli(s, "rollout", "status", "chat").exit_code == 2  # nothing was recorded
    assert _cli(s, "rollout", "abort", "chat").exit_code == 2  # --reason is required


def test_rollout_verbs_never_import_torch(tmp_path: Path, artifacts: Artifacts) -> None:
    report_file = tmp_path / "eval.json"
    report_file.write_text(json.dumps({"suite": "smoke", "passed": True}))
    alpha, beta = artifacts.adapters["alpha"], artifacts.adapters["beta"]
    a, b = directory_digest(alpha), directory_digest(beta)
    verbs: list[tuple[list[str], int]] = [
        (["base", "register", str(artifacts.base), "--tokenizer", str(artifacts.tokenizer),
          "--name", "tiny"], 0),
        (["tenant", "create", "acme"], 0),
        (["adapter", "register", str(alpha), "--tenant", "acme", "--alias", "chat"], 0),
        (["adapter", "release", a, "--evaluation", str(report_file), "--external"], 0),
        (["adapter", "register", str(beta), "--tenant", "acme", "--alias", "chat"], 0),
        (["adapter", "release", b, "--evaluation", str(report_file), "--external", "--to",
          "canary"], 0),
        (["alias", "rollout", "chat", b, "--steps", "10,100", "--window", "30s"], 0),
        (["rollout", "status", "chat"], 0),
        (["rollout", "pause", "chat"], 0),
        (["rollout", "resume", "chat"], 0),
        (["rollout", "abort", "chat", "--reason", "test"], 0),
    ]
    report = _run_verbs(tmp_path / "home", verbs)
    for (args, code), r in zip(verbs, report, strict=True):
        assert r["code"] == code, f"{' '.join(args)}: exit {r['code']}: {r['out']}"
        assert r["heavy"] == [], f"`loraplane {' '.join(args)}` imported {r['heavy']}"
