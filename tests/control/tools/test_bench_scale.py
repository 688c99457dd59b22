"""``loraplane bench scale`` at a tiny size through the CLI: every incident query kind measured,
its rows counted by the database itself, and the plan's indexes named."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import sqlalchemy as sa
from typer.testing import CliRunner

from control.cli.main import app
from control.contracts.db import make_engine
from control.contracts.ledger import request_ledger
from control.tools import bench_coldload, bench_incidents
from control.tools.bench_incidents import measure


def test_each_kind_is_timed_and_its_rows_are_the_subject_s(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    result = measure(url, 20_000)
    engine = make_engine(url)
    with engine.connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(request_ledger)).scalar() \
            == 20_000
        per_adapter = conn.execute(sa.select(sa.func.count()).select_from(request_ledger).where(
            request_ledger.c.adapter_digest == bench_incidents._digest("adapter", 5))).scalar()
    assert per_adapter and 5 <= per_adapter <= 40  # 16 on average: 80 % of rows / 1000 adapters
    for kind in ("adapter", "release", "training_data_version", "base_hour"):
        k = result[kind]
        assert k["median_ms"] > 0 and k["p95_ms"] >= k["median_ms"]
        assert k["rows_median"] > 0 and k["indexes"], kind
        assert k["met"] == (k["p95_ms"] < bench_incidents.GOAL_MS)


def test_the_cli_prints_the_figures(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(bench_incidents.QUICK, "rows", 5000)
    # the cold loads at a small width: the 7B shape is bench_coldload's own tests'
    monkeypatch.setattr(bench_coldload, "QUICK",
                        {"adapters": 2, "rounds": 2, "hidden": 256, "layers": 2})
    monkeypatch.delenv("LORAPLANE_TEST_PG_URL", raising=False)
    out = CliRunner().invoke(app, ["--json", "bench", "scale", "--quick"])
    assert out.exit_code == 0, out.output
    cold = json.loads(out.output)["cold_loads"]
    assert cold["loads"] == 4 and cold["shape"]["hidden"] == 256
    for key in ("cold_load_vs_read_7b", "cold_load_p95_s", "read_hash_p95_s"):
        assert cold[key] > 0, key
    inc = json.loads(out.output)["incidents"]
    assert inc["sqlite"]["rows"] == 5000 and "postgresql" not in inc
    assert inc["sqlite"]["base_hour"]["indexes"] == ["ix_ledger_base_time"]
