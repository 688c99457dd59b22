"""The placement series as the endpoint picker reads them: one lora_requests_info series, the
last busy one standing when idle, residency series dropped when an adapter leaves."""

from __future__ import annotations

from backend.triton.placement_metrics import PlacementMetrics, PlacementState
from tests.integration.router_protocol import lora_affinity, parse

A, B, C = ("sha256:" + c * 64 for c in "abc")


def _text(m: PlacementMetrics) -> str:
    lines = []
    for (name, labels), value in m.values.items():
        inner = ",".join(f'{k}="{v}"' for k, v in labels)
        lines.append(f"{name}{{{inner}}} {value}" if inner else f"{name} {value}")
    return "\n".join(lines)


class _Clock:
    def __init__(self) -> None:
        self.t = 1_700_000_000.0

    def __call__(self) -> float:
        self.t += 1.0
        return self.t


def _metrics(states: list[PlacementState]) -> PlacementMetrics:
    it = iter(states)
    return PlacementMetrics(None, lambda: next(it), clock=_Clock())


def test_fresh_host_has_the_family_but_no_adapters() -> None:
    m = _metrics([PlacementState(0, 0, 0.0, 4)])
    m.publish()
    pod = parse(_text(m))
    assert pod.errors == []
    assert pod.running == 0 and pod.waiting == 0 and pod.kv_usage == 0.0
    assert pod.active_models is None  # the picker keeps what it had


def test_busy_then_idle_keeps_one_series_the_last_busy_one() -> None:
    m = _metrics([
        PlacementState(2, 1, 0.5, 2, (A,), (B,), {A: "device"}),
        PlacementState(1, 0, 0.25, 2, (B,), (), {A: "host", B: "device"}),
        PlacementState(0, 0, 0.0, 2, (), (), {B: "device"}),
    ])
    m.publish()
    first = parse(_text(m))
    assert first.active_models == {A, B} and first.max_active_models == 2
    assert first.running == 2 and first.waiting == 1 and first.kv_usage == 0.5
    m.publish()
    second = parse(_text(m))
    assert second.active_models == {B}
    assert second.loaded == {"host": {A}, "device": {B}}
    m.publish()  # idle: the last busy series stands; A is no longer resident at all
    idle = parse(_text(m))
    assert idle.active_models == {B} and idle.running == 0
    assert idle.loaded == {"device": {B}}
    info = [k for k in m.values if k[0] == "vllm:lora_requests_info"]
    assert len(info) == 1  # bounded: old series are dropped
    assert lora_affinity(idle, B) == 1.0 and lora_affinity(idle, C) == 0.8


def test_at_capacity_scores_zero_and_lists_stay_bounded_by_slots() -> None:
    m = _metrics([PlacementState(2, 0, 1.0, 2, (A, B), (), {A: "device", B: "device"})])
    m.publish()
    pod = parse(_text(m))
    assert lora_affinity(pod, C) == 0.0 and lora_affinity(pod, A) == 1.0


def test_host_memory_series_are_bounded_by_the_slots_most_recent_first() -> None:
    """A host tier of a thousand adapters is published as at most HOST_SERIES_PER_SLOT per
    device slot, the most recently used; every device adapter is published; a revoked one never.
    Before: every adapter in host memory had a series, and the family was rebuilt whenever
    one moved (a quarter of a busy engine process at 1,000 adapters, issue 24)."""
    from types import SimpleNamespace

    from backend.triton.placement_metrics import HOST_SERIES_PER_SLOT, state_of

    digests = ["sha256:" + f"{i:064x}" for i in range(1000)]
    report = {d: SimpleNamespace(tier="host", revoked=False, active_requests=0)
              for d in digests}  # least recently used first, as the cache reports
    report[digests[5]].tier = "device"
    report[digests[-1]].revoked = True
    service = SimpleNamespace(
        scheduler=SimpleNamespace(load=lambda: (0, 0), adapters_in_flight=lambda: ([], [])),
        cache=SimpleNamespace(report=lambda: report),
        engine=SimpleNamespace(max_adapters=2), limits=SimpleNamespace(max_running=4))
    s = state_of(service)
    host = {d for d, level in s.residency.items() if level == "host"}
    assert len(host) == HOST_SERIES_PER_SLOT * 2
    assert host == set(digests[-1 - HOST_SERIES_PER_SLOT * 2:-1])  # the newest, not revoked
    assert s.residency[digests[5]] == "device"
    m = _metrics([s, s])
    m.publish()
    m.publish()
    assert sum(1 for (name, _l) in m.values if name == "vllm:lora_adapter_loaded") == 9


def test_kv_usage_is_the_kv_budget_reserved_when_that_binds_before_the_rows() -> None:
    """One long request holds 90 % of the KV budget with three of four rows free: the picker's
    kv_cache_usage_perc says 0.9 (it said 0.25, rows alone, and sent it more long requests)."""
    from types import SimpleNamespace

    from backend.triton.placement_metrics import state_of

    def service(reserved: int, running: int, budget: int | None) -> SimpleNamespace:
        return SimpleNamespace(
            scheduler=SimpleNamespace(load=lambda: (running, 0),
                                      adapters_in_flight=lambda: ([], []),
                                      kv_reserved=lambda: reserved),
            cache=SimpleNamespace(report=lambda: {}), engine=SimpleNamespace(max_adapters=2),
            limits=SimpleNamespace(max_running=4, max_kv_tokens=budget))

    assert state_of(service(900, 1, 1000)).kv_usage == 0.9
    assert state_of(service(100, 3, 1000)).kv_usage == 0.75  # rows bind first
    assert state_of(service(900, 1, None)).kv_usage == 0.25  # no budget: rows
    m = _metrics([state_of(service(900, 1, 1000))])
    m.publish()
    assert parse(_text(m)).kv_usage == 0.9


def test_adapters_are_named_by_the_affinity_values_their_requests_carried() -> None:
    """Issue 25: a request placed through a host's OpenAI route names its ticket's affinity
    value, never the sealed digest; the host publishes the values its requests' tickets
    carried, so the picker's LoRA-affinity scorer finds the value a request used (1.0) on the
    host running it. A ticket without the value leaves the digest; the lists stay bounded by
    max_lora, and each adapter keeps at most two values."""
    from types import SimpleNamespace

    from backend.serving.affinity_names import AffinityNames
    from backend.triton.placement_metrics import state_of

    x, y, z = "0123456789abcdef", "fedcba9876543210", "00112233aabbccdd"
    names = AffinityNames()
    for digest, value in ((A, x), (A, y), (A, z), (B, None), (C, x)):
        names.record(digest, value)  # A reached through three aliases; C: x's canary arm
    in_flight = ([A, C], [B])
    service = SimpleNamespace(
        affinities=names,
        scheduler=SimpleNamespace(load=lambda: (2, 1), adapters_in_flight=lambda: in_flight,
                                  kv_reserved=lambda: 0),
        cache=SimpleNamespace(report=lambda: {
            d: SimpleNamespace(tier="device", revoked=False, active_requests=1)
            for d in (A, B, C)}),
        engine=SimpleNamespace(max_adapters=3), limits=SimpleNamespace(max_running=4))
    s = state_of(service)
    m = _metrics([s])
    m.publish()
    pod = parse(_text(m))
    # A's two most recent values (x is gone from A), C's x once; B's digest (no value)
    assert pod.active_models == {z, y, x, B}
    assert lora_affinity(pod, z) == lora_affinity(pod, x) == lora_affinity(pod, B) == 1.0
    assert A not in pod.active_models and C not in pod.active_models  # digests stay sealed
    assert len(s.running_adapters) <= 3 and len(s.waiting_adapters) <= 3
    assert pod.loaded == {"device": {z, y, x, B}}
    loaded = {dict(k)["adapter_name"]: dict(k)["digest"] for (n, k) in m.values
              if n == "vllm:lora_adapter_loaded"}
    assert loaded == {z: A, y: A, x: C, B: B}  # operators can still tell which adapter


def test_the_affinity_map_is_bounded() -> None:
    from backend.serving.affinity_names import AffinityNames

    names = AffinityNames(max_digests=2)
    for digest in (A, B, C):
        names.record(digest, "0123456789abcdef")
    assert names.names(A) == (A,)  # forgotten: the least recently recorded
    assert names.names(C) == ("0123456789abcdef",)
