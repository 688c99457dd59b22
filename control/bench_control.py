"""``loraplane bench control``: control-plane ratios measured side by side in one run.

- ``command_vs_raw_save``: registry commands per second (``create_tenant``: name check, existence
  read, one event, saved by the application) divided by raw eventsourcing ``save()`` calls per
  second of the same aggregate on the same database, measured in alternating rounds;
- ``projection_events_per_s``: a full projection rebuild (every event replayed into the view
  tables, in batches with tracking writes) on the same database;
- ``ticket_p50_ms`` / ``ticket_p99_ms``: ``POST /v1/tickets`` through the real aiohttp gateway at
  concurrency 16 (client in the same process: it shares the CPU, so this is an upper bound).

Runs on a fresh SQLite file and, given a URL, on a fresh PostgreSQL schema (dropped afterwards).
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import sqlalchemy as sa

from control.config import Settings
from control.db import dispose_engines, make_engine

CONCURRENCY = 16


def _tiny_base(root: Path) -> tuple[Path, Path]:
    """A stand-in base (one Linear weight) and tokenizer: routing needs digests, not a model."""
    from safetensors.numpy import save_file

    base, tok = root / "base", root / "tokenizer"
    base.mkdir(parents=True)
    tok.mkdir(parents=True)
    save_file({"model.layers.0.self_attn.q_proj.weight": np.zeros((4, 4), np.float32)},
              str(base / "model.safetensors"))
    (tok / "tokenizer.json").write_text(json.dumps({"model": {"type": "bytes"}}))
    return base, tok


def _command_vs_raw(settings: Settings, n: int) -> dict[str, float]:
    from control.domain import Tenant
    from control.registry import Registry

    reg = Registry(settings, follow=False)
    cmd_s = raw_s = 0.0
    rounds = 3
    per = max(1, n // rounds)
    for r in range(rounds):
        t0 = time.perf_counter()
        for i in range(per):
            reg.save(Tenant.create(f"raw-{r}-{i}", f"lp_raw-{r}-{i}", "bench"))
        raw_s += time.perf_counter() - t0
        t0 = time.perf_counter()
        for i in range(per):
            reg.create_tenant(f"cmd-{r}-{i}", actor="bench")
        cmd_s += time.perf_counter() - t0
    total = per * rounds
    return {"command_per_s": total / cmd_s, "raw_save_per_s": total / raw_s,
            "command_vs_raw_save": raw_s / cmd_s}


def _projection_rate(settings: Settings) -> dict[str, float]:
    from control.registry import Registry
    from projections.follower import ProjectionFollower

    reg = Registry(settings, follow=False)
    engine = make_engine(settings.db_url)
    follower = ProjectionFollower(reg, engine, batch_size=500)
    t0 = time.perf_counter()
    n = follower.rebuild_into(engine)
    dt = time.perf_counter() - t0
    return {"projection_events": n, "projection_events_per_s": n / dt}


def _ticket_latency(settings: Settings, work: Path, n: int) -> dict[str, float]:
    from aiohttp import web

    from control.clients import free_port
    from control.gateway import make_app, new_event_loop
    from control.registry import Registry
    from control.serve import open_signer
    from control.ticket_office import TicketOffice
    from projections.route_cache import CachedRoutingView

    reg = Registry(settings)
    base, tok = _tiny_base(work / "artifacts")
    reg.register_base(base, tok, name="bench-base", actor="bench", alias="bench-alias")
    key = reg.create_tenant("bench-tenant", actor="bench")
    reg.grant("bench-tenant", "bench-alias", actor="bench")
    office = TicketOffice(settings, CachedRoutingView(make_engine(settings.db_url)),
                          open_signer(settings, reg, "bench"))
    port = free_port()
    loop = new_event_loop()
    ready = threading.Event()
    runner = web.AppRunner(make_app(office), access_log=None)

    def serve() -> None:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(runner.setup())
        loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", port).start())
        ready.set()
        loop.run_forever()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    ready.wait(30)
    # The load generator runs in its own process: in this one it would share the interpreter
    # lock with the server it measures.
    proc = subprocess.run(
        [sys.executable, "-m", "control.loadgen", "--url", f"http://127.0.0.1:{port}/v1/tickets",
         "--bearer", key, "--alias", "bench-alias", "--requests", str(n),
         "--concurrency", str(CONCURRENCY)],
        capture_output=True, text=True, timeout=600, check=False)
    asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(30)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)
    try:
        out = json.loads(proc.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise RuntimeError(f"load generator failed: {proc.stderr[-2000:]}") from None
    if "error" in out:
        raise RuntimeError(f"load generator failed: {out['error']}")
    return {"ticket_p50_ms": out["p50_ms"], "ticket_p99_ms": out["p99_ms"],
            "tickets_per_s": out["per_s"], "ticket_concurrency": CONCURRENCY}


def measure(settings: Settings, work: Path, *, commands: int, tickets: int) -> dict[str, Any]:
    """All three measurements on one database."""
    out: dict[str, Any] = {}
    out.update(_command_vs_raw(settings, commands))
    out.update(_projection_rate(settings))
    out.update(_ticket_latency(settings, work, tickets))
    return {k: round(v, 3) if isinstance(v, float) else v for k, v in out.items()}


def run_all(work: Path, *, pg_url: str | None, commands: int = 300,
            tickets: int = 2000) -> dict[str, Any]:
    """Measure on SQLite and, with ``pg_url``, on a scratch PostgreSQL schema."""
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    results: dict[str, Any] = {}
    home = work / "sqlite"
    s = Settings(home=home, db_url=f"sqlite:///{home / 'bench.db'}")
    s.ensure_dirs()
    results["sqlite"] = measure(s, home, commands=commands, tickets=tickets)
    if pg_url:
        schema = "lp_bench_" + uuid.uuid4().hex[:10]
        admin = sa.create_engine(pg_url)
        with admin.begin() as conn:
            conn.exec_driver_sql(f"CREATE SCHEMA {schema}")
        sep = "&" if "?" in pg_url else "?"
        home = work / "postgresql"
        s = Settings(home=home, db_url=f"{pg_url}{sep}options=-csearch_path%3D{schema}")
        s.ensure_dirs()
        try:
            results["postgresql"] = measure(s, home, commands=commands, tickets=tickets)
        finally:
            dispose_engines()
            with admin.begin() as conn:
                conn.exec_driver_sql(f"DROP SCHEMA {schema} CASCADE")
            admin.dispose()
    results["goals"] = {"command_vs_raw_save": ">= 0.8", "projection_events_per_s":
                        ">= 5000 (SQLite)", "ticket_p50_ms": "<= 2 at concurrency 16"}
    shutil.rmtree(work, ignore_errors=True)
    return results
