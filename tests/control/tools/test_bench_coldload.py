"""``bench scale``'s cold loads of 7B-shaped adapters: the generated folder is a valid PEFT
adapter the engine's own checks accept, a broken one is refused, and the figures come out."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from backend.serving.engine_types import AdapterLoadError
from control.contracts.adapter_format import CONFIG_FILE, WEIGHTS_FILE, LoraConfig
from control.contracts.digests import directory_digest
from control.contracts.store import ArtifactStore
from control.tools import bench_coldload
from control.tools.bench_coldload import measure, residency_7b, write_adapter


def test_the_7b_shaped_adapter_is_32_mib_of_peft_lora(tmp_path: Path) -> None:
    out = write_adapter(tmp_path / "a", seed=3)
    config = LoraConfig.from_json((out / CONFIG_FILE).read_bytes())  # the format's own rules
    assert config.rank == 16
    tensors = load_file(str(out / WEIGHTS_FILE))
    assert len(tensors) == 32 * 4 * 2
    a = tensors["base_model.model.model.layers.31.self_attn.o_proj.lora_A.weight"]
    b = tensors["base_model.model.model.layers.31.self_attn.o_proj.lora_B.weight"]
    assert a.shape == (16, 4096) and b.shape == (4096, 16) and a.dtype == torch.float16
    assert b.abs().sum() > 0  # not PEFT's zero init: a load has real weights to check
    size = (out / WEIGHTS_FILE).stat().st_size
    assert 32 * 2**20 <= size < 33 * 2**20
    # seeded: the same seed writes the same bytes, another seed others
    assert directory_digest(out) == directory_digest(write_adapter(tmp_path / "b", seed=3))
    assert directory_digest(out) != directory_digest(write_adapter(tmp_path / "c", seed=4))


def test_it_loads_through_the_store_and_the_engine_s_checks(tmp_path: Path) -> None:
    out = write_adapter(tmp_path / "a", seed=1, hidden=256, layers=2)
    store = ArtifactStore(tmp_path / "store")
    digest = directory_digest(out)
    store.put(out, digest)
    residency = residency_7b(hidden=256, layers=2)
    prepared = residency.prepare(residency.read_adapter(store.read_verified(digest)))
    assert len(prepared.pairs) == 2 * 4
    a, b = prepared.pairs["model.layers.1.self_attn.v_proj"]
    assert a.shape == (16, 256) and b.shape == (256, 16) and a.dtype == residency.dtype
    # the checks are the engine's: a NaN weight is refused, naming its module
    tensors = load_file(str(out / WEIGHTS_FILE))
    tensors["base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"][3, 2] = \
        float("nan")
    save_file(tensors, str(out / WEIGHTS_FILE))
    with pytest.raises(AdapterLoadError, match=r"v_proj'.*not all finite"):
        residency.read_adapter(out)
    # and against the 7B shape: a 256-wide adapter does not fit a 4,096-wide base
    with pytest.raises(AdapterLoadError, match=r"expected lora_A \[16, 4096\]"):
        residency_7b().read_adapter(store.read_verified(digest))


def test_measure_reports_the_ratio_and_the_seconds() -> None:
    r = measure(2, 2, hidden=256, layers=2)
    assert r["loads"] == 4 and r["adapters"] == 2
    assert r["cold_load_vs_read_7b"] == pytest.approx(r["cold_load_p95_s"] / r["read_hash_p95_s"])
    assert r["met_ratio"] == (r["cold_load_vs_read_7b"] <= bench_coldload.GOAL_RATIO)
    assert r["met_seconds"] == (r["cold_load_p95_s"] < bench_coldload.GOAL_P95_S)
    assert set(r["stage_median_s"]) == {"fetch_verify", "parse_check", "prepare"}
    assert all(v > 0 for v in r["stage_median_s"].values())
    assert "not placing in a slot" in r["covers"]
    json.dumps(r)  # what --json prints
