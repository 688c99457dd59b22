"""Slots, both LoRA paths, continuous batching and the prefix cache, against PEFT and each other."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from transformers import LlamaForCausalLM

import backend.serving.lora_ops as lora_ops
from backend.serving.engine import (
    AdapterBusyError,
    DecodeBatch,
    Engine,
    GenerationRequest,
    GenerationResult,
)
from backend.serving.lora_ops import SlotBatch
from backend.serving.prefix_cache import PrefixCache, PrefixKey
from backend.serving.scheduler import QueueFull, Scheduler, SchedulerLimits
from control.tools.kit import KitManifest
from tests.artifacts import perturbed_copy

LOGIT_ATOL = 1e-4
NAMES = ("alpha", "beta", "gamma")


@pytest.fixture(scope="module")
def manifest(kit_dir: Path) -> KitManifest:
    return KitManifest.load(kit_dir)


@pytest.fixture(scope="module")
def many(kit_dir: Path, manifest: KitManifest,
         tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Eight distinct adapters (perturbed kit adapters): enough for the gather path."""
    root = tmp_path_factory.mktemp("many")
    out: dict[str, Path] = {}
    for i in range(8):
        name = NAMES[i % 3]
        digest = "sha256:" + f"{i:02x}" * 32
        out[digest] = perturbed_copy(kit_dir / manifest.adapters[name].path, root / f"a{i}",
                                     1.0 + 0.05 * i)
    return out


@pytest.fixture(scope="module")
def engine(kit_dir: Path, many: dict[str, Path]) -> Engine:
    eng = Engine(kit_dir / "base", kit_dir / "tokenizer", device="cpu", max_rank=16,
                 max_adapters=12)
    for digest, path in many.items():
        eng.load_adapter(digest, path)
    return eng


def _requests(many: dict[str, Path]) -> list[GenerationRequest]:
    prompts = ["Hello there", "The cat", "x", "What is the weather", "", "A red bird", "1 + 1",
               "night", "Open the door"]
    adapters: list[str | None] = [None, *many]
    return [GenerationRequest(prompts[i % len(prompts)], adapters[i % len(adapters)],
                              max_tokens=6 + i % 5) for i in range(12)]


@pytest.mark.parametrize("segment_max", [0, 100], ids=["gather", "segment"])
def test_both_paths_equal_peft_for_every_row(engine: Engine, kit_dir: Path,
                                             many: dict[str, Path], segment_max: int,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lora_ops, "SEGMENT_MAX_ADAPTERS", segment_max)
    requests = _requests(many)
    slots = SlotBatch.from_slots([engine.slot_of(r.adapter) or 0 if r.adapter else 0
                                  for r in requests], engine.device)
    assert slots.path == ("gather" if segment_max == 0 else "segment")
    logits = engine.next_token_logits(requests)
    results = engine.generate(requests)
    base = LlamaForCausalLM.from_pretrained(kit_dir / "base", dtype=torch.float32).eval()
    for i, r in enumerate(requests):
        model = base if r.adapter is None else PeftModel.from_pretrained(
            LlamaForCausalLM.from_pretrained(kit_dir / "base", dtype=torch.float32),
            many[r.adapter]).eval()
        ids = torch.tensor([engine.encode(r.prompt)])
        with torch.inference_mode():
            ref = model(input_ids=ids).logits[0, -1]
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                 do_sample=False, max_new_tokens=r.max_tokens)
        torch.testing.assert_close(logits[i], ref, atol=LOGIT_ATOL, rtol=0)
        assert results[i].token_ids == out[0, ids.shape[1]:].tolist(), (i, r)


def test_base_slot_stays_zero_and_negative_slots_are_refused(engine: Engine) -> None:
    assert engine.base_slot_is_zero()
    with pytest.raises(ValueError, match=">= 0"):
        SlotBatch.from_slots([0, -1], engine.device)


def test_ranks_are_padded_and_bytes_match_the_slot_tensors(engine: Engine,
                                                           many: dict[str, Path]) -> None:
    digest = next(iter(many))
    views = engine.slot_tensors(digest)
    assert engine.resident_adapters()[digest] == sum(t.numel() * t.element_size() for t in views)
    host = engine.read_adapter(many[digest])
    assert engine.slot_bytes_for(host) == engine.resident_adapters()[digest]
    assert all(t.shape[0] == 16 or t.shape[-1] == 16 for t in views)  # kit rank 8 padded to 16


def test_an_adapter_in_use_cannot_be_unloaded(engine: Engine, many: dict[str, Path]) -> None:
    digest = list(many)[1]
    seq = engine.open_sequence(GenerationRequest("hi", digest))
    with pytest.raises(AdapterBusyError):
        engine.unload_adapter(digest)
    engine.close_sequence(seq)
    engine.unload_adapter(digest)
    assert engine.slot_of(digest) is None and engine.base_slot_is_zero()
    engine.load_adapter(digest, many[digest])


class Sink:
    """Collects one sequence's pieces and result; can cancel after some pieces."""

    def __init__(self, cancel_after: int | None = None) -> None:
        self.pieces: list[str] = []
        self.result: GenerationResult | None = None
        self.outcome = ""
        self.done = threading.Event()
        self.cancel_after = cancel_after

    def cancelled(self) -> bool:
        return self.cancel_after is not None and len(self.pieces) >= self.cancel_after

    def token(self, piece: str) -> None:
        self.pieces.append(piece)

    def finish(self, result: GenerationResult, outcome: str, reason: str | None = None) -> None:
        self.result, self.outcome = result, outcome
        self.done.set()


def test_continuous_batching_equals_one_batch_and_streams(engine: Engine,
                                                          many: dict[str, Path]) -> None:
    requests = _requests(many)
    expected = [engine.generate([r])[0] for r in requests]
    sched = Scheduler(engine, SchedulerLimits(max_running=4, max_queued=64))
    try:
        sinks = [Sink() for _ in requests]
        for r, sink in zip(requests, sinks, strict=True):  # arrive while others decode
            sched.submit(engine.open_sequence(r), sink, stream=True)
        for sink in sinks:
            assert sink.done.wait(60)
    finally:
        sched.stop()
    for want, sink in zip(expected, sinks, strict=True):
        assert sink.outcome == "ok" and sink.result is not None
        assert sink.result.token_ids == want.token_ids
        assert "".join(sink.pieces) == want.text
    assert sched.steps > max(r.max_tokens for r in requests)  # rows joined over many steps


def test_cancellation_and_the_queue_bound(engine: Engine) -> None:
    sched = Scheduler(engine, SchedulerLimits(max_running=1, max_queued=1))
    try:
        first, second = Sink(cancel_after=2), Sink()
        hold = threading.Event()
        first.cancelled = lambda: hold.is_set() and len(first.pieces) >= 2  # type: ignore[method-assign]
        sched.submit(engine.open_sequence(GenerationRequest("Hello", None, max_tokens=100)),
                     first, stream=True)
        while sched.load() != (1, 0):  # the first one runs; the next waits in the queue
            threading.Event().wait(0.01)
        sched.submit(engine.open_sequence(GenerationRequest("Hi", None, max_tokens=3)), second)
        extra = engine.open_sequence(GenerationRequest("Hey", None, max_tokens=3))
        with pytest.raises(QueueFull, match="busy"):
            sched.submit(extra, Sink())
        engine.close_sequence(extra)
        hold.set()
        assert first.done.wait(60) and second.done.wait(60)
    finally:
        sched.stop()
    assert first.outcome == "cancelled"
    assert first.result is not None and first.result.tokens_out < 100
    assert second.outcome == "ok"


def test_prefix_cache_never_shares_between_adapters(engine: Engine,
                                                    many: dict[str, Path]) -> None:
    cache: PrefixCache[DecodeBatch] = PrefixCache(64 * 2**20)
    a, b = list(many)[:2]  # alpha and beta copies
    expected = {d: engine.generate([GenerationRequest("Hello there", d)])[0] for d in (a, b)}
    sched = Scheduler(engine, prefix_cache=cache)
    try:
        for _ in range(2):  # the second round runs from the cache
            for d in (a, b):
                seq = engine.open_sequence(GenerationRequest("Hello there", d))
                key = PrefixKey("base", d, "tok", tuple(seq.prompt_ids), salt=b"tenant")
                sink = Sink()
                sched.submit(seq, sink, key=key)
                assert sink.done.wait(60)
                assert sink.result is not None
                assert sink.result.token_ids == expected[d].token_ids, d
    finally:
        sched.stop()
    assert len(cache) == 2  # one entry per adapter for the same prompt
    assert cache.stats.hits == 2 and cache.stats.misses == 2
    assert expected[a].text != expected[b].text
    assert cache.purge_adapter(a) == 1 and len(cache) == 1


def test_prefix_keys_differ_by_every_digest() -> None:
    ids = (1, 2, 3)
    s = b"tenant"
    keys = {PrefixKey("b", "a1", "t", ids, salt=s), PrefixKey("b", "a2", "t", ids, salt=s),
            PrefixKey("b", None, "t", ids, salt=s), PrefixKey("b2", "a1", "t", ids, salt=s),
            PrefixKey("b", "a1", "t2", ids, salt=s), PrefixKey("b", "a1", "t", (1, 2), salt=s),
            PrefixKey("b", "a1", "t", ids, salt=b"other tenant")}
    assert len(keys) == 7


def test_preparing_an_adapter_takes_no_engine_lock(engine: Engine,
                                                   many: dict[str, Path]) -> None:
    """A cold load's conversion work runs beside decoding: only the copy into the slot waits
    for the engine's lock."""
    host = engine.read_adapter(next(iter(many.values())))
    prepared: list[object] = []
    with engine._lock:  # as if a decode step held it
        worker = threading.Thread(target=lambda: prepared.append(engine.prepare(host)))
        worker.start()
        worker.join(10)
        assert not worker.is_alive() and len(prepared) == 1


def test_a_prompt_is_remembered_once_and_a_hit_is_not_stored_again(engine: Engine) -> None:
    cache: PrefixCache[DecodeBatch] = PrefixCache(64 * 2**20)
    puts: list[PrefixKey] = []
    put = cache.put

    def counted(key: PrefixKey, value: DecodeBatch, nbytes: int) -> None:
        puts.append(key)
        put(key, value, nbytes)

    cache.put = counted  # type: ignore[method-assign]
    sched = Scheduler(engine, prefix_cache=cache, start=False)
    results = []
    for _ in range(2):  # the second runs from the cache
        sinks = []
        for prompt in ("Hello there", "The cat"):  # two rows: one prefill of both
            seq = engine.open_sequence(GenerationRequest(prompt, None, max_tokens=4))
            key = PrefixKey("base", None, "tok", tuple(seq.prompt_ids), salt=b"tenant")
            sinks.append(Sink())
            sched.submit(seq, sinks[-1], key=key)
        leaves = engine.steps.kv_traffic.leaves
        sched.run_once()  # the prefill, and the prompts remembered (or restored)
        # taking a row's entry is not a leave of the batch (it was, and copied the row twice)
        assert engine.steps.kv_traffic.leaves == leaves
        while sched.run_once():
            pass
        results.append([s.result.token_ids for s in sinks if s.result is not None])
    assert len(puts) == 2, "a prompt restored from the cache was stored again"
    assert len(results[0]) == 2 and results[0] == results[1]
    for entry in cache.values():  # each its own columns, compact
        assert entry.keys[0].shape[2] == entry.mask.shape[1] == int(entry.mask.sum())
        assert all(k.is_contiguous() for k in entry.keys + entry.values)
