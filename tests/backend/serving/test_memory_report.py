"""Memory categories that add up: an engine with resident adapters, a running batch on the gather
path (continuous batching through the real scheduler) and prefix cache entries, counted by
``backend.serving.memory_report`` and, independently, by every live tensor storage in the
process."""

from __future__ import annotations

import gc
import warnings
from pathlib import Path

import torch

from backend.serving.engine import DecodeBatch, Engine, GenerationRequest, GenerationResult
from backend.serving.memory_report import MEMORY_CATEGORIES, entry_footprint, resident_memory
from backend.serving.prefix_cache import PrefixCache, PrefixKey
from backend.serving.scheduler import Scheduler, SchedulerLimits
from backend.triton.metrics import BackendMetrics
from control.contracts.db import make_engine
from control.contracts.ledger import Ledger, Outcome
from control.tools.kit import KitManifest
from tests.artifacts import perturbed_copy

MiB = 2**20


class _Quiet:
    """A scheduler sink that keeps nothing but how the row ended."""

    def __init__(self) -> None:
        self.outcome: Outcome | None = None

    def cancelled(self) -> bool:
        return False

    def token(self, piece: str) -> None:
        pass

    def finish(self, result: GenerationResult, outcome: Outcome, reason: str | None) -> None:
        self.outcome = outcome


def _live_storages() -> dict[tuple[str, int], torch.UntypedStorage]:
    """Every storage a live tensor or module parameter uses, by (device, address)."""
    gc.collect()
    tensors: list[torch.Tensor] = []
    with warnings.catch_warnings():  # isinstance() on torch's deprecated aliases warns
        warnings.simplefilter("ignore", FutureWarning)
        for obj in gc.get_objects():
            if isinstance(obj, torch.Tensor):
                tensors.append(obj)
            elif isinstance(obj, torch.nn.Module):
                tensors += [*obj.parameters(recurse=False), *obj.buffers(recurse=False)]
    out: dict[tuple[str, int], torch.UntypedStorage] = {}
    for t in tensors:
        if t.device.type != "meta":
            storage = t.untyped_storage()
            out[(str(t.device), storage.data_ptr())] = storage
    return out


def test_memory_categories_add_up_to_every_live_tensor(kit_dir: Path,
                                                       tmp_path: Path) -> None:
    kit = KitManifest.load(kit_dir)
    adapters = {"sha256:" + f"{i:02x}" * 32: perturbed_copy(
        kit_dir / kit.adapters[("alpha", "beta", "gamma")[i % 3]].path, tmp_path / f"a{i}",
        1.0 + 0.02 * i) for i in range(8)}
    # Held, so that no storage freed after this point can lend its address to a new one.
    before = _live_storages()

    engine = Engine(kit_dir / "base", kit_dir / "tokenizer", device="cpu", max_rank=8,
                    max_adapters=12)
    for digest, path in adapters.items():
        engine.load_adapter(digest, path)
    # As the service makes it: the entries' storages kept as they come and go (the report reads
    # those), checked below against a walk over every entry's tensors.
    prefix: PrefixCache[DecodeBatch] = PrefixCache(64 * MiB, footprint=entry_footprint)
    scheduler = Scheduler(engine, SchedulerLimits(max_running=24, max_queued=24),
                          prefix, start=False)
    sinks = []
    names: list[str | None] = [*adapters, None]
    for i in range(24):  # eight adapters and the base in one batch: the gather path
        prompt = f"{i} " + "the quiet river runs by the old city under a bright moon " * 2
        seq = engine.open_sequence(GenerationRequest(prompt, names[i % len(names)],
                                                     max_tokens=100))
        sinks.append(_Quiet())
        scheduler.submit(seq, sinks[-1], key=PrefixKey("base", seq.request.adapter, "tok",
                                                       tuple(seq.prompt_ids), salt=b"t"))
    for _ in range(3):
        scheduler.run_once()
    running = scheduler.running_batch()
    # rows that met eos have left; the others, of more than four adapters, run the gather path
    assert running is not None and len(running) >= 12 and running.slots.path == "gather"
    assert len(prefix) == 24

    report = resident_memory(engine, scheduler, prefix)
    walked = PrefixCache[DecodeBatch](64 * MiB)  # no footprint: the report walks its entries
    for i, entry in enumerate(prefix.values()):
        walked.put(PrefixKey("base", None, "tok", (i,), salt=b"w"), entry, 1)
    assert resident_memory(engine, scheduler, walked) == report
    now = _live_storages()
    counted = sum(s.nbytes() for key, s in now.items() if key not in before)
    total = sum(report.values())
    print("\nmemory categories: " + ", ".join(f"{k} {v}" for k, v in report.items())
          + f"; sum {total}; independent count of live tensor storages {counted}; "
            f"ratio {total / counted:.4f}")
    assert set(report) == set(MEMORY_CATEGORIES)
    assert abs(total - counted) <= 0.05 * counted
    for kind in MEMORY_CATEGORIES[:-1]:  # each large enough that missing it would show
        assert report[kind] > 0.05 * counted, kind
    assert report["workspace"] > 0
    assert report["adapter_banks"] == engine.plan.bank_bytes

    # The gauges publish the same report, and the resident adapters' part of the banks.
    ledger = Ledger(make_engine(f"sqlite:///{tmp_path / 'ledger.db'}"))
    metrics = BackendMetrics(None, ledger.engine, "h",
                             engine=engine,
                             memory_report=lambda: resident_memory(engine, scheduler, prefix))
    metrics.refresh_memory()
    for kind in MEMORY_CATEGORIES:
        assert metrics.value("loraplane_backend_resident_bytes", kind=kind) == report[kind]
    assert metrics.value("loraplane_backend_resident_bytes", kind="adapter_weights") == \
        len(adapters) * engine.plan.slot_bytes
    scheduler.stop()
    assert all(s.outcome is not None for s in sinks) and engine.pins() == {}
