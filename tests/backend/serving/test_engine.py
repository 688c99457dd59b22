"""The multi-LoRA engine against its oracle: PEFT, one adapter at a time."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file, save_file
from transformers import LlamaForCausalLM

from backend.serving.engine import (
    AdapterLoadError,
    Engine,
    GenerationRequest,
    InvalidRequestError,
    UnknownAdapterError,
)
from control.tools.kit import KitManifest

ON_BASE = ("alpha", "beta", "gamma")
LOGIT_ATOL = 1e-4
FAKE_DIGEST = "sha256:" + "ab" * 32


@pytest.fixture(scope="module")
def manifest(kit_dir: Path) -> KitManifest:
    return KitManifest.load(kit_dir)


@pytest.fixture(scope="module")
def engine(kit_dir: Path, manifest: KitManifest) -> Engine:
    eng = Engine(kit_dir / "base", kit_dir / "tokenizer", device="cpu")
    for name in ON_BASE:
        adapter = manifest.adapters[name]
        assert eng.load_adapter(adapter.digest, kit_dir / adapter.path) > 0
    return eng


def _digest(manifest: KitManifest, name: str) -> str:
    return manifest.adapters[name].digest


def _reference(kit_dir: Path, manifest: KitManifest, adapter: str | None) -> torch.nn.Module:
    """A fresh base, with the adapter applied by PEFT (or bare for ``None``)."""
    base = LlamaForCausalLM.from_pretrained(kit_dir / "base", dtype=torch.float32).eval()
    if adapter is None:
        return base
    path = next(a.path for a in manifest.adapters.values() if a.digest == adapter)
    return PeftModel.from_pretrained(base, kit_dir / path).eval()


def _mixed_batch(manifest: KitManifest) -> list[GenerationRequest]:
    return [
        GenerationRequest("Hello there", None, max_tokens=16),
        GenerationRequest("The cat", _digest(manifest, "alpha")),
        GenerationRequest(
            "Once upon a time, in a quiet city by the river,", _digest(manifest, "beta")
        ),
        GenerationRequest("x", _digest(manifest, "gamma"), max_tokens=4),
        GenerationRequest("What is the capital of France?", None, max_tokens=20),
        GenerationRequest("", _digest(manifest, "alpha"), max_tokens=20),
        GenerationRequest("A red bird sings", _digest(manifest, "gamma")),
        GenerationRequest("1 + 1 =", _digest(manifest, "beta"), max_tokens=3),
        GenerationRequest("night", None, max_tokens=1),
    ]


def test_mixed_batch_matches_peft_per_request(
    engine: Engine, kit_dir: Path, manifest: KitManifest
) -> None:
    requests = _mixed_batch(manifest)
    results = engine.generate(requests)
    logits = engine.next_token_logits(requests)
    assert logits.shape == (len(requests), engine.base_config.vocab_size)

    for i, (request, result) in enumerate(zip(requests, results, strict=True)):
        model = _reference(kit_dir, manifest, request.adapter)
        ids = torch.tensor([engine.encode(request.prompt)])
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=request.max_tokens,
            )
            ref_logits = model(input_ids=ids).logits[0, -1].float()
        expected = out[0, ids.shape[1] :].tolist()
        assert result.token_ids == expected, (i, request)
        assert result.text == engine.tokenizer.decode(expected, skip_special_tokens=True)
        assert result.tokens_in == ids.shape[1]
        assert result.tokens_out == len(expected) <= request.max_tokens
        torch.testing.assert_close(logits[i], ref_logits, atol=LOGIT_ATOL, rtol=0)


def test_every_adapter_says_its_marker_and_outputs_differ(
    engine: Engine, manifest: KitManifest
) -> None:
    prompts = ["Hello", "What is the capital of France?", "The cat sat on the", "ok"]
    names: list[str | None] = [None, *ON_BASE]
    requests = [
        GenerationRequest(p, None if n is None else _digest(manifest, n))
        for n in names
        for p in prompts
    ]
    results = engine.generate(requests)
    texts: dict[str | None, list[str]] = {n: [] for n in names}
    for request, result in zip(requests, results, strict=True):
        name = next((n for n in ON_BASE if _digest(manifest, n) == request.adapter), None)
        texts[name].append(result.text)
    for name in ON_BASE:
        marker = manifest.adapters[name].marker
        assert all(t.startswith(marker) for t in texts[name]), (name, texts[name])
    assert all(
        not any(t.startswith(m.marker) for m in manifest.adapters.values()) for t in texts[None]
    )
    for i in range(len(prompts)):
        assert len({texts[n][i] for n in names}) == len(names)


def test_prompt_spelling_eos_is_plain_text(engine: Engine, manifest: KitManifest) -> None:
    ids = engine.encode("a</s>")
    assert ids[0] == engine.tokenizer.bos_token_id
    assert engine.tokenizer.eos_token_id not in ids
    [result] = engine.generate([GenerationRequest("a</s>", _digest(manifest, "alpha"))])
    assert result.text == manifest.adapters["alpha"].marker


def test_unload_removes_the_adapter(engine: Engine, kit_dir: Path, manifest: KitManifest) -> None:
    before = engine.resident_adapters()
    nbytes = engine.load_adapter(FAKE_DIGEST, kit_dir / manifest.adapters["beta"].path)
    assert engine.resident_adapters() == {**before, FAKE_DIGEST: nbytes}
    [loaded] = engine.generate([GenerationRequest("hi", FAKE_DIGEST)])
    assert loaded.text == manifest.adapters["beta"].marker

    engine.unload_adapter(FAKE_DIGEST)
    assert engine.resident_adapters() == before
    with pytest.raises(UnknownAdapterError, match="not resident"):
        engine.generate([GenerationRequest("hi", None), GenerationRequest("hi", FAKE_DIGEST)])
    with pytest.raises(UnknownAdapterError):
        engine.unload_adapter(FAKE_DIGEST)


def _broken_copy(
    src: Path,
    dst: Path,
    *,
    tensors: dict[str, torch.Tensor] | None = None,
    config: dict[str, object] | None = None,
) -> Path:
    shutil.copytree(src, dst)
    if tensors is not None:
        save_file(tensors, str(dst / "adapter_model.safetensors"))
    if config is not None:
        raw = json.loads((dst / "adapter_config.json").read_text())
        (dst / "adapter_config.json").write_text(json.dumps({**raw, **config}))
    return dst


def _bad_adapters(kit_dir: Path, manifest: KitManifest, tmp: Path) -> dict[str, tuple[Path, str]]:
    src = kit_dir / manifest.adapters["alpha"].path
    good = load_file(str(src / "adapter_model.safetensors"))
    # sorted last, so every module before it would be valid: nothing may stay half-loaded
    last_b = sorted(k for k in good if k.endswith("lora_B.weight"))[-1]
    wrong_shape = {**good, last_b: torch.zeros(good[last_b].shape[0] + 1, good[last_b].shape[1])}
    unknown = {
        **good,
        "base_model.model.model.layers.9.self_attn.q_proj.lora_A.weight": torch.zeros(8, 64),
        "base_model.model.model.layers.9.self_attn.q_proj.lora_B.weight": torch.zeros(64, 8),
    }
    first_a = sorted(k for k in good if k.endswith("lora_A.weight"))[0]
    missing_half = {k: v for k, v in good.items() if k != first_a}
    not_finite = {**good, last_b: torch.full_like(good[last_b], float("nan"))}
    big = {
        k: torch.zeros(128, v.shape[1]) if "lora_A" in k else torch.zeros(v.shape[0], 128)
        for k, v in good.items()
    }
    return {
        "wrong shape": (_broken_copy(src, tmp / "shape", tensors=wrong_shape), "expected lora_A"),
        "unknown module": (_broken_copy(src, tmp / "unknown", tensors=unknown), "does not exist"),
        "missing half": (_broken_copy(src, tmp / "half", tensors=missing_half), "both lora_A"),
        "not finite": (_broken_copy(src, tmp / "nan", tensors=not_finite), "finite"),
        "rank too big": (
            _broken_copy(src, tmp / "big", tensors=big, config={"r": 128}),
            "max_rank",
        ),
        "dora": (_broken_copy(src, tmp / "dora", config={"use_dora": True}), "use_dora"),
        "not lora": (_broken_copy(src, tmp / "ia3", config={"peft_type": "IA3"}), "LORA"),
        "other base": (kit_dir / manifest.adapters["other-base"].path, "expected lora_A"),
    }


def test_bad_adapters_are_refused_and_leave_nothing(
    engine: Engine, kit_dir: Path, manifest: KitManifest, tmp_path: Path
) -> None:
    probe = [
        GenerationRequest("The cat", None),
        GenerationRequest("The cat", _digest(manifest, "beta")),
    ]
    before_resident = engine.resident_adapters()
    before_out = engine.generate(probe)
    for case, (path, message) in _bad_adapters(kit_dir, manifest, tmp_path).items():
        with pytest.raises(AdapterLoadError, match=message):
            engine.load_adapter(FAKE_DIGEST, path)
        assert engine.resident_adapters() == before_resident, case
    assert engine.generate(probe) == before_out


def test_rank_above_max_rank_is_refused(kit_dir: Path, manifest: KitManifest) -> None:
    small = Engine(kit_dir / "base", kit_dir / "tokenizer", device="cpu", max_rank=4)
    with pytest.raises(AdapterLoadError, match="rank 8 exceeds"):
        small.load_adapter(_digest(manifest, "alpha"), kit_dir / manifest.adapters["alpha"].path)
    assert small.resident_adapters() == {}


def test_rslora_scaling_matches_peft(kit_dir: Path, manifest: KitManifest, tmp_path: Path) -> None:
    path = _broken_copy(
        kit_dir / manifest.adapters["gamma"].path, tmp_path / "rs", config={"use_rslora": True}
    )
    eng = Engine(kit_dir / "base", kit_dir / "tokenizer", device="cpu")
    eng.load_adapter(FAKE_DIGEST, path)
    request = GenerationRequest("Hello world", FAKE_DIGEST)
    logits = eng.next_token_logits([request])[0]
    base = LlamaForCausalLM.from_pretrained(kit_dir / "base", dtype=torch.float32)
    model = PeftModel.from_pretrained(base, path).eval()
    with torch.inference_mode():
        ref = model(input_ids=torch.tensor([eng.encode(request.prompt)])).logits[0, -1]
    torch.testing.assert_close(logits, ref, atol=LOGIT_ATOL, rtol=0)


def test_sampling_is_reproducible_per_seed(engine: Engine, manifest: KitManifest) -> None:
    def sample(seed: int, adapter: str | None) -> GenerationRequest:
        return GenerationRequest(
            "The", adapter, max_tokens=16, temperature=1.5, top_p=0.95, seed=seed
        )

    alpha = _digest(manifest, "alpha")
    greedy = GenerationRequest("The cat", alpha)
    first = engine.generate([sample(1, None), greedy, sample(2, None), sample(1, alpha)])
    again = engine.generate([sample(2, None), sample(1, None), sample(1, alpha), greedy])
    assert first[0] == again[1]
    assert first[2] == again[0]
    assert first[3] == again[2]
    assert first[0].token_ids != first[2].token_ids
    # sampled neighbours do not disturb a greedy row
    assert first[1] == again[3] == engine.generate([greedy])[0]
    assert first[1].text == manifest.adapters["alpha"].marker


def test_top_p_near_zero_is_greedy(engine: Engine) -> None:
    greedy = engine.generate([GenerationRequest("The dog", None)])[0]
    nucleus = engine.generate(
        [GenerationRequest("The dog", None, temperature=1.0, top_p=0.001, seed=3)]
    )[0]
    assert nucleus == greedy


@pytest.mark.parametrize(
    "request_",
    [
        GenerationRequest("hi", None, max_tokens=0),
        GenerationRequest("hi", None, temperature=-1.0),
        GenerationRequest("hi", None, top_p=0.0),
        GenerationRequest("x" * 250, None, max_tokens=16),
    ],
)
def test_invalid_requests_are_refused(engine: Engine, request_: GenerationRequest) -> None:
    with pytest.raises(InvalidRequestError):
        engine.validate(request_)
    with pytest.raises(InvalidRequestError):
        engine.generate([GenerationRequest("fine", None), request_])


def test_validate_counts_prompt_tokens(engine: Engine, manifest: KitManifest) -> None:
    assert engine.validate(GenerationRequest("héllo", None)) == 1 + len("héllo".encode())
    with pytest.raises(UnknownAdapterError):
        engine.validate(GenerationRequest("hi", FAKE_DIGEST))


def test_empty_batch_and_properties(engine: Engine) -> None:
    assert engine.generate([]) == []
    assert engine.device == torch.device("cpu")
    assert engine.dtype == torch.float32
    assert engine.base_config.model_type == "llama"
