"""``make gpu-check``: the engine's GPU claims, checked in one call; prints a JSON report.

    python -m control.tools.bench.gpu_check                  # on a GPU, real sizes (a few minutes)
    python -m control.tools.bench.gpu_check --device cpu     # dry run: toy sizes, what CI runs

Nothing is downloaded: the model is a random bench kit (``control.tools.bench.kit``), built in a
temporary folder. The real run (``--device cuda``) builds a Llama with the layer shape of an 8B
base (hidden 4096, intermediate 14336, 32 heads, 8 key/value heads; 4 layers, so that building and
loading it take seconds) and 32 rank-16 adapters on q, k, v, o, and serves in bf16. The dry run
(``--device cpu``) runs the same checks on a toy base (hidden 64, 2 layers) with 8 adapters.

The checks, each reported with its numbers and a status (``pass``, ``fail``, ``measured``: numbers
taken, goal not judged; ``skipped`` or ``not available``, with the reason):

- ``peft_equality_segment`` and ``peft_equality_gather``: one mixed batch (every adapter once,
  base rows among them, prompts of different lengths so rows are left-padded), generated greedily
  by the engine with the LoRA path forced (``backend.serving.lora_ops.SEGMENT_MAX_ADAPTERS``),
  against
  PEFT's greedy output for each row alone on the same token ids, device and dtype. The path each
  decode step ran is read from the batch (the gather path leaves its per-row copies on it). Rows
  must be equal, except that a row may part from PEFT at a near-tie: where the two tokens' logits
  are within :data:`TIE_RTOL` of the largest logit in both the engine's and PEFT's view. bf16
  keeps 8 significant bits, and the engine rounds differently from PEFT at every layer (it folds
  the scaling into B and computes ``(x A) B``; batch shapes pick other kernels), so two correct
  implementations may order two logits that close differently; past that point the row is not
  comparable and is not compared. The equality says something only if the adapters change the
  answer: the report counts the adapter rows whose PEFT output differs from the base's on the
  same prompt, and the check fails unless at least half of them do.
- ``mixed_vs_base``: tokens/s of the mixed batch (every request its own adapter) against the
  same prompts on the base alone, alternated, best of ``--reps`` (``control.tools.bench.kit``).
- ``continuous_batching``: tokens/s of every request as a concurrent stream through the
  scheduler, against one stream alone.
- ``memory_accounting``: the engine's memory by category (``backend.serving.memory_report``) with a
  batch of every adapter running on the gather path and its prompts in a prefix cache, against
  ``torch.cuda.memory_allocated()`` less what was allocated before the engine: within
  :data:`MEMORY_RTOL`. On a CPU there is no allocator to compare with: skipped, the categories
  reported (``tests/backend/serving/test_memory_report.py`` checks them against every live
  tensor there).

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
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

import torch

from backend.serving import lora_ops
from backend.serving.engine import DecodeBatch, Engine, GenerationRequest, GenerationResult
from backend.serving.memory_report import resident_memory
from backend.serving.prefix_cache import PrefixCache, PrefixKey
from backend.serving.scheduler import Scheduler, SchedulerLimits
from control.tools.bench.kit import (
    GOALS,
    NEW_TOKENS,
    RANK,
    TARGETS,
    BenchKit,
    BenchShape,
    bench_prompts,
    best_alternating,
    build_bench_kit,
    continuous_batching,
    count_tokens,
    meets,
)

# A row may part from PEFT where its two candidate tokens' logits are this close, relative to the
# largest logit (see the module notes): 4 to 8 bf16 steps at the top logit's magnitude. Measured on
# the CPU at hidden 512, bf16 rows part at 1 or 2 steps, and in about half the rows: the logits of
# 95 printable candidates crowd a grid of a few hundred bf16 values.
TIE_RTOL = 2.0**-5
# Each adapter changes its projections' outputs by about half (control.tools.bench.kit): measured on
# the CPU profiles, every adapter row's first token then differs from the base's, so equality
# with PEFT tells the adapters apart. Throughput does not depend on the values.
ADAPTER_SHARE = 0.5
# The memory categories must add up to what the allocator holds within this share (the issue's).
MEMORY_RTOL = 0.05
EQUALITY_TOKENS = 16  # new tokens per row in the equality checks
PREFIX_CACHE_BYTES = 1 << 30  # holds every prompt of the memory check at the real sizes
BASE_ROW_EVERY = 4  # one base row after every this many adapter rows
EXIT_FAILED, EXIT_CANNOT_RUN = 1, 2


class Status(StrEnum):
    PASS = "pass"
    FAIL = "fail"
    MEASURED = "measured"  # numbers taken; the goal is judged on a GPU only
    SKIPPED = "skipped"
    NOT_AVAILABLE = "not available"


@dataclass(frozen=True)
class Profile:
    """What one mode builds and how it judges."""

    device: str
    shape: BenchShape
    adapters: int
    judged: bool  # throughput goals judged (real sizes on a GPU), else only measured
    reps: int


PROFILES = {
    # The layer shape of an 8B Llama; 4 layers: each ratio is per layer, and 4 build in seconds.
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


@contextlib.contextmanager
def forced_path(path: str) -> Iterator[None]:
    """Every batch made inside takes ``path`` ("segment" or "gather") whatever its number of
    distinct adapters (``SlotBatch.from_slots`` reads the threshold at call time)."""
    saved = lora_ops.SEGMENT_MAX_ADAPTERS
    lora_ops.SEGMENT_MAX_ADAPTERS = 0 if path == "gather" else sys.maxsize
    try:
        yield
    finally:
        lora_ops.SEGMENT_MAX_ADAPTERS = saved


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


def compare(row: int, ours: Greedy, theirs: Greedy) -> dict[str, Any] | None:
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
    bound = TIE_RTOL * float(theirs.logits[k].abs().max())
    return {"row": row, "position": k, "engine_token": a, "peft_token": b,
            "engine_margin": engine_margin, "peft_margin": peft_margin, "tie_bound": bound,
            "tie": max(engine_margin, peft_margin) <= bound}


def check_equality(engine: Engine, rows: list[Row], references: list[Greedy],
                   base_outputs: list[Greedy], path: str) -> dict[str, Any]:
    """The engine's greedy batch with ``path`` forced, against PEFT row by row."""
    with forced_path(path):
        ours, paths, gathered = engine_greedy(engine, rows)
    partings = [p for i, (o, t) in enumerate(zip(ours, references, strict=True))
                if (p := compare(i, o, t)) is not None]
    ran = sorted(set(paths) - {"none"})
    adapter_rows = [i for i, r in enumerate(rows) if r.adapter is not None]
    changed = sum(references[i].tokens != base_outputs[i].tokens for i in adapter_rows)
    first_step = max(float((o.logits[0] - t.logits[0]).abs().max())
                     for o, t in zip(ours, references, strict=True))
    problems = []
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
        "tokens_per_row": EQUALITY_TOKENS,
        "partings": partings,
    }


# -- throughput ------------------------------------------------------------------------------

def _goal(name: str) -> str:
    op, value = GOALS[name]
    return f"{op} {value}"


def judge(name: str, ratio: float, complete: bool, judged: bool) -> Status:
    """A throughput check's status: a measurement that lost tokens fails; otherwise the ratio
    against the goal of ``name`` where ``judged``, else only measured."""
    if not complete:
        return Status.FAIL
    if not judged:
        return Status.MEASURED
    return Status.PASS if meets(name, ratio) else Status.FAIL


def check_mixed_vs_base(engine: Engine, kit: BenchKit, profile: Profile) -> dict[str, Any]:
    """The mixed batch against the base alone on the same prompts, alternated."""
    prompts = bench_prompts(len(kit.adapters))
    mixed = [GenerationRequest(p, d, max_tokens=NEW_TOKENS)
             for p, d in zip(prompts, kit.adapters, strict=True)]
    bare = [GenerationRequest(p, None, max_tokens=NEW_TOKENS) for p in prompts]
    counts: dict[str, int] = {}

    def run(name: str, requests: list[GenerationRequest]) -> Callable[[], int]:
        def once() -> int:
            results: list[GenerationResult] = engine.generate(requests)
            counts[name] = count_tokens(results)
            return counts[name]
        return once

    run("mixed", mixed[:2])()  # warm-up: first kernels, allocator pools
    best = best_alternating({"mixed": run("mixed", mixed), "base": run("base", bare)},
                            profile.reps)
    expected = len(prompts) * NEW_TOKENS  # the printable head: no row stops early
    ratio = best["mixed"] / best["base"]
    complete = counts == {"mixed": expected, "base": expected}
    return {"status": judge("mixed_vs_base", ratio, complete, profile.judged),
            "ratio": ratio, "goal": _goal("mixed_vs_base"), "goal_judged": profile.judged,
            "mixed_tokens_per_s": best["mixed"], "base_tokens_per_s": best["base"],
            "requests": len(mixed), "adapters": len(set(kit.adapters)),
            "tokens_per_run": counts, "tokens_expected": expected, "reps": profile.reps}


def check_continuous(engine: Engine, kit: BenchKit, profile: Profile) -> dict[str, Any]:
    """Every request as a concurrent stream against one stream alone (the scheduler)."""
    prompts = bench_prompts(len(kit.adapters))
    requests = [GenerationRequest(p, d, max_tokens=NEW_TOKENS)
                for p, d in zip(prompts, kit.adapters, strict=True)]
    rates = continuous_batching(engine, requests, profile.reps)
    ratio = rates.many / rates.one
    # The goal is written for 32 streams; fewer (the dry run) cannot be judged against it.
    judged = profile.judged and len(requests) == 32
    tokens = {"many": rates.many_tokens, "one": rates.one_tokens}
    expected = {"many": len(requests) * NEW_TOKENS, "one": NEW_TOKENS}
    return {"status": judge("continuous_32_vs_1", ratio, tokens == expected, judged),
            "ratio": ratio, "goal": _goal("continuous_32_vs_1"), "goal_judged": judged,
            "streams": len(requests), "many_streams_tokens_per_s": rates.many,
            "one_stream_tokens_per_s": rates.one, "tokens_per_run": tokens,
            "tokens_expected": expected, "reps": profile.reps}


# -- memory ----------------------------------------------------------------------------------

class _Quiet:
    """A sink that takes every token and keeps nothing."""

    def cancelled(self) -> bool:
        return False

    def token(self, piece: str) -> None:
        pass

    def finish(self, result: GenerationResult, outcome: str, reason: str | None) -> None:
        pass


def check_memory(engine: Engine, kit: BenchKit, allocated_before: int) -> dict[str, Any]:
    """The engine's categories with a batch of every adapter running (between two decode
    steps, driven on this thread) and its prompts in a prefix cache, against the allocator."""
    prompts = bench_prompts(len(kit.adapters))
    prefix: PrefixCache[DecodeBatch] = PrefixCache(PREFIX_CACHE_BYTES)
    sched = Scheduler(engine, SchedulerLimits(max_running=len(prompts),
                                              max_queued=len(prompts)), prefix, start=False)
    try:
        with forced_path("gather"):  # what a batch of this many adapters takes anyway
            for p, d in zip(prompts, kit.adapters, strict=True):
                seq = engine.open_sequence(GenerationRequest(p, d, max_tokens=NEW_TOKENS))
                sched.submit(seq, _Quiet(), key=PrefixKey("bench", d, "bench",
                                                          tuple(seq.prompt_ids), salt=b"bench"))
            for _ in range(3):  # prefill, then decode steps: KV, gathered copies, workspace
                sched.run_once()
        categories = resident_memory(engine, sched, prefix)
        counted = sum(categories.values())
        out: dict[str, Any] = {"categories": categories, "counted_bytes": counted,
                               "tolerance": MEMORY_RTOL}
        if engine.device.type != "cuda":
            return {"status": Status.SKIPPED,
                    "reason": "torch.cuda.memory_allocated() needs a CUDA device (on a CPU, "
                              "tests/backend/serving/test_memory_report.py counts every live "
                              "tensor instead)",
                    **out}
        torch.cuda.synchronize(engine.device)
        allocated = torch.cuda.memory_allocated(engine.device) - allocated_before
        share = counted / allocated
        return {"status": Status.PASS if abs(share - 1) <= MEMORY_RTOL else Status.FAIL,
                "allocated_bytes": allocated, "counted_over_allocated": share, **out}
    finally:
        sched.stop()


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


def run_checks(profile: Profile, dtype: torch.dtype, work_dir: Path,
               progress: Callable[[str], None] = lambda _m: None) -> dict[str, Any]:
    """Build the kit under ``work_dir``, run every check; the report."""
    started = time.perf_counter()
    device = require_device(profile.device)
    progress(f"building a random Llama (hidden {profile.shape.hidden}, "
             f"{profile.shape.layers} layers) and {profile.adapters} adapters")
    kit = build_bench_kit(work_dir / "kit", n_adapters=profile.adapters, shape=profile.shape,
                          delta_share=ADAPTER_SHARE)
    built = time.perf_counter() - started
    before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    engine = Engine(kit.base, kit.tokenizer, device=profile.device, dtype=dtype, max_rank=RANK,
                    max_adapters=profile.adapters)
    for digest, path in kit.adapters.items():
        engine.load_adapter(digest, path)
    checks: dict[str, dict[str, Any]] = {}
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
    return {
        "mode": "gpu" if profile.device == "cuda" else "cpu dry run",
        "passed": all(c["status"] != Status.FAIL for c in checks.values()),
        "checks": checks,
        "setup": {**_device_report(device), "dtype": str(dtype).removeprefix("torch."),
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
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16",
                        help="the serving dtype (default bfloat16, the engine's on CUDA)")
    parser.add_argument("--reps", type=int, default=None,
                        help="runs of each throughput measurement, best kept "
                             "(default 3 on cuda, 1 on cpu)")
    parser.add_argument("--work-dir", type=Path, default=None,
                        help="where to build the kit (default: a temporary folder, removed)")
    parser.add_argument("--out", type=Path, default=None, help="also write the report here")
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
            report = run_checks(profile, getattr(torch, args.dtype), work, progress)
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
