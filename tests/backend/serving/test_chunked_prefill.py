"""Chunked prefill (``backend.serving.chunked_prefill``): a long prompt computed a chunk per turn
gives the one-pass prefill's results, writes its KV once, and never holds the running streams up
for more than one chunk. The serving state machine runs chunked prompts too (its
``prefill_chunk=6``), with PEFT's tokens as the reference."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from backend.serving.chunked_prefill import PartialPrefill
from backend.serving.engine import Engine, GenerationRequest, GenerationResult, Sequence
from backend.serving.kv_arena import KvTraffic
from backend.serving.memory_report import resident_memory
from backend.serving.scheduler import Scheduler, SchedulerLimits
from control.contracts.ledger import Outcome
from control.tools.kit import KitManifest
from tests.backend.serving.sequences import opened, storages
from tests.faults import EndlessEngine

LONG = "Once upon a time, in a quiet city by the sea, " * 4  # 185 tokens with bos
CHUNK = 16


@pytest.fixture(scope="module")
def engine(kit_dir: Path) -> Engine:
    # no row stops at eos, so the short streams are still running when the long prompt lands
    eng = EndlessEngine(kit_dir / "base", kit_dir / "tokenizer", device="cpu")
    alpha = KitManifest.load(kit_dir).adapters["alpha"]
    eng.load_adapter(alpha.digest, kit_dir / alpha.path)
    return eng


@pytest.fixture(scope="module")
def alpha(kit_dir: Path) -> str:
    return KitManifest.load(kit_dir).adapters["alpha"].digest


@pytest.mark.parametrize("chunk", [CHUNK, 7])
def test_a_chunked_prompt_equals_its_one_pass_prefill(engine: Engine, alpha: str,
                                                      chunk: int) -> None:
    request = GenerationRequest(LONG, alpha, max_tokens=8)
    with opened(engine, request, request) as (whole, chunked):
        assert len(whole.prompt_ids) > 10 * chunk
        one = engine.prefill([whole])
        engine.steps.kv_traffic = traffic = KvTraffic()
        part = PartialPrefill(chunked)
        passes, buffers, done = 0, None, None
        while done is None:
            done = engine.prefill_chunk(part, chunk)
            passes += 1
            if buffers is None:
                buffers = storages(part.keys + part.values)
            assert storages(part.keys + part.values) == buffers, "a chunk moved the KV"
        assert passes == math.ceil(len(whole.prompt_ids) / chunk)
        # every chunk wrote its own columns into the room the first one reserved, once
        assert traffic.written == traffic.computed > 0
        assert done.kv_capacity >= len(whole.prompt_ids) + request.max_tokens
        torch.testing.assert_close(done.logits, one.logits, rtol=0, atol=1e-5)
        for a, b in zip(done.keys + done.values, one.keys + one.values, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
        assert torch.equal(done.last_pos, one.last_pos) and torch.equal(done.mask, one.mask)
        for batch in (one, done):
            for _ in range(request.max_tokens - 1):
                engine.choose(batch)
                engine.advance(batch)
        assert chunked.produced == whole.produced and len(whole.produced) == 7
        assert chunked.observed == whole.observed == {alpha}


class Sink:
    def __init__(self) -> None:
        self.cancel = False
        self.ends: list[tuple[GenerationResult, Outcome, str | None]] = []

    def cancelled(self) -> bool:
        return self.cancel

    def token(self, piece: str) -> None:
        pass

    def finish(self, result: GenerationResult, outcome: Outcome, reason: str | None) -> None:
        self.ends.append((result, outcome, reason))


def _alone(engine: Engine, request: GenerationRequest) -> list[int]:
    """``request``'s tokens with nothing else running and no chunking."""
    sched = Scheduler(engine, SchedulerLimits(prefill_chunk=0), start=False)
    sink = Sink()
    sched.submit(engine.open_sequence(request), sink)
    while sched.run_once():
        pass
    ((result, outcome, _reason),) = sink.ends
    assert outcome == Outcome.OK
    return list(result.token_ids)


def test_running_streams_get_a_token_every_turn_while_a_long_prompt_prefills(
        engine: Engine, alpha: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """No turn computes more than one chunk of the long prompt, and every running stream gets
    its token on every turn meanwhile; the long request's answer is the one it gets alone.
    Before chunking, the whole 185-token prompt ran in one pass of the turn that admitted it."""
    widths: list[int] = []  # tokens per row of every forward pass
    forward = engine._forward

    def counted(seqs: list[Sequence], slots: Any, ids: torch.Tensor, *rest: Any) -> Any:
        widths.append(ids.shape[1])
        return forward(seqs, slots, ids, *rest)

    long_request = GenerationRequest(LONG, alpha, max_tokens=4)
    want = _alone(engine, long_request)
    monkeypatch.setattr(engine, "_forward", counted)
    sched = Scheduler(engine, SchedulerLimits(prefill_chunk=CHUNK), start=False)
    shorts = [engine.open_sequence(GenerationRequest(p, a, max_tokens=40))
              for p, a in (("Hi", alpha), ("The cat", None))]
    sinks = [Sink() for _ in shorts]
    for seq, sink in zip(shorts, sinks, strict=True):
        sched.submit(seq, sink)
    sched.run_once()
    sched.run_once()
    long_seq = engine.open_sequence(long_request)
    long_sink = Sink()
    sched.submit(long_seq, long_sink)
    chunks = math.ceil(len(long_seq.prompt_ids) / CHUNK)
    for turn in range(chunks):
        before = [len(s.produced) for s in shorts]
        widths.clear()
        sched.run_once()
        assert [len(s.produced) for s in shorts] == [n + 1 for n in before], turn
        assert max(widths) <= CHUNK, f"turn {turn} computed {max(widths)} tokens of a row"
        running, queued = sched.load()
        assert (running, queued) == (3, 0)  # the long job counts as running throughout
        joined = turn == chunks - 1
        assert (long_seq.produced != []) == joined, turn
    while sched.run_once():
        pass
    ((result, outcome, _reason),) = long_sink.ends
    assert outcome == Outcome.OK and list(result.token_ids) == want
    assert all(s.ends[0][1] == Outcome.OK for s in sinks)
    assert engine.pins() == {}


@pytest.mark.parametrize("how", ["cancelled", "revoked"])
def test_a_long_prompt_ended_mid_prefill_ends_once_and_holds_nothing(
        engine: Engine, alpha: str, how: str) -> None:
    sched = Scheduler(engine, SchedulerLimits(prefill_chunk=CHUNK), start=False)
    seq = engine.open_sequence(GenerationRequest(LONG, alpha, max_tokens=4))
    sink = Sink()
    sched.submit(seq, sink)
    sched.run_once()
    sched.run_once()
    assert sched.load() == (1, 0) and not sink.ends and engine.pins()
    # the prompt's KV so far is counted where the memory report looks
    assert resident_memory(engine, sched)["kv_cache"] >= sum(
        t.nbytes for t in sched.prefill_tensors()) > 0
    if how == "cancelled":
        sink.cancel = True
    else:
        sched.revoke(alpha, immediate=False)
    while sched.run_once():
        pass
    ((result, outcome, reason),) = sink.ends
    assert (outcome, reason) == ((Outcome.CANCELLED, "before_start") if how == "cancelled"
                                 else (Outcome.REJECTED, "revoked"))
    assert result.token_ids == [] and seq.lease.released
    assert sched.load() == (0, 0) and sched.prefill_tensors() == [] and engine.pins() == {}


def test_a_negative_chunk_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LORAPLANE_PREFILL_CHUNK", "-1")
    with pytest.raises(ValueError, match="LORAPLANE_PREFILL_CHUNK"):
        SchedulerLimits.from_env()
    monkeypatch.setenv("LORAPLANE_PREFILL_CHUNK", "0")
    assert SchedulerLimits.from_env().prefill_chunk == 0
