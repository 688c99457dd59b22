"""``loraplane selftest hostile --json`` against a real deployment, and what it says when it
cannot try something.

The first test is the run whose table the README shows (it prints it).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from control.cli.main import app
from control.tools.hostile.report import NOT_APPLICABLE, NOT_TRIED, Report
from control.tools.hostile.serving import NOT_FORWARDED
from control.tools.selftest import CATEGORIES
from tests.hostile.conftest import HostileStack

ATTRIBUTION_REQUESTS = 1000


def _args(hostile: HostileStack, *extra: str, metrics: bool = True) -> list[str]:
    t = hostile.target
    return ["--json", "--home", str(hostile.settings.home), "selftest", "hostile",
            "--gateway", t.gateway_url, "--http", t.http_url, "--grpc", t.grpc_url,
            *(["--metrics", str(t.metrics_url)] if metrics else []), *extra]


def _set_apart(data: dict[str, Any], category: str, kind: str) -> dict[str, int]:
    return {x["reason"]: x["cases"] for x in data["could_not_try"]
            if x["category"] == category and x["kind"] == kind}


@pytest.mark.triton
def test_selftest_hostile_cli(hostile: HostileStack) -> None:
    result = CliRunner().invoke(app, _args(
        hostile, "--requests", str(ATTRIBUTION_REQUESTS), "--clients", "32"),
        env={"LORAPLANE_DB_URL": hostile.settings.db_url})
    data = json.loads(result.stdout.strip().splitlines()[-1])
    cats = data["categories"]
    print("\n| category | tried | refused as expected | failed | not applicable | not tried |"
          "\n| --- | --- | --- | --- | --- | --- |")
    for c, r in cats.items():
        print(f"| {c} | {r['tried']} | {r['refused_as_expected']} | {r['failed']} | "
              f"{r['not_applicable']} | {r['not_tried']} |")
    for x in data["could_not_try"]:
        print(f"{x['category']}: {x['kind']} x{x['cases']}: {x['reason']} {x['examples']}")
    for c, r in cats.items():
        for f in r["failures"]:
            print(f"FAILED {c}: {f}")
    assert list(cats) == list(CATEGORIES)
    for c, r in cats.items():
        assert r["failed"] == 0, (c, r["failures"])
        assert r["tried"] > 0, c
        # Metrics given, PEFT importable, the home's key is the gateway's: nothing left untried.
        assert r["not_tried"] == 0, (c, data["could_not_try"])
        assert r["tried"] == r["refused_as_expected"]
    # Headers Triton never forwards are set apart, never counted as refusals.
    assert _set_apart(data, "parameters", NOT_APPLICABLE)[NOT_FORWARDED] == 8 * 7
    # Every attribution request was judged against its reference (prompts on which references
    # agree or are empty are left out of the burst, and counted apart, one case per prompt).
    assert cats["attribution"]["tried"] == ATTRIBUTION_REQUESTS
    assert data["complete"] and data["failed"] == 0
    assert result.exit_code == 0


@pytest.mark.triton
def test_selftest_says_it_did_not_search_metrics_it_was_not_given(hostile: HostileStack) -> None:
    result = CliRunner().invoke(app, _args(hostile, "--category", "identity", metrics=False),
                                env={"LORAPLANE_DB_URL": hostile.settings.db_url})
    data = json.loads(result.stdout.strip().splitlines()[-1])
    assert list(data["categories"]) == ["identity"]
    identity = data["categories"]["identity"]
    assert identity["failed"] == 0, identity["failures"]
    assert identity["not_tried"] == 1
    (reason,) = _set_apart(data, "identity", NOT_TRIED)
    assert "no --metrics given" in reason
    assert result.exit_code == 0  # identity still tried its other cases: complete


@pytest.mark.triton
def test_selftest_without_peft_judges_nothing_and_says_incomplete(
        hostile: HostileStack, tmp_path: Path) -> None:
    # A broken install, as an operator's machine might have it: `import peft` fails.
    (tmp_path / "peft.py").write_text("raise ImportError('peft is broken here')\n")
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{Path.cwd()}",
           "LORAPLANE_DB_URL": hostile.settings.db_url}
    proc = subprocess.run(
        [sys.executable, "-m", "control.cli.main",
         *_args(hostile, "--category", "attribution", "--requests", "24", "--clients", "4")],
        env=env, capture_output=True, text=True, timeout=600)
    data = json.loads(proc.stdout.strip().splitlines()[-1])
    attribution = data["categories"]["attribution"]
    assert attribution["failed"] == 0, attribution["failures"]
    assert attribution["tried"] == 0  # the engine's claims alone are not evidence
    assert attribution["not_tried"] == 24
    (reason,) = _set_apart(data, "attribution", NOT_TRIED)
    assert "PEFT not importable" in reason and "peft is broken here" in reason
    assert not data["complete"]
    assert proc.returncode == 3, proc.stderr[-2000:]


def test_selftest_without_the_database_blocks_every_category(tmp_path: Path) -> None:
    unreachable = "postgresql+psycopg://postgres@127.0.0.1:1/nothing"
    result = CliRunner().invoke(app, [
        "--json", "--home", str(tmp_path), "selftest", "hostile",
        "--gateway", "http://127.0.0.1:1", "--http", "127.0.0.1:1", "--grpc", "127.0.0.1:1"],
        env={"LORAPLANE_DB_URL": unreachable})
    data = json.loads(result.stdout.strip().splitlines()[-1])
    assert [x["kind"] for x in data["could_not_try"]] == ["blocked"] * len(CATEGORIES)
    assert all("no access to the database" in x["reason"] for x in data["could_not_try"])
    assert all(r["tried"] == 0 for r in data["categories"].values())
    assert "postgres@" not in result.stdout  # the URL (and any password in it) stays out
    assert not data["complete"] and result.exit_code == 3


def test_cases_set_apart_are_never_passes() -> None:
    report = Report()
    report.check("tickets", "garbage/http", True)
    report.not_applicable("parameters", "header:adapter", "never forwarded")
    report.not_tried("attribution", "request/http", "no reference")
    data = report.to_json(("tickets", "parameters", "attribution"))
    assert data["categories"]["tickets"]["refused_as_expected"] == 1
    for c, kind in (("parameters", "not_applicable"), ("attribution", "not_tried")):
        r = data["categories"][c]
        assert (r["tried"], r["refused_as_expected"], r[kind]) == (0, 0, 1)
    assert not data["complete"]  # two of the three categories tried nothing
    assert report.complete(("tickets",))
    report.check("tickets", "expired/http", False, "served")
    assert report.failed == 1
    assert report.to_json()["categories"]["tickets"]["failures"] == ["expired/http: served"]
