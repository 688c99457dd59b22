"""The production-shape check of ``gpu-check``: the engine at an 8B base's full size, with random
weights and nothing downloaded.

On CUDA the base has Llama-3-8B's dimensions (hidden 4096, 32 layers, MLP 14336, 32 heads and
8 key/value heads, a 128,256-token vocabulary) and its adapters target all seven projections:
three at rank 64 and one at rank 16 in banks of rank 64, so the MLP LoRA path and rank padding
both run. The CPU dry run runs the same code on scaled-down dimensions (:data:`SHAPE_PROFILES`).

It reports, and judges:

- ``first_token``: for every adapter and the base, the engine's first-token logits of one
  prompt against PEFT's, computed on the same random model while the kit was built; the
  largest difference, relative to the largest logit, must be within the dtype's
  ``LOGIT_RTOL`` (``control.tools.bench.gpu_check``).
- ``contexts``: for each context length, a batch of rows (base and adapters mixed, sampling on:
  temperature and top-p, a seed per row) prefilled and then decoded; ms per decode step
  (median), prefill seconds, every row's tokens counted (a row failing alone as ``numerical``
  fails the check). On CUDA, the peak of ``torch.cuda.max_memory_allocated()`` above what the
  device held before the engine, against the memory plan: weights + slot banks + twice the
  live KV (the plan's own bound for a decode step) + the plan's activation headroom.
"""

from __future__ import annotations

import gc
import math
import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from backend.serving.engine import DecodeBatch, Engine, GenerationRequest
from backend.serving.memory import (
    KV_HEADROOM_FRACTION,
    TARGET_MODULES,
    MemoryPlan,
    device_memory,
)
from control.contracts.digests import directory_digest
from control.tools.bench.kit import BenchShape
from control.tools.kit import build_tokenizer

PROBE = "The quick brown fox jumps over the lazy dog."
SAMPLING = {"temperature": 0.8, "top_p": 0.95}
DELTA_SHARE = 0.5  # each adapter moves its projections' outputs by about half: visible in logits


@dataclass(frozen=True)
class ShapeProfile:
    shape: BenchShape
    vocab: int
    ranks: tuple[int, ...]  # one adapter per entry; the banks hold the largest
    contexts: tuple[int, ...]  # prompt tokens of each measured batch
    rows: int  # rows per batch
    steps: int  # decode steps timed per batch


SHAPE_PROFILES = {
    "cuda": ShapeProfile(BenchShape(hidden=4096, layers=32, intermediate=14336, heads=32,
                                    kv_heads=8), vocab=128256, ranks=(64, 64, 64, 16),
                         contexts=(512, 1024, 2048, 4096), rows=8, steps=16),
    "cpu": ShapeProfile(BenchShape(hidden=64, layers=2, intermediate=172, heads=4, kv_heads=2),
                        vocab=2048, ranks=(8, 8, 8, 2), contexts=(32, 64, 128), rows=4,
                        steps=4),
}


@dataclass
class ShapeKit:
    base: Path
    tokenizer: Path
    adapters: dict[str, Path]  # digest -> directory
    probe_ids: list[int]
    # PEFT's first-token logits of the probe, per adapter digest (None: the base), float32 CPU
    references: dict[str | None, torch.Tensor]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build_shape_kit(root: Path, profile: ShapeProfile, device: torch.device,
                    dtype: torch.dtype, seed: int = 5) -> ShapeKit:
    """The random base and adapters of ``profile``, built on ``device`` in ``dtype`` (an 8B base
    initialised on a CPU would take minutes), written under ``root``; PEFT's logits of the probe
    for each, taken from the same in-memory model."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    tok = build_tokenizer()
    tok.save_pretrained(root / "tokenizer")
    s = profile.shape
    cfg = LlamaConfig(vocab_size=profile.vocab, hidden_size=s.hidden,
                      intermediate_size=s.intermediate, num_hidden_layers=s.layers,
                      num_attention_heads=s.heads, num_key_value_heads=s.kv_heads,
                      max_position_embeddings=2 * max(profile.contexts),
                      tie_word_embeddings=False, bos_token_id=tok.bos_token_id,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    with torch.device(device):
        base = LlamaForCausalLM._from_config(cfg, dtype=dtype).eval()
    ids = [int(tok.bos_token_id),
           *tok(PROBE, add_special_tokens=False, split_special_tokens=True)["input_ids"]]
    probe = torch.tensor([ids], device=device)

    def last_logits(model: Any) -> torch.Tensor:
        with torch.inference_mode():
            return model(input_ids=probe).logits[0, -1].float().cpu()

    references: dict[str | None, torch.Tensor] = {None: last_logits(base)}
    base.save_pretrained(root / "base", safe_serialization=True)
    # PEFT's random B scaled so the delta is DELTA_SHARE of the projection's output (as the
    # bench kit does; see control.tools.bench.kit._delta_scale)
    scale = 3 * DELTA_SHARE * cfg.initializer_range * math.sqrt(s.hidden)
    adapters: dict[str, Path] = {}
    for i, rank in enumerate(profile.ranks):
        model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=rank,
                                                target_modules=list(TARGET_MODULES),
                                                init_lora_weights=False))
        model.peft_config["default"].base_model_name_or_path = str(root / "base")
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.mul_(scale)
        out = root / "adapters" / f"r{rank}-{i}"
        model.save_pretrained(str(out))
        (out / "README.md").unlink(missing_ok=True)
        digest = directory_digest(out)
        adapters[digest] = out
        references[digest] = last_logits(model)
        base = model.unload()
    del base, model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return ShapeKit(root / "base", root / "tokenizer", adapters, ids, references)


def first_token(engine: Engine, kit: ShapeKit, rtol: float) -> dict[str, Any]:
    """The engine's first-token logits of the probe, every adapter and the base in one batch,
    against PEFT's."""
    order: list[str | None] = [None, *kit.adapters]
    logits = engine.next_token_logits([GenerationRequest(PROBE, d, max_tokens=1)
                                       for d in order])
    diffs = {}
    for row, digest in enumerate(order):
        ref = kit.references[digest]
        diffs["base" if digest is None else kit.adapters[digest].name] = float(
            (logits[row] - ref).abs().max() / ref.abs().max())
    # the adapters must matter: an adapter whose logits equal the base's proves nothing
    base = kit.references[None]
    moved = min(float((kit.references[d] - base).abs().max() / base.abs().max())
                for d in kit.adapters)
    problems = [f"{name}: logits differ from PEFT's by {d:.2e} of the largest, over {rtol:.2e}"
                for name, d in diffs.items() if not d <= rtol]
    if moved <= 10 * rtol:
        problems.append(f"an adapter moves the logits by only {moved:.2e}: within the tolerance")
    return {"status": "fail" if problems else "pass", "problems": problems,
            "relative_diff": diffs, "tolerance": rtol, "smallest_adapter_effect": moved}


def _prompt(n_tokens: int, seed: int) -> str:
    rng = random.Random(seed)
    return "".join(chr(rng.randrange(32, 127)) for _ in range(n_tokens - 1))  # bos + bytes


def measure_context(engine: Engine, kit: ShapeKit, profile: ShapeProfile, context: int,
                    allocated_before: int) -> dict[str, Any]:
    """One batch at ``context`` prompt tokens: prefill, then ``profile.steps`` decode steps."""
    device = engine.device
    adapters: list[str | None] = [None, *kit.adapters]
    seqs = [engine.open_sequence(GenerationRequest(
        _prompt(context, i), adapters[i % len(adapters)], max_tokens=profile.steps + 1,
        seed=i, **SAMPLING)) for i in range(profile.rows)]
    steps: list[float] = []
    try:
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        _sync(device)
        t0 = time.perf_counter()
        batch: DecodeBatch | None = engine.prefill(seqs)
        _sync(device)
        prefill = time.perf_counter() - t0
        while batch is not None:
            engine.choose(batch)
            batch = engine.retain(batch, [i for i, s in enumerate(batch.seqs) if not s.done])
            if batch is not None:
                t = time.perf_counter()
                engine.advance(batch)
                _sync(device)
                steps.append(time.perf_counter() - t)
        produced = [len(s.produced) for s in seqs]
        failures = sorted({s.failure for s in seqs if s.failure})
        # sampling over a random model's vocabulary may draw the eos token: such a row is done
        at_eos = sum(0 < len(s.produced) <= profile.steps and s.produced[-1] in engine.eos_ids
                     for s in seqs)
        complete = sum(len(s.produced) == profile.steps + 1 for s in seqs) + at_eos
    finally:
        for s in seqs:
            engine.close_sequence(s)
    out: dict[str, Any] = {
        "context": context, "rows": profile.rows, "prefill_s": round(prefill, 4),
        "ms_per_step": round(1000 * statistics.median(steps), 3) if steps else None,
        "decode_steps": len(steps), "tokens": sum(produced),
        "tokens_expected": profile.rows * (profile.steps + 1), "rows_complete": complete,
        "rows_ended_at_eos": at_eos, "failures": failures}
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device) - allocated_before
        out.update(peak_against_plan(engine.plan, profile.rows * (context + profile.steps),
                                     peak, device_memory(str(device))))
    return out


def peak_against_plan(plan: MemoryPlan, live_tokens: int, peak: int,
                      device_bytes: int) -> dict[str, Any]:
    """A batch's peak allocation against what the memory plan allows it: the weights, the slot
    banks, twice the live KV (the old and the new KV of a step) and the activation headroom."""
    weights = plan.shapes.weight_count() * plan.element_size
    live_kv = live_tokens * plan.kv_token_bytes
    planned = weights + plan.bank_bytes + 2 * live_kv + int(KV_HEADROOM_FRACTION * device_bytes)
    return {"peak_bytes": peak, "planned_bytes": planned, "peak_over_plan": peak / planned,
            "live_kv_bytes": live_kv,
            "peak_beyond_weights_and_banks_over_live_kv": (
                (peak - weights - plan.bank_bytes) / live_kv)}


def check_production_shapes(profile: ShapeProfile, device: torch.device, dtype: torch.dtype,
                            work_dir: Path, rtol: float) -> dict[str, Any]:
    """Build the kit, serve it, run :func:`first_token` and every context of ``profile``."""
    started = time.perf_counter()
    kit = build_shape_kit(work_dir / "shapes", profile, device, dtype)
    built = time.perf_counter() - started
    before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    engine = Engine(kit.base, kit.tokenizer, device=str(device), dtype=dtype,
                    max_rank=max(profile.ranks), max_adapters=len(profile.ranks))
    try:
        for digest, path in kit.adapters.items():
            engine.load_adapter(digest, path)
        equality = first_token(engine, kit, rtol)
        contexts = [measure_context(engine, kit, profile, c, before) for c in profile.contexts]
    finally:
        del engine
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    problems = list(equality["problems"])
    for c in contexts:
        if c["rows_complete"] != c["rows"] or c["failures"]:
            problems.append(f"context {c['context']}: {c['rows_complete']} of {c['rows']} rows "
                            f"produced all their tokens or ended at eos, failures "
                            f"{c['failures']}")
        if "peak_over_plan" in c and c["peak_over_plan"] > 1:
            problems.append(f"context {c['context']}: peak memory {c['peak_bytes']:,} B is over "
                            f"the plan's {c['planned_bytes']:,} B")
    return {"status": "fail" if problems else "pass", "problems": problems,
            "shape": {**profile.shape.as_dict(), "vocab": profile.vocab},
            "ranks": list(profile.ranks), "targets": list(TARGET_MODULES),
            "sampling": SAMPLING, "first_token": equality, "contexts": contexts,
            "memory_judged": device.type == "cuda", "kit_build_seconds": round(built, 2)}
