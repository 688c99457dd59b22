"""The segment bookkeeping of continuous batching against a per-row reference (hypothesis).

Rows join (a prefill's segment: left-padded to its longest, with room for its tokens), decode
(each row's token is written into its segment's room through the cache layers a decode step
builds), finish and leave (the running batch's ``reuse``: compacted in place), in any order
and any shapes. After every step each row's keys and values, read from its segment, equal the
columns the reference recorded for that row, the mask says each row's length, the batch keeps
at most ``MOST_SEGMENTS``, and a decode step never moves a buffer (each segment keeps room for
its rows' tokens). Bytes are written only for computed columns, merges and rows moving up.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from backend.serving.batch_ops import merged, selected
from backend.serving.engine_types import DecodeBatch, KvSegment
from backend.serving.kv_arena import KvTraffic, empty_room, room_for
from backend.serving.kv_segments import MOST_SEGMENTS, decode_layers, written_back
from backend.serving.lora_ops import SlotBatch

HEADS, DIM = 2, 3
CPU = torch.device("cpu")


@dataclass
class _Req:
    max_tokens: int


@dataclass(eq=False)
class _Row:
    request: _Req
    prompt_ids: list[int]
    produced: list[int] = field(default_factory=list)
    slot: int = 0
    done: bool = False


class SegmentMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.batch: DecodeBatch | None = None
        self.ref: dict[_Row, list[torch.Tensor]] = {}  # row -> its columns [heads, dim]
        self.traffic = KvTraffic()
        self.counter = 0.0

    def _column(self) -> torch.Tensor:
        self.counter += 1.0
        return torch.full((HEADS, DIM), self.counter)

    @rule(shapes=st.lists(st.tuples(st.integers(1, 12), st.integers(1, 6)),
                          min_size=1, max_size=3))
    def join(self, shapes: list[tuple[int, int]]) -> None:
        rows = [_Row(_Req(n), list(range(length))) for length, n in shapes]
        width = max(len(r.prompt_ids) for r in rows)
        # keys and values in buffers with room, as a prefill writes them (ArenaLayer.empty)
        keys, values = (empty_room(torch.empty(1, HEADS, 1, DIM), len(rows), width,
                                   room_for(rows)).zero_() for _ in range(2))
        for i, r in enumerate(rows):
            self.ref[r] = [self._column() for _ in r.prompt_ids]
            keys[i, :, width - len(r.prompt_ids):] = torch.stack(self.ref[r], dim=1)
            values[i, :, width - len(r.prompt_ids):] = torch.stack(self.ref[r], dim=1) + 0.5
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):
            mask[i, width - len(r.prompt_ids):] = 1
        new = DecodeBatch([*rows], [KvSegment([keys], [values], width + room_for(rows))],
                          mask, torch.zeros((len(rows), 1), dtype=torch.long),
                          torch.zeros((len(rows), 4)), _slots(rows))
        if self.batch is None:
            self.batch = new
            return
        before, segments = self.traffic.written, len(self.batch.segments) + 1
        self.batch = merged(self.batch, new, CPU, self.traffic)
        if segments <= MOST_SEGMENTS:
            assert self.traffic.written == before, "a join without a merge copied KV"

    @precondition(lambda self: self.batch is not None)
    @rule()
    def step(self) -> None:
        """One token for every row (``choose``), rows that are done leave (the scheduler's
        retain, in place), the others feed their token (``advance``)."""
        assert self.batch is not None
        for r in self.batch.seqs:
            r.produced.append(1)
            r.done = len(r.produced) >= r.request.max_tokens
        keep = [i for i, r in enumerate(self.batch.seqs) if not r.done]
        for r in self.batch.seqs:
            if r.done:
                del self.ref[r]
        if not keep:
            self.batch = None
            return
        self.batch = selected(self.batch, keep, CPU, self.traffic, reuse=True)
        buffers = [t.untyped_storage().data_ptr() for t in self.batch.kv_tensors()]
        layers = decode_layers(self.batch.segments, self.batch.seqs, 1, self.traffic)
        new = torch.stack([self._column() for _ in self.batch.seqs])[:, :, None, :]
        for r, col in zip(self.batch.seqs, new, strict=True):
            self.ref[r].append(col[:, 0, :].clone())
        layers[0].update(new, new + 0.5)
        self.batch.segments = written_back(self.batch.segments, layers)
        self.batch.mask = torch.cat([self.batch.mask, torch.ones_like(self.batch.mask[:, :1])],
                                    dim=1)
        assert [t.untyped_storage().data_ptr() for t in self.batch.kv_tensors()] == buffers, \
            "a decode step moved KV"

    @precondition(lambda self: self.batch is not None and len(self.batch) > 1)
    @rule(data=st.data())
    def leave(self, data: st.DataObject) -> None:
        """Some rows end early (cancelled, revoked): the rest stay in place."""
        assert self.batch is not None
        n = len(self.batch)
        keep = sorted(data.draw(st.sets(st.integers(0, n - 1), min_size=1, max_size=n - 1)))
        for i, r in enumerate(self.batch.seqs):
            if i not in keep:
                del self.ref[r]
        self.batch = selected(self.batch, keep, CPU, self.traffic, reuse=True)

    @invariant()
    def every_row_reads_its_own_columns(self) -> None:
        if self.batch is None:
            assert not self.ref
            return
        b = self.batch
        assert len(b.segments) <= MOST_SEGMENTS
        assert sum(seg.rows for seg in b.segments) == len(b.seqs) == len(self.ref)
        assert b.mask.shape[1] == max(seg.width for seg in b.segments)
        for first, end, seg in b.spans():
            rows = b.seqs[first:end]
            # room for every token its rows may still feed: no step moves the buffer
            left = max(r.request.max_tokens - len(r.produced) for r in rows)
            assert seg.capacity - seg.width >= left - 1
            for j, r in enumerate(rows):
                cols = self.ref[r]
                n = len(cols)
                assert int(b.mask[first + j].sum()) == n
                want = torch.stack(cols, dim=1)
                assert torch.equal(seg.keys[0][j, :, seg.width - n:], want), "lost its keys"
                assert torch.equal(seg.values[0][j, :, seg.width - n:], want + 0.5), \
                    "a row lost its values"
                assert not seg.keys[0][j, :, :seg.width - n].any(), "padding is not zeros"

    @invariant()
    def nothing_is_written_but_computed_columns_merges_and_moves(self) -> None:
        assert self.traffic.written >= self.traffic.computed


def _slots(rows: list[_Row]) -> SlotBatch:
    return SlotBatch.from_slots([r.slot for r in rows], CPU)


TestSegmentMachine = SegmentMachine.TestCase
TestSegmentMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
