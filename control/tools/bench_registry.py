"""A hundred thousand adapters in the registry (issue 24, in ``bench scale``).

A scratch registry (a SQLite file in a temporary folder; with ``--pg-url``, the same again in
PostgreSQL scratch schemas) gets a stand-in base (one Linear layer:
routing needs digests, not a model), ``tenants`` tenants, and ``adapters`` adapters (100,000;
1,000 with ``--quick``), each a valid PEFT folder of seeded random rank-1 weights, spread
round-robin over the tenants. Each adapter is registered, released (external evaluation, up to
stable) and granted to its owner by the registry's own desks, the commands
``bench_zipf`` runs one by one, inside :meth:`control.app.registry.Registry.batched`: every
command's checks, artifacts and events are its own, and the batch saves about 5,000 events at
a time instead of three transactions per adapter. Nine events an adapter (registered, alias
created, evaluation, three promotions, release, alias pointed, grant); the test counts them
against the one-by-one path. A second registry of ``small`` (100) adapters is built the same way.

Measured:

- ``registration_per_s``: adapters (and events) per second of the batched registration, the
  artifact store's writes included;
- ``projection_events_per_s``: the projection tables rebuilt from the event store from scratch
  (``ProjectionFollower.rebuild_into``: every event replayed, in batches with tracking writes),
  which is how the registry's tables are built here: the bulk path writes no projection row;
- ``ticket_p99_100k_vs_100``: p99 of ``POST /v1/tickets`` through the real aiohttp gateway, one
  gateway process per registry (a :class:`CachedRoutingView` over its tables, the signing key of
  ``control.ops.serve.open_signer``), driven by ``control.tools.loadgen`` in its own process
  (``bench_control._load``) at concurrency ``CONCURRENCY``, in alternating rounds (ABBA), each
  round a random adapter's alias of a tenant whose API key the bench holds. The ratio is the
  median of the large side's round p99s over the small side's; the round pairs give the spread.
  In ``churn`` rounds one registry command (a new tenant) is recorded on the gateway's registry
  every ``CHURN_S`` and projected at once, as on a registry in use: every command moves the
  projection, and the gateway's route cache re-reads what it changed (``routing_changes``);
- resident memory (``VmRSS``): each gateway process after its rounds; and the Triton host's
  governance view (``projections.host_view.HostGovernance``, what a host reads before each
  request) loaded in a process of its own, its RSS before and after the load. No tritonserver
  runs here: the host's model weights and adapter cache do not grow with the registry, only this
  view does.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from control.contracts.config import Settings
from control.contracts.db import make_engine
from control.contracts.loops import new_event_loop
from control.gateway.server import make_app
from control.gateway.ticket_office import TicketOffice
from control.ops.clients import free_port
from control.ops.serve import open_signer
from control.tools.bench_control import _load, _tiny_base
from projections.follower import ProjectionFollower, open_registry
from projections.host_view import HostGovernance
from projections.route_cache import CachedRoutingView

ACTOR = "bench-registry"
CONCURRENCY = 4
CHURN_S = 0.5
GOAL = 1.2
SEED = 24
EVAL = {"suite": "bench-registry", "passed": True, "producer": "bench"}
Q_PROJ = "model.layers.0.self_attn.q_proj"  # the stand-in base's one Linear (4 x 4)


@dataclass(frozen=True)
class Size:
    adapters: int
    small: int
    tenants: int
    rounds: int  # measured rounds per side and mode
    requests: int  # per round


QUICK = Size(adapters=1000, small=100, tenants=8, rounds=2, requests=1000)
FULL = Size(adapters=100_000, small=100, tenants=100, rounds=3, requests=3000)


@dataclass(frozen=True)
class Built:
    settings: Settings
    adapters: int
    events: int
    registration_s: float
    keys: dict[str, str]  # tenant -> API key
    aliases: dict[str, list[str]]  # tenant -> its adapters' aliases


def write_adapter(out: Path, i: int) -> Path:
    """A PEFT folder of rank 1 on the stand-in base's q_proj, seeded by ``i``."""
    from safetensors.numpy import save_file  # as bench_control: the writers only

    out.mkdir(parents=True)
    rng = np.random.default_rng(SEED * 1_000_003 + i)
    save_file({f"base_model.model.{Q_PROJ}.lora_A.weight":
               rng.standard_normal((1, 4)).astype(np.float32),
               f"base_model.model.{Q_PROJ}.lora_B.weight":
               rng.standard_normal((4, 1)).astype(np.float32)},
              str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": 1, "lora_alpha": 2, "target_modules": ["q_proj"],
         "base_model_name_or_path": "bench-base"}))
    return out


def register_one(reg: Any, path: Path, tenant: str, alias: str) -> str:
    """What ``bench_zipf.register`` does for one adapter: registered, released, granted."""
    digest: str = reg.register_adapter(path, tenant=tenant, alias=alias, actor=ACTOR)
    reg.advance(digest, external=True, evaluation=EVAL, actor=ACTOR)
    reg.grant(tenant, alias, actor=ACTOR)
    return digest


def build(home: Path, adapters: int, tenants: int, *, batched: bool = True,
          db_url: str | None = None,
          progress: Callable[[str], None] = lambda _m: None) -> Built:
    """A scratch registry with ``adapters`` adapters over ``tenants`` tenants (see the module
    notes) on ``db_url`` (None: a SQLite file in ``home``); its projection tables are left empty
    (:func:`rebuild` fills them)."""

    settings = Settings(home=home, db_url=db_url or f"sqlite:///{home / 'registry.db'}")
    settings.ensure_dirs()
    reg = open_registry(settings, follow=False)
    base, tok = _tiny_base(home / "artifacts")
    reg.register_base(base, tok, name="bench-base", actor=ACTOR, alias="bench-base-alias")
    names = [f"rt{j}" for j in range(tenants)]
    keys = {t: reg.create_tenant(t, actor=ACTOR) for t in names}
    open_signer(settings, reg, ACTOR)  # the gateway's key, recorded before the rebuild
    aliases: dict[str, list[str]] = {t: [] for t in names}
    src = home / "src"
    t0 = time.perf_counter()
    with reg.batched() if batched else _nothing():
        for i in range(adapters):
            tenant, alias = names[i % tenants], f"ra-{i}"
            path = write_adapter(src / str(i), i)
            register_one(reg, path, tenant, alias)
            shutil.rmtree(path)  # the store holds the registered copy
            aliases[tenant].append(alias)
            if (i + 1) % 10_000 == 0:
                progress(f"registry: registered {i + 1:,} of {adapters:,} adapters")
    spent = time.perf_counter() - t0
    events = int(reg.recorder.max_notification_id() or 0)
    reg.close()
    return Built(settings, adapters, events, spent, keys, aliases)


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *_exc: object) -> None:
        return None


def rebuild(settings: Settings) -> tuple[int, float]:
    """Replay the whole event store into the projection tables; (events, seconds)."""

    engine = make_engine(settings.db_url)
    follower = ProjectionFollower(open_registry(settings, follow=False), engine,
                                  batch_size=1000)
    t0 = time.perf_counter()
    n = follower.rebuild_into(engine)
    return n, time.perf_counter() - t0


def rss_kib(pid: int) -> int:
    """Resident memory of process ``pid`` (``VmRSS``), KiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError("no VmRSS")


# -- the gateway and the host's view, each in a process of its own ------------------------------

def _serve_gateway(home: Path, db_url: str) -> None:
    """The gateway over a built registry (``python -m control.tools.bench_registry gateway``):
    prints its port, serves until stdin closes."""
    from aiohttp import web


    settings = Settings(home=home, db_url=db_url)
    reg = open_registry(settings, follow=False)
    office = TicketOffice(settings, CachedRoutingView(make_engine(db_url)),
                          open_signer(settings, reg, ACTOR))
    loop = new_event_loop()
    runner = web.AppRunner(make_app(office), access_log=None)
    port = free_port()
    loop.run_until_complete(runner.setup())
    loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", port).start())
    threading.Thread(target=lambda: (sys.stdin.read(), loop.call_soon_threadsafe(loop.stop)),
                     daemon=True).start()
    print(port, flush=True)
    loop.run_forever()
    loop.run_until_complete(runner.cleanup())


def _host_view(db_url: str) -> None:
    """Load what a Triton host reads of the governance state; print its size and the RSS."""

    before = rss_kib(os.getpid())
    state = HostGovernance(make_engine(db_url)).current()
    print(json.dumps({"rss_before_kib": before, "rss_kib": rss_kib(os.getpid()),
                      "releases": len(state.releases)}), flush=True)


def host_memory(settings: Settings) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, "-m", "control.tools.bench_registry", "host",
                           settings.db_url], capture_output=True, text=True, timeout=600,
                          check=True)
    out: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    out["view_kib"] = out["rss_kib"] - out["rss_before_kib"]
    return out


class Gateway:
    """A gateway process over one built registry."""

    def __init__(self, built: Built) -> None:
        self.built = built
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "control.tools.bench_registry", "gateway",
             str(built.settings.home), built.settings.db_url],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        self.port = int(self.proc.stdout.readline())

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def _churn(settings: Settings, stop: threading.Event, label: str) -> None:
    """One registry command every ``CHURN_S``, projected at once (a registry in use)."""

    reg = open_registry(settings)
    i = 0
    while not stop.wait(CHURN_S):
        reg.create_tenant(f"churn-{label}-{i}", actor=ACTOR)
        i += 1
    reg.close()


def _round(gw: Gateway, rng: random.Random, requests: int, churn: bool) -> dict[str, float]:
    tenant = rng.choice(sorted(gw.built.keys))
    alias = rng.choice(gw.built.aliases[tenant])
    stop = threading.Event()
    churner = threading.Thread(target=_churn, args=(gw.built.settings, stop,
                                                    f"{gw.port}-{rng.random():.6f}"))
    if churn:
        churner.start()
    try:
        out = _load(gw.port, ["--bearer", gw.built.keys[tenant], "--alias", alias], requests,
                    CONCURRENCY)
    finally:
        stop.set()
        if churn:
            churner.join(30)
    return out


def _spread(xs: list[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def tickets(large: Built, small: Built, size: Size,
            progress: Callable[[str], None]) -> dict[str, Any]:
    """Rounds alternating between the two gateways (ABBA), steady and under churn."""
    rng = random.Random(SEED)
    gws = {"large": Gateway(large), "small": Gateway(small)}
    out: dict[str, Any] = {}
    try:
        for gw in gws.values():  # warm-up: the snapshot loaded, the connections made
            _round(gw, rng, 200, churn=False)
        for mode in ("steady", "churn"):
            p99: dict[str, list[float]] = {"large": [], "small": []}
            p50: dict[str, list[float]] = {"large": [], "small": []}
            for r in range(size.rounds):
                order = ("small", "large") if r % 2 == 0 else ("large", "small")
                for side in order:
                    res = _round(gws[side], rng, size.requests, churn=mode == "churn")
                    p99[side].append(res["p99_ms"])
                    p50[side].append(res["p50_ms"])
                progress(f"registry: tickets, {mode} round {r + 1}: p99 large "
                         f"{p99['large'][-1]:.2f} ms, small {p99['small'][-1]:.2f} ms")
            pairs = [a / b for a, b in zip(p99["large"], p99["small"], strict=True)]
            out[mode] = {
                "ticket_p99_ms": {s: _spread(v) for s, v in p99.items()},
                "ticket_p50_ms": {s: _spread(v) for s, v in p50.items()},
                "ratio": statistics.median(p99["large"]) / statistics.median(p99["small"]),
                "round_pair_ratios": pairs}
        out["gateway_rss_kib"] = {s: rss_kib(gw.proc.pid) for s, gw in gws.items()}
    finally:
        for gw in gws.values():
            gw.close()
    return out


def run_bench(*, quick: bool = False, size: Size | None = None, pg_url: str | None = None,
              sqlite: bool = True,
              progress: Callable[[str], None] = lambda _m: None) -> dict[str, Any]:
    """The whole measurement on scratch registries (see the module notes): on SQLite files
    (unless ``sqlite`` is False), and with ``pg_url`` also on PostgreSQL (two scratch schemas,
    dropped afterwards), reported under ``postgresql`` with the same keys."""
    size = size or (QUICK if quick else FULL)
    with tempfile.TemporaryDirectory(prefix="loraplane-registry-") as tmp:
        out = _measure(Path(tmp) / "sqlite", size, None, None, progress) if sqlite else {}
        if pg_url:
            from control.tools.bench_ledger import scratch_schema  # sqlalchemy admin: here only

            with scratch_schema(pg_url) as large_url, scratch_schema(pg_url) as small_url:
                progress("registry: the same on PostgreSQL")
                out["postgresql"] = _measure(Path(tmp) / "pg", size, large_url, small_url,
                                             progress)
    return out


def _measure(root: Path, size: Size, large_url: str | None, small_url: str | None,
             progress: Callable[[str], None]) -> dict[str, Any]:
    t_all = time.perf_counter()
    progress(f"registry: registering {size.adapters:,} adapters (batched)")
    large = build(root / "large", size.adapters, size.tenants, db_url=large_url,
                  progress=progress)
    small = build(root / "small", size.small, min(size.tenants, size.small), db_url=small_url)
    progress(f"registry: {large.events:,} events in {large.registration_s:.0f} s; "
             "rebuilding the projections")
    projected, rebuild_s = rebuild(large.settings)
    rebuild(small.settings)
    host = {"large": host_memory(large.settings), "small": host_memory(small.settings)}
    t = tickets(large, small, size, progress)
    steady, churn = t["steady"], t["churn"]
    return {
        "adapters": size.adapters, "small_adapters": size.small, "tenants": size.tenants,
        "events": large.events, "events_per_adapter": round(large.events / size.adapters, 2),
        "registration_s": round(large.registration_s, 1),
        "registration_adapters_per_s": round(size.adapters / large.registration_s, 1),
        "registration_events_per_s": round(large.events / large.registration_s, 1),
        "projection_events": projected, "projection_rebuild_s": round(rebuild_s, 1),
        "projection_events_per_s": round(projected / rebuild_s, 1),
        "ticket_p99_100k_vs_100": round(steady["ratio"], 3),
        "ticket_p99_100k_vs_100_churn": round(churn["ratio"], 3),
        "goal": f"ticket_p99_100k_vs_100 <= {GOAL}", "met": steady["ratio"] <= GOAL,
        "met_churn": churn["ratio"] <= GOAL,
        "tickets": {"steady": steady, "churn": churn},
        "gateway_rss_mib": {k: round(v / 1024, 1) for k, v in t["gateway_rss_kib"].items()},
        "host_view": {k: {"releases": v["releases"], "rss_mib": round(v["rss_kib"] / 1024, 1),
                          "view_mib": round(v["view_kib"] / 1024, 1)} for k, v in host.items()},
        "setup": {"concurrency": CONCURRENCY, "requests_per_round": size.requests,
                  "rounds_each": size.rounds, "churn_every_s": CHURN_S,
                  "database": "sqlite" if large_url is None else "postgresql",
                  "seconds": round(time.perf_counter() - t_all, 1)},
    }


def main(argv: list[str]) -> None:
    if argv[:1] == ["gateway"]:
        _serve_gateway(Path(argv[1]), argv[2])
    elif argv[:1] == ["host"]:
        _host_view(argv[1])
    else:
        # [N [PG_URL [--pg-only]]]: N adapters at the full size's rounds (the quick size's
        # with N at most its own); --pg-only skips the SQLite side
        n = int(argv[0]) if argv else QUICK.adapters
        shape = FULL if n > QUICK.adapters else QUICK
        print(json.dumps(run_bench(size=Size(n, shape.small, shape.tenants, shape.rounds,
                                             shape.requests),
                                   pg_url=argv[1] if len(argv) > 1 else None,
                                   sqlite="--pg-only" not in argv[2:],
                                   progress=lambda m: print(m, file=sys.stderr)), indent=1))


if __name__ == "__main__":
    main(sys.argv[1:])
