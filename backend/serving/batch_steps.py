"""The continuous-batching steps over one mixed batch: prefill, merge, retain, choose, advance.

Rows join and leave between decode steps; the KV bookkeeping is ``backend.serving.batch_ops``.
Each forward pass goes through the engine's ``_forward`` (handed in as ``forward``), which
records what every row's slot holds before it calls :meth:`BatchSteps.run_model`: the one
place the base model runs, with the batch's slot rows set for every ``SlottedLinear``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from collections.abc import Sequence as Sequence_
from typing import Protocol

import torch
from transformers import DynamicCache, LlamaForCausalLM, PreTrainedConfig

from backend.serving.batch_ops import cache_tensors, merged, selected
from backend.serving.engine_types import (
    DecodeBatch,
    GenerationRequest,
    GenerationResult,
    Sequence,
)
from backend.serving.kv_arena import ArenaLayer, KvTraffic, room_for
from backend.serving.kv_segments import decode_layers, written_back
from backend.serving.lora_ops import SlotBatch
from backend.serving.row_runs import RowRuns, plan
from backend.serving.sampling import FAILED, RowSampling, choose_tokens
from backend.serving.slots import SlotContext, SlotIdentity

# seqs, slots, ids [batch, n], mask [batch, width], positions [batch, n], cache -> logits
Forward = Callable[[list[Sequence], SlotBatch, torch.Tensor, torch.Tensor, torch.Tensor,
                    DynamicCache], torch.Tensor]


# A prefill is cut into at most this many passes, each a KV segment of its own; one more pass
# is taken to be worth this many positions of padding (rows x columns): unlike a decode step's
# runs, a group's padding is memory the rows hold until they end, not one step's compute.
PREFILL_GROUPS = 2
PREFILL_GROUP_COST = 256


class BatchSteps:
    """The steps the scheduler (and ``Engine.generate``) drives, under the engine's lock."""

    def __init__(self, model: LlamaForCausalLM, context: SlotContext, lock: threading.RLock,
                 device: torch.device, pad_id: int, forward: Forward) -> None:
        self.model, self.context, self.lock = model, context, lock
        self.device, self.pad_id, self.forward = device, pad_id, forward
        self.kv_traffic = KvTraffic()
        # the decode step's runs of rows (backend.serving.row_runs), for the pass about to run
        self._row_runs: RowRuns | None = None

    def prefill(self, seqs: list[Sequence],
                cached: dict[int, DecodeBatch] | None = None) -> DecodeBatch:
        """Run the prompts of new sequences (left-padded, one mixed batch) into a DecodeBatch;
        rows of ``cached`` (restored from a prefix cache) skip the forward pass."""
        cached = cached or {}
        todo = [i for i in range(len(seqs)) if i not in cached]
        with self.lock, torch.inference_mode():
            parts: list[DecodeBatch] = []
            rows = [seqs[i] for i in todo]
            # Rows are prefilled in groups of consecutive rows, each left-padded to its own
            # longest and kept as a KV segment of its own: one long prompt among short ones
            # does not widen their buffers (the scheduler sends them sorted by length).
            for first, end in prefill_groups([len(s.prompt_ids) for s in rows]):
                parts.append(self._prefill_rows(rows[first:end]))
            order = todo + [i for i in range(len(seqs)) if i in cached]
            for i in order[len(todo):]:
                one = cached[i]
                seqs[i].observed |= one.observed  # what the slot held when it was computed
                parts.append(DecodeBatch([seqs[i]], list(one.segments), one.mask,
                                         one.last_pos, one.logits, one.slots))
            merged = parts[0]
            for p in parts[1:]:
                merged = self.merge(merged, p)
            # restore request order
            pos = {i: k for k, i in enumerate(order)}
            out = self.select(merged, [pos[i] for i in range(len(seqs))])
            # slots come from the sequences now, never from what a cached entry was built with
            out.slots = SlotBatch.from_slots([s.slot for s in out.seqs], self.device)
            return out

    def _prefill_rows(self, seqs: list[Sequence]) -> DecodeBatch:
        prompts = [s.prompt_ids for s in seqs]
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
            mask[i, width - len(p) :] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)  # [batch, width]
        positions = (mask.cumsum(-1) - 1).clamp(min=0)  # [batch, width]
        slots = SlotBatch.from_slots([s.slot for s in seqs], self.device)
        # The prompts' keys and values go straight into buffers with room for the rows' tokens.
        arena = [ArenaLayer.empty(room_for(seqs), self.kv_traffic)
                 for _ in range(self.model.config.num_hidden_layers)]
        cache = DynamicCache(config=self.model.config)
        cache.layers = list(arena)
        logits = self.forward(seqs, slots, ids, mask, positions, cache)
        keys, values = cache_tensors(cache)
        return DecodeBatch.one(list(seqs), keys, values, mask, positions[:, -1:], logits, slots,
                               kv_capacity=arena[0].capacity)

    def run_model(self, slots: SlotBatch, ids: torch.Tensor, mask: torch.Tensor,
                  positions: torch.Tensor, cache: DynamicCache) -> torch.Tensor:
        """One pass of the base model with ``slots`` as every slotted module's rows; the logits
        of each row's last position."""
        self.context.batch = slots
        runs, self._row_runs = self._row_runs, None
        try:
            out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions,
                             cache=cache, use_cache=True, logits_to_keep=1, row_runs=runs)
        finally:
            self.context.batch = None
        logits: torch.Tensor = out.logits[:, -1, :]
        return logits

    def merge(self, a: DecodeBatch, b: DecodeBatch) -> DecodeBatch:
        """One batch holding the rows of both (``backend.serving.batch_ops.merged``)."""
        with self.lock, torch.inference_mode():
            return merged(a, b, self.device, self.kv_traffic)

    def retain(self, batch: DecodeBatch, keep: list[int], *,
               reuse: bool = False) -> DecodeBatch | None:
        """The batch with only rows ``keep``; None when no row is left. ``reuse``: the caller
        gives ``batch`` up, so its buffers may hold the rows kept (no new KV buffers)."""
        if not keep:
            return None
        if keep == list(range(len(batch))):
            return batch
        with self.lock, torch.inference_mode():
            return selected(batch, keep, self.device, self.kv_traffic, reuse=reuse)

    def select(self, batch: DecodeBatch, keep: list[int]) -> DecodeBatch:
        return selected(batch, keep, self.device, self.kv_traffic)

    @staticmethod
    def choose(batch: DecodeBatch, eos_ids: frozenset[int]) -> list[int | None]:
        """Pick each row's next token; mark rows that reached eos or their limit as done; a row
        whose logits are not finite, or whose probabilities are not a distribution, fails alone
        (``failure = "numerical"``)."""
        rows = [RowSampling(s.request.temperature, s.request.top_p, s.generator)
                for s in batch.seqs]
        with torch.inference_mode():
            # the step's one device-to-host read, for greedy and sampled rows together
            ids = choose_tokens(batch.logits.float(), rows).tolist()
        chosen: list[int | None] = [None if t == FAILED else t for t in ids]
        for s, token in zip(batch.seqs, chosen, strict=True):
            if token is None:
                s.failure, s.done = "numerical", True
                continue
            s.produced.append(token)
            if token in eos_ids or len(s.produced) >= s.request.max_tokens:
                s.done = True
        return chosen

    def advance(self, batch: DecodeBatch) -> None:
        """One decode step: feed each row's last token, extend the KV cache, new logits."""
        with self.lock, torch.inference_mode():
            ids = torch.tensor([[s.produced[-1]] for s in batch.seqs], dtype=torch.long,
                               device=self.device)  # [batch, 1]
            batch.mask = torch.cat([batch.mask, torch.ones_like(batch.mask[:, :1])], dim=1)
            batch.last_pos = batch.last_pos + 1
            # Each layer writes the new token's keys and values into its segment's room
            # (backend.serving.kv_arena, kv_segments), instead of concatenating the whole KV.
            layers = decode_layers(batch.segments, batch.seqs,
                                   self.model.config.num_hidden_layers, self.kv_traffic)
            cache = DynamicCache(config=self.model.config)
            cache.layers = list(layers)
            # Rows attend over their own columns, not their segment's longest row's: a row's KV
            # is the rightmost prompt + tokens-fed columns of its segment (row_runs).
            self._row_runs = segment_runs(batch)
            batch.logits = self.forward(batch.seqs, batch.slots, ids, batch.mask,
                                        batch.last_pos, cache)
            batch.segments = written_back(batch.segments, layers)


def prefill_groups(lengths: list[int]) -> list[tuple[int, int]]:
    """Consecutive groups ``[first, end)`` of rows whose prompts are ``lengths`` to prefill
    as one pass each: at most :data:`PREFILL_GROUPS`, split where the padding a group would
    hold is worth more than one more pass (:data:`PREFILL_GROUP_COST`, rows x columns)."""
    if not lengths:
        return []
    runs = plan(lengths, max(lengths), run_cost=PREFILL_GROUP_COST, most=PREFILL_GROUPS)
    return [(0, len(lengths))] if runs is None else [(f, e) for f, e, _c in runs.spans]


def segment_runs(batch: DecodeBatch) -> RowRuns | None:
    """The decode step's runs of rows (``backend.serving.row_runs``), planned within each
    segment (a run never crosses one: each has its own buffers); None for one segment whose
    rows are best read in one run over its whole width."""
    spans: list[tuple[int, int, int]] = []
    for first, end, seg in batch.spans():
        lengths = [len(s.prompt_ids) + len(s.produced) for s in batch.seqs[first:end]]
        runs = plan(lengths, seg.width + 1)
        if runs is None:
            spans.append((first, end, seg.width + 1))
        else:
            spans.extend((first + f, first + e, c) for f, e, c in runs.spans)
    if len(spans) == 1 and spans[0][2] == batch.mask.shape[1]:
        return None
    return RowRuns(tuple(spans))


def row_generator(request: GenerationRequest, device: torch.device) -> torch.Generator | None:
    """The row's sampling generator: none for greedy decoding, else seeded by the request's
    ``seed`` (or at random)."""
    if request.temperature == 0.0:
        return None
    gen = torch.Generator(device=device)
    if request.seed is None:
        gen.seed()
    else:
        gen.manual_seed(request.seed)
    return gen


# -- whole batches (the oracle's entry points, ``Engine.generate`` and ``next_token_logits``):
# driven through the engine's own methods, so a subclass's checks and faults apply to them too.

class WholeBatchEngine(Protocol):
    """What the whole-batch drivers use of ``backend.serving.engine.Engine``: typed here, not
    imported, because the engine imports this module (tests/test_architecture.py refuses the
    cycle even under ``TYPE_CHECKING``)."""

    _lock: threading.RLock

    @property
    def base_config(self) -> PreTrainedConfig: ...

    def _prepare_one(self, r: GenerationRequest) -> tuple[list[int], SlotIdentity | None]: ...

    def open_sequence(self, request: GenerationRequest) -> Sequence: ...

    def close_sequence(self, seq: Sequence) -> None: ...

    def prefill(self, seqs: list[Sequence]) -> DecodeBatch: ...

    def choose(self, batch: DecodeBatch) -> list[int | None]: ...

    def retain(self, batch: DecodeBatch, keep: list[int], *,
               reuse: bool = False) -> DecodeBatch | None: ...

    def advance(self, batch: DecodeBatch) -> None: ...

    def text(self, ids: Sequence_[int]) -> str: ...


def first_logits(engine: WholeBatchEngine, requests: Sequence_[GenerationRequest]) -> torch.Tensor:
    """``[batch, vocab]`` float32 logits of each request's first generated token."""
    with engine._lock:
        seqs = _open_all(engine, requests)
        try:
            if not seqs:
                return torch.empty((0, engine.base_config.vocab_size))
            return engine.prefill(seqs).logits.float().cpu()
        finally:
            for s in seqs:
                engine.close_sequence(s)


def generate_all(engine: WholeBatchEngine, requests: Sequence_[GenerationRequest]
                 ) -> list[GenerationResult]:
    """Every request continued in one mixed batch, one forward pass per step."""
    with engine._lock:
        seqs = _open_all(engine, requests)
        try:
            batch = engine.prefill(seqs) if seqs else None
            while batch is not None:
                engine.choose(batch)
                batch = engine.retain(batch, [i for i, s in enumerate(batch.seqs)
                                              if not s.done], reuse=True)
                if batch is not None:
                    engine.advance(batch)
            return [s.result(engine.text(s.produced)) for s in seqs]
        finally:
            for s in seqs:
                engine.close_sequence(s)


def _open_all(engine: WholeBatchEngine, requests: Sequence_[GenerationRequest]) -> list[Sequence]:
    for r in requests:  # all or nothing: validate every request before pinning any slot
        engine._prepare_one(r)
    return [engine.open_sequence(r) for r in requests]
