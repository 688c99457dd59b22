"""The reference kit: layout, digests, determinism, tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import PreTrainedTokenizerFast

from control.contracts.digests import directory_digest
from control.ops.kit import ADAPTERS, KitManifest, build_kit


@pytest.fixture(scope="module")
def manifest(kit_dir: Path) -> KitManifest:
    return KitManifest.load(kit_dir)


def test_layout(kit_dir: Path, manifest: KitManifest) -> None:
    assert sorted(p.name for p in (kit_dir / "base").iterdir()) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
    ]
    assert sorted(p.name for p in (kit_dir / "base-b").iterdir()) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
    ]
    assert (kit_dir / "tokenizer" / "tokenizer.json").is_file()
    assert set(manifest.adapters) == set(ADAPTERS)
    assert len([a for a in manifest.adapters.values() if a.base == "base"]) >= 3
    for adapter in manifest.adapters.values():
        files = sorted(p.name for p in (kit_dir / adapter.path).iterdir())
        assert files == ["adapter_config.json", "adapter_model.safetensors"]


def test_manifest_digests_match_the_files(kit_dir: Path, manifest: KitManifest) -> None:
    assert manifest.base_digest == directory_digest(kit_dir / manifest.base_path)
    assert manifest.base_b_digest == directory_digest(kit_dir / manifest.base_b_path)
    assert manifest.tokenizer_digest == directory_digest(kit_dir / manifest.tokenizer_path)
    assert manifest.base_digest != manifest.base_b_digest
    digests = {a.digest for a in manifest.adapters.values()}
    assert len(digests) == len(manifest.adapters)
    for adapter in manifest.adapters.values():
        assert adapter.digest == directory_digest(kit_dir / adapter.path)


def test_adapter_config_names_its_base_by_digest(kit_dir: Path, manifest: KitManifest) -> None:
    by_base = {"base": manifest.base_digest, "base-b": manifest.base_b_digest}
    for adapter in manifest.adapters.values():
        config = json.loads((kit_dir / adapter.path / "adapter_config.json").read_text())
        assert config["base_model_name_or_path"] == by_base[adapter.base] == adapter.base_digest
        assert config["peft_type"] == "LORA"
        assert config["r"] == 8
        assert config["lora_alpha"] == 16


def test_manifest_round_trips(manifest: KitManifest) -> None:
    assert KitManifest.from_json(manifest.to_json()) == manifest


def test_tokenizer_is_byte_level_with_bos(kit_dir: Path) -> None:
    tok = PreTrainedTokenizerFast.from_pretrained(kit_dir / "tokenizer")
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("<s>", "</s>", "<pad>")
    assert len(tok) == 259
    for text in ["", "hello", "  two  spaces\n\ttab", "héllo wörld € 🤖", "<s> not </s> special"]:
        ids = tok(text, split_special_tokens=True)["input_ids"]
        assert ids[0] == tok.bos_token_id
        assert tok.decode(ids, skip_special_tokens=True) == text
        assert len(ids) == 1 + len(text.encode())


def test_same_seed_rebuilds_identically(
    kit_dir: Path, manifest: KitManifest, tmp_path: Path
) -> None:
    threads = torch.get_num_threads()
    steps: list[str] = []
    rebuilt = build_kit(tmp_path / "again", seed=manifest.seed, progress=steps.append)
    assert rebuilt == manifest
    assert (tmp_path / "again" / "kit.json").read_text() == (kit_dir / "kit.json").read_text()
    assert steps and steps[-1] == "kit.json written"
    # the build must not leak its single-thread, deterministic settings
    assert torch.get_num_threads() == threads
    assert not torch.are_deterministic_algorithms_enabled()
