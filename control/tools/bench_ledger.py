"""``ledger_log_vs_plain``: what each host's Merkle log costs the request ledger's writer.

The same writer (``backend.serving.recorder.LedgerWriter``) completes the same number of running
rows twice per round: once plain, once with its host's log (every final row hashed into a leaf
and appended in the same transaction). Rounds alternate the two sides and each reports rows per
second of the logged side divided by the plain side's, so both meet the same machine load; the
result is the median ratio of the rounds, with their spread. Only the completions are timed
(the running rows are inserted beforehand, as admission does), up to every callback's answer,
the checkpoint signed at close included.

Two loads: ``burst`` hands the writer every completion at once (transactions of up to 512 rows:
the writer's ceiling, where the log's hashing and second insert show most), ``paced`` one at a
time, each waiting for its answer (one row a transaction, as a lightly loaded host writes: the
commit's flush dominates).
"""

from __future__ import annotations

import contextlib
import secrets
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from backend.serving.recorder import LedgerWriter
from control.contracts.db import dispose_engines, make_engine
from control.contracts.ledger import Completion, Ledger, LedgerEntry, Outcome

GOAL = 0.9
# Sized so that one side of a round lasts long enough (a fraction of a second, not the tens of
# milliseconds 2000 burst rows took) for the machine's other work to even out, and enough rounds
# (odd: a true median) that one disturbed round cannot pass for the result.
QUICK = {"rows": 5000, "paced_rows": 300, "runs": 7}
FULL = {"rows": 20000, "paced_rows": 1000, "runs": 11}
_D = "sha256:" + "a" * 64


def _side(ledger: Ledger, tag: str, rows: int, host: str | None, paced: bool = False) -> float:
    """Rows per second completing ``rows`` running rows through one writer (``paced``: one
    at a time)."""
    name = host or "plain"
    entries = [LedgerEntry(f"{tag}-{i}", f"t-{i}", "bench", "lora_llm", name, _D, _D, _D,
                           admitted_at=time.time(), max_tokens=8, temperature=0.0, top_p=1.0)
               for i in range(rows)]
    for k in range(0, rows, 500):
        ledger.admit(entries[k:k + 500])
    writer = LedgerWriter(ledger, host=host)
    done = threading.Semaphore(0)
    start = time.perf_counter()
    for e in entries:
        writer.complete(Completion(e.request_id, Outcome.OK, 5, 8, served_digest=_D),
                        lambda _ok: done.release(), output=f"answer of {e.request_id}")
        if paced and not done.acquire(timeout=120):
            raise RuntimeError("the ledger writer stopped answering")
    for _ in range(0 if paced else rows):
        if not done.acquire(timeout=120):
            raise RuntimeError("the ledger writer stopped answering")
    writer.close()
    return rows / (time.perf_counter() - start)


def _rounds(ledger: Ledger, load: str, rows: int, runs: int,
            progress: Callable[[str], None]) -> dict[str, Any]:
    ratios, plain, logged = [], [], []
    for r in range(runs):
        order = [None, "bench-host"] if r % 2 == 0 else ["bench-host", None]
        rates = {h: _side(ledger, f"{load}{r}-{h or 'plain'}", rows, h, load == "paced")
                 for h in order}
        plain.append(rates[None])
        logged.append(rates["bench-host"])
        ratios.append(rates["bench-host"] / rates[None])
        progress(f"{load} round {r + 1}/{runs}: plain {rates[None]:.0f} rows/s, logged "
                 f"{rates['bench-host']:.0f} rows/s, ratio {ratios[-1]:.3f}")
    ratio = statistics.median(ratios)
    return {
        "ledger_log_vs_plain": round(ratio, 3), "goal": GOAL, "met": ratio >= GOAL,
        "runs": runs, "rows_per_run": rows, "ratios": [round(x, 3) for x in ratios],
        "spread": [round(min(ratios), 3), round(max(ratios), 3)],
        "plain_rows_s": round(statistics.median(plain), 1),
        "logged_rows_s": round(statistics.median(logged), 1),
    }


def measure(db_url: str, *, rows: int, paced_rows: int, runs: int,
            progress: Callable[[str], None] = lambda _m: None) -> dict[str, Any]:
    """Alternating rounds on ``db_url``, both loads; see the module notes."""
    ledger = Ledger(make_engine(db_url))
    _side(ledger, "warm", 50, "bench-host")  # creates the tables and warms both paths
    _side(ledger, "warm-plain", 50, None)
    return {"database": make_engine(db_url).dialect.name,
            "burst": _rounds(ledger, "burst", rows, runs, progress),
            "paced": _rounds(ledger, "paced", paced_rows, runs, progress)}


def run_bench(*, quick: bool, pg_url: str | None = None,
              progress: Callable[[str], None] = lambda _m: None) -> dict[str, Any]:
    """On a fresh SQLite file (and on ``pg_url`` too when given)."""
    size = QUICK if quick else FULL
    out: dict[str, Any] = {"quick": quick}
    with tempfile.TemporaryDirectory(prefix="lp-bench-ledger-") as d:
        out["sqlite"] = measure(f"sqlite:///{Path(d) / 'ledger.db'}", progress=progress,
                                **size)
    if pg_url:
        with scratch_schema(pg_url) as url:
            out["postgresql"] = measure(url, progress=progress, **size)
    return out


@contextlib.contextmanager
def scratch_schema(pg_url: str) -> Iterator[str]:
    """``pg_url`` pointed at a schema of its own, dropped afterwards: a bench leaves no rows
    behind."""
    schema = f"lp_bench_{secrets.token_hex(6)}"
    admin = sa.create_engine(pg_url)
    with admin.begin() as conn:
        conn.exec_driver_sql(f"CREATE SCHEMA {schema}")
    try:
        sep = "&" if "?" in pg_url else "?"
        yield f"{pg_url}{sep}options=-csearch_path%3D{schema}"
    finally:
        dispose_engines()
        with admin.begin() as conn:
            conn.exec_driver_sql(f"DROP SCHEMA {schema} CASCADE")
        admin.dispose()
