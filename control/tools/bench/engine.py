"""``loraplane bench engine``: the multi-LoRA engine's ratios, measured side by side in one run.

Setup (the issue's table): a Llama base scaled for benchmarking (hidden 512, 8 layers, random
init), 32 LoRA adapters of rank 16 on q, k, v, o with random weights, 32 requests over the 32
adapters, 64-token prompts, 32 new tokens, greedy: a bench kit of ``control.tools.bench.kit``, whose
printable-only head makes every request run its full 32 tokens (no eos) and return exactly its
tokens as text, one byte each. A client can then count a request's tokens from its answer alone;
the shapes, and so the work per token, are those of an unrestricted head.

In-process ratios compare measurements taken in this run, alternated, best of ``reps`` each (the
machine is shared; the best run is the least disturbed one).

``governed_vs_open`` needs more than a best-of, because governance costs a few percent and the
shared machine's noise is larger. Two real tritonservers run side by side on one registry: the
production deployment (role ``all``: gateway, follower, governed engine) and a second Triton host
(role ``triton``, its own ports and host id, trusting the same keys) started from the
benchmark's own model repository, whose engine is ``control.tools.bench.open_peer.OpenService`` (no
governance checks, no ledger, no watcher). Bursts of 32 concurrent gRPC requests alternate
between them, never overlapping, ``triton_runs`` (at least 5) each, in ABBA order so that drift
favours neither side. Each side counts its tokens from the texts its own answers returned; the
governed count is cross-checked against its ledger rows, and an open host that wrote any ledger
row fails the bench. Reported: the ratio of the medians, each side's median, quartiles and
extremes, and the spread of the per-round ratios.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from backend.serving.cache import AdapterCache, CacheBudgets, CacheQuota
from backend.serving.engine import Engine, GenerationRequest
from backend.serving.fingerprint import CHECK_EVERY as FINGERPRINT_EVERY
from backend.serving.kv_arena import KvTraffic
from control.contracts.config import Settings
from control.contracts.db import make_engine
from control.contracts.ledger import Ledger
from control.contracts.store import ArtifactStore
from control.ops.clients import infer_with, request_ticket
from control.ops.serve import Deployment, Ports
from control.tools.bench.kit import (
    BENCH_SHAPE,
    GOALS,
    N_ADAPTERS,
    NEW_TOKENS,
    PROMPT_TOKENS,
    RANK,
    TARGETS,
    BenchKit,
    base_latency_under_cold_loads,
    bench_prompts,
    best_alternating,
    build_bench_kit,
    continuous_batching,
    count_tokens,
    meets,
    read_and_hash,
)
from control.tools.bench.kv_shapes import padding_costs
from control.tools.bench.open_peer import open_repository
from control.tools.bench.prefill_stall import decode_stall
from control.tools.bench.stats import p95
from projections.follower import open_registry

if TYPE_CHECKING:
    from control.ops.serve import Deployment

TENANTS = 4
TRITON_RUNS, MIN_TRITON_RUNS = 15, 5  # bursts per side for governed_vs_open
GOVERNED_HOST, OPEN_HOST = "bench-governed", "bench-open"  # the ledger's host column

log = logging.getLogger("loraplane.bench")


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


@dataclass(frozen=True)
class Burst:
    """One timed burst through one Triton host: every request sent at once, every answer in."""

    seconds: float
    request_ids: list[str]
    texts: list[str]
    tokens: int  # counted from ``texts``, what this host's answers returned

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


@dataclass(frozen=True)
class Spread:
    """One side's runs: the median with the quartiles and extremes around it."""

    runs: list[float]

    @property
    def median(self) -> float:
        return statistics.median(self.runs)

    def as_dict(self) -> dict[str, Any]:
        q1, _, q3 = statistics.quantiles(self.runs, n=4, method="inclusive")
        return {"median": self.median, "min": min(self.runs), "q1": q1, "q3": q3,
                "max": max(self.runs), "runs": list(self.runs)}


def median_interval(xs: list[float], level: float = 0.95) -> tuple[float, float, float]:
    """A distribution-free confidence interval for the median of ``xs`` (the sign test's): the
    k-th smallest and k-th largest value, k as large as ``level`` allows; (low, high, coverage).
    With 5 values it is (min, max) at 94 %; with 15, the 4th and 12th at 96 %."""
    n, ys = len(xs), sorted(xs)

    def at_most(j: int) -> float:  # P(B <= j), B ~ Binomial(n, 1/2)
        return sum(math.comb(n, i) for i in range(j + 1)) / 2**n

    k = 1
    while k < (n + 1) // 2 and 2 * at_most(k) <= 1 - level:
        k += 1
    return ys[k - 1], ys[n - k], 1 - 2 * at_most(k - 1)


@dataclass
class _SideBySide:
    """The governed deployment and the open Triton host, both serving the bench kit."""

    governed: Deployment
    open: Deployment
    keys: dict[str, str]  # tenant -> API key
    aliases: dict[str, tuple[str, str]]  # digest -> (tenant, alias)

    def tickets(self) -> dict[str, str]:
        """A fresh ticket per adapter from the governed gateway; both hosts accept them."""
        tickets = {}
        for d, (tenant, alias) in self.aliases.items():
            status, body = request_ticket(self.governed.gateway_url, self.keys[tenant], alias)
            if status != 200:
                raise RuntimeError(f"bench ticket for {alias}: {status} {body}")
            tickets[d] = str(body["ticket"])
        return tickets


@contextlib.contextmanager
def _side_by_side(root: Path, kit: BenchKit) -> Iterator[_SideBySide]:
    """Register the bench kit, then start the governed deployment (role ``all``) and the open
    Triton host (role ``triton``, the benchmark's own model repository) on free ports."""
    home = root / "home"
    settings = Settings(home=home, db_url=f"sqlite:///{home / 'loraplane.db'}", max_rank=RANK)
    settings.ensure_dirs()
    aliases = {d: (f"t{i % TENANTS}", f"t{i % TENANTS}-a{i:02d}")
               for i, d in enumerate(kit.adapters)}
    reg = open_registry(settings)
    base = reg.register_base(kit.base, kit.tokenizer, name="bench-base", actor="bench")
    keys = {t: reg.create_tenant(t, actor="bench") for t in sorted({t for t, _ in
                                                                    aliases.values()})}
    for d, path in kit.adapters.items():
        tenant, alias = aliases[d]
        digest = reg.register_adapter(path, tenant=tenant, alias=alias, actor="bench", base=base)
        reg.advance(digest, external=True, evaluation={"suite": "bench", "passed": True},
                    actor="bench")
        reg.grant(tenant, alias, actor="bench")
    # No prompt cache: repeated bench prompts would skip prefill and flatter Triton's numbers.
    # Both tritonservers inherit these; neither reads anything that turns governance off.
    env = {"LORAPLANE_MAX_RANK": str(RANK), "LORAPLANE_LOG_LEVEL": "WARNING",
           "LORAPLANE_PREFIX_CACHE_BYTES": "0"}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)

    def ports() -> Ports:
        return Ports.free()

    governed = Deployment(settings, ports(), actor="bench", host_id=GOVERNED_HOST)
    opened = Deployment(settings, ports(), actor="bench", role="triton", host_id=OPEN_HOST,
                        model_repository=open_repository(root / "open-repository"))
    try:
        governed.start()
        # Only once the first is ready: both assemble Triton's backend folder in one run folder.
        opened.start()
        yield _SideBySide(governed, opened, keys, aliases)
    finally:
        for dep in (opened, governed):
            try:
                dep.stop()
            except RuntimeError:
                # Deployment.start stops what it started when Triton fails to get ready, and
                # a second stop then raises ("Event loop is closed"), which would hide why.
                log.warning("stopping a bench deployment failed", exc_info=True)
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class _Clients:
    """The bench's gRPC clients: one per (client thread, Triton host), kept across bursts.

    ``control.ops.clients.generate`` opens a channel per request; here that set-up, slow on a
    loaded machine, would stagger the burst's arrivals and turn one batch into many smaller
    ones, a cost of the client that varies from burst to burst."""

    def __init__(self, size: int) -> None:
        self.pool = ThreadPoolExecutor(size, thread_name_prefix="bench-client")
        self._local = threading.local()
        self._opened: list[Any] = []
        self._lock = threading.Lock()

    def client(self, url: str) -> Any:
        import tritonclient.grpc as grpcclient

        mine: dict[str, Any] = self._local.__dict__.setdefault("clients", {})
        if url not in mine:
            mine[url] = grpcclient.InferenceServerClient(url)
            with self._lock:
                self._opened.append(mine[url])
        return mine[url]

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        for c in self._opened:
            c.close()


def _generate(client: Any, prompt: str, ticket: str) -> tuple[str, str]:
    """One unary ``lora_llm`` request, as a tenant's application sends it; (request id, text).
    An error answer raises (``TritonRefused``)."""
    g = infer_with(client, "grpc", prompt, ticket, max_tokens=NEW_TOKENS)
    return g.request_id, g.text


def _burst(clients: _Clients, url: str, tickets: dict[str, str], prompts: list[str],
           digests: list[str], count: Callable[[str], int]) -> Burst:
    """Every prompt at once as a unary gRPC request (one client thread each, released
    together); timed until the last answer is in. A refused or failed request fails the bench."""
    start = threading.Barrier(len(prompts))

    def one(i: int) -> tuple[str, str]:
        client = clients.client(url)
        start.wait(timeout=60)
        return _generate(client, prompts[i], tickets[digests[i]])

    t0 = time.perf_counter()
    out = list(clients.pool.map(one, range(len(prompts))))
    seconds = time.perf_counter() - t0
    texts = [text for _rid, text in out]
    return Burst(seconds, [rid for rid, _text in out], texts, sum(count(t) for t in texts))


def _governed_vs_open(side: _SideBySide, kit: BenchKit, prompts: list[str], digests: list[str],
                      runs: int, progress: Callable[[str], None]) -> dict[str, Any]:
    """Alternate bursts between the two hosts, ``runs`` each; see the module notes."""
    from transformers import AutoTokenizer


    tok = AutoTokenizer.from_pretrained(kit.tokenizer)

    def count(text: str) -> int:  # exact here: one printable byte per token (module notes)
        return len(tok(text, add_special_tokens=False)["input_ids"])

    assert side.governed.triton is not None and side.open.triton is not None
    urls = {"governed": side.governed.triton.grpc_url, "open": side.open.triton.grpc_url}
    bursts: dict[str, list[Burst]] = {"governed": [], "open": []}
    clients = _Clients(len(prompts))
    try:
        tickets = side.tickets()
        for name in ("governed", "open"):  # untimed: loads every adapter once on each host
            _burst(clients, urls[name], tickets, prompts, digests, count)
        for r in range(runs):
            progress(f"governed vs open: round {r + 1} of {runs}")
            tickets = side.tickets()  # outside the timing; the same fresh tickets for both
            # ABBA: each side goes first in half the rounds, so drift favours neither
            for name in ("governed", "open") if r % 2 == 0 else ("open", "governed"):
                try:
                    bursts[name].append(_burst(clients, urls[name], tickets, prompts, digests,
                                               count))
                except Exception as e:
                    raise RuntimeError(f"{name} burst failed: {e}") from e
    finally:
        clients.close()

    # Cross-checks, after every timed burst: the governed ledger's own count of the same
    # requests; no ledger row from the open host (else it was not the open engine).
    ledger = Ledger(make_engine(side.governed.settings.db_url))
    ledger_tokens = 0
    for b in bursts["governed"]:
        for rid in b.request_ids:
            row = ledger.get(rid)
            ledger_tokens += int(row.tokens_out or 0) if row is not None else 0
    open_rows = sum(1 for e in ledger.query() if e.host == OPEN_HOST)
    if open_rows:
        raise RuntimeError(f"the open host wrote {open_rows} ledger rows: it was not running "
                           "control.tools.bench.open_peer.OpenService; "
                           "governed_vs_open not measured")
    differing = sum(g != o for bg, bo in zip(bursts["governed"], bursts["open"], strict=True)
                    for g, o in zip(bg.texts, bo.texts, strict=True))
    governed = Spread([b.tokens_per_s for b in bursts["governed"]])
    opened = Spread([b.tokens_per_s for b in bursts["open"]])
    rounds = Spread([g.tokens_per_s / o.tokens_per_s
                     for g, o in zip(bursts["governed"], bursts["open"], strict=True)])
    low, high, coverage = median_interval(rounds.runs)
    return {
        "ratio_of_medians": governed.median / opened.median,
        # Paired by round, so drift between rounds cancels; the interval says whether this run
        # can tell governed from open at all (noise may not pass for a result).
        "round_ratio_median_interval": {"low": low, "high": high, "coverage": coverage},
        "distinguishable_from_1": low > 1.0 or high < 1.0,
        "governed_tokens_per_s": governed.as_dict(),
        "open_tokens_per_s": opened.as_dict(),
        "round_ratios": rounds.as_dict(),
        "runs_each": runs,
        "order": "ABBA (governed first in odd rounds, open first in even rounds)",
        "requests_per_run": len(prompts),
        "tokens": {
            "governed_returned": sum(b.tokens for b in bursts["governed"]),
            "governed_ledger": ledger_tokens,
            "open_returned": sum(b.tokens for b in bursts["open"]),
        },
        "open_ledger_rows": open_rows,
        "answers_differing_between_sides": differing,
    }


def run_bench(reps: int = 2, *, triton: bool = True, triton_runs: int = TRITON_RUNS,
              progress: Callable[[str], None] = lambda _m: None,
              work_dir: Path | None = None) -> dict[str, Any]:
    """Measure every ratio; returns {"ratios": {...}, "measurements": {...},
    "governed_vs_open": {...} (medians, spreads, cross-checks), "setup": {...}}."""
    if triton and triton_runs < MIN_TRITON_RUNS:
        raise ValueError(f"governed_vs_open needs at least {MIN_TRITON_RUNS} runs of each side, "
                         f"not {triton_runs}")
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    ctx = tempfile.TemporaryDirectory(prefix="lp-bench-") if work_dir is None else None
    root = Path(ctx.name) if ctx is not None else Path(work_dir)  # type: ignore[arg-type]
    try:
        return _run(root, reps, triton_runs if triton else 0, progress)
    finally:
        if ctx is not None:
            ctx.cleanup()


def _run(root: Path, reps: int, triton_runs: int,
         progress: Callable[[str], None]) -> dict[str, Any]:
    m: dict[str, float] = {}
    progress("building the bench kit (random-init base and 32 adapters)")
    kit = build_bench_kit(root / "kit")
    digests = list(kit.adapters)
    prompts = bench_prompts(N_ADAPTERS)
    engine = Engine(kit.base, kit.tokenizer, device=None, max_rank=RANK, max_adapters=N_ADAPTERS)

    progress("cold loads vs read+hash")

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
        read_and_hash(store.path(d))
        reads.append(time.perf_counter() - t0)
    cache = AdapterCache(engine, store.read_verified, budgets=CacheBudgets(),
                         quota=CacheQuota(resident_share=1.0, loads_per_minute=1e6,
                                          load_burst=10**6))
    loads: list[float] = []
    for d in digests:
        t0 = time.perf_counter()
        cache.release(cache.acquire(d, None))
        loads.append(time.perf_counter() - t0)
    m["cold_load_p95_s"], m["read_hash_p95_s"] = p95(loads), p95(reads)

    mixed = [GenerationRequest(p, d, max_tokens=NEW_TOKENS) for p, d in zip(prompts, digests,
                                                                            strict=True)]
    bare = [GenerationRequest(p, None, max_tokens=NEW_TOKENS) for p in prompts]
    progress("mixed batch vs base batch vs PEFT")
    engine.generate(mixed[:2])  # warm up
    peft_run = _peft_mixed(kit, prompts, digests, engine.device, engine.dtype)
    best = best_alternating({"mixed": lambda: count_tokens(engine.generate(mixed)),
                             "base": lambda: count_tokens(engine.generate(bare)),
                             "peft": peft_run}, reps)
    m.update({f"{k}_tokens_per_s": v for k, v in best.items()})

    progress("weight fingerprints: a check on every pass vs none")

    def checked_every(n: int) -> int:
        engine.fingerprint_every = n
        return count_tokens(engine.generate(mixed))

    fp = best_alternating({"every_pass": lambda: checked_every(1),
                           "none": lambda: checked_every(0)}, reps)
    engine.fingerprint_every = FINGERPRINT_EVERY
    m["fingerprint_every_pass_tokens_per_s"] = fp["every_pass"]
    m["fingerprint_off_tokens_per_s"] = fp["none"]

    progress("KV bytes written per byte computed: one mixed batch")
    engine.steps.kv_traffic = KvTraffic()
    engine.generate(mixed)
    m["kv_written_per_computed_one_batch"] = engine.steps.kv_traffic.copied_per_computed()

    progress("continuous batching: 32 streams vs 1")
    engine.steps.kv_traffic = traffic = KvTraffic()
    streams = continuous_batching(engine, mixed, reps)
    m["kv_bytes_computed_streams"], m["kv_bytes_written_streams"] = (traffic.computed,
                                                                      traffic.written)
    m["kv_joins_streams"], m["kv_leaves_streams"] = traffic.joins, traffic.leaves
    kv_copied = traffic.copied_per_computed()  # before the storm below adds its own rows
    m["streams_32_tokens_per_s"], m["streams_1_tokens_per_s"] = streams.many, streams.one
    del peft_run

    progress("decode stalls while a 2,048-token prompt arrives: chunked, one pass, none")
    stall = decode_stall(engine, prompts, reps)
    m.update({k: float(v) for k, v in stall.items() if k != "decode_stall_during_prefill"})

    progress("padding to the longest row: 31 short rows and a 2,048-token one vs 32 short")
    padding = padding_costs(engine, prompts, NEW_TOKENS, reps)
    m.update({k: v for k, v in padding.items() if k not in ("mixed_lengths_vs_uniform",
                                                            "peak_kv_vs_live_kv")})

    progress("base-row p95 latency during a storm of cold loads vs quiet")
    for d in list(engine.resident_adapters()):  # the storm starts from an empty device
        engine.unload_adapter(d)
    storm = base_latency_under_cold_loads(engine, store.read_verified, digests, prompts,
                                          max(3, reps))
    m["base_p95_quiet_s"], m["base_p95_storm_s"] = storm["quiet_p95_s"], storm["storm_p95_s"]
    m["storm_cold_loads"] = storm["cold_loads"]

    ratios: dict[str, float | None] = {
        "mixed_vs_base": best["mixed"] / best["base"],
        "mixed_vs_peft": best["mixed"] / best["peft"],
        "continuous_32_vs_1": m["streams_32_tokens_per_s"] / m["streams_1_tokens_per_s"],
        # KV bytes written into buffers (new tokens', and every join's, leave's and move's)
        # over the bytes the model computed, across the continuous-batching runs
        "kv_bytes_copied_per_token": kv_copied,
        # p95 gap between the running streams' tokens while a long prompt is prefilled in
        # chunks, over the gap with no arrival (``decode_stall_unchunked``: in one pass)
        "decode_stall_during_prefill": stall["decode_stall_during_prefill"],
        # decode tokens/s with one 2,048-token row among 31 short ones, over 32 short rows; and
        # the KV bytes held at the peak over those the rows' tokens need (rows are padded)
        "mixed_lengths_vs_uniform": padding["mixed_lengths_vs_uniform"],
        "peak_kv_vs_live_kv": padding["peak_kv_vs_live_kv"],
        "triton_vs_inprocess": None,
        "cold_load_vs_read": m["cold_load_p95_s"] / m["read_hash_p95_s"],
        "governed_vs_open": None,
        "base_p95_storm_vs_quiet": storm["ratio"],
        # decode throughput with a weight fingerprint check on every pass, against none; the
        # default checks every FINGERPRINT_EVERY-th pass, so costs about 1/64 of the gap
        "fingerprint_every_pass_vs_off": fp["every_pass"] / fp["none"],
    }
    side_by_side: dict[str, Any] | None = None
    if triton_runs:
        del engine, cache
        progress("Triton: governed deployment and open host, side by side")
        with _side_by_side(root, kit) as side:
            side_by_side = _governed_vs_open(side, kit, prompts, digests, triton_runs, progress)
        governed, opened = side_by_side["governed_tokens_per_s"], side_by_side["open_tokens_per_s"]
        m["triton_governed_tokens_per_s"] = governed["median"]
        m["triton_open_tokens_per_s"] = opened["median"]
        m["triton_governed_best_tokens_per_s"] = governed["max"]
        # best against best, like the in-process measurement it is compared with
        ratios["triton_vs_inprocess"] = governed["max"] / m["streams_32_tokens_per_s"]
        ratios["governed_vs_open"] = side_by_side["ratio_of_medians"]
    return {
        "ratios": ratios,
        "goals": {k: f"{op} {v}" for k, (op, v) in GOALS.items()},
        "met": {k: None if (r := ratios[k]) is None else meets(k, r) for k in GOALS},
        "measurements": m,
        "governed_vs_open": side_by_side,
        "setup": {"hidden": BENCH_SHAPE.hidden, "layers": BENCH_SHAPE.layers, "rank": RANK,
                  "targets": TARGETS, "requests": N_ADAPTERS, "adapters": N_ADAPTERS,
                  "prompt_tokens": PROMPT_TOKENS, "new_tokens": NEW_TOKENS, "reps": reps,
                  "triton_runs": triton_runs,
                  "device": str(torch.device("cuda" if torch.cuda.is_available() else "cpu")),
                  "threads": torch.get_num_threads()},
    }
