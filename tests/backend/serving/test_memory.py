"""The memory model at real size, on the CPU: an 8B-shaped plan by shape arithmetic and the meta
device (nothing of 8B size is allocated), the cache accounting adapters by the slots they occupy,
and configurations that cannot hold one adapter refused at start (engine, serve, triton-host).
The categories that add up are ``tests/backend/serving/test_memory_report.py``'s."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from typer.testing import CliRunner

from backend.serving.cache import AdapterCache, CacheBudgets, CacheQuota, CacheRefused
from backend.serving.engine import AdapterSource, Engine, HostAdapter, PreparedAdapter
from backend.serving.memory import (
    DEFAULT_ADAPTER_FRACTION,
    TARGET_MODULES,
    AdapterBudget,
    AdapterMemoryError,
    BaseShapes,
    MemoryPlan,
    plan_memory,
    slot_bytes,
)
from backend.serving.slots import SlotTable
from control.tools.kit import KitManifest

MiB, GiB = 2**20, 2**30
BF16 = 2
# Llama 3 8B's shapes; the vocabulary only moves the base weights.
EIGHT_B = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                      tie_word_embeddings=False)
EIGHT_B_PARAMS = 8_030_261_248  # Meta's published count for Llama 3 8B
GPU_80GB = 80 * 10**9


def _plan(adapter_bytes: int | None = None, *, device_bytes: int = GPU_80GB, max_rank: int = 64,
          max_slots: int = 64) -> MemoryPlan:
    return plan_memory(BaseShapes.from_config(EIGHT_B), max_rank=max_rank, element_size=BF16,
                       budget=AdapterBudget(adapter_bytes, max_slots), device_bytes=device_bytes)


# -- the plan ---------------------------------------------------------------------------------

def test_one_rank_64_slot_of_an_8b_base_is_320_mib_by_shapes_and_by_the_meta_model() -> None:
    shapes = BaseShapes.from_config(EIGHT_B)
    with torch.device("meta"):  # shapes only: no 8B weights are allocated
        model = LlamaForCausalLM(EIGHT_B)
    targets = [m for name, m in model.named_modules()
               if isinstance(m, torch.nn.Linear) and name.rsplit(".", 1)[-1] in TARGET_MODULES]
    by_modules = sum((m.in_features + m.out_features) * 64 * BF16 for m in targets)
    one = slot_bytes(shapes, 64, BF16)
    print(f"\n8B slot, rank 64, bf16, {len(targets)} target modules: {one} bytes "
          f"({one / MiB:.1f} MiB); base weights {shapes.weight_count() * BF16 / GiB:.2f} GiB")
    assert one == by_modules == 320 * MiB
    assert len(targets) == 7 * 32
    assert shapes.weight_count() == sum(p.numel() for p in model.parameters()) == EIGHT_B_PARAMS
    assert slot_bytes(shapes, 16, BF16) == 80 * MiB  # the slot scales with the rank
    assert shapes.kv_bytes_per_token(BF16) == 128 * 2**10


@pytest.mark.parametrize(("adapter_bytes", "device_bytes", "max_slots", "slots"), [
    (640 * MiB, GPU_80GB, 64, 1),  # one adapter slot and the all-zero base slot
    (1 * GiB, GPU_80GB, 64, 2),
    (20 * GiB, GPU_80GB, 64, 63),
    (20 * GiB, GPU_80GB, 16, 16),  # the slot cap binds
    (None, GPU_80GB, 64, 64),  # default: 40 % of what is left holds 75; the cap binds
    (None, GPU_80GB, 1000, 75),
    (None, 40 * 10**9, 64, 27),
    (None, 24 * 10**9, 64, 8),
])
def test_slots_a_budget_holds(adapter_bytes: int | None, device_bytes: int, max_slots: int,
                              slots: int) -> None:
    plan = _plan(adapter_bytes, device_bytes=device_bytes, max_slots=max_slots)
    print(f"\nbudget {adapter_bytes}, device {device_bytes / 1e9:.0f} GB, cap {max_slots}: "
          f"{plan.slots} slots, banks {plan.bank_bytes / GiB:.2f} GiB ({plan.budget_source})")
    assert plan.slots == slots
    assert plan.bank_bytes == (slots + 1) * 320 * MiB <= plan.budget_bytes
    if adapter_bytes is None:
        left = device_bytes - EIGHT_B_PARAMS * BF16
        assert plan.budget_bytes == int(DEFAULT_ADAPTER_FRACTION * left)


def test_a_budget_below_one_adapter_is_refused_naming_it() -> None:
    with pytest.raises(AdapterMemoryError) as e:
        _plan(512 * MiB)
    message = str(e.value)
    print(f"\nrefusal: {message}")
    assert "LORAPLANE_ADAPTER_BYTES=536870912 gives adapter slot banks 512.0 MiB" in message
    assert "one adapter of rank 64 needs 640.0 MiB" in message
    assert "its slot (320.0 MiB" in message and "LORAPLANE_MAX_RANK" in message
    # the same budget holds one adapter of a smaller maximum rank
    assert _plan(512 * MiB, max_rank=32).slots == 2
    # a 16 GB device has nothing left after 16 GB of bf16 weights: the default holds nothing
    with pytest.raises(AdapterMemoryError, match="LORAPLANE_ADAPTER_BYTES unset"):
        _plan(device_bytes=16 * 10**9)


def test_banks_larger_than_the_device_are_refused() -> None:
    with pytest.raises(AdapterMemoryError) as e:
        _plan(200 * GiB, max_slots=500)
    assert ("500 slots of 320.0 MiB need 156.6 GiB of slot banks, but the 74.5 GiB device has "
            "59.5 GiB left after 15.0 GiB of base weights") in str(e.value)


def test_the_engine_refuses_before_reading_any_weights(tmp_path: Path) -> None:
    base = tmp_path / "base-8b"
    base.mkdir()
    (base / "config.json").write_text(EIGHT_B.to_json_string())  # no weights, no tokenizer
    with pytest.raises(AdapterMemoryError, match="LORAPLANE_ADAPTER_BYTES=536870912") as e:
        Engine(base, tmp_path / "no-tokenizer", device="cpu", dtype=torch.bfloat16,
               budget=AdapterBudget(adapter_bytes=512 * MiB))
    assert "needs 640.0 MiB" in str(e.value)


# -- the cache over a placement that follows the plan -----------------------------------------

class PlannedPlacement:
    """What the cache needs of the engine, for an 8B-shaped base without its weights: adapters
    are read into meta tensors of their real shapes and occupy the slots the plan holds."""

    def __init__(self, plan: MemoryPlan) -> None:
        self.plan = plan
        self.table = SlotTable(plan.slots)

    @property
    def max_adapters(self) -> int:
        return self.plan.slots

    def read_adapter(self, source: AdapterSource) -> HostAdapter:
        assert isinstance(source, Mapping)
        raw = json.loads(source["adapter_config.json"])
        rank, dims = int(raw["r"]), self.plan.shapes.target_dims()
        pairs = {}
        for layer in range(self.plan.shapes.layers):
            for module in raw["target_modules"]:
                fan_in, fan_out = dims[module]
                pairs[f"model.layers.{layer}.{module}"] = (
                    torch.empty((rank, fan_in), dtype=torch.bfloat16, device="meta"),
                    torch.empty((fan_out, rank), dtype=torch.bfloat16, device="meta"))
        return HostAdapter(rank=rank, scaling=1.0, pairs=pairs)

    def prepare(self, adapter: HostAdapter) -> PreparedAdapter:
        return PreparedAdapter(rank=adapter.rank, pairs=adapter.pairs)

    def place(self, digest: str, adapter: PreparedAdapter) -> int:
        self.table.allocate(digest)
        return self.slot_bytes_for(adapter)

    def unload_adapter(self, digest: str) -> None:
        self.table.release(digest)

    def slot_bytes_for(self, adapter: PreparedAdapter) -> int:
        return self.plan.slot_bytes


def _adapter(rank: int = 64) -> dict[str, bytes]:
    return {"adapter_config.json": json.dumps(
        {"peft_type": "LORA", "r": rank, "target_modules": list(TARGET_MODULES)}).encode()}


def _planned_cache(plan: MemoryPlan, budgets: CacheBudgets | None = None) -> AdapterCache:
    return AdapterCache(PlannedPlacement(plan), lambda _digest: _adapter(),
                        budgets=budgets or CacheBudgets(host_bytes=8 * GiB),
                        quota=CacheQuota(room_wait_s=0.0))  # the default resident share


def test_a_rank_64_adapter_of_an_8b_base_loads_at_the_default_tenant_share() -> None:
    plan = _plan(1 * GiB)  # two adapter slots
    cache = _planned_cache(plan)
    assert cache.quota.resident_share == 0.5  # half of 640 MiB is less than one slot
    a, b, c = ("sha256:" + ch * 64 for ch in "abc")
    cache.release(cache.acquire(a, "acme"))
    assert cache.usage()["device"] == 320 * MiB
    cache.release(cache.acquire(b, "acme"))  # acme's share is one slot: its older one goes
    cache.release(cache.acquire(c, "globex"))
    report = cache.report()
    assert report[a].evictions == {"tenant_share": 1}
    assert {d for d, r in report.items() if r.tier == "device"} == {b, c}
    assert cache.usage()["device"] == 2 * 320 * MiB == plan.adapter_capacity_bytes


def test_an_adapter_the_device_budget_cannot_hold_is_refused_naming_the_budget() -> None:
    plan = _plan(1 * GiB)
    small = _planned_cache(plan, CacheBudgets(device_bytes=256 * MiB, host_bytes=8 * GiB))
    with pytest.raises(CacheRefused) as e:
        small.acquire("sha256:" + "d" * 64, "acme")
    assert e.value.reason == "device_budget"
    assert "LORAPLANE_ADAPTER_BYTES" in str(e.value) and str(320 * MiB) in str(e.value)
    assert small.usage()["device"] == 0

    full = _planned_cache(plan)
    held = [full.acquire("sha256:" + ch * 64, tenant) for ch, tenant in (("e", "acme"),
                                                                         ("f", "globex"))]
    with pytest.raises(CacheRefused) as e:  # both slots held by running requests
        full.acquire("sha256:" + "0" * 64, "initech")
    assert e.value.reason == "no_room" and "LORAPLANE_ADAPTER_BYTES" in str(e.value)
    for lease in held:
        full.release(lease)


# -- refused at start, before Triton is launched ----------------------------------------------

LAUNCHED: list[object] = []


@pytest.fixture()
def home(tmp_path: Path, kit_dir: Path) -> Path:
    """A home with the kit's base registered (one rank-64 fp32 slot of it is 512 KiB)."""
    from control.cli.main import app

    kit = KitManifest.load(kit_dir)
    h = tmp_path / "home"
    res = CliRunner().invoke(app, ["--home", str(h), "base", "register",
                                   str(kit_dir / kit.base_path), "--name", "tiny"],
                             env={"LORAPLANE_DB_URL": ""})
    assert res.exit_code == 0, res.output
    return h


@pytest.fixture()
def root_logging() -> Iterator[None]:
    """``triton-host`` configures the root logger onto the runner's stderr, which is closed
    once the command returns: put pytest's handlers back."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for h in list(root.handlers):
        root.removeHandler(h)
    for h in handlers:
        root.addHandler(h)
    root.setLevel(level)


@pytest.mark.parametrize("verb", [["serve"], ["triton-host", "--wait", "0"]])
@pytest.mark.usefixtures("root_logging")
def test_serve_and_triton_host_refuse_a_budget_below_one_adapter(
        verb: list[str], home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import control.cli.main
    import control.ops.serve

    class Recorded(control.ops.serve.TritonProcess):
        def start(self) -> None:
            LAUNCHED.append(self)

    LAUNCHED.clear()
    monkeypatch.setattr(control.ops.serve, "TritonProcess", Recorded)
    env = {"LORAPLANE_HOME": str(home), "LORAPLANE_DB_URL": "",
           "LORAPLANE_ADAPTER_BYTES": "600KiB"}
    result = CliRunner().invoke(control.cli.main.app, verb, env=env)
    print(f"\n{' '.join(verb)}: exit {result.exit_code}: {result.output.strip()}")
    assert result.exit_code == 2, result.output
    output = " ".join(result.output.split())  # rich wraps long lines
    assert "AdapterMemoryError" in output
    assert "LORAPLANE_ADAPTER_BYTES=614400 gives adapter slot banks 600.0 KiB" in output
    assert "one adapter of rank 64 needs 1.0 MiB" in output
    assert LAUNCHED == []  # Triton never started


def test_serve_hands_the_checked_memory_settings_to_triton(
        home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import control.ops.serve
    from control.contracts.config import Settings

    class Recorded(control.ops.serve.TritonProcess):
        def start(self) -> None:
            LAUNCHED.append(self)

        def wait_ready(self, timeout_s: float = 180.0) -> None:
            pass

    LAUNCHED.clear()
    monkeypatch.setattr(control.ops.serve, "TritonProcess", Recorded)
    settings = Settings(home=home, db_url=f"sqlite:///{home / 'loraplane.db'}",
                        adapter_bytes=2 * MiB, adapter_slots=3, max_rank=32,
                        resident_share=0.25)
    dep = control.ops.serve.Deployment(settings, control.ops.serve.Ports(0, 0, 0, 0), role="triton")
    try:
        dep.start()
    finally:
        dep.stop()
    [triton] = LAUNCHED
    assert isinstance(triton, Recorded)
    assert {k: triton.env[k] for k in settings.memory_env()} == {
        "LORAPLANE_MAX_RANK": "32", "LORAPLANE_ADAPTER_BYTES": str(2 * MiB),
        "LORAPLANE_ADAPTER_SLOTS": "3", "LORAPLANE_TENANT_RESIDENT_SHARE": "0.25",
        "LORAPLANE_WARMUP_ADAPTERS": "0"}
