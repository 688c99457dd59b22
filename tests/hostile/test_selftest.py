"""``loraplane selftest hostile --json`` against a real deployment: every category, zero failures.

This is the run whose table the README shows (it prints it).
"""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from control.cli import app
from control.selftest import CATEGORIES
from tests.hostile.conftest import HostileStack

pytestmark = pytest.mark.triton


def test_selftest_hostile_cli(hostile: HostileStack) -> None:
    t = hostile.target
    result = CliRunner().invoke(app, [
        "--json", "--home", str(hostile.settings.home), "selftest", "hostile",
        "--gateway", t.gateway_url, "--http", t.http_url, "--grpc", t.grpc_url,
        "--metrics", str(t.metrics_url), "--requests", "1000", "--clients", "32"],
        env={"LORAPLANE_DB_URL": hostile.settings.db_url})
    data = json.loads(result.stdout.strip().splitlines()[-1])
    print("\n| category | tried | refused as expected | failed |\n| --- | --- | --- | --- |")
    for c, r in data.items():
        print(f"| {c} | {r['tried']} | {r['refused_as_expected']} | {r['failed']} |")
    assert list(data) == list(CATEGORIES)
    for c, r in data.items():
        assert r["tried"] > 0, c
        assert r["failed"] == 0, (c, r["failures"])
    assert data["attribution"]["tried"] >= 1000
    assert result.exit_code == 0
