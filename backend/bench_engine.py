"""``loraplane bench engine``: the multi-LoRA engine's ratios, measured side by side in one run.

Setup (the issue's table): a Llama base scaled for benchmarking (hidden 512, 8 layers, random
init), 32 LoRA adapters of rank 16 on q, k, v, o with random weights (PEFT
``init_lora_weights=False``; no training: throughput does not depend on what the weights say),
32 requests over the 32 adapters, 64-token prompts, 32 new tokens, greedy.

Each ratio compares two measurements taken in this run, alternated, best of ``reps`` each (the
machine is shared; the best run is the least disturbed one). Triton ratios start a real
tritonserver (two, one after the other, for governed vs open) on free ports.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import random
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from backend.cache import AdapterCache, CacheBudgets, TenantPolicy
from backend.engine import Engine, GenerationRequest, GenerationResult
from backend.scheduler import Scheduler, SchedulerLimits

HIDDEN, LAYERS, RANK, TARGETS = 512, 8, 16, ["q_proj", "k_proj", "v_proj", "o_proj"]
N_ADAPTERS, PROMPT_TOKENS, NEW_TOKENS = 32, 64, 32
TENANTS = 4
UNGOVERNED_ENV = "LORAPLANE_BENCH_UNGOVERNED"  # read by backend.triton_glue

GOALS: dict[str, tuple[str, float]] = {
    "mixed_vs_base": (">=", 0.85),
    "mixed_vs_peft": (">=", 3.0),
    "continuous_32_vs_1": (">=", 6.0),
    "triton_vs_inprocess": (">=", 0.8),
    "cold_load_vs_read": ("<=", 2.0),
    "governed_vs_open": (">=", 0.95),
}


@dataclass(frozen=True)
class BenchKit:
    base: Path
    tokenizer: Path
    adapters: dict[str, Path]  # digest -> directory


def build_bench_kit(root: Path, n_adapters: int = N_ADAPTERS, seed: int = 7) -> BenchKit:
    """The scaled base, the byte tokenizer and ``n_adapters`` random-weight LoRA adapters."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    from backend.kit import build_tokenizer
    from control.digests import directory_digest

    torch.manual_seed(seed)
    tok = build_tokenizer()
    tok.save_pretrained(root / "tokenizer")
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=HIDDEN, intermediate_size=1376,
                      num_hidden_layers=LAYERS, num_attention_heads=8, num_key_value_heads=8,
                      max_position_embeddings=256, tie_word_embeddings=False,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id, dtype="float32")
    base = LlamaForCausalLM(cfg).eval()
    base.save_pretrained(root / "base", safe_serialization=True)
    adapters: dict[str, Path] = {}
    for i in range(n_adapters):
        model = get_peft_model(LlamaForCausalLM.from_pretrained(root / "base"),
                               LoraConfig(r=RANK, lora_alpha=RANK, target_modules=TARGETS,
                                          init_lora_weights=False))
        with torch.no_grad():  # small random deltas: distinct adapters, sane logits
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.mul_(0.05)
        out = root / "adapters" / f"a{i:02d}"
        model.save_pretrained(str(out))
        (out / "README.md").unlink(missing_ok=True)  # the registry stores only config + weights
        adapters[directory_digest(out)] = out
    return BenchKit(root / "base", root / "tokenizer", adapters)


def _prompts(n: int, seed: int = 11) -> list[str]:
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz "
    # byte tokenizer: bos + 63 bytes = 64 prompt tokens
    return ["".join(rng.choice(letters) for _ in range(PROMPT_TOKENS - 1)) for _ in range(n)]


def _best(fn: Callable[[], int], reps: int) -> tuple[float, int]:
    """(best tokens/s, tokens) over ``reps`` runs of ``fn`` (which returns tokens produced)."""
    best, tokens = 0.0, 0
    for _ in range(reps):
        t0 = time.perf_counter()
        n = fn()
        rate = n / (time.perf_counter() - t0)
        if rate > best:
            best, tokens = rate, n
    return best, tokens


def _tokens(results: list[GenerationResult]) -> int:
    return sum(r.tokens_out for r in results)


def _run_scheduler(sched: Scheduler, engine: Engine, requests: list[GenerationRequest]) -> int:
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


def _peft_mixed(kit: BenchKit, prompts: list[str], digests: list[str],
                device: torch.device, dtype: torch.dtype) -> Callable[[], int]:
    from peft import PeftModel
    from transformers import AutoTokenizer, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(kit.tokenizer)
    base = LlamaForCausalLM.from_pretrained(kit.base, dtype=dtype)
    names = {d: f"a{i}" for i, d in enumerate(digests)}
    first = digests[0]
    model = PeftModel.from_pretrained(base, kit.adapters[first], adapter_name=names[first])
    for d in digests[1:]:
        model.load_adapter(kit.adapters[d], adapter_name=names[d])
    model = model.to(device).eval()  # the same device and dtype as the engine
    enc = [[tok.bos_token_id, *tok(p, add_special_tokens=False)["input_ids"]] for p in prompts]
    ids = torch.tensor(enc, device=device)
    eos = tok.eos_token_id

    def run() -> int:
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                 do_sample=False, max_new_tokens=NEW_TOKENS,
                                 adapter_names=[names[d] for d in digests],
                                 pad_token_id=tok.pad_token_id)
        new = out[:, ids.shape[1]:].tolist()
        return sum(len(row[: row.index(eos) + 1]) if eos in row else len(row) for row in new)

    return run


def _read_and_hash(path: Path) -> None:
    for p in sorted(path.rglob("*")):
        if p.is_file():
            hashlib.sha256(p.read_bytes()).hexdigest()


def _p95(xs: list[float]) -> float:
    return statistics.quantiles(xs, n=20)[-1] if len(xs) >= 2 else xs[0]


@contextlib.contextmanager
def _deployment(home: Path, kit: BenchKit, *, ungoverned: bool) -> Iterator[tuple[Any, dict[
        str, str]]]:
    """A real deployment on free ports serving the bench kit; yields (deployment, tickets)."""
    from control.clients import free_port, request_ticket
    from control.config import Settings
    from control.registry import Registry
    from control.serve import Deployment, Ports

    settings = Settings(home=home, db_url=f"sqlite:///{home / 'loraplane.db'}", max_rank=RANK)
    fresh = not (home / "loraplane.db").exists()
    settings.ensure_dirs()
    keys: dict[str, str] = {}
    aliases: dict[str, tuple[str, str]] = {}  # digest -> (tenant, alias)
    for i, d in enumerate(kit.adapters):
        aliases[d] = (f"t{i % TENANTS}", f"t{i % TENANTS}-a{i:02d}")
    keyfile = home / "bench-keys.txt"
    if fresh:
        reg = Registry(settings)
        base = reg.register_base(kit.base, kit.tokenizer, name="bench-base", actor="bench")
        for t in sorted({t for t, _ in aliases.values()}):
            keys[t] = reg.create_tenant(t, actor="bench")
        for d, path in kit.adapters.items():
            tenant, alias = aliases[d]
            digest = reg.register_adapter(path, tenant=tenant, alias=alias, actor="bench",
                                          base=base)
            reg.release(digest, evaluation={"suite": "bench", "passed": True}, actor="bench")
            reg.grant(tenant, alias, actor="bench")
        keyfile.write_text("\n".join(f"{t} {k}" for t, k in keys.items()))
    else:
        keys = dict(line.split(" ", 1) for line in keyfile.read_text().splitlines())
    # no prompt cache: repeated bench prompts would skip prefill and flatter Triton's numbers
    env = {"LORAPLANE_MAX_RANK": str(RANK), "LORAPLANE_LOG_LEVEL": "WARNING",
           "LORAPLANE_PREFIX_CACHE_BYTES": "0"}
    if ungoverned:
        env[UNGOVERNED_ENV] = "1"
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    dep = Deployment(settings, Ports(free_port(), free_port(), free_port(), free_port()),
                     actor="bench")
    try:
        dep.start()
        tickets = {}
        for d, (tenant, alias) in aliases.items():
            status, body = request_ticket(dep.gateway_url, keys[tenant], alias)
            if status != 200:
                raise RuntimeError(f"bench ticket for {alias}: {status} {body}")
            tickets[d] = str(body["ticket"])
        yield dep, tickets
    finally:
        dep.stop()
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _triton_rate(dep: Any, tickets: dict[str, str], prompts: list[str], digests: list[str],
                 reps: int, tokens_per_request: dict[str, int] | None) -> tuple[float, dict[
                     str, int]]:
    """Best tokens/s of 32 concurrent unary gRPC clients; tokens counted from the ledger."""
    from backend.ledger import Ledger
    from control.clients import generate
    from control.db import make_engine

    assert dep.triton is not None
    url = dep.triton.grpc_url

    def one(i: int) -> tuple[str, str]:
        g = generate(url, prompts[i], tickets[digests[i]], protocol="grpc",
                     max_tokens=NEW_TOKENS)
        return g.request_id, g.text

    with ThreadPoolExecutor(len(prompts)) as pool:
        list(pool.map(one, range(len(prompts))))  # warm: loads every adapter once
        best, counted = 0.0, tokens_per_request or {}
        for _ in range(reps):
            t0 = time.perf_counter()
            out = list(pool.map(one, range(len(prompts))))
            dt = time.perf_counter() - t0
            if tokens_per_request is None:
                ledger = Ledger(make_engine(dep.settings.db_url))
                counted = {}
                for i, (rid, _text) in enumerate(out):
                    row = ledger.get(rid)
                    counted[digests[i]] = int(row.tokens_out or 0) if row else 0
            best = max(best, sum(counted.values()) / dt)
    return best, counted


def run_bench(reps: int = 2, *, triton: bool = True,
              progress: Callable[[str], None] = lambda _m: None,
              work_dir: Path | None = None) -> dict[str, Any]:
    """Measure every ratio; returns {"ratios": {...}, "measurements": {...}, "setup": {...}}."""
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    ctx = tempfile.TemporaryDirectory(prefix="lp-bench-") if work_dir is None else None
    root = Path(ctx.name) if ctx is not None else Path(work_dir)  # type: ignore[arg-type]
    try:
        return _run(root, reps, triton, progress)
    finally:
        if ctx is not None:
            ctx.cleanup()


def _run(root: Path, reps: int, triton: bool,
         progress: Callable[[str], None]) -> dict[str, Any]:
    m: dict[str, float] = {}
    progress("building the bench kit (random-init base and 32 adapters)")
    kit = build_bench_kit(root / "kit")
    digests = list(kit.adapters)
    prompts = _prompts(N_ADAPTERS)
    engine = Engine(kit.base, kit.tokenizer, device=None, max_rank=RANK, max_adapters=N_ADAPTERS)

    progress("cold loads vs read+hash")
    from control.store import ArtifactStore

    store = ArtifactStore(root / "store")
    for d, path in kit.adapters.items():
        store.put(path, d)
    # one-off costs of a fresh engine (wrapping modules, allocating slot banks) are not a load's
    first = digests[0]
    engine.load_adapter(first, kit.adapters[first])
    engine.unload_adapter(first)
    reads: list[float] = []
    for d in digests:
        t0 = time.perf_counter()
        _read_and_hash(store.path(d))
        reads.append(time.perf_counter() - t0)
    cache = AdapterCache(engine, store.read_verified, budgets=CacheBudgets(),
                         policy=TenantPolicy(resident_share=1.0, loads_per_minute=1e6,
                                             load_burst=10**6))
    loads: list[float] = []
    for d in digests:
        t0 = time.perf_counter()
        cache.release(cache.acquire(d, None))
        loads.append(time.perf_counter() - t0)
    m["cold_load_p95_s"], m["read_hash_p95_s"] = _p95(loads), _p95(reads)

    mixed = [GenerationRequest(p, d, max_tokens=NEW_TOKENS) for p, d in zip(prompts, digests,
                                                                            strict=True)]
    bare = [GenerationRequest(p, None, max_tokens=NEW_TOKENS) for p in prompts]
    progress("mixed batch vs base batch vs PEFT")
    engine.generate(mixed[:2])  # warm up
    peft_run = _peft_mixed(kit, prompts, digests, engine.device, engine.dtype)
    best = {"mixed": 0.0, "base": 0.0, "peft": 0.0}
    for _ in range(reps):  # alternate, so drift on a shared machine hits all three alike
        best["mixed"] = max(best["mixed"], _best(lambda: _tokens(engine.generate(mixed)), 1)[0])
        best["base"] = max(best["base"], _best(lambda: _tokens(engine.generate(bare)), 1)[0])
        best["peft"] = max(best["peft"], _best(peft_run, 1)[0])
    m.update({f"{k}_tokens_per_s": v for k, v in best.items()})

    progress("continuous batching: 32 streams vs 1")
    sched = Scheduler(engine, SchedulerLimits(max_running=32, max_queued=64))
    try:
        m["streams_32_tokens_per_s"] = _best(lambda: _run_scheduler(sched, engine, mixed),
                                             reps)[0]
        m["streams_1_tokens_per_s"] = _best(lambda: _run_scheduler(sched, engine, mixed[:1]),
                                            reps)[0]
    finally:
        sched.stop()
    del peft_run

    ratios: dict[str, float | None] = {
        "mixed_vs_base": best["mixed"] / best["base"],
        "mixed_vs_peft": best["mixed"] / best["peft"],
        "continuous_32_vs_1": m["streams_32_tokens_per_s"] / m["streams_1_tokens_per_s"],
        "triton_vs_inprocess": None,
        "cold_load_vs_read": m["cold_load_p95_s"] / m["read_hash_p95_s"],
        "governed_vs_open": None,
    }
    if triton:
        del engine, cache
        home = root / "home"
        home.mkdir()
        progress("Triton, governed: 32 concurrent gRPC clients")
        with _deployment(home, kit, ungoverned=False) as (dep, tickets):
            gov, counted = _triton_rate(dep, tickets, prompts, digests, reps, None)
        progress("Triton, open (no ticket, revocation or ledger checks): 32 clients")
        with _deployment(home, kit, ungoverned=True) as (dep, tickets):
            open_rate, _ = _triton_rate(dep, tickets, prompts, digests, reps, counted)
        m["triton_governed_tokens_per_s"], m["triton_open_tokens_per_s"] = gov, open_rate
        ratios["triton_vs_inprocess"] = gov / m["streams_32_tokens_per_s"]
        ratios["governed_vs_open"] = gov / open_rate
    return {
        "ratios": ratios,
        "goals": {k: f"{op} {v}" for k, (op, v) in GOALS.items()},
        "met": {k: None if ratios[k] is None else (
            ratios[k] >= v if op == ">=" else ratios[k] <= v)  # type: ignore[operator]
            for k, (op, v) in GOALS.items()},
        "measurements": m,
        "setup": {"hidden": HIDDEN, "layers": LAYERS, "rank": RANK, "targets": TARGETS,
                  "requests": N_ADAPTERS, "adapters": N_ADAPTERS,
                  "prompt_tokens": PROMPT_TOKENS, "new_tokens": NEW_TOKENS, "reps": reps,
                  "device": str(torch.device("cuda" if torch.cuda.is_available() else "cpu")),
                  "threads": torch.get_num_threads()},
    }
