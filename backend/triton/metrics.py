"""Backend metrics on Triton's metrics port, through the Python backend's custom metrics API.

The serving path calls one hook, :meth:`Telemetry.batch_done`, which hands the ids of the
requests just answered to :meth:`BackendMetrics.finished`; everything else happens on a daemon
thread, off the response path. That thread reads the requests' rows from the request ledger (the
durable record the response already waited for) and this host's new ``adapter_loads`` rows,
and turns them into series:

===========================================  =====================================================
``loraplane_backend_requests_total``          requests by ``outcome`` (ok, rejected, failed, ...)
``loraplane_backend_request_seconds``         latency of ok requests, admitted to finished
``loraplane_backend_tokens_total``            tokens by ``kind`` (prompt, completion)
``loraplane_backend_refusals_total``          refused requests by ``reason`` (ticket and limits)
``loraplane_backend_adapter_cache_total``     cache events by ``event`` (hit, miss,
                                              load_failure, eviction) and ``reason``
``loraplane_backend_prefix_cache_total``      prompt (prefix) cache lookups by ``event`` (hit,
                                              miss); keys are per tenant, so a hit is always
                                              the tenant's own prompt
``loraplane_backend_resident_bytes``          bytes by ``kind``: base_weights, adapter_banks,
                                              gathered, kv_cache, prefix_cache, workspace (they
                                              add up: ``backend.serving.memory_report``); and
                                              adapter_weights, the part of adapter_banks that
                                              resident adapters occupy (not added again)
``loraplane_backend_resident_adapters``       adapters resident now
``loraplane_backend_cache_tier_bytes``        the adapter cache's bytes by ``tier`` (device, host,
                                              store); ``..._tier_budget_bytes`` its budgets,
                                              ``..._tier_adapters`` the adapters each holds
``loraplane_backend_cache_pending_loads``     cold loads queued or running (at most the load
                                              queue's bound)
``loraplane_backend_leases``                  adapter leases held by live requests (0 when idle)
``loraplane_backend_slot_pins``               slot pins held by live sequences (0 when idle)
``loraplane_backend_invariant_violations``    broken lease/pin/job invariants by ``kind``
                                              (``backend.serving.lease.VIOLATION_KINDS``); always 0
``loraplane_backend_identity_mismatches``     requests failed closed: the slot did not hold the
                                              ticket's adapter; always 0
``loraplane_backend_ledger_backlog``          ledger rows held for retry (database away)
``loraplane_backend_ledger_poisoned``         ledger rows set aside because they can never be
                                              written (``backend.serving.recorder``); alert on > 0
===========================================  =====================================================

The lease, pin, violation, mismatch and backlog series are read from the service every second
and after every batch, so an idle host's values settle within a second.

Labels are bounded: outcomes, token kinds and memory kinds are fixed; reasons come from the
backend's own fixed vocabularies, and any reason past :data:`MAX_REASONS` distinct values is
counted as ``other``. No tenant, alias, digest or request id is ever a label.

``pb_utils`` is passed in (Triton's module inside the stub); without it, values are kept in
:attr:`BackendMetrics.values` only, which is what the unit tests read.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import re
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import sqlalchemy as sa

from backend.serving.memory_report import MEMORY_CATEGORIES, resident_memory
from backend.triton.placement_metrics import PlacementMetrics
from control.contracts.ledger import adapter_loads, request_ledger
from control.contracts.telemetry import (
    LOG_FORMAT_ENV,
    TRACEPARENT,
    configure_logging,
    parent_context,
    tracer,
)

log = logging.getLogger("loraplane.backend.metrics")

LATENCY_BUCKETS = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0]
# The categories that add up, and adapter_weights: the resident adapters' slots within the banks.
MEMORY_KINDS = (*MEMORY_CATEGORIES, "adapter_weights")
MAX_REASONS = 32
_REASON_RE = re.compile(r"^[a-z][a-z0-9_]{0,31}$")


class _Series:
    """One metric family: the Triton family when pb_utils is given, and a plain dict."""

    def __init__(self, owner: BackendMetrics, name: str, doc: str, kind: str,
                 buckets: list[float] | None = None) -> None:
        self.owner, self.name, self.buckets = owner, name, buckets
        self._family = None
        self._metrics: dict[tuple[tuple[str, str], ...], Any] = {}
        pb = owner.pb
        if pb is not None:
            kinds = {"counter": pb.MetricFamily.COUNTER, "gauge": pb.MetricFamily.GAUGE,
                     "histogram": pb.MetricFamily.HISTOGRAM}
            self._family = pb.MetricFamily(name=name, description=doc, kind=kinds[kind])

    def _metric(self, labels: dict[str, str]) -> Any:
        key = tuple(sorted(labels.items()))
        if self._family is not None and key not in self._metrics:
            if self.buckets is not None:
                self._metrics[key] = self._family.Metric(labels=labels, buckets=self.buckets)
            else:
                self._metrics[key] = self._family.Metric(labels=labels)
        return self._metrics.get(key)

    def inc(self, labels: dict[str, str], value: float = 1.0) -> None:
        if value <= 0:
            return
        m = self._metric(labels)
        if m is not None:
            m.increment(value)
        self.owner._record(self.name, labels, value, add=True)

    def set(self, labels: dict[str, str], value: float) -> None:
        m = self._metric(labels)
        if m is not None:
            m.set(value)
        self.owner._record(self.name, labels, value, add=False)

    def observe(self, labels: dict[str, str], value: float) -> None:
        m = self._metric(labels)
        if m is not None:
            m.observe(value)
        self.owner._record(self.name + "_count", labels, 1.0, add=True)
        self.owner._record(self.name + "_sum", labels, value, add=True)


class BackendMetrics:
    """The backend's metric families and the thread that fills them from the ledger."""

    def __init__(self, pb_utils: Any, db: sa.engine.Engine, host: str,
                 engine: Any = None, health: Callable[[], dict[str, int]] | None = None,
                 violations: Callable[[], dict[str, int]] | None = None,
                 memory_report: Callable[[], Mapping[str, int]] | None = None,
                 cache_tiers: Callable[[], Mapping[str, Mapping[str, int]]] | None = None
                 ) -> None:
        """``memory_report``: bytes by category (``backend.serving.memory_report.resident_memory``
        over
        the service's engine, scheduler and prefix cache); without it, the engine's alone."""
        self.pb = pb_utils
        self.db = db
        self.host = host
        self.engine = engine
        self.memory_report = memory_report
        self.cache_tiers = cache_tiers  # the adapter cache's ``tiers()``
        self.health = health
        self.violation_counts = violations
        self.values: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
        self._values_lock = threading.Lock()
        self._reasons: set[str] = set()
        self._last_load_id = self._max_load_id()
        self._queue: queue.Queue[list[str] | None] = queue.Queue()
        self.requests = _Series(self, "loraplane_backend_requests_total",
                                "Requests answered by this host, by outcome.", "counter")
        self.latency = _Series(self, "loraplane_backend_request_seconds",
                               "Seconds from admission to answer, ok requests.", "histogram",
                               LATENCY_BUCKETS)
        self.tokens = _Series(self, "loraplane_backend_tokens_total",
                              "Tokens processed, by kind (prompt, completion).", "counter")
        self.refusals = _Series(self, "loraplane_backend_refusals_total",
                                "Requests refused, by reason (ticket checks, limits, loads).",
                                "counter")
        self.cache = _Series(self, "loraplane_backend_adapter_cache_total",
                             "Adapter cache events: hit, miss, load_failure, eviction; "
                             "by reason.", "counter")
        self.prefix = _Series(self, "loraplane_backend_prefix_cache_total",
                              "Prompt (prefix) cache lookups: hit, miss.", "counter")
        self._prefix_seen = {"hit": 0, "miss": 0}  # the service's counts already exported
        self.memory = _Series(self, "loraplane_backend_resident_bytes",
                              "Bytes resident in this model instance, by kind.", "gauge")
        self.adapters = _Series(self, "loraplane_backend_resident_adapters",
                                "Adapters resident in this model instance.", "gauge")
        self.tier_bytes = _Series(self, "loraplane_backend_cache_tier_bytes",
                                  "Adapter cache bytes by tier (device, host, store).", "gauge")
        self.tier_budget = _Series(self, "loraplane_backend_cache_tier_budget_bytes",
                                   "Adapter cache budget by tier.", "gauge")
        self.tier_adapters = _Series(self, "loraplane_backend_cache_tier_adapters",
                                     "Adapters held by tier.", "gauge")
        self.pending_loads = _Series(self, "loraplane_backend_cache_pending_loads",
                                     "Cold adapter loads queued or running.", "gauge")
        self.leases = _Series(self, "loraplane_backend_leases",
                              "Adapter leases held by live requests.", "gauge")
        self.pins = _Series(self, "loraplane_backend_slot_pins",
                            "Slot pins held by live sequences.", "gauge")
        self.violations = _Series(self, "loraplane_backend_invariant_violations",
                                  "Broken lease, pin or job invariants, by kind (always 0).",
                                  "gauge")
        self.mismatches = _Series(self, "loraplane_backend_identity_mismatches",
                                  "Requests failed closed because the slot did not hold the "
                                  "ticket's adapter (always 0).", "gauge")
        self.backlog = _Series(self, "loraplane_backend_ledger_backlog",
                               "Ledger rows held for retry while the database is away.",
                               "gauge")
        self.poisoned = _Series(self, "loraplane_backend_ledger_poisoned",
                                "Ledger rows set aside because they can never be written "
                                "(logged in full); alert when above 0.", "gauge")
        for kind in ("prompt", "completion"):
            self._record(self.tokens.name, {"kind": kind}, 0.0, add=True)
        self._thread: threading.Thread | None = None

    # -- hooks ------------------------------------------------------------------------------

    def start(self) -> BackendMetrics:
        """Start the accounting thread; publish the resident bytes once."""
        self.refresh_memory()
        self._thread = threading.Thread(target=self._run, name="metrics", daemon=True)
        self._thread.start()
        return self

    def finished(self, request_ids: Iterable[str]) -> None:
        """Hook: these requests have been answered (their ledger rows are final)."""
        ids = [r for r in request_ids if r]
        if ids:
            self._queue.put(ids)

    def close(self, timeout_s: float = 5.0) -> None:
        """Account for what is queued, then stop the thread."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout_s)
            self._thread = None

    # -- accounting -------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            try:
                item = self._queue.get(timeout=1.0)
            except queue.Empty:
                self._safely_refresh()
                continue
            if item is None:
                return
            batch = list(item)
            while len(batch) < 512:  # coalesce a burst into one ledger query
                try:
                    more = self._queue.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    self._safely(batch)
                    return
                batch.extend(more)
            self._safely(batch)

    def _safely_refresh(self) -> None:
        try:
            self.refresh_memory()
        except Exception:  # metrics must never take serving down
            log.warning("metrics refresh failed", exc_info=True)

    def _safely(self, ids: list[str]) -> None:
        try:
            self.account(ids)
        except Exception:  # metrics must never take serving down
            log.warning("metrics accounting failed", exc_info=True)

    def account(self, request_ids: Sequence[str]) -> None:
        """Turn the given requests' ledger rows, and new load records, into series."""
        t = request_ledger
        with self.db.connect() as conn:
            rows = conn.execute(
                sa.select(t.c.outcome, t.c.reason, t.c.adapter_digest, t.c.tokens_in,
                          t.c.tokens_out, t.c.admitted_at, t.c.finished_at)
                .where(t.c.request_id.in_(list(request_ids)))).all()
            loads = conn.execute(
                sa.select(adapter_loads.c.id, adapter_loads.c.adapter_digest,
                          adapter_loads.c.outcome, adapter_loads.c.reason)
                .where(adapter_loads.c.id > self._last_load_id,
                       adapter_loads.c.host == self.host)
                .order_by(adapter_loads.c.id)).all()
        missed: dict[str, int] = {}
        for load in loads:
            self._last_load_id = max(self._last_load_id, int(load.id))
            if load.outcome == "loaded":
                missed[load.adapter_digest] = missed.get(load.adapter_digest, 0) + 1
                self.cache.inc({"event": "miss", "reason": "not_resident"})
            elif load.outcome == "failed":
                self.cache.inc({"event": "load_failure", "reason": self._reason(load.reason)})
            elif load.outcome == "unloaded":
                self.cache.inc({"event": "eviction", "reason": self._reason(load.reason)})
        for r in rows:
            self.requests.inc({"outcome": self._reason(r.outcome)})
            if r.outcome == "rejected":
                self.refusals.inc({"reason": self._reason(r.reason)})
            if r.outcome == "ok":
                if r.finished_at is not None:
                    self.latency.observe({}, max(0.0, r.finished_at - r.admitted_at))
                self.tokens.inc({"kind": "prompt"}, float(r.tokens_in or 0))
                self.tokens.inc({"kind": "completion"}, float(r.tokens_out or 0))
                if r.adapter_digest is not None:
                    # The first request after a load was the miss; the others found it resident.
                    if missed.get(r.adapter_digest, 0) > 0:
                        missed[r.adapter_digest] -= 1
                    else:
                        self.cache.inc({"event": "hit", "reason": "resident"})
        self.refresh_memory()

    def refresh_memory(self) -> None:
        """Publish the gauges read from the engine and the service."""
        if self.health is not None:
            h = self.health()
            self.leases.set({}, float(h.get("leases", 0)))
            self.pins.set({}, float(h.get("pins", 0)))
            self.mismatches.set({}, float(h.get("identity_mismatches", 0)))
            self.backlog.set({}, float(h.get("ledger_backlog", 0)))
            self.poisoned.set({}, float(h.get("ledger_poisoned", 0)))
            for event, key in (("hit", "prefix_hits"), ("miss", "prefix_misses")):
                n = int(h.get(key, 0))  # the service counts; a counter only moves forward
                self.prefix.inc({"event": event}, float(n - self._prefix_seen[event]))
                self._prefix_seen[event] = max(n, self._prefix_seen[event])
        if self.violation_counts is not None:
            for kind, n in self.violation_counts().items():
                self.violations.set({"kind": kind}, float(n))
        if self.cache_tiers is not None:
            tiers = self.cache_tiers()
            for tier in ("device", "host", "store"):
                t = tiers.get(tier, {})
                self.tier_bytes.set({"tier": tier}, float(t.get("bytes", 0)))
                self.tier_budget.set({"tier": tier}, float(t.get("budget", 0)))
                self.tier_adapters.set({"tier": tier}, float(t.get("adapters", 0)))
            self.pending_loads.set({}, float(tiers.get("loads", {}).get("pending", 0)))
        if self.engine is None:
            return
        report = (self.memory_report() if self.memory_report is not None
                  else resident_memory(self.engine))
        for kind in MEMORY_CATEGORIES:
            self.memory.set({"kind": kind}, float(report.get(kind, 0)))
        adapters = dict(self.engine.resident_adapters())
        self.memory.set({"kind": "adapter_weights"}, float(sum(adapters.values())))
        self.adapters.set({}, float(len(adapters)))

    def _reason(self, reason: str | None) -> str:
        r = (reason or "none").lower()
        if not _REASON_RE.match(r):
            return "other"
        if r not in self._reasons:
            if len(self._reasons) >= MAX_REASONS:
                return "other"
            self._reasons.add(r)
        return r

    def _max_load_id(self) -> int:
        with self.db.connect() as conn:
            return int(conn.execute(sa.select(sa.func.coalesce(sa.func.max(adapter_loads.c.id),
                                                               0))).scalar() or 0)

    def _record(self, name: str, labels: dict[str, str], value: float, *, add: bool) -> None:
        key = (name, tuple(sorted(labels.items())))
        with self._values_lock:
            self.values[key] = (self.values.get(key, 0.0) + value) if add else value

    def value(self, name: str, **labels: str) -> float:
        """The current value of one series (tests, debugging)."""
        return self.values.get((name, tuple(sorted(labels.items()))), 0.0)


class Telemetry:
    """The one object the Triton glue holds: metrics plus OpenTelemetry spans.

    Hook: :meth:`batch_done` after a batch's answers exist (ledger rows final), with the
    requests as received (their parameters may carry a W3C ``traceparent``) and the answers in
    the same order. Tracing is configured by ``LORAPLANE_TRACES`` and off by default.
    """

    def __init__(self, metrics: BackendMetrics, tracer: Any,
                 placement: PlacementMetrics | None = None) -> None:
        self.metrics = metrics
        self.placement = placement  # the balancer's series (backend.triton.placement_metrics)
        self.tracer = tracer
        self.tracing = tracer.__class__.__name__ != "NoOpTracer"

    @classmethod
    def for_service(cls, pb_utils: Any, service: Any) -> Telemetry:
        """Telemetry for a running :class:`backend.serving.service.LoraService`, thread started."""
        if os.environ.get(LOG_FORMAT_ENV):  # JSON log lines in Triton's log, when asked for
            configure_logging()
        metrics = BackendMetrics(pb_utils, service.ledger.engine, service.host,
                                 engine=service.engine, health=service.health,
                                 violations=service.engine.violations.snapshot,
                                 memory_report=service.memory_report,
                                 cache_tiers=service.cache.tiers).start()
        placement = PlacementMetrics.for_service(pb_utils, service).start()
        return cls(metrics, tracer("loraplane-backend"), placement)

    def batch_done(self, incoming: Sequence[Any], answers: Sequence[Any],
                   started_ns: int) -> None:
        self.metrics.finished(a.request_id for a in answers)
        if self.tracing:
            try:
                self._spans(incoming, answers, started_ns)
            except Exception:  # tracing must never take serving down
                log.warning("tracing failed", exc_info=True)

    def _spans(self, incoming: Sequence[Any], answers: Sequence[Any], started_ns: int) -> None:
        end = time.time_ns()
        for req, ans in zip(incoming, answers, strict=False):
            params = req.parameters
            if isinstance(params, str):
                try:
                    params = json.loads(params or "{}")
                except ValueError:
                    params = {}
            tp = params.get(TRACEPARENT) if isinstance(params, dict) else None
            span = self.tracer.start_span(
                "backend.lora_llm", context=parent_context(tp if isinstance(tp, str) else None),
                start_time=started_ns)
            span.set_attribute("loraplane.request_id", ans.request_id)
            span.set_attribute("loraplane.adapter_digest", ans.adapter_digest)
            span.set_attribute("loraplane.host", self.metrics.host)
            span.set_attribute("loraplane.ok", bool(ans.ok))
            span.end(end_time=end)

    def close(self) -> None:
        self.metrics.close()
        if self.placement is not None:
            self.placement.close()
