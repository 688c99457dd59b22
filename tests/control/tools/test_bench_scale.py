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
from control.tools import (
    bench_coldload,
    bench_fairness,
    bench_incidents,
    bench_registry,
    bench_warmup,
    bench_zipf,
)
from control.tools.bench_incidents import measure

ZIPF = {"zipf_1000_vs_32": 1.0}  # stands in for the Zipf bench's figures (not read here)


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


def test_the_cli_prints_the_figures(monkeypatch: pytest.MonkeyPatch, kit_dir: Path) -> None:
    monkeypatch.setitem(bench_incidents.QUICK, "rows", 5000)
    # the Zipf bench through tritonserver is test_bench_zipf's; the churn attack and the
    # warm-up run here at their smallest
    monkeypatch.setattr(bench_zipf, "run_bench", lambda *_a, **_k: ZIPF)
    # the registry bench at a tiny size: its figures are test_bench_registry's
    monkeypatch.setattr(bench_registry, "QUICK", bench_registry.Size(
        adapters=12, small=4, tenants=2, rounds=1, requests=100))
    monkeypatch.setattr(bench_fairness, "QUICK", {"runs": 1, "requests": 12, "versions": 6})
    monkeypatch.setattr(bench_warmup, "QUICK", {"restarts": 1})
    # the cold loads at a small width: the 7B shape is bench_coldload's own tests'
    monkeypatch.setattr(bench_coldload, "QUICK",
                        {"adapters": 2, "rounds": 2, "hidden": 256, "layers": 2})
    monkeypatch.delenv("LORAPLANE_TEST_PG_URL", raising=False)
    out = CliRunner().invoke(app, ["--json", "bench", "scale", "--quick", "--kit",
                                   str(kit_dir)])
    assert out.exit_code == 0, out.output
    fair = json.loads(out.stdout)["fairness"]
    assert fair["victim_failures"] == 0 and fair["churn_vs_none_p95"] > 0
    assert set(fair["runs"]) == {"none", "steady", "churn"}
    assert all(r["victim_requests"] == 12 for rs in fair["runs"].values() for r in rs)
    assert fair["runs"]["churn"][0]["attacker"]["sent"] > 0
    warm = json.loads(out.stdout)["warmup"]
    assert warm["ttft_first_with_s"] > 0 and warm["ttft_first_without_s"] > 0
    assert warm["warmup_s"] is not None
    cold = json.loads(out.stdout)["cold_loads"]
    assert cold["loads"] == 4 and cold["shape"]["hidden"] == 256
    for key in ("cold_load_vs_read_7b", "cold_load_p95_s", "read_hash_p95_s"):
        assert cold[key] > 0, key
    reg = json.loads(out.stdout)["registry"]
    assert reg["adapters"] == 12 and reg["events_per_adapter"] > 9
    assert reg["ticket_p99_100k_vs_100"] > 0 and reg["projection_events_per_s"] > 0
    inc = json.loads(out.stdout)["incidents"]
    assert inc["sqlite"]["rows"] == 5000 and "postgresql" not in inc
    assert inc["sqlite"]["base_hour"]["indexes"] == ["ix_ledger_base_time"]
