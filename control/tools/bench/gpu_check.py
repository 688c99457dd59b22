"""``make gpu-check``: the engine's GPU claims, checked in one call; prints a JSON report.

    python -m control.tools.bench.gpu_check                  # on a GPU, real sizes (a few minutes)
    python -m control.tools.bench.gpu_check --device cpu     # dry run: toy sizes, what CI runs

On a GPU host with no network, run it from a ``make gpu-bundle`` folder
(``control.tools.bench.gpu_bundle``). It prints its environment first
(``control.tools.bench.gpu_env``). Nothing is downloaded: the model is a random bench kit
(``control.tools.bench.kit``), built in a temporary folder. The real run (``--device cuda``)
builds a Llama with the layer shape of an 8B base (hidden 4096, intermediate 14336, 32 heads, 8
key/value heads; 4 layers, so that building and loading it take seconds) and 32 rank-16 adapters
on q, k, v, o, and serves in bf16. The dry run (``--device cpu``) runs the same checks on a toy
base (hidden 64, 2 layers) with 8 adapters.

The checks, each reported with its numbers and a status (``pass``, ``fail``, ``measured``: numbers
taken, goal not judged; ``skipped`` or ``not available``, with the reason):

- ``libraries`` and ``libraries_in_stub_env``: the CUDA runtime, cuDNN and cuBLAS files torch
  loaded, against the ``nvidia-*`` wheels it was installed with, in this process and in one
  started with the ``LD_LIBRARY_PATH`` Triton's Python stub gets (``gpu_env``).

- ``peft_equality_segment`` and ``peft_equality_gather``: one mixed batch (every adapter once,
  base rows among them, prompts of different lengths so rows are left-padded), generated greedily
  by the engine with the LoRA path forced (``backend.serving.lora_ops.SEGMENT_MAX_ADAPTERS``),
  against
  PEFT's greedy output for each row alone on the same token ids, device and dtype. The path each
  decode step ran is read from the batch (the gather path leaves its per-row copies on it). Rows
  must be equal, except that a row may part from PEFT at a near-tie: where the two tokens' logits
  are within :func:`logit_rtol` of the largest logit in both the engine's and PEFT's view. bf16
  keeps 8 significant bits, and the engine rounds differently from PEFT at every layer (it folds
  the scaling into B and computes ``(x A) B``; batch shapes pick other kernels), so two correct
  implementations may order two logits that close differently; past that point the row is not
  comparable and is not compared. The equality says something only if the adapters change the
  answer: the report counts the adapter rows whose PEFT output differs from the base's on the
  same prompt, and the check fails unless at least half of them do.
- ``mixed_vs_base``: tokens/s of the mixed batch (every request its own adapter) against the
  same prompts on the base alone, alternated, best of ``--reps`` (``control.tools.bench.kit``).
- ``continuous_batching``: tokens/s of every request as a concurrent stream through the
  scheduler, against one stream alone, judged as a share of the engine's own batch speedup
  measured in the same run (``gpu_perf.check_continuous`` says why).
- ``memory_accounting``: the engine's memory by category (``backend.serving.memory_report``) with a
  batch of every adapter running on the gather path and its prompts in a prefix cache, against
  ``torch.cuda.memory_allocated()`` less what was allocated before the engine: within
  :data:`MEMORY_RTOL`, in total and beyond the base weights. On a CPU there is no allocator to
  compare with: skipped, the categories reported (``tests/backend/serving/test_memory_report.py``
  checks them against every live tensor there).
- ``production_shapes``: Llama-3-8B's full shape with rank-64 and rank-16 adapters on all seven
  projections, 4k contexts, sampling on, peak memory against the plan (``gpu_shapes``); scaled
  down in the dry run.

On a GPU the throughput ratios are judged against ``control.tools.bench.kit.GOALS`` (the issue's
table); in the dry run they are only measured (toy sizes on a shared CPU say nothing about a
GPU), though every request must still have produced all its tokens. The exit status is 0 when no
check failed, 1 otherwise, 2 when the check cannot run here (no CUDA device).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import json
import math
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from backend.serving.engine import DecodeBatch, Engine, GenerationRequest
from control.tools.bench import gpu_env
from control.tools.bench.gpu_perf import (
    MEMORY_RTOL,
    Profile,
    Status,
    check_continuous,
    check_memory,
    check_mixed_vs_base,
    forced_path,
    judge,
)
from control.tools.bench.gpu_shapes import SHAPE_PROFILES, check_production_shapes
from control.tools.bench.kit import (
    NEW_TOKENS,
    RANK,
    TARGETS,
    BenchKit,
    BenchShape,
    bench_prompts,
    build_bench_kit,
)

__all__ = ["MEMORY_RTOL", "PROFILES", "CannotRun", "Profile", "Status", "judge", "main",
           "run_checks"]

# How far the engine's logits may be from PEFT's, relative to the largest logit, for a model of
# two layers; deeper models get sqrt(layers / 2) times more (rounding errors of independent
# layers add like a random walk). Measured on the CPU at two layers (control.tools.bench
# .gpu_shapes, every projection adapted): float32 3e-7, bfloat16 5.5e-3 (about 1.4 of bf16's
# unit roundoff, 2^-8). The bounds give float32 a margin of about 12, bfloat16 about 3, float16
# bf16's bound less its 3 fewer mantissa bits. The same bound decides a near-tie: a row may part
# from PEFT where its two candidate tokens' logits are this close (see the module notes).
BASE_RTOL = {torch.float32: 2.0**-18, torch.bfloat16: 2.0**-6, torch.float16: 2.0**-9}
# Each adapter changes its projections' outputs by about half (control.tools.bench.kit): measured on
# the CPU profiles, every adapter row's first token then differs from the base's, so equality
# with PEFT tells the adapters apart. Throughput does not depend on the values.
ADAPTER_SHARE = 0.5
EQUALITY_TOKENS = 16  # new tokens per row in the equality checks
BASE_ROW_EVERY = 4  # one base row after every this many adapter rows
EXIT_FAILED, EXIT_CANNOT_RUN = 1, 2


def logit_rtol(dtype: torch.dtype, layers: int) -> float:
    """The bound of :data:`BASE_RTOL` for ``dtype``, scaled to ``layers``."""
    return BASE_RTOL[dtype] * math.sqrt(max(layers, 2) / 2)


PROFILES = {
    # The layer shape of an 8B Llama; 4 layers: each ratio is per layer, and 4 build in seconds.
    # The full 8B shape runs in production_shapes (control.tools.bench.gpu_shapes).
    "cuda": Profile("cuda", BenchShape(hidden=4096, layers=4, intermediate=14336, heads=32,
                                       kv_heads=8), adapters=32, judged=True, reps=3),
    # Toy sizes; key/value heads fewer than heads, as on the real base.
    "cpu": Profile("cpu", BenchShape(hidden=64, layers=2, intermediate=172, heads=4, kv_heads=2),
                   adapters=8, judged=False, reps=1),
}


class CannotRun(Exception):
    """The check cannot run on this machine; the message says what is missing."""


# -- equality against PEFT -------------------------------------------------------------------

@dataclass(frozen=True)
class Row:
    """One request of the equality batch: its prompt's token ids and adapter (None: base)."""

    prompt: str
    ids: list[int]
    adapter: str | None


@dataclass(frozen=True)
class Greedy:
    """A greedy continuation and the logits each of its tokens was chosen from."""

    tokens: list[int]
    logits: list[torch.Tensor]  # per token [vocab] float32, on the CPU


def equality_rows(engine: Engine, kit: BenchKit) -> list[Row]:
    """Every adapter once and a base row after every :data:`BASE_ROW_EVERY`, with prompts of
    different lengths (rows are left-padded to the longest)."""
    adapters: list[str | None] = []
    for i, digest in enumerate(kit.adapters):
        adapters.append(digest)
        if i % BASE_ROW_EVERY == BASE_ROW_EVERY - 1:
            adapters.append(None)
    prompts = bench_prompts(len(adapters), seed=13)
    rows = []
    for i, adapter in enumerate(adapters):
        prompt = prompts[i][: 8 + (i * 11) % 48]
        rows.append(Row(prompt, engine.encode(prompt), adapter))
    return rows


def peft_references(kit: BenchKit, rows: list[Row], device: torch.device,
                    dtype: torch.dtype) -> tuple[list[Greedy], list[Greedy]]:
    """PEFT's greedy output for each row alone, and the base's for each row's prompt (is the
    adapter changing anything?), on ``device`` in ``dtype``. The model is dropped on return;
    the caller frees the device's cache."""
    from peft import PeftModel
    from transformers import LlamaForCausalLM

    digests = [d for d in kit.adapters if any(r.adapter == d for r in rows)]
    names = {d: f"a{i}" for i, d in enumerate(digests)}
    base = LlamaForCausalLM.from_pretrained(kit.base, dtype=dtype)
    model = PeftModel.from_pretrained(base, kit.adapters[digests[0]],
                                      adapter_name=names[digests[0]])
    for d in digests[1:]:
        model.load_adapter(kit.adapters[d], adapter_name=names[d])
    model = model.to(device).eval()
    pad = int(model.config.pad_token_id or 0)

    def generate(ids: list[int]) -> Greedy:
        x = torch.tensor([ids], device=device)
        with torch.inference_mode():
            out = model.generate(input_ids=x, attention_mask=torch.ones_like(x),
                                 do_sample=False, max_new_tokens=EQUALITY_TOKENS,
                                 output_logits=True, return_dict_in_generate=True,
                                 pad_token_id=pad)
        tokens = out.sequences[0, x.shape[1]:].tolist()
        return Greedy(tokens, [step[0].float().cpu() for step in out.logits])

    own, bare = [], []
    for row in rows:
        with model.disable_adapter():
            bare.append(generate(row.ids))
        if row.adapter is None:
            own.append(bare[-1])
        else:
            model.set_adapter(names[row.adapter])
            own.append(generate(row.ids))
    return own, bare


def engine_greedy(engine: Engine, rows: list[Row]) -> tuple[list[Greedy], list[str], int]:
    """The rows as one batch through the engine's own steps (prefill, then choose and advance as
    the scheduler drives them); the logits behind every token, the path each decode step ran,
    and how many decode steps gathered per-row weights."""
    seqs = [engine.open_sequence(GenerationRequest(r.prompt, r.adapter,
                                                   max_tokens=EQUALITY_TOKENS)) for r in rows]
    logits: list[list[torch.Tensor]] = [[] for _ in rows]
    index = {id(s): i for i, s in enumerate(seqs)}
    paths: list[str] = []
    gathered = 0
    try:
        batch: DecodeBatch | None = engine.prefill(seqs)
        while batch is not None:
            for s, row_logits in zip(batch.seqs, batch.logits.float().cpu(), strict=True):
                logits[index[id(s)]].append(row_logits)
            engine.choose(batch)
            batch = engine.retain(batch, [i for i, s in enumerate(batch.seqs) if not s.done])
            if batch is not None:
                engine.advance(batch)
                paths.append(batch.slots.path)
                gathered += bool(batch.slots.gathered)  # the gather path left its copies
    finally:
        for s in seqs:
            engine.close_sequence(s)
    return [Greedy(list(s.produced), logits[i]) for i, s in enumerate(seqs)], paths, gathered


def compare(row: int, ours: Greedy, theirs: Greedy, rtol: float) -> dict[str, Any] | None:
    """None when the tokens are equal; else where they part, with both sides' margins between
    the two tokens and whether that is a near-tie."""
    # zip stops at the shorter: a row that ended early is caught by the length test below
    k = next((i for i, (a, b) in enumerate(zip(ours.tokens, theirs.tokens, strict=False))
              if a != b), None)
    if k is None:
        if len(ours.tokens) == len(theirs.tokens):
            return None
        k = min(len(ours.tokens), len(theirs.tokens))
        return {"row": row, "position": k, "tie": False, "reason": "lengths differ",
                "engine_tokens": len(ours.tokens), "peft_tokens": len(theirs.tokens)}
    a, b = ours.tokens[k], theirs.tokens[k]
    engine_margin = float(ours.logits[k][a] - ours.logits[k][b])
    peft_margin = float(theirs.logits[k][b] - theirs.logits[k][a])
    bound = rtol * float(theirs.logits[k].abs().max())
    return {"row": row, "position": k, "engine_token": a, "peft_token": b,
            "engine_margin": engine_margin, "peft_margin": peft_margin, "tie_bound": bound,
            "tie": max(engine_margin, peft_margin) <= bound}


def check_equality(engine: Engine, rows: list[Row], references: list[Greedy],
                   base_outputs: list[Greedy], path: str) -> dict[str, Any]:
    """The engine's greedy batch with ``path`` forced, against PEFT row by row."""
    rtol = logit_rtol(engine.dtype, int(engine.base_config.num_hidden_layers))
    with forced_path(path):
        ours, paths, gathered = engine_greedy(engine, rows)
    partings = [p for i, (o, t) in enumerate(zip(ours, references, strict=True))
                if (p := compare(i, o, t, rtol)) is not None]
    ran = sorted(set(paths) - {"none"})
    adapter_rows = [i for i, r in enumerate(rows) if r.adapter is not None]
    changed = sum(references[i].tokens != base_outputs[i].tokens for i in adapter_rows)
    first_step = max(float((o.logits[0] - t.logits[0]).abs().max())
                     for o, t in zip(ours, references, strict=True))
    # the first token's logits are comparable in every row (no row has parted yet)
    first_relative = max(float((o.logits[0] - t.logits[0]).abs().max() / t.logits[0].abs().max())
                         for o, t in zip(ours, references, strict=True))
    problems = []
    if not first_relative <= rtol:
        problems.append(f"first-token logits differ from PEFT's by {first_relative:.2e} of the "
                        f"largest, over the {str(engine.dtype).removeprefix('torch.')} bound "
                        f"{rtol:.2e}")
    if ran != [path] or (gathered > 0) != (path == "gather"):
        problems.append(f"decode steps ran {ran} ({gathered} gathered), not {path}")
    if any(not p["tie"] for p in partings):
        problems.append("rows part from PEFT where the logits are not a near-tie")
    if 2 * changed < len(adapter_rows):
        problems.append(f"only {changed} of {len(adapter_rows)} adapters change PEFT's answer: "
                        "equality would not tell them apart")
    return {
        "status": Status.FAIL if problems else Status.PASS,
        "problems": problems,
        "rows": len(rows),
        "adapter_rows": len(adapter_rows),
        "rows_equal": len(rows) - len(partings),
        "rows_parting_at_near_ties": sum(p["tie"] for p in partings),
        "adapter_rows_differing_from_base": changed,
        "paths_run": ran,
        "decode_steps": len(paths),
        "decode_steps_gathering": gathered,
        "max_first_token_logit_diff": first_step,
        "max_first_token_relative_diff": first_relative,
        "tolerance": rtol,
        "tokens_per_row": EQUALITY_TOKENS,
        "partings": partings,
    }


# -- the run ---------------------------------------------------------------------------------

def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _timed(fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    t0 = time.perf_counter()
    out = fn()
    return {**out, "seconds": round(time.perf_counter() - t0, 2)}


def _device_report(device: torch.device) -> dict[str, Any]:
    out: dict[str, Any] = {"device": str(device), "torch": torch.__version__,
                           "cuda": torch.version.cuda, "threads": torch.get_num_threads()}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        out.update(name=props.name, memory_bytes=props.total_memory)
    return out


def require_device(device: str) -> torch.device:
    """The torch device for ``device``; raises ``CannotRun`` when it is not usable here."""
    if device == "cuda" and not torch.cuda.is_available():
        build = ("a CPU build" if torch.version.cuda is None
                 else f"built for CUDA {torch.version.cuda}, which sees no GPU")
        raise CannotRun(
            f"--device cuda needs a visible NVIDIA GPU and a CUDA build of torch; this torch "
            f"{torch.__version__} is {build}. Install the CUDA build into the venv (on Linux "
            f"x86_64, PyPI's torch wheel is one; see TORCH_SPEC in the Makefile), or run the "
            f"dry run: make gpu-check GPU_CHECK_ARGS='--device cpu'")
    return torch.device(device)


def _engine_checks(profile: Profile, kit: BenchKit, dtype: torch.dtype, device: torch.device,
                   checks: dict[str, dict[str, Any]], progress: Callable[[str], None]) -> str:
    """The checks on the bench kit's engine, added to ``checks``; the engine's memory plan. The
    engine is dropped on return."""
    before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    engine = Engine(kit.base, kit.tokenizer, device=profile.device, dtype=dtype, max_rank=RANK,
                    max_adapters=profile.adapters)
    for digest, path in kit.adapters.items():
        engine.load_adapter(digest, path)
    plan = engine.plan.describe()
    # First, while the engine is all the device holds (the comparison subtracts what was there).
    progress("memory accounting")
    checks["memory_accounting"] = _timed(lambda: check_memory(engine, kit, before))
    progress("PEFT references, one row at a time")
    rows = equality_rows(engine, kit)
    references, base_outputs = peft_references(kit, rows, device, dtype)
    _free(device)  # PEFT's copy of the model, before the throughput runs
    for lora_path in ("segment", "gather"):
        progress(f"equality against PEFT, {lora_path} path")
        checks[f"peft_equality_{lora_path}"] = _timed(functools.partial(
            check_equality, engine, rows, references, base_outputs, lora_path))
    progress("mixed batch against the base alone")
    checks["mixed_vs_base"] = _timed(lambda: check_mixed_vs_base(engine, kit, profile))
    progress("continuous batching: every stream against one")
    checks["continuous_batching"] = _timed(lambda: check_continuous(engine, kit, profile))
    return plan


def run_checks(profile: Profile, dtype: torch.dtype, work_dir: Path,
               progress: Callable[[str], None] = lambda _m: None,
               production_shapes: bool = True) -> dict[str, Any]:
    """Build the kit under ``work_dir``, run every check; the report."""
    started = time.perf_counter()
    # First of all, also where the check cannot run: it tells why (a CPU torch, no GPU seen).
    environment = gpu_env.environment()
    progress(f"environment: {json.dumps(environment)}")
    device = require_device(profile.device)
    checks: dict[str, dict[str, Any]] = {}
    # Before anything else: numbers taken on a cuDNN or cuBLAS other than torch's own would
    # describe the wrong libraries.
    checks["libraries"] = gpu_env.library_check()
    checks["libraries_in_stub_env"] = gpu_env.stub_library_check()
    for name in ("libraries", "libraries_in_stub_env"):
        for problem in checks[name].get("problems", []):
            progress(f"{name}: FAIL: {problem}")
    progress(f"building a random Llama (hidden {profile.shape.hidden}, "
             f"{profile.shape.layers} layers) and {profile.adapters} adapters")
    kit = build_bench_kit(work_dir / "kit", n_adapters=profile.adapters, shape=profile.shape,
                          delta_share=ADAPTER_SHARE)
    built = time.perf_counter() - started
    plan = _engine_checks(profile, kit, dtype, device, checks, progress)
    _free(device)  # the engine is gone: the production shapes need the device's memory
    if production_shapes:
        shapes = SHAPE_PROFILES[profile.device]
        progress(f"production shapes: hidden {shapes.shape.hidden}, {shapes.shape.layers} "
                 f"layers, vocabulary {shapes.vocab}, ranks {list(shapes.ranks)}")
        rtol = logit_rtol(dtype, shapes.shape.layers)
        checks["production_shapes"] = _timed(lambda: check_production_shapes(
            shapes, device, dtype, work_dir, rtol))
    else:
        checks["production_shapes"] = {"status": Status.SKIPPED,
                                       "reason": "--no-production-shapes"}
    return {
        "mode": "gpu" if profile.device == "cuda" else "cpu dry run",
        "passed": all(c["status"] != Status.FAIL for c in checks.values()),
        "checks": checks,
        "environment": environment,
        "setup": {"memory_plan": plan, **_device_report(device),
                  "dtype": str(dtype).removeprefix("torch."),
                  "shape": profile.shape.as_dict(), "adapters": profile.adapters,
                  "rank": RANK, "targets": TARGETS, "adapter_share": ADAPTER_SHARE,
                  "new_tokens": NEW_TOKENS,
                  "kit_build_seconds": round(built, 2)},
        "seconds": round(time.perf_counter() - started, 2),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m control.tools.bench.gpu_check",
        description="The engine's GPU checks (PEFT equality on both LoRA paths, mixed batch "
                    "and continuous batching throughput, memory accounting); prints a JSON "
                    "report. --device cpu is the dry run at toy sizes.")
    parser.add_argument("--device", choices=sorted(PROFILES), default="cuda")
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16",
                        help="the serving dtype (default bfloat16, the engine's on CUDA)")
    parser.add_argument("--reps", type=int, default=None,
                        help="runs of each throughput measurement, best kept "
                             "(default 3 on cuda, 1 on cpu)")
    parser.add_argument("--work-dir", type=Path, default=None,
                        help="where to build the kit (default: a temporary folder, removed)")
    parser.add_argument("--out", type=Path, default=None, help="also write the report here")
    parser.add_argument("--no-production-shapes", action="store_true",
                        help="skip the 8B-shape check (on a GPU it builds and writes a 16 GB "
                             "random base first)")
    args = parser.parse_args(argv)
    profile = PROFILES[args.device]
    if args.reps is not None:
        if args.reps < 1:
            parser.error("--reps must be at least 1")
        profile = Profile(profile.device, profile.shape, profile.adapters, profile.judged,
                          args.reps)

    def progress(message: str) -> None:
        print(f"gpu-check: {message}", file=sys.stderr, flush=True)

    try:
        with contextlib.ExitStack() as stack:
            work = args.work_dir or Path(stack.enter_context(
                tempfile.TemporaryDirectory(prefix="lp-gpu-check-")))
            report = run_checks(profile, getattr(torch, args.dtype), work, progress,
                                production_shapes=not args.no_production_shapes)
    except CannotRun as e:
        print(f"gpu-check: {e}", file=sys.stderr)
        return EXIT_CANNOT_RUN
    text = json.dumps(report, indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")
    return 0 if report["passed"] else EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
