"""``loraplane bench control``: control-plane ratios measured side by side in one run.

- ``command_vs_raw_save``: registry commands per second (``create_tenant``: name checks, key
  generation, one event saved by the application, duplicates refused by the store's unique index,
  the audit-checkpoint check) divided by raw eventsourcing ``save()`` calls per second of the same
  aggregate on the same database, measured in alternating rounds;
  ``command_with_projection_vs_raw_save`` is the same command also catching the projection
  tables up in its own process, as a CLI command run without ``serve`` does;
- ``chained_vs_plain_save``: what chaining each event in its recording transaction costs
  (``control.app.chain``): raw ``save()`` per second through the chained recorder divided by the
  same saves through eventsourcing-sqlalchemy's plain recorder, two applications with their own
  tables on the same database, in alternating rounds (ABBA);
- ``projection_events_per_s``: a full projection rebuild (every event replayed into the view
  tables, in batches with tracking writes) on the same database;
- ``ticket_p50_ms`` / ``ticket_p99_ms``: ``POST /v1/tickets`` through the real aiohttp gateway at
  concurrency 16, from a lean load generator in its own process (:mod:`control.tools.loadgen`) on
  the same machine; ``ticket_p50_ms_c1`` the same one request at a time (the service time, without
  queueing). At concurrency 16 a closed loop's latency is 16 / throughput, so the p50 there says
  as much about the cores available as about the gateway: ``http_floor_p50_ms`` is the same
  server, loop and client answering ``GET /healthz`` (no ticket work at all), and
  ``ticket_vs_http_floor_p50`` the ratio of the two.

Runs on a fresh SQLite file and, given a URL, on a fresh PostgreSQL schema (dropped afterwards).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any
from uuid import UUID

import numpy as np
import sqlalchemy as sa
from eventsourcing.application import Application

from control.app import chain
from control.contracts.config import Settings
from control.contracts.db import dispose_engines, make_engine
from control.contracts.loops import new_event_loop
from control.domain import Tenant
from control.gateway.server import make_app
from control.gateway.ticket_office import TicketOffice
from control.ops.clients import free_port
from control.ops.serve import open_signer
from projections.follower import ProjectionFollower, open_registry
from projections.route_cache import CachedRoutingView

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
    """Raw ``save()`` against two command paths, in alternating rounds on one database:
    the command alone (a follower process keeps the projections, as under ``serve``), and the
    command that also catches the projections up in its own process (the CLI's default)."""
    raw = open_registry(settings, follow=False)
    command = open_registry(settings, follow=False)
    following = open_registry(settings)
    spent = {"raw": 0.0, "command": 0.0, "following": 0.0}
    rounds = 3
    per = max(1, n // rounds)
    for r in range(rounds):
        t0 = time.perf_counter()
        for i in range(per):
            raw.save(Tenant.create(f"raw-{r}-{i}", f"lp_raw-{r}-{i}", "bench"))
        spent["raw"] += time.perf_counter() - t0
        for name, reg in (("command", command), ("following", following)):
            t0 = time.perf_counter()
            for i in range(per):
                reg.create_tenant(f"{name}-{r}-{i}", actor="bench")
            spent[name] += time.perf_counter() - t0
    total = per * rounds
    return {"command_per_s": total / spent["command"], "raw_save_per_s": total / spent["raw"],
            "command_vs_raw_save": spent["raw"] / spent["command"],
            "command_with_projection_vs_raw_save": spent["raw"] / spent["following"]}


class _PlainApp(Application[UUID]):
    name = "BenchPlain"  # table benchplain_events


class _ChainedApp(Application[UUID]):
    name = "BenchChained"  # tables benchchained_events and benchchained_events_chain


def _chained_vs_plain(settings: Settings, n: int) -> dict[str, float]:
    """Raw saves through the chained recorder against the plain one (see the module notes)."""
    apps = {"plain": _PlainApp(env={"PERSISTENCE_MODULE": "eventsourcing_sqlalchemy",
                                    "SQLALCHEMY_URL": settings.db_url}),
            "chained": _ChainedApp(env={"PERSISTENCE_MODULE": chain.PERSISTENCE_TOPIC,
                                        "SQLALCHEMY_URL": settings.db_url})}
    spent = {"plain": 0.0, "chained": 0.0}
    rounds = 4
    per = max(1, n // rounds)
    for r in range(rounds):
        order = ("plain", "chained") if r in (0, 3) else ("chained", "plain")
        for name in order:
            t0 = time.perf_counter()
            for i in range(per):
                apps[name].save(Tenant.create(f"{name}-{r}-{i}", f"lp_{name}-{r}-{i}", "bench"))
            spent[name] += time.perf_counter() - t0
    total = per * rounds
    return {"chained_save_per_s": total / spent["chained"],
            "plain_save_per_s": total / spent["plain"],
            "chained_vs_plain_save": spent["plain"] / spent["chained"]}


def _projection_rate(settings: Settings) -> dict[str, float]:
    reg = open_registry(settings, follow=False)
    engine = make_engine(settings.db_url)
    follower = ProjectionFollower(reg, engine, batch_size=500)
    t0 = time.perf_counter()
    n = follower.rebuild_into(engine)
    dt = time.perf_counter() - t0
    return {"projection_events": n, "projection_events_per_s": n / dt}


def _ticket_latency(settings: Settings, work: Path, n: int) -> dict[str, float]:
    from aiohttp import web


    reg = open_registry(settings)
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
    try:
        c16 = _load(port, ["--bearer", key, "--alias", "bench-alias"], n, CONCURRENCY)
        c1 = _load(port, ["--bearer", key, "--alias", "bench-alias"], max(200, n // 4), 1)
        floor = _load(port, ["--method", "GET"], n, CONCURRENCY, path="/healthz")
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
    return {"ticket_p50_ms": c16["p50_ms"], "ticket_p99_ms": c16["p99_ms"],
            "tickets_per_s": c16["per_s"], "ticket_concurrency": CONCURRENCY,
            "ticket_p50_ms_c1": c1["p50_ms"], "tickets_per_s_c1": c1["per_s"],
            "http_floor_p50_ms": floor["p50_ms"], "http_floor_per_s": floor["per_s"],
            "ticket_vs_http_floor_p50": c16["p50_ms"] / floor["p50_ms"]}


def _load(port: int, args: list[str], n: int, concurrency: int,
          path: str = "/v1/tickets") -> dict[str, float]:
    """Run :mod:`control.tools.loadgen` in its own process: in this one it would share the
    interpreter lock with the server it measures."""
    proc = subprocess.run(
        [sys.executable, "-m", "control.tools.loadgen", "--url", f"http://127.0.0.1:{port}{path}",
         *args, "--requests", str(n), "--concurrency", str(concurrency)],
        capture_output=True, text=True, timeout=600, check=False)
    try:
        out: dict[str, float] = json.loads(proc.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise RuntimeError(f"load generator failed: {proc.stderr[-2000:]}") from None
    if "error" in out:
        raise RuntimeError(f"load generator failed: {out['error']}")
    return out


def measure(settings: Settings, work: Path, *, commands: int, tickets: int) -> dict[str, Any]:
    """All three measurements on one database."""
    out: dict[str, Any] = {}
    out.update(_command_vs_raw(settings, commands))
    out.update(_chained_vs_plain(settings, commands))
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
    results["machine"] = {"cpus": os.cpu_count(), "load_generator": "same machine, own process"}
    results["goals"] = {"command_vs_raw_save": ">= 0.8", "projection_events_per_s":
                        ">= 5000 (SQLite)", "ticket_p50_ms": "<= 2 at concurrency 16"}
    shutil.rmtree(work, ignore_errors=True)
    return results
