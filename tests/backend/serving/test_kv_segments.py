"""The running batch's KV in segments (``backend.serving.kv_segments``, issue 26).

Rows that join are a segment of their own, so a join moves no KV and a short row is never padded
to a long one's width. Past ``MOST_SEGMENTS`` two neighbours are merged: the smallest merge,
one copy of their rows only. The engine tests decode rows that joined one at a time (more joins
than the segment limit, so merges happen between steps) and compare every row's tokens with the
row decoded alone: a segment read with another's columns, or a merge that shifted a row, changes
them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from backend.serving.engine import Engine, GenerationRequest
from backend.serving.engine_types import KvSegment
from backend.serving.kv_arena import KvTraffic
from backend.serving.kv_segments import MOST_SEGMENTS, coalesced, gathered
from control.tools.kit import KitManifest
from tests.backend.serving.sequences import opened, storages

HEADS, DIM = 2, 3


@dataclass
class _Req:
    max_tokens: int


@dataclass
class _Row:
    request: _Req
    produced: list[int] = field(default_factory=list)


def _segment(rows: int, width: int, start: float) -> KvSegment:
    """``rows`` rows of ``width`` columns, every value distinct, one layer."""
    n = rows * HEADS * width * DIM
    t = torch.arange(start, start + n, dtype=torch.float32).reshape(rows, HEADS, width, DIM)
    return KvSegment([t], [t + 0.5], capacity=0)


def test_a_merge_copies_only_the_smallest_neighbours_and_keeps_each_row() -> None:
    widths = [40, 6, 5, 30, 7]  # the neighbours 6 and 5 make the smallest merged buffer
    segments = [_segment(2, w, 1000.0 * i) for i, w in enumerate(widths)]
    rows = [_Row(_Req(4)) for _ in range(2 * len(widths))]
    traffic = KvTraffic()
    out = coalesced(segments, rows, most=len(widths) - 1, traffic=traffic)
    assert len(out) == len(widths) - 1
    assert out[0] is segments[0] and out[2] is segments[3] and out[3] is segments[4]
    merged = out[1]
    assert (merged.rows, merged.width, merged.capacity) == (4, 6, 6 + 4)
    # each row right-aligned in the merged buffer, zeros left of the narrower rows
    assert torch.equal(merged.keys[0][:2], segments[1].keys[0])
    assert torch.equal(merged.keys[0][2:, :, 1:], segments[2].keys[0])
    assert torch.equal(merged.values[0][2:, :, 1:], segments[2].values[0])
    assert not merged.keys[0][2:, :, :1].any()
    # the bytes written are the merged buffers (keys and values), nothing of the others
    assert traffic.written == 2 * 4 * HEADS * 6 * DIM * 4


def test_rows_gathered_across_segments_keep_their_columns() -> None:
    a, b = _segment(2, 5, 0.0), _segment(3, 9, 500.0)
    spans = [(0, 2, a), (2, 5, b)]
    keep, lengths = [4, 0, 2], [7, 5, 9]
    out = gathered(spans, keep, lengths, room=3)
    assert (out.rows, out.width, out.capacity) == (3, 9, 12)
    assert torch.equal(out.keys[0][0, :, 2:], b.keys[0][2, :, -7:])
    assert not out.keys[0][0, :, :2].any()
    assert torch.equal(out.keys[0][1, :, 4:], a.keys[0][0])
    assert torch.equal(out.values[0][2], b.values[0][0])


@pytest.fixture(scope="module")
def engine(kit_dir: Path) -> Engine:
    eng = Engine(kit_dir / "base", kit_dir / "tokenizer", device="cpu", max_rank=16,
                 max_adapters=2)
    for name in ("alpha", "beta"):
        adapter = KitManifest.load(kit_dir).adapters[name]
        eng.load_adapter(adapter.digest, kit_dir / adapter.path)
    return eng


def test_rows_joining_one_at_a_time_decode_as_they_would_alone(engine: Engine,
                                                               kit_dir: Path) -> None:
    adapters = KitManifest.load(kit_dir).adapters
    alpha, beta = adapters["alpha"].digest, adapters["beta"].digest
    requests = [GenerationRequest("Once upon a time, in a quiet city by the sea", alpha, 9),
                GenerationRequest("Hi", None, 12),
                GenerationRequest("The cat sat on the mat and", beta, 7),
                GenerationRequest("A", alpha, 14),
                GenerationRequest("Yes, and then", None, 10),
                GenerationRequest("word " * 12, beta, 6),
                GenerationRequest("Q", None, 11)]
    alone = [engine.generate([r])[0].token_ids for r in requests]
    engine.steps.kv_traffic = traffic = KvTraffic()
    with opened(engine, *requests) as seqs:
        batch, most, merges_seen = None, 0, False
        for seq in seqs:  # one joins per step
            joining = engine.prefill([seq])
            if batch is None:
                batch = joining
            else:
                before = len(batch.segments) + 1
                written = traffic.written
                batch = engine.merge(batch, joining)
                # a join alone writes nothing; a merge past the limit writes its two segments
                assert (traffic.written == written) == (before <= MOST_SEGMENTS)
                merges_seen |= before > MOST_SEGMENTS
            most = max(most, len(batch.segments))
            engine.choose(batch)
            batch = engine.retain(batch, [i for i, s in enumerate(batch.seqs) if not s.done],
                                  reuse=True)
            if batch is not None:
                engine.advance(batch)
        while batch is not None:
            engine.choose(batch)
            batch = engine.retain(batch, [i for i, s in enumerate(batch.seqs) if not s.done],
                                  reuse=True)
            if batch is not None:
                buffers = storages(batch.kv_tensors())
                engine.advance(batch)
                # rows that stay write their token into the room they have
                assert storages(batch.kv_tensors()) == buffers
        assert merges_seen and most == MOST_SEGMENTS
        assert [s.produced for s in seqs] == alone
