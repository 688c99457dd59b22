"""``loraplane bench cli --runs 1 --json``: a real run (one deployment with a real tritonserver),
checked for the report's shape and for every measured time being a positive number. Speed itself
is not asserted here (tests assert behaviour); the bench reports it against its goals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from control.cli.main import app
from control.ops.triton_server import TritonUnavailable, find_triton
from control.tools.bench_cli import GOALS, MEASURES
from tests.required import unavailable

pytestmark = pytest.mark.triton


def test_bench_cli_reports_every_measure_of_one_real_run(kit_dir: Path, tmp_path: Path) -> None:
    try:
        find_triton(tmp_path / "probe")
    except TritonUnavailable as e:
        unavailable("the real tritonserver", str(e))
    res = CliRunner().invoke(app, ["--json", "--home", str(tmp_path / "h"), "bench", "cli",
                                   "--runs", "1", "--kit", str(kit_dir)],
                             env={"LORAPLANE_DB_URL": ""})
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout)
    assert set(report) == {"medians", "goals", "met", "runs", "revocations", "setup"}
    assert set(report["runs"]) == set(report["medians"]) == set(MEASURES)
    for key in MEASURES:
        (only,) = report["runs"][key]
        assert isinstance(only, float) and only > 0, (key, only)
        assert report["medians"][key] == only
    assert report["goals"] == GOALS
    assert set(report["met"]) == set(GOALS)
    assert all(isinstance(v, bool) for v in report["met"].values())
    (revocation,) = report["revocations"]
    assert revocation["digest"].startswith("sha256:")
    assert revocation["to_refusal_s"] == report["runs"]["revoke_to_refusal_s"][0]
    assert revocation["polls"] >= 1 and revocation["refusal_status"] == "400"
    assert report["setup"]["runs"] == 1 and report["setup"]["adapters_listed"] == 3
