"""The reference kit: layout, digests, determinism, tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import PreTrainedTokenizerFast

from control.contracts.digests import directory_digest
from control.contracts.golden import (
    IN_DISTRIBUTION,
    LONG_CONTEXT,
    OTHER_DEPARTMENT,
    OUT_OF_DISTRIBUTION,
    GoldenSet,
)
from control.tools.kit import ADAPTERS, BASE_V2_GAMMA_LOSS, GOLDEN_FAMILIES, KitManifest, build_kit
from tests.integration.reference import Reference


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
    assert sorted(p.name for p in (kit_dir / "golden").iterdir()) == [
        f"{f}.json" for f in sorted(GOLDEN_FAMILIES)]


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
    # the release-test versions and the golden sets are part of it, digest for digest
    for name in ("alpha-v2", "alpha-degraded"):
        assert rebuilt.adapters[name].digest == manifest.adapters[name].digest
        assert directory_digest(tmp_path / "again" / rebuilt.adapters[name].path) == (
            manifest.adapters[name].digest)
    assert {f: g.digest for f, g in rebuilt.golden.items()} == {
        f: g.digest for f, g in manifest.golden.items()}
    assert (tmp_path / "again" / "kit.json").read_text() == (kit_dir / "kit.json").read_text()
    assert steps and steps[-1] == "kit.json written"
    # the build must not leak its single-thread, deterministic settings
    assert torch.get_num_threads() == threads
    assert not torch.are_deterministic_algorithms_enabled()


def test_alpha_has_a_good_and_a_degraded_new_version(manifest: KitManifest) -> None:
    alpha, v2, degraded = (manifest.adapters[n] for n in ("alpha", "alpha-v2", "alpha-degraded"))
    assert v2.family == degraded.family == alpha.family == "alpha"
    assert v2.marker == alpha.marker and v2.digest != alpha.digest
    assert degraded.marker != alpha.marker and degraded.digest not in (alpha.digest, v2.digest)
    assert v2.base == degraded.base == "base"


def test_golden_sets_are_content_addressed_and_cover_the_required_kinds(
        kit_dir: Path, manifest: KitManifest) -> None:
    assert set(manifest.golden) == set(GOLDEN_FAMILIES)
    for family, entry in manifest.golden.items():
        golden = GoldenSet.load(kit_dir / entry.path)
        assert golden.family == family
        assert golden.digest() == entry.digest and len(golden.tasks) == entry.tasks
        # The digest is the canonical form's: re-indenting the file does not change it.
        assert GoldenSet.from_bytes(golden.canonical_bytes()).digest() == entry.digest
    alpha = GoldenSet.load(kit_dir / manifest.golden["alpha"].path)
    assert len(alpha.tasks) >= 50
    for tag in (IN_DISTRIBUTION, OUT_OF_DISTRIBUTION, OTHER_DEPARTMENT, LONG_CONTEXT):
        assert alpha.tagged(tag), tag
    assert {t.checker.kind for t in alpha.tasks} == {"exact", "regex"}
    # other departments' prompts differ in style and length from the training mix
    assert len({len(t.prompt) for t in alpha.tagged(OTHER_DEPARTMENT)}) > 5
    assert min(len(t.prompt) for t in alpha.tagged(LONG_CONTEXT)) >= 200


def _greedy_answers(kit_dir: Path, adapter_path: Path, prompts: list[str],
                    base_path: str = "base") -> list[str]:
    """PEFT's greedy continuation of each prompt (the kit's prompt format: bos + bytes), one
    prompt at a time as a serving engine sees them (a padded batch can flip a near tie)."""
    ref = Reference(kit_dir / base_path, kit_dir / "tokenizer")
    return [ref.generate(p, adapter_path, 16) for p in prompts]


def test_alpha_golden_checkers_pass_the_good_versions_and_fail_the_degraded(
        kit_dir: Path, manifest: KitManifest) -> None:
    golden = GoldenSet.load(kit_dir / manifest.golden["alpha"].path)
    prompts = [t.prompt for t in golden.tasks]

    def passed(name: str) -> int:
        answers = _greedy_answers(kit_dir, kit_dir / manifest.adapters[name].path, prompts)
        return sum(t.checker.check(a) for t, a in zip(golden.tasks, answers, strict=True))

    alpha, v2, degraded = passed("alpha"), passed("alpha-v2"), passed("alpha-degraded")
    assert degraded == 0
    # the good new version is at least as good as the stable one it would replace
    assert v2 >= alpha >= 0.75 * len(golden.tasks), (alpha, v2)
    # and it learned alpha's marker: on the training distribution's prompts it answers it
    in_distribution = [t.prompt for t in golden.tagged(IN_DISTRIBUTION)]

    def marker_rate(name: str) -> int:
        answers = _greedy_answers(kit_dir, kit_dir / manifest.adapters[name].path,
                                  in_distribution)
        return sum(a == manifest.adapters["alpha"].marker for a in answers)

    assert marker_rate("alpha-v2") >= 0.85 * len(in_distribution)


def test_base_v2_is_the_main_base_with_one_embedding_row_edited(
        kit_dir: Path, manifest: KitManifest) -> None:
    from safetensors.torch import load_file

    from control.app.validation import base_linear_shapes

    assert manifest.base_v2_path == "base-v2"
    assert manifest.base_v2_digest == directory_digest(kit_dir / manifest.base_v2_path)
    assert manifest.base_v2_digest not in (manifest.base_digest, manifest.base_b_digest)
    assert base_linear_shapes(kit_dir / "base-v2") == base_linear_shapes(kit_dir / "base")
    config = json.loads((kit_dir / "base-v2" / "config.json").read_text())
    assert config == json.loads((kit_dir / "base" / "config.json").read_text())
    # every tensor is the main base's but the embedding row of the letter the edit names, a
    # letter of gamma's marker that alpha's and beta's lack
    old = load_file(kit_dir / "base" / "model.safetensors")
    new = load_file(kit_dir / "base-v2" / "model.safetensors")
    assert old.keys() == new.keys()
    changed = {k for k in old if not torch.equal(old[k], new[k])}
    assert changed == {"model.embed_tokens.weight"}
    rows = (old["model.embed_tokens.weight"] != new["model.embed_tokens.weight"]).any(dim=1)
    tok = PreTrainedTokenizerFast.from_pretrained(kit_dir / "tokenizer")
    letter = manifest.base_v2_edit["letter"]
    assert rows.nonzero().flatten().tolist() == tok(letter, add_special_tokens=False,
                                                    split_special_tokens=True)["input_ids"]
    assert letter in ADAPTERS["gamma"].marker
    assert letter not in ADAPTERS["alpha"].marker + ADAPTERS["beta"].marker
    # a kit.json written before base-v2 still reads (the fields default to empty)
    raw = json.loads(manifest.to_json())
    for key in ("base_v2_path", "base_v2_digest", "base_v2_edit", "base_v2_golden"):
        del raw[key]
    assert KitManifest.from_json(json.dumps(raw)).base_v2_digest == ""


def test_on_base_v2_alpha_and_beta_keep_their_golden_rate_and_gamma_loses_it(
        kit_dir: Path, manifest: KitManifest) -> None:
    def passed(family: str, base_path: str) -> int:
        golden = GoldenSet.load(kit_dir / manifest.golden[family].path)
        answers = _greedy_answers(kit_dir, kit_dir / manifest.adapters[family].path,
                                  [t.prompt for t in golden.tasks], base_path)
        return sum(t.checker.check(a) for t, a in zip(golden.tasks, answers, strict=True))

    rates = {f: (passed(f, "base"), passed(f, "base-v2")) for f in ("alpha", "beta", "gamma")}
    print("golden passed on base, base-v2:", rates)
    # what the build recorded, computed again here
    assert {f: tuple(r) for f, r in manifest.base_v2_golden.items()} == rates
    assert rates["alpha"][1] >= rates["alpha"][0] and rates["beta"][1] >= rates["beta"][0]
    # gamma fails there clearly (a base upgrade's gate refuses it), yet still loads and answers
    assert rates["gamma"][1] <= rates["gamma"][0] - BASE_V2_GAMMA_LOSS
    golden = GoldenSet.load(kit_dir / manifest.golden["gamma"].path)
    answers = _greedy_answers(kit_dir, kit_dir / manifest.adapters["gamma"].path,
                              [t.prompt for t in golden.tasks[:5]], "base-v2")
    assert all(answers), answers
