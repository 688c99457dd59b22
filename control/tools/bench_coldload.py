"""Cold loads at a 7B model's size (issue 24's ``cold_load_vs_read_7b`` in ``bench scale``).

Adapters shaped like a Llama-2-7B adapter: rank 16 on q, k, v and o of 32 layers at hidden 4,096,
in fp16, about 32 MiB of safetensors each, with seeded random weights, written as PEFT folders
(``adapter_config.json`` from PEFT's own ``LoraConfig``, tensors under PEFT's names) and put in a
real :class:`ArtifactStore` under their digests. Each cold load is what the adapter cache does
before it places an adapter, on a load worker as the cache runs it
(``backend.serving.load_workers``): the store reads the files and checks those bytes against the
digest, the engine's :class:`SlotResidency` parses them, checks the config, every tensor's shape
against the base's module and every weight's finiteness, and prepares the slots' dtype and
layout (float32 on a CPU host, bfloat16 on CUDA, where it is also pinned). The base it checks
against is a 7B-shaped Llama on the meta device: shapes only, no weights, so the engine's real
checks run without 13 GB of base.

What the ratio covers: host-tier stages only (read, verify, parse, checks, prepare). Placing in
a device slot is not in it: a slot bank for a 4,096-wide base needs that base loaded, and the
engine bench's ``cold_load_vs_read`` (hidden 512) measures placing. Against it: a plain read of
the same files plus SHA-256 of their bytes, alternated with the loads adapter by adapter so that
both see the same page cache and the same machine. The p95 of each, their ratio (goal <= 1.5)
and the load's p95 in seconds (the seed's goal: under 8 s) are reported.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch

from backend.serving.memory import BaseShapes, MemoryPlan, serving_dtype
from control.contracts.adapter_format import CONFIG_FILE, TENSOR_PREFIX, WEIGHTS_FILE
from control.contracts.digests import directory_digest
from control.tools.bench.kit import read_and_hash
from control.tools.bench.stats import p95

GOAL_RATIO = 1.5
GOAL_P95_S = 8.0
HIDDEN, LAYERS, HEADS, INTERMEDIATE, VOCAB = 4096, 32, 32, 11008, 32000  # Llama-2-7B
RANK, TARGETS = 16, ("q_proj", "k_proj", "v_proj", "o_proj")
# Both at the 7B shape; ``quick`` only takes fewer samples.
QUICK = {"adapters": 3, "rounds": 4, "hidden": HIDDEN, "layers": LAYERS}
FULL = {"adapters": 8, "rounds": 4, "hidden": HIDDEN, "layers": LAYERS}


def write_adapter(out: Path, seed: int, *, hidden: int = HIDDEN, layers: int = LAYERS,
                  rank: int = RANK) -> Path:
    """A PEFT LoRA folder with seeded random fp16 weights: rank ``rank`` on q, k, v, o of
    ``layers`` layers at width ``hidden``."""
    from peft import LoraConfig
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(layers):
        for target in TARGETS:
            module = f"{TENSOR_PREFIX}model.layers.{layer}.self_attn.{target}"
            # PEFT's own init bounds for A; B small and non-zero, as a trained adapter's is
            a = (torch.rand((rank, hidden), generator=g) * 2 - 1) / hidden ** 0.5
            b = torch.randn((hidden, rank), generator=g) * 0.01
            tensors[f"{module}.lora_A.weight"] = a.half()
            tensors[f"{module}.lora_B.weight"] = b.half()
    save_file(tensors, str(out / WEIGHTS_FILE))
    config = LoraConfig(r=rank, lora_alpha=rank, target_modules=list(TARGETS),
                        init_lora_weights=False, base_model_name_or_path="bench-7b-shape")
    (out / CONFIG_FILE).write_text(json.dumps(config.to_dict(), indent=2, sort_keys=True,
                                              default=_jsonable), encoding="utf-8")
    return out


def _jsonable(value: Any) -> Any:
    if isinstance(value, (set, frozenset)):
        return sorted(value)
    return str(value)


def residency_7b(hidden: int = HIDDEN, layers: int = LAYERS) -> Any:
    """The engine's :class:`SlotResidency` over a Llama of the given width and depth on the
    meta device (module shapes, no weights), in the dtype the engine serves in here."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from backend.serving.lease import Violations  # the serving side loads torch: bench only
    from backend.serving.residency import SlotResidency  # the same

    heads = max(1, hidden // 128)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, num_hidden_layers=layers,
                      intermediate_size=INTERMEDIATE if hidden == HIDDEN else 2 * hidden,
                      num_attention_heads=heads, num_key_value_heads=heads)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = getattr(torch, serving_dtype(device))
    plan = MemoryPlan(shapes=BaseShapes.from_config(cfg), max_rank=RANK,
                      element_size=torch.empty((), dtype=dtype).element_size(), slots=1,
                      budget_bytes=0, budget_source="bench: shapes only")
    residency = SlotResidency(model, plan, threading.RLock(), Violations(),
                              device=torch.device("meta"), dtype=dtype, max_rank=RANK)
    # prepare() pins for CUDA by the residency's device; meta would never pin
    residency.device = torch.device(device)
    return residency


def measure(adapters: int, rounds: int, *, hidden: int = HIDDEN, layers: int = LAYERS,
            progress: Callable[[str], None] = lambda _m: None) -> dict[str, Any]:
    """Write ``adapters`` adapters, then ``rounds`` times each: a plain read + SHA-256, and a
    cold load to the host tier on a load worker; p95s, ratio and stage medians."""
    # The serving side's load workers and the store, loaded when the bench runs (torch)
    from backend.serving.load_workers import LoadWorkers
    from control.contracts.store import ArtifactStore  # the same

    with tempfile.TemporaryDirectory(prefix="lp-bench-coldload-") as tmp:
        root = Path(tmp)
        store = ArtifactStore(root / "store")
        digests: list[str] = []
        for i in range(adapters):
            src = write_adapter(root / "src" / f"a{i}", seed=1000 + i, hidden=hidden,
                                layers=layers)
            digest = directory_digest(src)
            store.put(src, digest)
            digests.append(digest)
        nbytes = sum(p.stat().st_size for p in store.path(digests[0]).rglob("*") if p.is_file())
        progress(f"cold loads: {adapters} adapters of {nbytes / 2**20:.1f} MiB written")
        residency = residency_7b(hidden, layers)
        workers = LoadWorkers(name="bench-cold-load")
        stages: dict[str, list[float]] = {"fetch_verify": [], "parse_check": [], "prepare": []}

        def cold(digest: str) -> Any:
            t0 = time.perf_counter()
            files = store.read_verified(digest)  # store read + digest check of those bytes
            t1 = time.perf_counter()
            host = residency.read_adapter(files)  # parse, config, shapes, finiteness
            t2 = time.perf_counter()
            prepared = residency.prepare(host)  # slots' dtype and layout
            t3 = time.perf_counter()
            for k, v in zip(stages, (t1 - t0, t2 - t1, t3 - t2), strict=True):
                stages[k].append(v)
            return prepared

        def on_worker(digest: str) -> float:
            done: Future[Any] = Future()

            def job() -> None:
                try:
                    done.set_result(cold(digest))
                except BaseException as exc:
                    done.set_exception(exc)

            t0 = time.perf_counter()
            workers.submit(job)
            done.result(timeout=600)
            return time.perf_counter() - t0

        on_worker(digests[0])  # a worker's first load sets its thread up: not a load's cost
        for k in stages:
            stages[k].clear()
        reads: list[float] = []
        loads: list[float] = []
        for r in range(rounds):
            for d in digests:
                t0 = time.perf_counter()
                read_and_hash(store.path(d))
                reads.append(time.perf_counter() - t0)
                loads.append(on_worker(d))
            progress(f"cold loads: round {r + 1} of {rounds}")
    load_p95, read_p95 = p95(loads), p95(reads)
    return {
        "cold_load_vs_read_7b": load_p95 / read_p95,
        "goal_ratio": f"<= {GOAL_RATIO}",
        "met_ratio": load_p95 / read_p95 <= GOAL_RATIO,
        "cold_load_p95_s": load_p95,
        "goal_cold_load_p95_s": f"< {GOAL_P95_S}",
        "met_seconds": load_p95 < GOAL_P95_S,
        "read_hash_p95_s": read_p95,
        "cold_load_median_s": statistics.median(loads),
        "read_hash_median_s": statistics.median(reads),
        "stage_median_s": {k: statistics.median(v) for k, v in stages.items()},
        "covers": "store read + digest check, parse, config/shape/finiteness checks and "
                  "conversion to the slots' layout, on a load worker; not placing in a slot",
        "adapter_bytes": nbytes,
        "adapters": adapters, "rounds": rounds, "loads": len(loads),
        "shape": {"hidden": hidden, "layers": layers, "rank": RANK, "targets": list(TARGETS),
                  "file_dtype": "float16",
                  "slot_dtype": str(residency.dtype).removeprefix("torch.")},
    }


def run_bench(*, quick: bool,
              progress: Callable[[str], None] = lambda _m: None) -> dict[str, Any]:
    size = QUICK if quick else FULL
    return measure(size["adapters"], size["rounds"], hidden=size["hidden"],
                   layers=size["layers"], progress=progress)
