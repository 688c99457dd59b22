"""KV written once per decode step (issue 26): the arena against a reference that concatenates.

The reference is what every decode step did before: a fresh cache whose update concatenates each
layer's keys and values with the new token's (``torch.cat``). Rows join (left-padded with zeros
to the wider batch) and leave (dropping the left columns that became padding for every row left)
as ``backend.serving.batch_ops`` does. The arena must hold the same values at every step, write a
step's token into the buffer it already has, and never reserve more than the rows can use.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from backend.serving.engine import Engine, GenerationRequest
from backend.serving.kv_arena import (
    ArenaLayer,
    KvTraffic,
    compacted,
    picked,
    room_for,
    stacked,
)
from control.tools.kit import KitManifest
from tests.backend.serving.sequences import decode_in_place, opened, storages

HEADS, DIM = 2, 3


@dataclass
class _Req:
    max_tokens: int


@dataclass
class _Seq:
    """What ``room_for`` reads of a ``backend.serving.engine_types.Sequence``."""

    prompt_ids: list[int]
    request: _Req
    produced: list[int] = field(default_factory=list)


def _rows(n: int, width: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn((n, HEADS, width, DIM), generator=g)


def test_room_is_what_the_rows_may_still_produce() -> None:
    a = _Seq([1] * 10, _Req(40), produced=[7] * 5)  # 35 more
    b = _Seq([1] * 3, _Req(4))  # 4 more
    assert room_for([a, b]) == 35
    assert room_for([b]) == 4
    done = _Seq([1], _Req(2), produced=[5, 6])
    assert room_for([done]) == 1  # at least one position, even when nothing more is made


def test_a_step_writes_into_the_buffer_it_has() -> None:
    keys, values = _rows(3, 5, 1), _rows(3, 5, 2)
    first = ArenaLayer(stacked([keys], 5, 8), stacked([values], 5, 8), 13, 8)
    buffer = first.keys.untyped_storage().data_ptr()
    expect_k, expect_v = keys, values
    for step in range(8):
        k, v = _rows(3, 1, 10 + step), _rows(3, 1, 50 + step)
        got_k, got_v = first.update(k, v)
        expect_k, expect_v = torch.cat([expect_k, k], dim=2), torch.cat([expect_v, v], dim=2)
        assert torch.equal(got_k, expect_k) and torch.equal(got_v, expect_v)
        assert got_k.untyped_storage().data_ptr() == buffer, f"step {step} moved the keys"
    # out of room: the columns move once, to a buffer with room again
    k, v = _rows(3, 1, 99), _rows(3, 1, 98)
    got_k, _ = first.update(k, v)
    assert got_k.untyped_storage().data_ptr() != buffer
    assert first.capacity == 13 + 8  # the width it had, and the room again
    assert torch.equal(got_k, torch.cat([expect_k, k], dim=2))


def test_a_slice_with_the_strides_of_room_is_not_written_into() -> None:
    """A batch's rows ``t[:, :, first:]`` look like a buffer with room; the columns after them are
    another tensor's. Capacity comes from the batch, not from strides, so nothing is overwritten."""
    whole = _rows(2, 8, 3)
    before = whole.clone()
    view = whole[:, :, :5]  # strides of a buffer with 3 positions of room
    layer = ArenaLayer(view, view, 0, 4)
    layer.update(_rows(2, 1, 4), _rows(2, 1, 5))
    assert torch.equal(whole, before)


def test_padding_is_zeros_and_picked_rows_are_compact_copies() -> None:
    a, b = _rows(2, 3, 6), _rows(1, 5, 7)
    both = stacked([a, b], 5, 4)
    assert torch.equal(both[:2, :, :2], torch.zeros(2, HEADS, 2, DIM))
    assert torch.equal(both[:2, :, 2:], a) and torch.equal(both[2:], b)
    kept = picked(both, torch.tensor([2, 0]), 2, 4)
    assert torch.equal(kept, torch.stack([b[0, :, 2:], a[0]]))
    assert kept.untyped_storage().nbytes() == 2 * HEADS * (3 + 4) * DIM * 4


def test_a_leave_in_place_moves_only_the_rows_after_a_gap_once() -> None:
    rows = _rows(5, 4, 8)
    whole = stacked([rows], 4, 2)
    traffic = KvTraffic()
    kept = compacted(whole, [1, 2, 4], 1, traffic)  # rows 0 and 3 leave, column 0 is dropped
    assert torch.equal(kept, rows[[1, 2, 4]][:, :, 1:])
    assert kept.untyped_storage().data_ptr() == whole.untyped_storage().data_ptr()
    assert traffic.written == rows[4, :, 1:].nbytes  # row 4 moved into row 3; 1 and 2 stayed
    oldest_left = compacted(stacked([rows], 4, 2), [2, 3, 4], 0, traffic)
    assert torch.equal(oldest_left, rows[2:]) and traffic.written == rows[4, :, 1:].nbytes


class ArenaAgainstConcatenation(RuleBasedStateMachine):
    """Steps, joins and leaves in any order: the arena's view equals the concatenating reference,
    a step that has room writes in place, and the reservation never exceeds the rows' need."""

    def __init__(self) -> None:
        super().__init__()
        self.seed = 0
        self.seqs: list[_Seq] = []
        self.ref: torch.Tensor = torch.empty(0)
        self.keys: torch.Tensor = torch.empty(0)
        self.capacity = 0

    def _fresh(self, n: int, width: int) -> tuple[list[_Seq], torch.Tensor]:
        self.seed += 1
        seqs = [_Seq([1] * width, _Req(1 + (self.seed * 7 + i) % 40)) for i in range(n)]
        return seqs, _rows(n, width, self.seed)

    @initialize(n=st.integers(1, 4), width=st.integers(1, 12))
    def start(self, n: int, width: int) -> None:
        self.seqs, self.ref = self._fresh(n, width)
        self.keys, self.capacity = self.ref, 0  # a prefill's output: compact

    def _room(self) -> int:
        return room_for(self.seqs)

    @precondition(lambda self: any(len(s.produced) < s.request.max_tokens for s in self.seqs))
    @rule()
    def step(self) -> None:
        width = self.keys.shape[2]
        layer = ArenaLayer(self.keys, self.keys, self.capacity, self._room())
        before = self.keys.untyped_storage().data_ptr()
        self.seed += 1
        new = _rows(len(self.seqs), 1, self.seed)
        self.keys, _ = layer.update(new, new)
        if self.capacity > width:
            assert self.keys.untyped_storage().data_ptr() == before, "a step with room moved KV"
        self.capacity = layer.capacity
        self.ref = torch.cat([self.ref, new], dim=2)
        for s in self.seqs:
            s.produced.append(0)

    @rule(n=st.integers(1, 3), width=st.integers(1, 12))
    def join(self, n: int, width: int) -> None:
        seqs, rows = self._fresh(n, width)
        wide = max(width, self.keys.shape[2])
        self.seqs += seqs
        room = room_for(self.seqs)
        self.keys = stacked([self.keys, rows], wide, room)
        self.capacity = wide + room
        assert room == max(1, max(s.request.max_tokens - len(s.produced) for s in self.seqs))
        pad = torch.nn.functional.pad
        self.ref = torch.cat([pad(self.ref, (0, 0, wide - self.ref.shape[2], 0)),
                              pad(rows, (0, 0, wide - width, 0))])

    @precondition(lambda self: len(self.seqs) > 1)
    @rule(data=st.data())
    def leave(self, data: st.DataObject) -> None:
        keep = sorted(data.draw(st.sets(st.integers(0, len(self.seqs) - 1), min_size=1,
                                        max_size=len(self.seqs) - 1)))
        first = data.draw(st.integers(0, self.keys.shape[2] - 1))
        self.seqs = [self.seqs[i] for i in keep]
        room = room_for(self.seqs)
        self.keys = picked(self.keys, torch.tensor(keep), first, room)
        self.capacity = self.keys.shape[2] + room
        self.ref = self.ref[keep][:, :, first:]

    @precondition(lambda self: len(self.seqs) > 1 and self.capacity > 0)
    @rule(data=st.data())
    def leave_in_place(self, data: st.DataObject) -> None:
        """Rows leave the running batch: the kept ones move up within the same buffer."""
        keep = sorted(data.draw(st.sets(st.integers(0, len(self.seqs) - 1), min_size=1,
                                        max_size=len(self.seqs) - 1)))
        first = data.draw(st.integers(0, self.keys.shape[2] - 1))
        buffer = self.keys.untyped_storage().data_ptr()
        self.seqs = [self.seqs[i] for i in keep]
        self.keys = compacted(self.keys, keep, first)
        assert self.keys.untyped_storage().data_ptr() == buffer
        self.capacity -= first
        self.ref = self.ref[keep][:, :, first:]

    @invariant()
    def same_values_and_room_for_every_row(self) -> None:
        if not self.seqs:
            return
        assert torch.equal(self.keys, self.ref)
        if self.capacity:
            # Every row ends at the right edge: the buffer holds the row with the most tokens
            # left to its end, whatever its own length (a short row that joined wider ones is
            # padded to their width), so no step before that moves the KV.
            most = max(s.request.max_tokens - len(s.produced) for s in self.seqs)
            assert self.capacity - self.keys.shape[2] >= most


TestArenaAgainstConcatenation = ArenaAgainstConcatenation.TestCase
TestArenaAgainstConcatenation.settings = settings(max_examples=60, stateful_step_count=25,
                                                  deadline=None)


# -- through the engine: the real model's decode steps ------------------------------------------

@pytest.fixture(scope="module")
def engine(kit_dir: Path) -> Engine:
    eng = Engine(kit_dir / "base", kit_dir / "tokenizer", device="cpu")
    manifest = KitManifest.load(kit_dir)
    alpha = manifest.adapters["alpha"]
    eng.load_adapter(alpha.digest, kit_dir / alpha.path)
    return eng


def test_engine_decode_steps_write_in_place(engine: Engine, kit_dir: Path) -> None:
    """Between joins and leaves, every layer's keys and values stay in one buffer: a decode step
    writes its token there instead of concatenating the whole KV (which allocated anew)."""
    alpha = KitManifest.load(kit_dir).adapters["alpha"].digest
    requests = [GenerationRequest("Once upon a time", alpha, max_tokens=12),
                GenerationRequest("Hi", None, max_tokens=12)]
    with opened(engine, *requests) as seqs:
        engine.steps.kv_traffic = traffic = KvTraffic()
        batch = engine.prefill(seqs)
        buffers = decode_in_place(engine, batch, 10, "decode step")
        assert batch.keys[0].shape[2] == max(len(s.prompt_ids) for s in seqs) + 10
        # the room the prefill reserved: what the rows may make, no more than the longest needs
        longest = max(len(s.prompt_ids) + s.request.max_tokens for s in seqs)
        assert batch.keys[0].shape[2] < batch.kv_capacity <= longest
        # the counters: every byte written was computed by the model (prompts, padding
        # included, and ten tokens a row), one position being keys and values of every layer
        c = engine.base_config
        position = 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * 4
        width = max(len(s.prompt_ids) for s in seqs)
        assert traffic.computed == len(seqs) * (width + 10) * position
        assert traffic.written == traffic.computed
        # a leave moves the rows kept, from their first column that is not padding, once
        copy = engine.retain(batch, [1])
        assert copy is not None
        row = (len(seqs[1].prompt_ids) + 10) * position
        assert traffic.written - traffic.computed == row
        # the running batch's leave keeps the buffers: the row kept is the newest, so it stays
        # where it is, moves nothing, and holds the same values as the copy
        kept = engine.retain(batch, [1], reuse=True)
        assert kept is not None
        assert storages(kept.keys + kept.values) == buffers
        assert all(torch.equal(a, b) for a, b in zip(kept.keys + kept.values,
                                                     copy.keys + copy.values, strict=True))
        assert traffic.written - traffic.computed == row


def test_a_short_row_joining_a_wide_one_is_a_segment_of_its_own(engine: Engine) -> None:
    """Rows joining become a segment of their own (``backend.serving.kv_segments``): the join
    writes no KV, the short row's buffer is as wide as its own prompt (before, it was padded to
    the wide row's width and the whole batch was copied into a new buffer), it has room to its
    own end, and both rows decode in place until they finish, leaving as they do."""
    wide = GenerationRequest("Once upon a time, in a quiet city", None, max_tokens=3)
    short = GenerationRequest("Hi", None, max_tokens=12)
    with opened(engine, wide, short) as (a, b):
        engine.steps.kv_traffic = traffic = KvTraffic()
        batch = engine.prefill([a])
        engine.choose(batch)
        engine.advance(batch)
        joining = engine.prefill([b])
        written = traffic.written
        merged = engine.merge(batch, joining)
        assert traffic.written == written, "the join copied KV"
        assert [seg.width for seg in merged.segments] == [len(a.prompt_ids) + 1,
                                                          len(b.prompt_ids)]
        assert merged.segments[1].capacity >= len(b.prompt_ids) + short.max_tokens
        short_buffers = storages(merged.segments[1].tensors())
        batch, steps = merged, 0
        while batch is not None:
            engine.choose(batch)
            batch = engine.retain(batch, [i for i, s in enumerate(batch.seqs) if not s.done],
                                  reuse=True)
            if batch is None:
                break
            engine.advance(batch)
            steps += 1
            assert storages(batch.segments[-1].tensors()) == short_buffers, \
                f"step {steps} moved the short row's KV"
        assert traffic.written == traffic.computed  # nothing but computed KV was ever written
        assert len(b.produced) == short.max_tokens or b.produced[-1] in engine.eos_ids
