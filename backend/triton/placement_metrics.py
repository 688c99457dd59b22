"""The model-server metrics protocol an adapter-aware balancer reads, on Triton's metrics port.

The Gateway API Inference Extension's endpoint picker (``llm-d/llm-d-router``) places requests
by what each model server publishes in vLLM's names. Its LoRA-affinity scorer reads:

=============================================  ===================================================
``vllm:num_requests_waiting``                   requests admitted but not decoding yet: queued in
                                                the scheduler, or waiting for their adapter's load
``vllm:num_requests_running``                   sequences in the running (decode) batch
``vllm:kv_cache_usage_perc``                    0..1, whichever binds first: the KV positions
                                                the live requests reserve over the host's KV
                                                budget (``max_kv_tokens``), or decode rows in use
                                                over ``max_running``
``vllm:lora_requests_info``                     value: when the series was last set (Unix
                                                seconds); labels ``max_lora`` (device slots),
                                                ``running_lora_adapters`` and
                                                ``waiting_lora_adapters`` (comma-separated adapter
                                                names, each list at most ``max_lora`` long)
``vllm:lora_adapter_loaded``                    1 per resident adapter and name; labels
                                                ``adapter_name`` (a name), ``digest`` (the
                                                adapter's) and ``level`` (``device``: in a slot;
                                                ``host``: prepared in host memory, the most
                                                recently used, at most 4 per slot)
=============================================  ===================================================

The picker keeps, of ``vllm:lora_requests_info``, the series with the largest value among those
whose adapter lists are not both empty, and splits the lists on ``,``; an idle server's empty
series is skipped and the last busy one stands (vLLM leaves its old series behind). So this
exporter keeps exactly one series: the current one while anything is in flight, the last busy
one when idle, and an empty one only until the first request. Old series are dropped, which
keeps the family bounded however many adapters pass through.

``running/waiting_lora_adapters`` say which adapters have requests in flight, not which are
resident (llm-d-router #1500); ``vllm:lora_adapter_loaded`` says that.

An adapter's names (issue 25) are the affinity values the tickets of its recent requests
carried, at most two (``backend.serving.affinity_names``), or its digest where they carried
none: the picker matches a request's ``model`` against them, and through a host's OpenAI route
``model`` is the ticket's affinity value (the digest stays sealed in the ticket).

Labels carry affinity values (hashes of aliases) and adapter digests only, never a tenant or
alias: the metrics port is for the balancer and operators, kept away from tenants by the
deployment (``docker/k8s/networkpolicy.yaml``).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("loraplane.backend.placement")

WAITING = "vllm:num_requests_waiting"
RUNNING = "vllm:num_requests_running"
KV_USAGE = "vllm:kv_cache_usage_perc"
LORA_INFO = "vllm:lora_requests_info"
LORA_LOADED = "vllm:lora_adapter_loaded"
MAX_LORA, RUNNING_ADAPTERS, WAITING_ADAPTERS = ("max_lora", "running_lora_adapters",
                                                "waiting_lora_adapters")
LEVELS = ("device", "host")
INTERVAL_ENV = "LORAPLANE_PLACEMENT_METRICS_INTERVAL_S"
# The picker polls every 50 ms by default; a quarter second keeps the view fresh for a cost
# of three short lock holds (scheduler, cache) per tick.
DEFAULT_INTERVAL_S = 0.25
# Host-memory adapters published per device slot, most recently used first (see _residency).
HOST_SERIES_PER_SLOT = 4

Labels = tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class PlacementState:
    """What one host tells the balancer, read at one moment."""

    running: int
    waiting: int
    kv_usage: float
    max_lora: int
    running_adapters: tuple[str, ...] = ()  # names (affinity values, else digests)
    waiting_adapters: tuple[str, ...] = ()
    residency: Mapping[str, str] = field(default_factory=dict)  # digest -> device | host
    # digest -> the names it is published as (absent: its digest)
    names: Mapping[str, tuple[str, ...]] = field(default_factory=dict)


def state_of(service: Any) -> PlacementState:
    """The placement state of a running :class:`backend.serving.service.LoraService`."""
    running_n, queued_n = service.scheduler.load()
    running_d, queued_d = service.scheduler.adapters_in_flight()
    report = service.cache.report()
    # Leases on an adapter that is not in a slot yet belong to requests waiting for its load.
    loading = {d: r.active_requests for d, r in report.items()
               if r.active_requests > 0 and r.tier != "device" and not r.revoked}
    max_lora = int(service.engine.max_adapters)
    max_running = max(1, int(service.limits.max_running))
    # A host full of long requests has rows free and no KV to admit into them: the picker must
    # see it as full. What admission counts (backend.serving.kv_admission), over the budget.
    budget = getattr(service.limits, "max_kv_tokens", None)
    kv = service.scheduler.kv_reserved() / budget if budget else 0.0
    waiting_d = sorted(set(queued_d) | set(loading))
    residency = _residency(report, max_lora)
    recorded = getattr(service, "affinities", None)  # None: a stand-in service in a test
    names = {d: recorded.names(d) if recorded is not None else (d,)
             for d in {*running_d, *waiting_d, *residency}}
    running = _named(running_d, names)
    return PlacementState(
        running=running_n,
        waiting=queued_n + sum(loading.values()),
        kv_usage=min(1.0, max(running_n / max_running, kv)),
        max_lora=max_lora,
        # bounded by the slot count, in names: the picker reads a list's length against
        # max_lora as the slots in use
        running_adapters=running[:max_lora],
        waiting_adapters=tuple(n for n in _named([d for d in waiting_d if d not in running_d],
                                                 names) if n not in running)[:max_lora],
        residency=residency,
        names=names,
    )


def _named(digests: list[str], names: Mapping[str, tuple[str, ...]]) -> tuple[str, ...]:
    """The names of ``digests``, in order, each once (one value may name two adapters)."""
    return tuple(dict.fromkeys(n for d in digests for n in names[d]))


def _residency(report: Mapping[str, Any], max_lora: int) -> dict[str, str]:
    """Every adapter in a device slot, and the most recently used of those in host memory, at
    most ``HOST_SERIES_PER_SLOT`` per slot: a host tier of a thousand adapters published as a
    thousand series, rebuilt whenever one moved, took a quarter of a busy engine process."""
    live = [(d, r.tier) for d, r in report.items() if r.tier in LEVELS and not r.revoked]
    host = [d for d, tier in live if tier == "host"][-HOST_SERIES_PER_SLOT * max_lora:]
    return {d: tier for d, tier in live if tier == "device"} | dict.fromkeys(host, "host")


class _Family:
    """One gauge family whose series can be dropped; ``values`` mirrors what is exposed (the
    unit tests read it).

    Triton's Python backend keeps every metric of a family until the family itself is deleted,
    so dropping a series means deleting the family and creating it again with the series that
    stay (a scrape in between misses the family once; the picker then keeps what it had)."""

    def __init__(self, pb: Any, name: str, doc: str, values: dict[tuple[str, Labels], float]):
        self.pb, self.name, self.doc, self.values = pb, name, doc, values
        self._family: Any = None
        self._series: dict[Labels, Any] = {}
        self._create()

    def _create(self) -> None:
        if self.pb is not None:
            self._family = self.pb.MetricFamily(name=self.name, description=self.doc,
                                                kind=self.pb.MetricFamily.GAUGE)

    def set(self, labels: Mapping[str, str], value: float) -> None:
        key = tuple(sorted(labels.items()))
        if key not in self._series:
            self._series[key] = (self._family.Metric(labels=dict(labels))
                                 if self._family is not None else None)
        metric = self._series[key]
        if metric is not None:
            metric.set(value)
        self.values[(self.name, key)] = value

    def keep_only(self, keep: AbstractSet[Labels]) -> None:
        dropped = [k for k in self._series if k not in keep]
        if not dropped:
            return
        for key in dropped:
            self.values.pop((self.name, key), None)
        kept = {k: self.values.get((self.name, k), 0.0) for k in self._series if k in keep}
        # the metrics first, then the family (Triton's order), then the family anew
        self._series.clear()
        self._family = None
        self._create()
        for key, value in kept.items():
            self.set(dict(key), value)

    def held(self) -> AbstractSet[Labels]:
        return set(self._series)


class PlacementMetrics:
    """Publishes :class:`PlacementState` in the picker's names, from a thread of its own."""

    def __init__(self, pb_utils: Any, state: Callable[[], PlacementState], *,
                 interval_s: float = DEFAULT_INTERVAL_S,
                 clock: Callable[[], float] = time.time) -> None:
        self.state = state
        self.interval_s = interval_s
        self.clock = clock
        self.values: dict[tuple[str, Labels], float] = {}
        self._lock = threading.Lock()
        self.waiting = _Family(pb_utils, WAITING, "Requests waiting to be scheduled.", self.values)
        self.running = _Family(pb_utils, RUNNING, "Requests in the running batch.", self.values)
        self.kv = _Family(pb_utils, KV_USAGE, "Decode rows (KV cache) in use, 0 to 1.",
                          self.values)
        self.info = _Family(pb_utils, LORA_INFO, "Adapters with requests in flight; the value "
                            "is when the series was set (Unix seconds).", self.values)
        self.loaded = _Family(pb_utils, LORA_LOADED, "Resident adapters by level (device slot, "
                              "host memory).", self.values)
        self._busy_info = False  # a busy series has been published
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def for_service(cls, pb_utils: Any, service: Any) -> PlacementMetrics:
        interval = float(os.environ.get(INTERVAL_ENV, DEFAULT_INTERVAL_S))
        return cls(pb_utils, lambda: state_of(service), interval_s=interval)

    def start(self) -> PlacementMetrics:
        self.publish()
        self._thread = threading.Thread(target=self._run, name="placement-metrics", daemon=True)
        self._thread.start()
        return self

    def close(self, timeout_s: float = 2.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.publish()
            except Exception:  # metrics must never take serving down
                log.warning("placement metrics failed", exc_info=True)

    def publish(self) -> None:
        """Read the state once and publish it."""
        s = self.state()
        with self._lock:
            self.waiting.set({}, float(s.waiting))
            self.running.set({}, float(s.running))
            self.kv.set({}, float(s.kv_usage))
            self._publish_info(s)
            keep: set[Labels] = set()
            held = self.loaded.held()
            for digest, level in s.residency.items():
                for name in s.names.get(digest, (digest,)):
                    labels = {"adapter_name": name, "digest": digest, "level": level}
                    key = tuple(sorted(labels.items()))
                    if key not in held:  # always 1: a series already there is left as it is
                        self.loaded.set(labels, 1.0)
                    keep.add(key)
            self.loaded.keep_only(keep)

    def _publish_info(self, s: PlacementState) -> None:
        labels = {MAX_LORA: str(s.max_lora), RUNNING_ADAPTERS: ",".join(s.running_adapters),
                  WAITING_ADAPTERS: ",".join(s.waiting_adapters)}
        key = tuple(sorted(labels.items()))
        if s.running_adapters or s.waiting_adapters:
            self.info.set(labels, self.clock())
            self.info.keep_only({key})
            self._busy_info = True
        elif not self._busy_info and key not in self.info.held():
            # nothing ever ran: one empty series, so that the family exists (the picker
            # skips it and reads no adapters)
            self.info.set(labels, self.clock())
            self.info.keep_only({key})
        # idle after work: the last busy series stands, as the picker expects
