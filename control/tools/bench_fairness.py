"""The churn attack on the adapter cache (issue 24's fair sharing, in ``bench scale``).

One tenant, ``mallory``, creates new adapter versions in a loop and sends a request to each;
three victim tenants serve their own adapters. The victims' device hit rate and p95 latency are
measured three ways, alternated run by run in one process so that all see the same machine:

- ``none``: the victims alone;
- ``steady``: mallory sends the same requests to one version it keeps (its load on the batch,
  without churn);
- ``churn``: mallory's every request names a version the host has never seen.

The goal (issue 24): with churn, the victims' hit rate and p95 stay within 10 % of their figures
without the attacker (``churn`` against ``none``); ``churn`` against ``steady`` isolates what the
churn itself costs. What protects them is the cache's fair sharing (``backend.serving.cache``):
shares counted by owner, the victim of an eviction taken from owners over their fair part, and
each requester's own load rate and pending-load allowance.

The serving path is the real one in-process: :class:`backend.serving.service.LoraService` with
the real engine on the reference kit, the adapter cache, scheduler, ledger (SQLite), ticket
verification and governance from the registry's projections; tickets come from the gateway's
:class:`TicketOffice`. tritonserver's front is not in the loop: what is measured is the host's
cache policy and the CPU its loads take, and a second process would only add noise. Every
version is registered through the real registry before the runs (registration is the control
plane's work, on another machine in production; here it would take the GIL from serving).
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from backend.serving.cache import CacheQuota
from backend.serving.engine import Engine
from backend.serving.requests import Answer, IncomingRequest
from backend.serving.scheduler import SchedulerLimits
from backend.serving.service import LoraService
from control.app.registry import Registry
from control.app.serving_steps import RegistrySteps
from control.contracts.config import Settings
from control.contracts.db import make_engine
from control.contracts.ticket_seals import publish_seal
from control.contracts.tickets import TicketSigner
from control.contracts.wire import TICKET_PARAM
from control.gateway.ticket_office import TicketOffice
from control.tools.bench.stats import p95
from control.tools.bench_cli import fresh_adapter
from control.tools.kit import KitManifest, build_kit, work_dir
from projections.follower import open_registry
from projections.routing import RoutingView

ACTOR = "bench-fairness"
VICTIMS = ("acme", "globex", "initech")
ATTACKER = "mallory"
KIT_ADAPTERS = ("alpha", "beta", "gamma")  # the kit's adapters on its base
PER_VICTIM = 3  # adapters per victim: nine in all
SLOTS = 12  # device slots: the victims' nine fit, with room for the attacker's fair part
GOAL = 1.1  # churn / none, for the victims' p95; the hit rate's goal is >= 1 / GOAL
# Runs alternate none/steady/churn; a run is ``requests`` of the victims' (about 8 s at 300).
QUICK = {"runs": 3, "requests": 120, "versions": 150}
FULL = {"runs": 5, "requests": 300, "versions": 400}
ATTACK_INTERVAL_S = 0.05  # mallory's pace: 20 requests a second, each on a new version


@dataclass
class BenchHome:
    settings: Settings
    registry: Registry
    base: str
    office: TicketOffice
    aliases: dict[str, list[str]]  # tenant -> its aliases (mallory's: one per version)


def _register(reg: Registry, src: Path, root: Path, tenant: str, alias: str, n: int) -> None:
    path = fresh_adapter(src, root / f"{alias}-{n}", n)
    digest = reg.register_adapter(path, tenant=tenant, alias=alias, actor=ACTOR)
    reg.advance(digest, external=True, evaluation={"suite": "bench", "passed": True},
                actor=ACTOR)
    reg.grant(tenant, alias, actor=ACTOR)


def provision(root: Path, kit_dir: Path, versions: int,
               progress: Callable[[str], None]) -> BenchHome:
    settings = Settings(home=root, db_url=f"sqlite:///{root / 'loraplane.db'}")
    settings.ensure_dirs()
    kit = KitManifest.load(kit_dir)
    reg = open_registry(settings)
    reg.register_base(kit_dir / kit.base_path, kit_dir / kit.tokenizer_path, name="tiny-llama",
                      actor=ACTOR, alias="base")
    sources = [kit_dir / kit.adapters[name].path for name in KIT_ADAPTERS]
    aliases: dict[str, list[str]] = {}
    n = 1
    for tenant in (*VICTIMS, ATTACKER):
        reg.create_tenant(tenant, actor=ACTOR)
        count = versions if tenant == ATTACKER else PER_VICTIM
        aliases[tenant] = []
        for i in range(count):
            alias = f"{tenant}-{i}"
            _register(reg, sources[n % len(sources)], root / "adapters", tenant, alias, n)
            aliases[tenant].append(alias)
            n += 1
        progress(f"registered {count} adapters of {tenant}")
    signer, _ = TicketSigner.load_or_create(settings.keys_dir)
    reg.record_signing_key(signer.kid, signer.public_b64, actor=ACTOR)
    publish_seal(make_engine(settings.db_url), signer)
    routing = RoutingView(make_engine(settings.db_url))
    return BenchHome(settings, reg, routing.bases()[0].digest,
                 TicketOffice(settings, routing, signer), aliases)


def _ask(svc: LoraService, params: dict[str, object], prompt: str) -> tuple[Answer, float]:
    t0 = time.perf_counter()
    (a,) = svc.handle([IncomingRequest(prompt.encode(), params, max_tokens=4)])
    return a, time.perf_counter() - t0


def _tickets(home: BenchHome) -> dict[str, dict[str, object]]:
    """Request parameters with a fresh ticket, per victim alias and mallory's kept version."""
    kept = (ATTACKER, home.aliases[ATTACKER][0])
    return {a: {TICKET_PARAM: home.office.issue(t, a).token}
            for t, a in [(t, a) for t in VICTIMS for a in home.aliases[t]] + [kept]}


def _run(svc: LoraService, home: BenchHome, mode: str, requests: int,
         tickets: dict[str, dict[str, object]], attack: Iterator[str]) -> dict[str, Any]:
    """One run: the victims' ``requests`` (two clients per victim, their adapters in turn,
    the first weighted as a hot adapter), with mallory beside them as ``mode`` says."""
    before = svc.cache.report()
    latencies: list[float] = []
    failures: list[str] = []
    lock = threading.Lock()
    stop = threading.Event()
    attacker = {"sent": 0, "ok": 0, "refused": 0}

    def victim(k: int) -> None:
        tenant = VICTIMS[k % len(VICTIMS)]
        mine = home.aliases[tenant]
        for i in range(requests // (2 * len(VICTIMS))):
            alias = mine[0] if i % 2 == 0 else mine[1 + (i // 2) % (len(mine) - 1)]
            a, s = _ask(svc, tickets[alias], f"[{k}:{i}] Hello")
            with lock:
                latencies.append(s)
                if not a.ok:
                    failures.append(a.error)

    def mallory() -> None:
        while not stop.is_set():
            alias = (next(attack, None) if mode == "churn" else home.aliases[ATTACKER][0])
            if alias is None:  # every version registered has been sent: the attack ends
                attacker["exhausted"] = 1
                return
            params = tickets.get(alias) or {TICKET_PARAM: home.office.issue(ATTACKER,
                                                                            alias).token}
            a, _s = _ask(svc, params, "Hello")
            attacker["sent"] += 1
            attacker["ok" if a.ok else "refused"] += 1
            stop.wait(ATTACK_INTERVAL_S)

    threads = [threading.Thread(target=victim, args=(k,)) for k in range(2 * len(VICTIMS))]
    side = threading.Thread(target=mallory) if mode != "none" else None
    if side is not None:
        side.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stop.set()
    if side is not None:
        side.join()
    after = svc.cache.report()
    victim_digests = {d for d, r in after.items() if r.tenant in VICTIMS}
    hits = sum(after[d].hits - (before[d].hits if d in before else 0) for d in victim_digests)
    misses = sum(after[d].misses - (before[d].misses if d in before else 0)
                 for d in victim_digests)
    return {"mode": mode, "p95_s": p95(latencies), "hit_rate": hits / max(1, hits + misses),
            "victim_requests": len(latencies), "victim_failures": len(failures),
            "attacker": attacker}


def run_bench(kit_dir: Path | None = None, *, quick: bool = False,
              scratch: Path | None = None,
              progress: Callable[[str], None] = lambda _m: None) -> dict[str, Any]:
    """Alternate ``none``, ``steady`` and ``churn`` runs; medians of each and the ratios."""
    shape = QUICK if quick else FULL
    with work_dir(scratch, "loraplane-fairness-") as root:
        if kit_dir is None:
            progress("building the reference kit")
            kit_dir = root / "kit"
            build_kit(kit_dir)
        home = provision(root / "home", kit_dir, shape["versions"], progress)
        engine = Engine(kit_dir / "base", kit_dir / "tokenizer", device="cpu",
                        max_rank=home.settings.max_rank, max_adapters=SLOTS)
        svc = LoraService(home.settings, home.base, host="bench-fairness", engine=engine,
                          limits=SchedulerLimits(max_running=16, max_queued=256),
                          quota=CacheQuota(), steps=RegistrySteps)
        try:
            versions = iter(home.aliases[ATTACKER][1:])
            runs: dict[str, list[dict[str, Any]]] = {"none": [], "steady": [], "churn": []}
            _run(svc, home, "none", shape["requests"] // 2, _tickets(home), versions)  # warm-up
            for r in range(shape["runs"]):
                for mode in runs:  # fresh tickets each run: a ticket lives minutes
                    out = _run(svc, home, mode, shape["requests"], _tickets(home), versions)
                    runs[mode].append(out)
                    progress(f"run {r + 1}/{shape['runs']} {mode}: victims' p95 "
                             f"{out['p95_s'] * 1e3:.1f} ms, hit rate {out['hit_rate']:.3f}, "
                             f"attacker {out['attacker']}")
            resident = {t: sum(1 for x in svc.cache.report().values()
                               if x.tenant == t and x.tier == "device")
                        for t in (*VICTIMS, ATTACKER)}
        finally:
            svc.close()
    med = {m: {"p95_s": statistics.median(x["p95_s"] for x in rs),
               "hit_rate": statistics.median(x["hit_rate"] for x in rs)}
           for m, rs in runs.items()}
    p95_ratio = med["churn"]["p95_s"] / med["none"]["p95_s"]
    hit_ratio = med["churn"]["hit_rate"] / max(1e-9, med["none"]["hit_rate"])
    return {
        "churn_vs_none_p95": p95_ratio,
        "churn_vs_none_hit_rate": hit_ratio,
        "churn_vs_steady_p95": med["churn"]["p95_s"] / med["steady"]["p95_s"],
        "goal": f"p95 ratio <= {GOAL}, hit-rate ratio >= {1 / GOAL:.2f}",
        "met": p95_ratio <= GOAL and hit_ratio >= 1 / GOAL,
        "medians": med,
        "runs": runs,
        "resident_at_end": resident,
        "victim_failures": sum(x["victim_failures"] for rs in runs.values() for x in rs),
        "setup": {"victims": list(VICTIMS), "adapters_per_victim": PER_VICTIM,
                  "slots": SLOTS, "attacker_versions": shape["versions"],
                  "attack_interval_s": ATTACK_INTERVAL_S, **shape},
    }
