"""Bench: how long each console page takes to render with 1,000 adapters and 1,000,000 ledger
rows (issue 27 asks for under 200 ms each). A bench, not a test: run it by hand,

    .venv/bin/python -m tests.control.console.bench_pages [--adapters 1000] [--rows 1000000]

It builds a SQLite home under a temporary folder: a base, one tenant, N adapters registered
through the registry (perturbed copies of one tiny adapter: real events, real projections),
one alias with a stable and a canary release and a rollout, and M ledger rows spread over the
adapters, four hosts and the last 30 days (inserted in bulk, as hosts would have written them),
and each host's status report.
Then it serves the console on loopback and times each page (median of 5 GETs, after one warm-up)
and prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import requests


def build(root: Path, adapters: int, rows: int) -> tuple[Any, list[str]]:
    from control.contracts.db import make_engine
    from control.contracts.ledger import Ledger, request_ledger
    from control.domain import RolloutPolicy
    from projections.follower import open_registry
    from tests.artifacts import perturbed_copy
    from tests.control.app.rollout_world import release_to
    from tests.fixtures_control import build_artifacts, sqlite_settings

    art = build_artifacts(root / "art")
    settings = sqlite_settings(root / "home")
    settings.ensure_dirs()
    reg = open_registry(settings)
    reg.register_base(art.base, art.tokenizer, name="tiny", actor="op")
    reg.create_tenant("acme", actor="op")
    digests = []
    t0 = time.perf_counter()
    for i in range(adapters):
        src = art.adapters["alpha"]
        folder = src if i == 0 else perturbed_copy(src, root / "copies" / f"a{i}",
                                                   1.0 + i * 1e-4)
        digests.append(reg.register_adapter(folder, tenant="acme", alias=f"alias-{i % 50}",
                                            actor="op"))
    print(f"registered {adapters} adapters in {time.perf_counter() - t0:.0f} s",
          file=sys.stderr)
    release_to(reg, digests[0], "stable")
    release_to(reg, digests[50], "canary")  # alias-0 again: a canary of the same alias
    from control.app.rollouts import RolloutDesk

    RolloutDesk(reg).start("alias-0", digests[50], steps=[10, 50, 100], window_s=60,
                           policy=RolloutPolicy(), actor="op")
    engine = Ledger(make_engine(settings.db_url)).engine
    now = time.time()
    t0 = time.perf_counter()
    chunk = 20_000
    for start in range(0, rows, chunk):
        batch = []
        for j in range(start, min(rows, start + chunk)):
            at = now - (j * 2.6) % (30 * 86400)
            batch.append({"request_id": uuid.uuid4().hex, "ticket_id": "t", "tenant": "acme",
                          "model": "lora_llm", "host": f"triton-{j % 4}", "base_digest": None,
                          "adapter_digest": digests[j % adapters], "tokenizer_digest": None,
                          "admitted_at": at, "finished_at": at + 0.2, "tokens_in": 12,
                          "tokens_out": 30, "outcome": "ok" if j % 50 else "failed",
                          "reason": None, "release_digest": None})
        with engine.begin() as conn:
            conn.execute(request_ledger.insert(), batch)
    print(f"wrote {rows} ledger rows in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    return reg, digests


def report_hosts(settings: Any, digests: list[str]) -> None:
    """Each of the four hosts' status, as its reporter writes it every 2 s: 8 full slots and
    32 adapters in its host tier (done again before each measurement: reports go stale)."""
    from control.contracts.db import make_engine
    from control.contracts.host_status import HostStatus, HostStatusTable, SlotEntry

    table = HostStatusTable(make_engine(settings.db_url))
    now = time.time()
    for h in range(4):
        held = [digests[(h * 40 + i) % len(digests)] for i in range(40)]
        table.put(HostStatus(
            f"triton-{h}", now, now - 3600, 8,
            device=tuple(SlotEntry(d, 320 << 20, i % 3) for i, d in enumerate(held[:8])),
            host_tier=tuple(SlotEntry(d, 84 << 20, 0) for d in held[8:]), pending_loads=2,
            load_waiters=3, load_queue_max=64, running=12, waiting=4, kv_tokens_reserved=900,
            kv_tokens_budget=8192, health={"violations": 0}))


def reopen(root: Path) -> tuple[Any, list[str]]:
    from projections.follower import open_registry
    from projections.routing import RoutingView
    from tests.fixtures_control import sqlite_settings

    reg = open_registry(sqlite_settings(root / "home"))
    rows = RoutingView(reg.follower.engine).adapters(None)
    by_alias = sorted(rows, key=lambda r: r.registered_at)
    return reg, [r.digest for r in by_alias]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--adapters", type=int, default=1000)
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--root", type=Path, default=None)
    a = p.parse_args(argv)
    from control.console.app import Console
    from tests.control.console.server import logged_in, serving

    root = a.root or Path(tempfile.mkdtemp(prefix="console-bench-"))
    if (root / "home" / "loraplane.db").is_file():  # built by an earlier run: measure again
        reg, digests = reopen(root)
    else:
        reg, digests = build(root, a.adapters, a.rows)
    report_hosts(reg.settings, digests)
    console = Console(reg, actor="bench", verify_every_s=0.0)
    d = digests[1]
    pages = {"adapters": "/adapters", "adapter timeline": f"/adapters/{d}",
             "rollouts": "/rollouts", "rollout": "/rollouts/alias-0",
             "rollout live fragment": "/rollouts/alias-0/live", "hosts": "/hosts",
             "incident search (adapter)": f"/incidents?adapter={d}",
             "incident CSV": f"/incidents?adapter={d}&format=csv",
             "incident, one day": f"/incidents?adapter={d}&since="
                                  + time.strftime("%Y-%m-%dT%H:%M:%S",
                                                  time.gmtime(time.time() - 86400)),
             "audit (verify)": "/audit"}
    out: dict[str, Any] = {"adapters": len(digests), "ledger_rows": a.rows, "ms": {}}
    with serving(console) as base:
        s: requests.Session = logged_in(base, console)
        for name, path in pages.items():
            s.get(base + path, timeout=120).raise_for_status()
            took = []
            for _ in range(5):
                t0 = time.perf_counter()
                r = s.get(base + path, timeout=120)
                took.append((time.perf_counter() - t0) * 1000)
                r.raise_for_status()
            out["ms"][name] = round(statistics.median(took), 1)
            print(f"{name:<28} {out['ms'][name]:8.1f} ms", file=sys.stderr)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
