"""Random bench kits and the engine's in-process throughput measurements.

Shared by ``loraplane bench engine`` (``control.tools.bench.engine``) and ``make gpu-check``
(``control.tools.bench.gpu_check``), so both build the same kind of model and count tokens the
same way. This module reaches neither Triton nor the bench's open engine
(``control.tools.bench.open_peer``): the GPU check runs the governed engine only.

A bench kit is a Llama-architecture base with random weights (its shape a :class:`BenchShape`),
the byte tokenizer of the reference kit, and ``n`` LoRA adapters of rank :data:`RANK` on
:data:`TARGETS` with random weights (PEFT ``init_lora_weights=False``; no training: throughput
does not depend on what the weights say). The base's output rows are zero for every token but
printable ASCII, so every greedy step picks a printable byte: a request runs its full
``max_tokens`` (no eos), and the text it returns is exactly its tokens, one byte each.
"""

from __future__ import annotations

import hashlib
import math
import random
import statistics
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from backend.serving.cache import AdapterCache, CacheBudgets, CacheQuota
from backend.serving.engine import Engine, GenerationRequest, GenerationResult
from backend.serving.scheduler import Scheduler, SchedulerLimits
from control.contracts.digests import directory_digest
from control.tools.bench.stats import p95
from control.tools.kit import build_tokenizer

RANK, TARGETS = 16, ["q_proj", "k_proj", "v_proj", "o_proj"]
N_ADAPTERS, PROMPT_TOKENS, NEW_TOKENS = 32, 64, 32
# Each adapter's delta is this share of its projection's output (see _delta_scale): the size the
# bench's adapters have always had at hidden 512, kept at every width so that a wider base does
# not shrink the adapters into the rounding noise of bf16.
DELTA_SHARE = 0.037

# The ratio goals (the table); a measurement is compared with its goal where it is judged.
GOALS: dict[str, tuple[str, float]] = {
    "mixed_vs_base": (">=", 0.85),
    "mixed_vs_peft": (">=", 3.0),
    "continuous_32_vs_1": (">=", 6.0),
    "triton_vs_inprocess": (">=", 0.8),
    "cold_load_vs_read": ("<=", 2.0),
    "governed_vs_open": (">=", 0.95),
    "base_p95_storm_vs_quiet": ("<=", 1.2),
    "kv_bytes_copied_per_token": ("<=", 1.1),
    "decode_stall_during_prefill": ("<=", 1.5),
    "mixed_lengths_vs_uniform": (">=", 0.8),
    "peak_kv_vs_live_kv": ("<=", 1.1),
}


def meets(name: str, value: float) -> bool:
    """Whether ``value`` meets the goal of :data:`GOALS` named ``name``."""
    op, goal = GOALS[name]
    return value >= goal if op == ">=" else value <= goal


@dataclass(frozen=True)
class BenchShape:
    """The random base's shape."""

    hidden: int
    layers: int
    intermediate: int
    heads: int
    kv_heads: int

    def as_dict(self) -> dict[str, int]:
        return {"hidden": self.hidden, "layers": self.layers, "intermediate": self.intermediate,
                "heads": self.heads, "kv_heads": self.kv_heads}


# ``bench engine``'s base: scaled down to run on two CPU cores.
BENCH_SHAPE = BenchShape(hidden=512, layers=8, intermediate=1376, heads=8, kv_heads=8)


@dataclass(frozen=True)
class BenchKit:
    base: Path
    tokenizer: Path
    adapters: dict[str, Path]  # digest -> directory


def build_bench_kit(root: Path, n_adapters: int = N_ADAPTERS, seed: int = 7,
                    shape: BenchShape = BENCH_SHAPE,
                    delta_share: float = DELTA_SHARE) -> BenchKit:
    """The random base of ``shape``, the byte tokenizer and ``n_adapters`` random-weight LoRA
    adapters, each changing its projections' outputs by about ``delta_share``, written under
    ``root``."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM


    torch.manual_seed(seed)
    tok = build_tokenizer()
    tok.save_pretrained(root / "tokenizer")
    # 4,096 positions: the prefill-stall bench sends a 2,048-token prompt (rotary positions, so
    # the limit only bounds what the engine accepts)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=shape.hidden,
                      intermediate_size=shape.intermediate, num_hidden_layers=shape.layers,
                      num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
                      max_position_embeddings=4096, tie_word_embeddings=False,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id, dtype="float32")
    base = LlamaForCausalLM(cfg).eval()
    _printable_head(base, tok)
    base.save_pretrained(root / "base", safe_serialization=True)
    scale = _delta_scale(delta_share, shape.hidden, cfg.initializer_range)
    adapters: dict[str, Path] = {}
    for i in range(n_adapters):
        # One base in memory, wrapped and unwrapped per adapter: reading a multi-GB base back
        # from disk for each of 32 adapters would take minutes at hidden 4096.
        model = get_peft_model(base, LoraConfig(r=RANK, lora_alpha=RANK, target_modules=TARGETS,
                                                init_lora_weights=False))
        model.peft_config["default"].base_model_name_or_path = str(root / "base")
        with torch.no_grad():  # small random deltas: distinct adapters, sane logits
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.mul_(scale)
        out = root / "adapters" / f"a{i:02d}"
        model.save_pretrained(str(out))
        (out / "README.md").unlink(missing_ok=True)  # the registry stores only config + weights
        adapters[directory_digest(out)] = out
        base = model.unload()
    return BenchKit(root / "base", root / "tokenizer", adapters)


def _delta_scale(share: float, hidden: int, initializer_range: float) -> float:
    """The factor on PEFT's random B that makes an adapter's delta ``share`` of its projection's
    output. With PEFT's random init (uniform A and B, bounds 1/sqrt(fan in)) a unit
    input gives ``|A x| ~ 1/sqrt(3)`` per rank and ``|B A x| ~ scale/3`` per output, against
    ``initializer_range * sqrt(hidden)`` for the base projection: at hidden 512 this is the
    bench's 0.05 of old."""
    return 3 * share * initializer_range * math.sqrt(hidden)


def _printable_head(model: Any, tok: Any) -> None:
    """Zero the output rows of every token but printable ASCII (see the module notes): their
    logits are then exactly 0, below the largest of 95 random printable ones (all 95 negative
    has odds of about 2**-95; the governed side's ledger cross-check would show it)."""
    keep = [tok(chr(b), add_special_tokens=False)["input_ids"] for b in range(0x20, 0x7F)]
    if any(len(ids) != 1 for ids in keep):
        raise RuntimeError("the bench tokenizer is no longer one token per byte")
    with torch.no_grad():
        rows = torch.ones(model.lm_head.weight.shape[0], dtype=torch.bool)
        rows[[ids[0] for ids in keep]] = False
        model.lm_head.weight[rows] = 0.0


def bench_prompts(n: int, seed: int = 11) -> list[str]:
    """``n`` random lower-case prompts of :data:`PROMPT_TOKENS` tokens each (bos included)."""
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz "
    # byte tokenizer: bos + 63 bytes = 64 prompt tokens
    return ["".join(rng.choice(letters) for _ in range(PROMPT_TOKENS - 1)) for _ in range(n)]


def long_prompt(prompts: list[str], tokens: int) -> str:
    """A prompt of ``tokens`` tokens, bos included, made of ``prompts`` repeated (a byte
    tokenizer's: a character a token)."""
    text = " ".join(prompts)
    while len(text) < tokens:
        text += " " + text
    return text[:tokens - 1]


@dataclass
class TokenClock:
    """A stream's sink that keeps the time each piece arrives; ``stop`` cancels the stream (a
    bench's window is over and it need not wait for the rest)."""

    times: list[float] = field(default_factory=list)
    done: threading.Event = field(default_factory=threading.Event)
    stop: bool = False

    def cancelled(self) -> bool:
        return self.stop

    def token(self, piece: str) -> None:
        self.times.append(time.perf_counter())

    def finish(self, result: GenerationResult, outcome: str, reason: str | None) -> None:
        self.done.set()


def best_rate(fn: Callable[[], int], reps: int) -> tuple[float, int]:
    """(best tokens/s, tokens) over ``reps`` runs of ``fn`` (which returns tokens produced)."""
    best, tokens = 0.0, 0
    for _ in range(reps):
        t0 = time.perf_counter()
        n = fn()
        rate = n / (time.perf_counter() - t0)
        if rate > best:
            best, tokens = rate, n
    return best, tokens


def best_alternating(runs: Mapping[str, Callable[[], int]], reps: int) -> dict[str, float]:
    """Best tokens/s of each run, the runs alternated ``reps`` times, so that drift on a shared
    machine hits all of them alike."""
    best = dict.fromkeys(runs, 0.0)
    for _ in range(reps):
        for name, fn in runs.items():
            best[name] = max(best[name], best_rate(fn, 1)[0])
    return best


def count_tokens(results: list[GenerationResult]) -> int:
    return sum(r.tokens_out for r in results)


def run_streams(sched: Scheduler, engine: Engine, requests: list[GenerationRequest]) -> int:
    """Submit all at once (concurrent streams), wait for all; tokens produced."""
    done = threading.Semaphore(0)
    out: list[int] = []

    class Sink:
        def cancelled(self) -> bool:
            return False

        def token(self, piece: str) -> None:
            pass

        def finish(self, result: GenerationResult, outcome: str, reason: str | None) -> None:
            out.append(result.tokens_out)
            done.release()

    for r in requests:
        sched.submit(engine.open_sequence(r), Sink(), stream=True)
    for _ in requests:
        done.acquire()
    return sum(out)


@dataclass(frozen=True)
class StreamRates:
    """Best tokens/s of every request as a concurrent stream and of the first one alone, with
    the tokens each best run produced."""

    many: float
    one: float
    many_tokens: int
    one_tokens: int


def continuous_batching(engine: Engine, requests: list[GenerationRequest],
                        reps: int) -> StreamRates:
    """Every request as a concurrent stream, then the first one alone, through one scheduler
    that admits all of them at once."""
    sched = Scheduler(engine, SchedulerLimits(max_running=len(requests),
                                              max_queued=2 * len(requests)))
    try:
        many = best_rate(lambda: run_streams(sched, engine, requests), reps)
        one = best_rate(lambda: run_streams(sched, engine, requests[:1]), reps)
    finally:
        sched.stop()
    return StreamRates(many[0], one[0], many[1], one[1])


STORM_SLOTS = 4  # device slots during the storm: 32 adapters over 4, so every load is cold
STORM_REQUESTS = 24  # base-only requests timed per run
STORM_TOKENS = 8


def read_and_hash(path: Path) -> None:
    """What a cold load is compared with: read every file under ``path`` and SHA-256 it."""
    for p in sorted(path.rglob("*")):
        if p.is_file():
            hashlib.sha256(p.read_bytes()).hexdigest()


def base_latency_under_cold_loads(engine: Engine, fetch: Callable[[str], Any],
                                  digests: list[str], prompts: list[str],
                                  runs: int) -> dict[str, Any]:
    """p95 latency of base-only requests while another thread makes adapters resident from the
    store without pause (each load evicts another: read, digest check, parse, prepare, place),
    against the same requests with no loads; ``runs`` alternating runs of each.

    The storm's cache keeps only ``STORM_SLOTS`` adapters on the device and almost nothing in its
    host and store tiers, so every load does all its work. Requests go one at a time through one
    scheduler, as a latency probe, not a throughput test."""
    slot = engine.plan.slot_bytes
    cache = AdapterCache(engine, fetch,
                         # host and store tiers hold about two adapters: 32 cycling through
                         # them are fetched, hashed, parsed and prepared again on every load
                         budgets=CacheBudgets(device_bytes=STORM_SLOTS * slot,
                                              host_bytes=2 * slot, store_bytes=2 * slot),
                         quota=CacheQuota(resident_share=1.0, loads_per_minute=1e9,
                                          load_burst=10**9, room_wait_s=30.0))
    sched = Scheduler(engine, SchedulerLimits(max_running=4, max_queued=16))
    requests = [GenerationRequest(prompts[i % len(prompts)], None, max_tokens=STORM_TOKENS)
                for i in range(STORM_REQUESTS)]

    def timed() -> list[float]:
        out: list[float] = []
        for r in requests:
            t0 = time.perf_counter()
            run_streams(sched, engine, [r])
            out.append(time.perf_counter() - t0)
        return out

    def storm(stop: threading.Event, loads: list[int]) -> None:
        i = 0
        while not stop.is_set():
            cache.release(cache.acquire(digests[i % len(digests)], "storm"))
            loads[0] += 1
            i += 1

    quiet: list[float] = []
    stormy: list[float] = []
    loads = [0]
    try:
        timed()  # warm up
        for _ in range(runs):
            quiet.append(p95(timed()))
            stop = threading.Event()
            loader = threading.Thread(target=storm, args=(stop, loads), daemon=True)
            loader.start()
            try:
                stormy.append(p95(timed()))
            finally:
                stop.set()
                loader.join(60)
    finally:
        sched.stop()
        for d in list(engine.resident_adapters()):
            engine.unload_adapter(d)
    q, st = statistics.median(quiet), statistics.median(stormy)
    return {"quiet_p95_s": q, "storm_p95_s": st, "ratio": st / q,
            "quiet_p95_runs_s": quiet, "storm_p95_runs_s": stormy, "cold_loads": loads[0],
            "runs": runs}
