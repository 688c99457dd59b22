"""``loraplane bench ledger`` at a tiny size: both loads measured on both sides, ratios with
their spread, and the logged side's rows really in the host's log."""

from __future__ import annotations

from pathlib import Path

import sqlalchemy as sa

from control.contracts.db import make_engine
from control.contracts.ledger_log import ledger_log
from control.tools.bench_ledger import measure


def test_measure_reports_both_loads_with_their_spread(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'bench.db'}"
    result = measure(url, rows=30, paced_rows=4, runs=2)
    for load in ("burst", "paced"):
        r = result[load]
        assert r["runs"] == 2 and len(r["ratios"]) == 2
        assert r["spread"] == [min(r["ratios"]), max(r["ratios"])]
        assert r["plain_rows_s"] > 0 and r["logged_rows_s"] > 0
    with make_engine(url).connect() as conn:
        logged = conn.execute(sa.select(sa.func.count()).select_from(ledger_log)).scalar()
    assert logged == 50 + 2 * (30 + 4)  # the warm-up and each round's logged side, no more
