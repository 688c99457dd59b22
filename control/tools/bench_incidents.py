"""Incident queries over a million ledger rows (issue 24's ledger figures in ``bench scale``).

A scratch ledger gets ``rows`` rows shaped like a busy fleet's month: ``ADAPTERS`` adapters over
``BASES`` bases, two releases per adapter, a fifth of the rows on a base alone, one row in a
hundred an identity mismatch (the slot held another adapter than the ticket named), admission
times spread over thirty days. Then each kind of incident query
(:func:`projections.incidents.subject_query`, what ``incident requests`` runs) is timed on
``QUERIES`` subjects drawn at random: ``--adapter`` (about 800 rows each), ``--release`` (about
400), ``--training-data-version`` (ten adapters: about 8,000), and ``--base`` within one hour
(about 300; a base's whole month is a quarter of the ledger, which no incident page lists at
once). Each figure is the median and p95 of the queries, with the plan's indexes named: the
goal is under 50 ms for each kind, on SQLite and on PostgreSQL.
"""

from __future__ import annotations

import json
import random
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from control.contracts.db import dispose_engines, make_engine
from control.contracts.ledger import Ledger, request_ledger
from control.tools.bench_ledger import scratch_schema
from projections.incidents import ledger_rows, subject_query

GOAL_MS = 50.0
ADAPTERS = 1000
BASES = 4
QUERIES = 15
DAYS = 30
QUICK = {"rows": 100_000}
FULL = {"rows": 1_000_000}
_COLUMNS = [c.name for c in request_ledger.columns]


def _digest(kind: str, n: int) -> str:
    return "sha256:" + f"{kind}{n:08d}".encode().hex().ljust(64, "0")[:64]


def _rows(n: int, seed: int, start: float) -> Iterator[tuple[Any, ...]]:
    rnd = random.Random(seed)
    span = DAYS * 86400.0
    for i in range(n):
        a = rnd.randrange(ADAPTERS)
        base_only = rnd.random() < 0.2
        adapter = None if base_only else _digest("adapter", a)
        served = adapter
        if adapter is not None and rnd.random() < 0.01:  # the slot held another adapter
            served = _digest("adapter", (a + 1) % ADAPTERS)
        release = None if base_only else _digest("release", a * 2 + rnd.randrange(2))
        t = start + span * i / n
        row = {"request_id": f"r{seed}-{i:08d}", "ticket_id": f"t-{i}",
               "tenant": f"tenant-{a % 50}", "model": "lora_llm", "host": f"host-{i % 3}",
               "base_digest": _digest("base", a % BASES), "adapter_digest": adapter,
               "tokenizer_digest": _digest("tok", 0), "admitted_at": t,
               "finished_at": t + 0.5, "tokens_in": 40, "tokens_out": 64, "outcome": "ok",
               "reason": None, "release_digest": release, "served_digest": served,
               "max_tokens": 64, "temperature": 0.0, "top_p": 1.0, "seed": None}
        yield tuple(row[c] for c in _COLUMNS)


def fill(engine: Engine, rows: int, *, seed: int = 1, start: float = 1.7e9,
         progress: Callable[[str], None] = lambda _m: None) -> None:
    """Insert ``rows`` generated rows (through the driver, in chunks), then ANALYZE."""
    Ledger(engine)  # the table at the current version, indexes included
    chunk: list[tuple[Any, ...]] = []
    with engine.begin() as conn:
        if conn.dialect.name == "postgresql":
            raw = conn.connection.driver_connection
            assert raw is not None
            with raw.cursor().copy(
                    f"COPY request_ledger ({', '.join(_COLUMNS)}) FROM STDIN") as copy:
                for k, row in enumerate(_rows(rows, seed, start)):
                    copy.write_row(row)
                    if k % 200_000 == 0 and k:
                        progress(f"{k:,} of {rows:,} rows written")
        else:
            sql = (f"INSERT INTO request_ledger ({', '.join(_COLUMNS)}) VALUES "
                   f"({', '.join('?' * len(_COLUMNS))})")
            for k, row in enumerate(_rows(rows, seed, start)):
                chunk.append(row)
                if len(chunk) == 50_000:
                    conn.exec_driver_sql(sql, chunk)
                    chunk = []
                    progress(f"{k + 1:,} of {rows:,} rows written")
            if chunk:
                conn.exec_driver_sql(sql, chunk)
    with engine.begin() as conn:
        conn.exec_driver_sql("ANALYZE")


def indexes_used(engine: Engine, query: sa.Select[Any], *, usable: bool = False) -> list[str]:
    """The indexes the database's plan for ``query`` reads (none: it scans the table).
    ``usable``: on PostgreSQL, with table scans priced out, so that a small table shows which
    index the query can use (the planner rightly scans a table of a few pages)."""
    sql = str(query.compile(dialect=engine.dialect, compile_kwargs={"literal_binds": True}))
    with engine.connect() as conn:
        if conn.dialect.name == "postgresql":
            if usable:
                conn.exec_driver_sql("SET enable_seqscan = off")
            plan = conn.exec_driver_sql(f"EXPLAIN (FORMAT JSON) {sql}").scalar_one()
            doc = plan if isinstance(plan, list) else json.loads(plan)
            found: list[str] = []
            _walk(doc[0]["Plan"], found)
            return sorted(set(found))
        details = [str(r[-1]) for r in conn.exec_driver_sql(f"EXPLAIN QUERY PLAN {sql}")]
    return sorted({w for d in details for w in d.replace("(", " ").split()
                   if w.startswith("ix_ledger_")})


def _walk(node: dict[str, Any], found: list[str]) -> None:
    if "Index Name" in node:
        found.append(node["Index Name"])
    for child in node.get("Plans", []):
        _walk(child, found)


def _subjects(rnd: random.Random, start: float) -> dict[str, list[dict[str, Any]]]:
    hour = lambda: start + rnd.uniform(0, DAYS * 86400.0 - 3600)  # noqa: E731
    out: dict[str, list[dict[str, Any]]] = {"adapter": [], "release": [],
                                            "training_data_version": [], "base_hour": []}
    for _ in range(QUERIES):
        out["adapter"].append({"adapter": _digest("adapter", rnd.randrange(ADAPTERS))})
        out["release"].append({"release": _digest("release", rnd.randrange(ADAPTERS * 2))})
        first = rnd.randrange(ADAPTERS - 10)
        out["training_data_version"].append(
            {"adapters": [_digest("adapter", first + k) for k in range(10)]})
        since = hour()
        out["base_hour"].append({"base": _digest("base", rnd.randrange(BASES)),
                                 "since": since, "until": since + 3600})
    return out


def measure(db_url: str, rows: int,
            progress: Callable[[str], None] = lambda _m: None) -> dict[str, Any]:
    engine = make_engine(db_url)
    t0 = time.perf_counter()
    fill(engine, rows, progress=progress)
    out: dict[str, Any] = {"database": engine.dialect.name, "rows": rows,
                           "fill_s": round(time.perf_counter() - t0, 1)}
    start = 1.7e9
    for kind, subjects in _subjects(random.Random(7), start).items():
        ledger_rows(engine, **subjects[0])  # warm the cache and the connection
        times, counts = [], []
        for s in subjects:
            t = time.perf_counter()
            counts.append(len(ledger_rows(engine, **s)))
            times.append((time.perf_counter() - t) * 1000)
        times.sort()
        p95 = times[max(0, -(-95 * len(times) // 100) - 1)]
        out[kind] = {"median_ms": round(statistics.median(times), 2), "p95_ms": round(p95, 2),
                     "rows_median": int(statistics.median(counts)),
                     "indexes": indexes_used(engine, subject_query(**subjects[0])),
                     "met": p95 < GOAL_MS}
        progress(f"{engine.dialect.name} {kind}: median {out[kind]['median_ms']} ms, p95 "
                 f"{out[kind]['p95_ms']} ms, {out[kind]['rows_median']} rows, "
                 f"indexes {out[kind]['indexes']}")
    return out


def run_bench(*, quick: bool, pg_url: str | None = None,
              progress: Callable[[str], None] = lambda _m: None) -> dict[str, Any]:
    """On a fresh SQLite file, and in a scratch schema of ``pg_url`` when given."""
    size = QUICK if quick else FULL
    out: dict[str, Any] = {"goal_ms": GOAL_MS, "queries_per_kind": QUERIES}
    with tempfile.TemporaryDirectory(prefix="lp-bench-incidents-") as d:
        out["sqlite"] = measure(f"sqlite:///{Path(d) / 'ledger.db'}", size["rows"], progress)
        dispose_engines()
    if pg_url:
        with scratch_schema(pg_url) as url:
            out["postgresql"] = measure(url, size["rows"], progress)
    return out
