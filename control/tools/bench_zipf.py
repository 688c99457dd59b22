"""``zipf_1000_vs_32`` (issue 24, in ``bench scale``): is throughput flat in the adapter count?

One host, one real deployment (gateway, follower, a real tritonserver behind the front door),
``SLOTS`` (32) device slots and the cache's host tier (``CacheBudgets``' default 1 GiB). N distinct
adapters (1,000; 200 with ``--quick``), each written as a valid PEFT folder with seeded random
A/B weights at the reference kit's shapes and scale (so their greedy outputs differ from each
other and from the base), spread round-robin over ``TENANTS`` (8) tenants and registered one by
one through the real registry: registered, released (external evaluation) and granted to its
owner, each under its own alias. No bulk path: on this two-core machine that costs 0.07 to
0.16 s an adapter under load, 0.03 s on a quiet machine (three commands, each committed and
projected in process; most of it waits on the disk), reported as ``setup.registration_s``. The
deployment starts beside the registrations (Triton's start needs the CPU, they the disk) and
follows the registry as a running host does. Whole run (2026-12-05, two cores): 95 s for 1,000
adapters (27.5 s of registration), ``zipf_1000_vs_32`` 0.852 (round pairs 0.74 and 0.98); the
same morning, before the serving fixes the README lists, 0.49 under heavy load.
Each tenant's policy raises its cold-load rate to ``LOADS_PER_MINUTE`` (see ``register_base``).

Traffic: ``CLIENTS`` (32) client threads, each with its own tritonclient HTTP client, one request
at a time, greedy, ``MAX_TOKENS`` (8) tokens, each request's prompt unique in the run (so the
per-tenant prefix cache never answers a prefill, on either side). Adapters are drawn by Zipf
(s = 1.1, seeded) over the N adapters (the large side) or over the first 32 of them (the small
side: rank k is adapter k on both sides, so the small side is the large side's head). Tickets
are issued in process by a :class:`TicketOffice` over the deployment's signing key (as the
gateway signs them), one per adapter, afresh before each round (they live 300 s).

Order: every adapter is served once first (the warm-up: its first load reads the store and
fills the host tier, as S-LoRA keeps every adapter in host memory); then ``rounds`` measured
rounds of each side with the same number of requests, alternating small/large, large/small, ...
(ABBA), so a drift in the machine's load cannot pass for a result. Before each small round its
32 adapters are served once, unmeasured: the small side is measured in its steady state, with
every adapter resident. tokens/s of a round = completion tokens of its ok rows (the ledger's
``tokens_out``) / the round's wall time, first send to last answer. ``zipf_1000_vs_32`` = median
tokens/s of the large side / median of the small side (always named so; ``adapters`` says N), with
the ratio of each round pair as its spread.

What the host reports (read from the database after each round: ``request_ledger``,
``adapter_loads`` and ``host_status`` of this host):

- a request *waited on a load* when a load of its adapter (an ``adapter_loads`` row ``loaded``)
  ended while it was in flight (after its ``admitted_at``, by its ``finished_at``): a request
  holding an adapter keeps it from being evicted, so no other load of it can end then. Device
  hit rate = requests that did not wait / ok requests.
- a load is a *host-tier hit* when its adapter was loaded before in this run (its parsed tensors
  stayed in the host tier), else it read and verified the store. Host-tier evictions leave no
  row, so this holds only while the host tier never filled: the report checks that every adapter
  ever loaded fits its budget together (``host_tier_never_full``); otherwise host-tier figures
  are None.
- loads/s = loads started in the round / its wall time; evictions = ``unloaded`` rows by reason.
- load wait of a request that waited = end of that load - its ``admitted_at``: the p95 over those
  requests, and over all requests (the others count 0). Time queued before admission (behind
  admission threads blocked on loads) is not in the ledger: the client latencies, split by hit and
  miss, show it.

Provenance: every ok answer's ``adapter_digest`` (read from the slot that computed it) must equal
the digest its ticket was issued for, which the bench knows because it registered it; every
ledger row must be ok with ``served_digest`` equal to it; and on ``samples`` rows drawn at random
(seeded) from the measured rounds, the text must equal the adapter's own greedy output computed
in this process by PEFT (``control.tools.attribution_reference``) from the stored bytes. Any
mismatch sets ``provenance_ok`` false.
"""

from __future__ import annotations

import random
import shutil
import statistics
import threading
import time
from bisect import bisect_right
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from control.app.registry import Registry
from control.contracts.config import Settings
from control.contracts.db import make_engine
from control.contracts.host_status import REPORT_INTERVAL_S, HostStatusTable
from control.contracts.ledger import adapter_loads, request_ledger
from control.contracts.store import ArtifactStore
from control.gateway.ticket_office import TicketOffice
from control.ops.clients import TritonRefused, infer_with
from control.ops.serve import Deployment, Ports, open_signer
from control.tools.kit import KitManifest, build_kit
from control.tools.kit import work_dir as scratch_dir
from projections.follower import open_registry
from projections.route_cache import CachedRoutingView
from projections.routing import RoutingView

ACTOR = "bench-zipf"
HOST = "zipf-host"  # the host id its ledger and load rows carry
TENANTS, CLIENTS, SLOTS, SMALL = 8, 32, 32, 32
ZIPF_S = 1.1
LOADS_PER_MINUTE = 1200.0  # each tenant's policy (see register_base)
MAX_TOKENS = 8
GOAL, FLOOR = 0.9, 0.8
SEED = 24
WEIGHTS, CONFIG = "adapter_model.safetensors", "adapter_config.json"


@dataclass(frozen=True)
class Size:
    adapters: int
    requests: int  # per measured round, the same on each side
    rounds: int  # measured rounds per side
    samples: int  # rows checked against PEFT


QUICK = Size(adapters=200, requests=320, rounds=2, samples=12)
FULL = Size(adapters=1000, requests=640, rounds=2, samples=20)


@dataclass(frozen=True)
class Planted:
    """One registered adapter."""

    tenant: str
    alias: str
    digest: str


@dataclass
class Sent:
    """One request as the client saw it."""

    index: int  # unique in the run; the prompt carries it
    adapter: int
    prompt: str
    seconds: float = 0.0
    text: str = ""
    request_id: str = ""
    served: str = ""
    refused: str | None = None


@dataclass
class Round:
    side: str  # small | large | warm-up
    sent: list[Sent]
    started: float  # time.time() of the first send
    wall_s: float
    figures: dict[str, Any] = field(default_factory=dict)


# -- adapters and registration ------------------------------------------------------------------

def write_adapters(kit_dir: Path, out: Path, n: int) -> list[Path]:
    """``n`` PEFT folders: the kit's ``alpha`` config, and for each of its tensors a seeded
    random one of the same shape and standard deviation (the scale a trained one has, so each
    adapter answers its own way)."""
    import numpy as np
    from safetensors.numpy import load_file, save_file

    src = kit_dir / KitManifest.load(kit_dir).adapters["alpha"].path
    shapes = {k: (v.shape, float(v.std())) for k, v in load_file(str(src / WEIGHTS)).items()}
    paths = []
    for i in range(n):
        d = out / f"zipf-{i:04d}"
        d.mkdir(parents=True)
        rng = np.random.default_rng(SEED * 100_000 + i)
        save_file({k: (rng.standard_normal(shape) * std).astype(np.float32)
                   for k, (shape, std) in sorted(shapes.items())},
                  str(d / WEIGHTS), metadata={"format": "pt"})
        shutil.copyfile(src / CONFIG, d / CONFIG)
        paths.append(d)
    return paths


def register_base(settings: Settings, kit_dir: Path) -> tuple[Registry, list[str]]:
    """The kit's base and ``TENANTS`` tenants: what a deployment needs to start."""
    kit = KitManifest.load(kit_dir)
    reg = open_registry(settings)
    reg.register_base(kit_dir / kit.base_path, kit_dir / kit.tokenizer_path, name="tiny-llama",
                      actor=ACTOR, alias="base")
    from control.domain import TenantPolicy  # eventsourcing: as the registry's own verbs

    tenants = [f"zipf-t{j}" for j in range(TENANTS)]
    for t in tenants:
        reg.create_tenant(t, actor=ACTOR)
        # A busy tenant's operator raises its cold-load rate (the host's default, 120 a minute,
        # is a guard against churn): Zipf traffic over 1,000 adapters loads 2-3 a second per
        # tenant, and a refusal for rate would be measured as throughput lost to adapters.
        reg.set_policy(t, TenantPolicy(loads_per_minute=LOADS_PER_MINUTE), actor=ACTOR)
    return reg, tenants


def register(reg: Registry, tenants: list[str], paths: list[Path],
             progress: Callable[[str], None]) -> list[Planted]:
    """Each adapter registered, released and granted to its owner, one by one (adapter i
    belongs to tenant i mod ``TENANTS``)."""
    planted = []
    for i, path in enumerate(paths):
        tenant, alias = tenants[i % TENANTS], f"zipf-{i:04d}"
        digest = reg.register_adapter(path, tenant=tenant, alias=alias, actor=ACTOR)
        reg.advance(digest, external=True, evaluation={"suite": "bench-zipf", "passed": True},
                    actor=ACTOR)
        reg.grant(tenant, alias, actor=ACTOR)
        planted.append(Planted(tenant, alias, digest))
        if (i + 1) % 100 == 0:
            progress(f"zipf: registered {i + 1} of {len(paths)} adapters")
    return planted


def zipf_draws(n: int, count: int, rng: random.Random) -> list[int]:
    """``count`` adapter indexes in [0, n), index k drawn with weight (k + 1) ** -s."""
    weights = [(k + 1) ** -ZIPF_S for k in range(n)]
    return rng.choices(range(n), weights=weights, k=count)


# -- traffic ------------------------------------------------------------------------------------

class Traffic:
    """Sends rounds of requests from ``clients`` threads and numbers every request."""

    def __init__(self, url: str, office: TicketOffice, planted: list[Planted],
                 clients: int) -> None:
        self.url, self.office, self.planted, self.clients = url, office, planted, clients
        self.next_index = 0

    def round(self, side: str, adapters: list[int]) -> Round:
        # Fresh tickets for this round's adapters: a ticket lives 300 s, a full run longer.
        tickets = {a: self.office.issue(self.planted[a].tenant, self.planted[a].alias).token
                   for a in sorted(set(adapters))}
        sent = []
        for a in adapters:
            sent.append(Sent(self.next_index, a, f"q{self.next_index}: the cat sat"))
            self.next_index += 1
        work = iter(sent)
        lock = threading.Lock()

        def client() -> None:
            import tritonclient.http as httpclient

            c = httpclient.InferenceServerClient(self.url, connection_timeout=120.0,
                                                 network_timeout=120.0)
            try:
                while True:
                    with lock:
                        s = next(work, None)
                    if s is None:
                        return
                    t0 = time.perf_counter()
                    try:
                        g = infer_with(c, "http", s.prompt, tickets[s.adapter],
                                       max_tokens=MAX_TOKENS)
                        s.text, s.request_id, s.served = g.text, g.request_id, g.adapter_digest
                    except TritonRefused as e:
                        s.refused = f"{e.status}: {e.message}"[:200]
                    except Exception as e:  # a transport error: counted, the run goes on
                        s.refused = f"{type(e).__name__}: {e}"[:200]
                    s.seconds = time.perf_counter() - t0
            finally:
                c.close()

        threads = [threading.Thread(target=client, name=f"zipf-client-{i}", daemon=True)
                   for i in range(min(self.clients, len(sent)))]
        started, t0 = time.time(), time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return Round(side, sent, started, time.perf_counter() - t0)


# -- what the host recorded ---------------------------------------------------------------------

def _ledger(db: sa.engine.Engine, ids: list[str]) -> dict[str, Any]:
    t = request_ledger
    out: dict[str, Any] = {}
    with db.connect() as conn:
        for i in range(0, len(ids), 500):
            for r in conn.execute(sa.select(t).where(t.c.request_id.in_(ids[i:i + 500]))):
                out[r.request_id] = r
    return out


def _loads(db: sa.engine.Engine) -> list[Any]:
    t = adapter_loads
    with db.connect() as conn:
        return list(conn.execute(sa.select(t).where(t.c.host == HOST).order_by(t.c.id)))


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]  # nearest rank, upper


def analyse(r: Round, planted: list[Planted], db: sa.engine.Engine,
            loaded_before: set[str]) -> dict[str, Any]:
    """The round's figures from the ledger and the load rows (see the module notes); adds the
    digests it loaded to ``loaded_before``."""
    ok_sent = [s for s in r.sent if s.refused is None]
    rows = _ledger(db, [s.request_id for s in ok_sent])
    end = r.started + r.wall_s
    loads = [x for x in _loads(db) if r.started <= x.started_at <= end]
    ends: dict[str, list[float]] = {}
    host_hits = 0
    for x in loads:
        if x.outcome == "loaded":
            ends.setdefault(x.adapter_digest, []).append(x.started_at + x.seconds)
            host_hits += x.adapter_digest in loaded_before
            loaded_before.add(x.adapter_digest)
    for e in ends.values():
        e.sort()
    waits, hit_lat, miss_lat = [], [], []
    tokens = ledger_bad = 0
    for s in ok_sent:
        row = rows.get(s.request_id)
        want = planted[s.adapter].digest
        if row is None or row.outcome != "ok" or row.served_digest != want \
                or row.adapter_digest != want:
            ledger_bad += 1
            continue
        tokens += int(row.tokens_out or 0)
        e = ends.get(want, [])
        k = bisect_right(e, row.admitted_at)  # the first load of it that ended after admission
        if k < len(e) and e[k] <= (row.finished_at or end):
            waits.append(e[k] - row.admitted_at)
            miss_lat.append(s.seconds)
        else:
            hit_lat.append(s.seconds)
    n_loads = sum(len(e) for e in ends.values())
    refused = Counter((s.refused or "").split(":")[0] for s in r.sent if s.refused is not None)
    return {
        "requests": len(r.sent), "ok": len(ok_sent), "refused": dict(refused),
        "ledger_mismatches": ledger_bad,
        "wall_s": r.wall_s, "tokens": tokens, "tokens_per_s": tokens / r.wall_s,
        "device_hits": len(hit_lat), "waited_on_load": len(waits),
        "loads": n_loads, "host_tier_loads": host_hits, "store_loads": n_loads - host_hits,
        "load_failures": sum(1 for x in loads if x.outcome == "failed"),
        "evictions": dict(Counter(x.reason for x in loads if x.outcome == "unloaded")),
        "load_seconds": [x.seconds for x in loads if x.outcome == "loaded"],
        "waits": waits, "latency": [s.seconds for s in r.sent], "hit_latency": hit_lat,
        "miss_latency": miss_lat,
    }


def side_summary(rounds: list[Round], host_tier_ok: bool) -> dict[str, Any]:
    """One side's measured rounds together."""
    f = [r.figures for r in rounds]

    def total(k: str) -> int:
        return sum(int(x[k]) for x in f)

    def joined(k: str) -> list[float]:
        return [v for x in f for v in x[k]]

    ok, loads, wall = total("ok"), total("loads"), sum(x["wall_s"] for x in f)
    waits = joined("waits")
    refused: Counter[str] = Counter()
    evictions: Counter[str] = Counter()
    for x in f:
        refused.update(x["refused"])
        evictions.update(x["evictions"])
    return {
        "tokens_per_s": {"median": statistics.median(x["tokens_per_s"] for x in f),
                         "rounds": [x["tokens_per_s"] for x in f]},
        "requests": total("requests"), "ok": ok, "refused": dict(refused),
        "hit_rate": {
            "device": total("device_hits") / ok if ok else None,
            "host": (total("host_tier_loads") / loads if loads else None)
            if host_tier_ok else None,
            "store": (total("store_loads") / loads if loads else None) if host_tier_ok else None,
        },
        "loads": loads, "loads_per_s": loads / wall, "load_failures": total("load_failures"),
        "load_seconds_p95": _pct(joined("load_seconds"), 0.95),
        "waited_on_load": len(waits),
        "evictions": dict(evictions),
        "load_wait_s": {"p50_waiting": _pct(waits, 0.5), "p95_waiting": _pct(waits, 0.95),
                        "p95_all": _pct(waits + [0.0] * (ok - len(waits)), 0.95)},
        "latency_s": {"p50": _pct(joined("latency"), 0.5), "p95": _pct(joined("latency"), 0.95),
                      "hit_p95": _pct(joined("hit_latency"), 0.95),
                      "miss_p95": _pct(joined("miss_latency"), 0.95)},
        "wall_s": wall, "tokens": total("tokens"), "ledger_mismatches": total("ledger_mismatches"),
    }


def check_samples(store: ArtifactStore, base: str, tokenizer: str, planted: list[Planted],
                  sample: list[Sent]) -> dict[str, Any]:
    """Each sampled answer against PEFT's greedy output for its adapter (module notes)."""
    from control.tools.attribution_reference import BASE, load_reference  # torch and PEFT

    ref = load_reference(store, base, tokenizer, sorted({planted[s.adapter].digest
                                                         for s in sample}))
    rows = []
    for s in sample:
        digest = planted[s.adapter].digest
        want = ref.generate(s.prompt, digest, MAX_TOKENS)
        rows.append({"index": s.index, "adapter": s.adapter, "equal": want == s.text,
                     "distinct_from_base": want != ref.generate(s.prompt, BASE, MAX_TOKENS)})
    return {"sampled": len(rows), "mismatches": sum(not r["equal"] for r in rows),
            "distinct_from_base": sum(r["distinct_from_base"] for r in rows), "rows": rows}


# -- the run ------------------------------------------------------------------------------------

def run_bench(kit_dir: Path | None = None, *, quick: bool = False,
              progress: Callable[[str], None] = lambda _m: None,
              adapters: int | None = None, requests: int | None = None,
              rounds: int | None = None, samples: int | None = None, small: int = SMALL,
              slots: int = SLOTS, clients: int = CLIENTS,
              work_dir: Path | None = None) -> dict[str, Any]:
    """Run the bench of the module notes; returns JSON-able figures with ``zipf_1000_vs_32``.

    ``quick``: 200 adapters and fewer requests (CI); the other keywords override the size (a
    test's smaller run). ``kit_dir``: a built reference kit (default: build one, a minute)."""
    size = QUICK if quick else FULL
    size = Size(adapters or size.adapters, requests or size.requests, rounds or size.rounds,
                size.samples if samples is None else samples)
    if not 0 < small < size.adapters or size.rounds < 1 or min(slots, clients) < 1:
        raise ValueError("need 0 < small < adapters, rounds >= 1, slots and clients >= 1")
    with scratch_dir(work_dir, "lp-bench-zipf-") as root:
        if kit_dir is None:
            progress("building the reference kit (about a minute)")
            kit_dir = root / "kit"
            build_kit(kit_dir)
        return _run(kit_dir, root, size, small, slots, clients, progress)


def _run(kit_dir: Path, root: Path, size: Size, small: int, slots: int, clients: int,
         progress: Callable[[str], None]) -> dict[str, Any]:
    t_all = time.perf_counter()
    home = root / "home"
    settings = Settings(home=home, db_url=f"sqlite:///{home / 'loraplane.db'}",
                        adapter_slots=slots)
    settings.ensure_dirs()
    progress(f"zipf: writing {size.adapters} seeded random PEFT adapters")
    paths = write_adapters(kit_dir, root / "adapters", size.adapters)
    reg, tenants = register_base(settings, kit_dir)
    progress(f"zipf: starting the deployment ({slots} device slots) while the adapters register")
    dep = Deployment(settings, Ports.free(),
                     actor=ACTOR, host_id=HOST, progress=progress)
    db = make_engine(settings.db_url)
    # Started beside the registrations (they wait on the disk, Triton's start on the CPU): the
    # host follows the registry as any running host does.
    starting = ThreadPoolExecutor(1, thread_name_prefix="zipf-start")
    started = starting.submit(dep.start)
    try:
        t0 = time.perf_counter()
        try:
            planted = register(reg, tenants, paths, progress)
        finally:
            registration_s = time.perf_counter() - t0
            starting.shutdown(wait=True)  # never stop a deployment still starting
        started.result()
        progress(f"zipf: registered {size.adapters} adapters in {registration_s:.1f} s")
        office = TicketOffice(settings, CachedRoutingView(make_engine(settings.db_url)),
                              open_signer(settings, reg, ACTOR))
        traffic = Traffic(dep.tenant_http_url, office, planted, clients)
        loaded: set[str] = set()
        t0 = time.perf_counter()
        warm = traffic.round("warm-up", list(range(size.adapters)))
        warm.figures = analyse(warm, planted, db, loaded)
        progress(f"zipf: warm-up served each adapter once in {time.perf_counter() - t0:.1f} s "
                 f"({warm.figures['loads']} loads, {warm.figures['ok']} ok)")
        rng = random.Random(SEED)
        measured: dict[str, list[Round]] = {"small": [], "large": []}
        rewarm: list[Round] = []  # the small side's warm-ups: unmeasured, provenance checked
        order = []
        for k in range(size.rounds):
            for side in (("small", "large") if k % 2 == 0 else ("large", "small")):
                if side == "small":  # steady state: every adapter of the small side resident
                    w = traffic.round("warm-up", list(range(small)))
                    w.figures = analyse(w, planted, db, loaded)
                    rewarm.append(w)
                r = traffic.round(side, zipf_draws(small if side == "small" else size.adapters,
                                                   size.requests, rng))
                r.figures = analyse(r, planted, db, loaded)
                measured[side].append(r)
                order.append(side)
                progress(f"zipf: round {len(order)} ({side}): "
                         f"{r.figures['tokens_per_s']:.1f} tokens/s, {r.figures['loads']} loads, "
                         f"{r.figures['ok']}/{r.figures['requests']} ok")
        time.sleep(REPORT_INTERVAL_S + 0.5)  # a host_status report written after the last round
        status = next((s for s in HostStatusTable(db).all() if s.host == HOST), None)
        (base,) = RoutingView(db).bases()
        sample_pool = [s for r in measured["large"] + measured["small"] for s in r.sent
                       if s.refused is None]
        sample = random.Random(SEED + 1).sample(sample_pool, min(size.samples, len(sample_pool)))
        progress(f"zipf: checking {len(sample)} sampled answers against PEFT")
        samples = check_samples(ArtifactStore(settings.store_dir), base.digest,
                                base.tokenizer_digest, planted, sample)
    finally:
        dep.stop()
    return _report(size, small, slots, clients, planted, [warm, *rewarm], measured, order,
                   status, loaded, samples, registration_s, time.perf_counter() - t_all)


def _report(size: Size, small: int, slots: int, clients: int, planted: list[Planted],
            warmups: list[Round], measured: dict[str, list[Round]], order: list[str],
            status: Any, loaded: set[str], samples: dict[str, Any], registration_s: float,
            seconds: float) -> dict[str, Any]:
    # Host-tier evictions leave no load row: host-tier hits are known only while every adapter
    # ever loaded fits the host budget together (the module notes).
    per = max((e.bytes for e in status.host_tier), default=0) if status is not None else 0
    host_ok = status is not None and per > 0 and len(loaded) * per <= status.host_budget
    sides = {k: side_summary(v, host_ok) for k, v in measured.items()}
    pairs = [(a.figures["tokens_per_s"] / b.figures["tokens_per_s"])
             for a, b in zip(measured["large"], measured["small"], strict=True)]
    ratio = sides["large"]["tokens_per_s"]["median"] / sides["small"]["tokens_per_s"]["median"]
    every_round = [*warmups, *measured["small"], *measured["large"]]
    everything = [s for r in every_round for s in r.sent]
    ok = [s for s in everything if s.refused is None]
    digest_bad = sum(s.served != planted[s.adapter].digest for s in ok)
    ledger_bad = sum(r.figures["ledger_mismatches"] for r in every_round)
    warm = warmups[0]
    provenance = {
        "ok_answers": len(ok), "digest_mismatches": digest_bad,
        "ledger_mismatches": ledger_bad, "sampled": samples["sampled"],
        "sample_mismatches": samples["mismatches"],
        "sample_distinct_from_base": samples["distinct_from_base"],
        "provenance_ok": digest_bad == 0 and ledger_bad == 0 and samples["mismatches"] == 0,
        "rows": samples["rows"],
    }
    large = sides["large"]
    return {
        "zipf_1000_vs_32": ratio,
        "adapters": size.adapters, "small_adapters": small,
        "spread": {"round_ratios": pairs, "min": min(pairs), "max": max(pairs)},
        "goals": {"zipf_1000_vs_32": f">= {GOAL} goal, >= {FLOOR} floor"},
        "met": {"goal": ratio >= GOAL, "floor": ratio >= FLOOR},
        "tokens_per_s": {k: v["tokens_per_s"] for k, v in sides.items()},
        "hit_rate": large["hit_rate"], "loads_per_s": large["loads_per_s"],
        "evictions": large["evictions"], "load_wait_s": large["load_wait_s"],
        "provenance_ok": provenance["provenance_ok"], "provenance": provenance,
        "all_ok": len(ok) == len(everything),
        "sides": sides,
        "warmup": {k: warm.figures[k] for k in ("requests", "ok", "wall_s", "loads",
                                                "store_loads", "refused")},
        "host": None if status is None else {
            "host_tier_adapters": len(status.host_tier), "host_tier_bytes": status.host_bytes,
            "host_budget": status.host_budget, "device_adapters": len(status.device),
            "slots_total": status.slots_total, "adapters_ever_loaded": len(loaded),
            "host_tier_never_full": host_ok},
        "setup": {"tenants": TENANTS, "slots": slots, "clients": clients, "zipf_s": ZIPF_S,
                  "tenant_loads_per_minute": LOADS_PER_MINUTE,
                  "max_tokens": MAX_TOKENS, "requests_per_round": size.requests,
                  "rounds_each": size.rounds, "order": order, "seed": SEED,
                  "registration_s": registration_s,
                  "registration_per_adapter_s": registration_s / size.adapters,
                  "seconds": seconds},
        "definitions": {
            "hit_rate.device": "ok requests that found their adapter in a device slot (no "
                               "load of it ended while they were in flight) / ok requests",
            "hit_rate.host": "loads whose adapter was loaded before in this run (parsed "
                             "tensors kept in the host tier) / loads; None when the host "
                             "tier may have evicted",
            "hit_rate.store": "loads that read and verified the store / loads",
            "load_wait_s": "end of the load a request waited on - its admitted_at; p95 over "
                           "the requests that waited, and over all (others 0)",
        },
    }
