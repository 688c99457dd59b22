"""The endpoint picker's reading of a model server's metrics, written from its documented rules
(llm-d-router / gateway-api-inference-extension ``pkg/epp/backend/metrics``, the vLLM engine's
``promToPodMetrics``), to check loraplane's hosts against (``backend.triton.placement_metrics``).

- Each family is looked up by exact name; a missing family is an error for that field.
- Queue and KV gauges: of the family's series, the one with the latest sample timestamp (ties:
  the last listed) gives the value.
- ``vllm:lora_requests_info``: series whose ``running_lora_adapters`` and
  ``waiting_lora_adapters`` are both empty are skipped; of the rest, the one with the largest
  value (a creation time, which must be > 0) wins; its lists split on ``,`` are the active
  adapters, and ``max_lora`` parsed as an integer is the capacity. No such series: no adapter
  information (the picker keeps what it had).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)(?:\s+(-?\d+))?$")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


@dataclass
class Sample:
    labels: dict[str, str]
    value: float
    timestamp_ms: int = 0


@dataclass
class PodMetrics:
    running: int | None = None
    waiting: int | None = None
    kv_usage: float | None = None
    active_models: set[str] | None = None
    max_active_models: int | None = None
    loaded: dict[str, set[str]] = field(default_factory=dict)  # level -> digests
    errors: list[str] = field(default_factory=list)


def families(text: str) -> dict[str, list[Sample]]:
    """The Prometheus text format, by family name (comments skipped)."""
    out: dict[str, list[Sample]] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _LINE.match(line.strip())
        if m is None:
            raise ValueError(f"not a sample line: {line!r}")
        labels = {k: v.replace('\\"', '"').replace("\\\\", "\\")
                  for k, v in _LABEL.findall(m.group(2) or "")}
        out.setdefault(m.group(1), []).append(
            Sample(labels, float(m.group(3)), int(m.group(4) or 0)))
    return out


def _latest(fams: dict[str, list[Sample]], name: str, pod: PodMetrics) -> Sample | None:
    samples = fams.get(name)
    if not samples:
        pod.errors.append(f"metric family {name!r} not found")
        return None
    latest, ts = samples[0], -1
    for s in samples:
        if s.timestamp_ms >= ts:
            latest, ts = s, s.timestamp_ms
    return latest


def parse(text: str, kv_name: str = "vllm:kv_cache_usage_perc") -> PodMetrics:
    fams = families(text)
    pod = PodMetrics()
    if (s := _latest(fams, "vllm:num_requests_running", pod)) is not None:
        pod.running = int(s.value)
    if (s := _latest(fams, "vllm:num_requests_waiting", pod)) is not None:
        pod.waiting = int(s.value)
    if (s := _latest(fams, kv_name, pod)) is not None:
        pod.kv_usage = s.value
    info = fams.get("vllm:lora_requests_info")
    if info is None:
        pod.errors.append("metric family 'vllm:lora_requests_info' not found")
    else:
        best, best_ts = None, 0.0
        for s in info:
            if not s.labels.get("running_lora_adapters") and \
                    not s.labels.get("waiting_lora_adapters"):
                continue
            if s.value > best_ts:
                best, best_ts = s, s.value
        if best is not None:
            pod.active_models = set()
            for key in ("running_lora_adapters", "waiting_lora_adapters"):
                if best.labels.get(key):
                    pod.active_models |= set(best.labels[key].split(","))
            if best.labels.get("max_lora"):
                pod.max_active_models = int(best.labels["max_lora"])
    for s in fams.get("vllm:lora_adapter_loaded", []):
        if s.value > 0:
            pod.loaded.setdefault(s.labels["level"], set()).add(s.labels["adapter_name"])
    return pod


def lora_affinity(pod: PodMetrics, adapter: str) -> float:
    """The LoRA-affinity scorer's score for one pod (as the issue quotes it): 1.0 active, 0.8
    room to load, 0.0 at capacity (the 0.6 'already waiting' case needs the split lists)."""
    active = pod.active_models or set()
    if adapter in active:
        return 1.0
    if pod.max_active_models is not None and len(active) < pod.max_active_models:
        return 0.8
    return 0.0
