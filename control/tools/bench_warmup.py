"""Time to first token after a restart, with and without the warm-up list (issue 24, in
``bench scale``).

A host serves the victims' nine adapters of :mod:`control.tools.bench_fairness`'s home, then is
restarted (a new :class:`LoraService` on the same host id, engine and database) again and again,
alternating ``LORAPLANE_WARMUP_ADAPTERS`` = 16 and 0. After each start the host is given the
warm-up's own time (with the list: until it reports done; without: nothing to wait for), then
one streamed request on each adapter, one at a time: its time to first token is what a client
sees on the first request after a restart. Reported: the median of those firsts per side and
their ratio (with / without; below 1 is the warm-up's gain), and how long the warm-up took.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from backend.serving.engine import Engine
from backend.serving.requests import Answer, IncomingRequest
from backend.serving.scheduler import SchedulerLimits
from backend.serving.service import LoraService
from control.app.serving_steps import RegistrySteps
from control.contracts.wire import TICKET_PARAM
from control.tools.bench_fairness import VICTIMS, BenchHome, provision
from control.tools.kit import build_kit, work_dir

HOST = "bench-warmup"
WARMUP = 16
QUICK = {"restarts": 2}
FULL = {"restarts": 4}


class _FirstToken:
    """A streamed answer's sink that notes when its first piece came."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.first: float | None = None
        self.final: Answer | None = None

    def cancelled(self) -> bool:
        return False

    def piece(self, text: str, request_id: str, adapter_digest: str) -> None:
        if self.first is None:
            self.first = time.perf_counter()

    def answer(self, a: Answer) -> None:
        self.final = a
        self.done.set()


def _start(home: BenchHome, engine: Engine, warmup: int) -> LoraService:
    for d in list(engine.resident_adapters()):  # a restart: empty slots
        engine.unload_adapter(d)
    return LoraService(replace(home.settings, warmup_adapters=warmup), home.base, host=HOST,
                       engine=engine, limits=SchedulerLimits(max_running=16, max_queued=256),
                       steps=RegistrySteps)


def _ttfts(svc: LoraService, home: BenchHome) -> list[float]:
    out: list[float] = []
    for tenant in VICTIMS:
        for alias in home.aliases[tenant]:
            sink = _FirstToken()
            t0 = time.perf_counter()
            params: dict[str, object] = {TICKET_PARAM: home.office.issue(tenant, alias).token}
            svc.submit(IncomingRequest(b"Hello", params, max_tokens=4, stream=True), sink)
            if not sink.done.wait(120) or sink.final is None or not sink.final.ok:
                raise RuntimeError(f"a first request after the restart failed: {sink.final}")
            out.append((sink.first or time.perf_counter()) - t0)
    return out


def run_bench(kit_dir: Path | None = None, *, quick: bool = False,
              progress: Callable[[str], None] = lambda _m: None) -> dict[str, Any]:
    shape = QUICK if quick else FULL
    sides: dict[str, list[float]] = {"with": [], "without": []}
    warmups: list[float] = []
    with work_dir(None, "loraplane-warmup-") as root:
        if kit_dir is None:
            progress("building the reference kit")
            kit_dir = root / "kit"
            build_kit(kit_dir)
        home = provision(root / "home", kit_dir, 1, progress)
        engine = Engine(kit_dir / "base", kit_dir / "tokenizer", device="cpu",
                        max_rank=home.settings.max_rank, max_adapters=12)
        svc = _start(home, engine, 0)
        try:
            _ttfts(svc, home)  # the host's first life: what it held is on its load records
        finally:
            svc.close()
        for r in range(shape["restarts"]):
            for side, n in (("with", WARMUP), ("without", 0)):
                svc = _start(home, engine, n)
                try:
                    if not svc.warmup.done.wait(120):
                        raise RuntimeError("the warm-up did not finish within 120 s")
                    if n:
                        warmups.append(svc.warmup.seconds)
                    firsts = _ttfts(svc, home)
                finally:
                    svc.close()
                sides[side].append(statistics.median(firsts))
                progress(f"restart {r + 1}/{shape['restarts']} {side} the warm-up list: "
                         f"median first-request TTFT {statistics.median(firsts) * 1e3:.1f} ms")
    with_s, without_s = (statistics.median(sides["with"]), statistics.median(sides["without"]))
    return {"ttft_first_with_s": with_s, "ttft_first_without_s": without_s,
            "with_vs_without": with_s / without_s,
            "warmup_s": statistics.median(warmups) if warmups else None,
            "runs": sides, "setup": {"adapters": len(VICTIMS) * 3, "warmup_adapters": WARMUP,
                                     **shape}}
