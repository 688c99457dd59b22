"""The adapter format: one set of rules, applied by registration and by the engine alike."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from backend.serving.engine import AdapterLoadError, Engine
from control.app.validation import BaseInfo, base_linear_shapes, validate_adapter
from control.contracts.adapter_format import (
    CONFIG_FILE,
    MAX_CONFIG_BYTES,
    UNSUPPORTED_FEATURES,
    AdapterFormatError,
    LoraConfig,
    LoraTensor,
    lora_pairs,
)
from control.domain import ValidationFailed
from control.tools.kit import KitManifest
from tests.fixtures_control import Artifacts

PEFT_CONFIG: dict[str, object] = {  # what PEFT's save_pretrained writes, trimmed
    "peft_type": "LORA", "r": 8, "lora_alpha": 16, "lora_dropout": 0.0, "bias": "none",
    "target_modules": ["v_proj", "q_proj", "q_proj"], "base_model_name_or_path": "tiny",
    "task_type": "CAUSAL_LM", "use_rslora": False, "use_dora": False, "fan_in_fan_out": False,
    "modules_to_save": None, "rank_pattern": {}, "alpha_pattern": {},
    "layers_to_transform": None, "layers_pattern": None, "layer_replication": None,
}
# A value that switches each unsupported feature on, as a real config would set it.
FEATURE_ON: dict[str, object] = {
    "use_dora": True, "fan_in_fan_out": True, "bias": "lora_only", "lora_bias": True,
    "modules_to_save": ["lm_head"], "rank_pattern": {"q_proj": 4},
    "alpha_pattern": {"q_proj": 8}, "layer_replication": [[0, 2]],
    "layers_to_transform": [0, 1], "layers_pattern": "layers",
    "trainable_token_indices": [5], "alora_invocation_tokens": [1, 2], "use_qalora": True,
    "use_bdlora": True, "target_parameters": ["mlp.experts.gate_up_proj"],
}
Q_A = "base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight"
Q_B = "base_model.model.model.layers.3.self_attn.q_proj.lora_B.weight"


def _config(**changes: object) -> dict[str, object]:
    return {**PEFT_CONFIG, **changes}


def _refusal(config: dict[str, object]) -> str:
    with pytest.raises(AdapterFormatError) as info:
        LoraConfig.from_dict(config)
    return str(info.value)


# -- the parsed form ----------------------------------------------------------------------------


def test_a_peft_config_parses_to_rank_alpha_targets_and_scaling() -> None:
    config = LoraConfig.from_dict(PEFT_CONFIG)
    assert config == LoraConfig(rank=8, alpha=16, target_modules=("q_proj", "v_proj"))
    assert config.scaling == 2.0
    assert LoraConfig.from_json(json.dumps(PEFT_CONFIG).encode()) == config


def test_rslora_scales_by_the_square_root_of_the_rank() -> None:
    assert LoraConfig.from_dict(_config(r=16, use_rslora=True)).scaling == 4.0
    assert LoraConfig.from_dict({**_config(), "use_rslora": None}).use_rslora is False


def test_a_single_target_module_name_is_a_list_of_one() -> None:
    assert LoraConfig.from_dict(_config(target_modules="q_proj")).target_modules == ("q_proj",)


def test_the_config_is_frozen_and_validated_on_construction() -> None:
    config = LoraConfig(rank=4, alpha=8.0, target_modules=("q_proj",))
    with pytest.raises(AttributeError):
        config.rank = 8  # type: ignore[misc]
    with pytest.raises(AdapterFormatError, match="r must be an integer greater than 0"):
        LoraConfig(rank=0, alpha=8.0, target_modules=("q_proj",))


# -- refusals say what was expected and what was found ------------------------------------------


@pytest.mark.parametrize(("change", "expected", "found"), [
    ({"peft_type": "IA3"}, "peft_type must be LORA", '"IA3"'),
    ({"peft_type": None}, "peft_type must be LORA", "null"),
    ({"r": 0}, "r must be an integer greater than 0", "0"),
    ({"r": True}, "r must be an integer greater than 0", "true"),
    ({"r": "8"}, "r must be an integer greater than 0", '"8"'),
    ({"r": 2.0}, "r must be an integer greater than 0", "2.0"),
    ({"lora_alpha": 0}, "lora_alpha must be a finite positive number", "0"),
    ({"lora_alpha": float("inf")}, "lora_alpha must be a finite positive number", "Infinity"),
    ({"lora_alpha": "16"}, "lora_alpha must be a finite positive number", '"16"'),
    ({"lora_alpha": 10**400}, "lora_alpha must be a finite positive number",
     "a number too long to show"),  # no float holds it: refused, not an OverflowError
    ({"target_modules": []}, "target_modules must be a non-empty list", "an empty list"),
    ({"target_modules": ["q_proj", ""]}, "target_modules must be a non-empty list",
     "a list of 2"),
    ({"target_modules": [1]}, "target_modules must be a non-empty list", "a list of 1"),
    ({"target_modules": None}, "target_modules must be a non-empty list", "null"),
    ({"use_rslora": "false"}, "use_rslora must be true or false", '"false"'),
])
def test_each_field_is_refused_naming_what_was_expected_and_found(
        change: dict[str, object], expected: str, found: str) -> None:
    message = _refusal(_config(**change))
    assert message.startswith(expected)
    assert message.endswith(f"found {found}")


def test_a_missing_field_is_refused() -> None:
    for field in ("peft_type", "r", "lora_alpha", "target_modules"):
        config = _config()
        del config[field]
        assert _refusal(config)


def test_every_unsupported_feature_has_a_refused_example() -> None:
    assert set(FEATURE_ON) == set(UNSUPPORTED_FEATURES)


@pytest.mark.parametrize("feature", sorted(UNSUPPORTED_FEATURES))
def test_each_unsupported_feature_is_refused_by_name_with_the_values_accepted(
        feature: str) -> None:
    message = _refusal(_config(**{feature: FEATURE_ON[feature]}))
    assert message.startswith(f"{feature} is not supported: expected ")
    for accepted in UNSUPPORTED_FEATURES[feature]:
        assert json.dumps(accepted) in message
    assert "found " in message


@pytest.mark.parametrize("feature", sorted(UNSUPPORTED_FEATURES))
def test_each_unsupported_feature_may_be_absent_or_off(feature: str) -> None:
    absent = _config()
    absent.pop(feature, None)
    assert LoraConfig.from_dict(absent).rank == 8
    for off in UNSUPPORTED_FEATURES[feature]:
        assert LoraConfig.from_dict(_config(**{feature: off})).rank == 8


def test_per_layer_adaptation_is_refused() -> None:
    assert _refusal(_config(layers_to_transform=[0, 1])) == (
        "layers_to_transform is not supported: expected null or [], found a list of 2")
    assert _refusal(_config(layers_to_transform=3)).endswith("found 3")
    assert _refusal(_config(layers_pattern="layers")) == (
        'layers_pattern is not supported: expected null or [] or "", found "layers"')


def test_off_values_must_match_in_type() -> None:
    assert "use_dora" in _refusal(_config(use_dora=0))  # 0 == False in Python, not in JSON
    assert "fan_in_fan_out" in _refusal(_config(bias=None, fan_in_fan_out=0.0))


def test_a_found_value_never_echoes_a_path_or_free_text() -> None:
    for value in ("/srv/loraplane/store/sha256/ab/adapter", "globex's secret alias",
                  "x" * 40):
        message = _refusal(_config(peft_type=value))
        assert value not in message and message.endswith("found another string")
    assert _refusal(_config(modules_to_save=["/home/acme/lm_head"])).endswith("found a list of 1")
    assert _refusal(_config(rank_pattern={"/etc": 1})).endswith("found an object of 1 keys")


# -- the bytes of adapter_config.json ----------------------------------------------------------


@pytest.mark.parametrize(("raw", "expected"), [
    (b"{nope", "is not valid JSON"),
    (b'{"r": 8, "r": 8}', "is not valid JSON"),  # duplicate keys: parsers could disagree
    (b'{"lora_alpha": NaN}', "is not valid JSON"),
    (b"\xff\xfe", "is not valid JSON"),
    (b"[" * 100_000 + b"]" * 100_000, "is not valid JSON"),
    (b"[1, 2]", "must hold a JSON object, found a list of 2"),
    (b" " * (MAX_CONFIG_BYTES + 1), f"is larger than {MAX_CONFIG_BYTES} bytes"),
])
def test_config_bytes_are_strict_json_holding_an_object(raw: bytes, expected: str) -> None:
    with pytest.raises(AdapterFormatError) as info:
        LoraConfig.from_json(raw)
    assert str(info.value).startswith(CONFIG_FILE) and expected in str(info.value)


# -- tensor names -------------------------------------------------------------------------------


def test_a_tensor_name_maps_to_its_module_matrix_and_layer() -> None:
    a = LoraTensor.parse(Q_A)
    assert (a.module, a.matrix, a.layer) == ("model.layers.3.self_attn.q_proj", "A", 3)
    assert a.key == Q_A
    assert LoraTensor.parse(Q_B).matrix == "B"
    assert LoraTensor.parse("base_model.model.lm_head.lora_B.weight").layer is None


@pytest.mark.parametrize("key", [
    "model.layers.3.self_attn.q_proj.lora_A.weight",  # no PEFT prefix
    "base_model.model.model.layers.3.self_attn.q_proj.lora_C.weight",
    "base_model.model.model.layers.3.self_attn.q_proj.lora_A.bias",
    "base_model.model.model.layers.3.self_attn.q_proj.lora_A.default.weight",
    "base_model.model.model.embed_tokens.lora_embedding_A",
    "base_model.model.model.layers.3.self_attn.q_proj.lora_magnitude_vector",
    "base_model.model.lora_A.weight",  # no module
    Q_A + "\n",
])
def test_a_tensor_outside_the_naming_rule_is_refused(key: str) -> None:
    with pytest.raises(AdapterFormatError, match="unexpected tensor"):
        LoraTensor.parse(key)
    with pytest.raises(AdapterFormatError, match="unexpected tensor"):
        lora_pairs({Q_A: 1, Q_B: 2, key: 3})


def test_tensors_pair_up_by_module_in_module_order() -> None:
    v_a, v_b = Q_A.replace("q_proj", "v_proj"), Q_B.replace("q_proj", "v_proj")
    pairs = lora_pairs({v_b: "vb", Q_B: "qb", v_a: "va", Q_A: "qa"})
    assert list(pairs.items()) == [("model.layers.3.self_attn.q_proj", ("qa", "qb")),
                                   ("model.layers.3.self_attn.v_proj", ("va", "vb"))]


def test_a_module_needs_both_matrices_and_a_file_needs_tensors() -> None:
    with pytest.raises(AdapterFormatError, match="needs both lora_A and lora_B, found only lora_A"):
        lora_pairs({Q_A: 1})
    with pytest.raises(AdapterFormatError, match="needs both lora_A and lora_B, found only lora_B"):
        lora_pairs({Q_B: 1})
    with pytest.raises(AdapterFormatError, match="holds no LoRA tensors"):
        lora_pairs({})


# -- both sides apply it ----------------------------------------------------------------------


def _with_config(src: Path, dst: Path, **changes: object) -> Path:
    shutil.copytree(src, dst)
    config = json.loads((dst / CONFIG_FILE).read_text())
    (dst / CONFIG_FILE).write_text(json.dumps({**config, **changes}))
    return dst


PER_LAYER = [("layers_to_transform", [0]), ("layers_pattern", "layers")]


@pytest.mark.parametrize(("feature", "value"), PER_LAYER)
def test_registration_refuses_per_layer_adapters(
        artifacts: Artifacts, tmp_path: Path, feature: str, value: object) -> None:
    info = BaseInfo(name="tiny", digest=artifacts.base_digest,
                    tokenizer_digest="sha256:" + "0" * 64,
                    linear_shapes=base_linear_shapes(artifacts.base))
    path = _with_config(artifacts.adapters["alpha"], tmp_path / "per-layer", **{feature: value})
    with pytest.raises(ValidationFailed) as failed:
        validate_adapter(path, max_rank=8, lookup_base=lambda _ref: info)
    assert failed.value.check == "config" and feature in failed.value.message
    assert str(tmp_path) not in failed.value.message


@pytest.fixture(scope="module")
def engine(kit_dir: Path) -> Engine:
    return Engine(kit_dir / "base", kit_dir / "tokenizer", device="cpu")


@pytest.mark.parametrize(("feature", "value"), PER_LAYER)
def test_the_engine_refuses_per_layer_adapters_loaded_directly(
        engine: Engine, kit_dir: Path, tmp_path: Path, feature: str, value: object) -> None:
    """The point of one format module: an adapter that never went through registration (a
    directory handed to the engine, or its files in memory) is refused at load all the same,
    and nothing of it becomes resident."""
    good = kit_dir / KitManifest.load(kit_dir).adapters["alpha"].path
    assert engine.read_adapter(good).rank == 8  # the unmodified adapter is fine
    path = _with_config(good, tmp_path / "per-layer", **{feature: value})
    with pytest.raises(AdapterLoadError, match=f"{CONFIG_FILE}: {feature} is not supported") \
            as refused:
        engine.load_adapter("sha256:" + "cd" * 32, path)
    assert str(tmp_path) not in str(refused.value)
    in_memory = {p.name: p.read_bytes() for p in path.iterdir()}
    with pytest.raises(AdapterLoadError, match=f"{feature} is not supported"):
        engine.read_adapter(in_memory)
    assert engine.resident_adapters() == {}
