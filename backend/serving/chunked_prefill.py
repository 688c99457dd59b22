"""Chunked prefill: a long prompt computed a slice at a time, between decode steps.

A prompt used to be prefilled in one forward pass as soon as it was admitted, and every running
stream waited for that pass: one 2,000-token prompt stalled 31 streams for as long as
2,000 tokens of compute take (issue 26). Here a prompt longer than the scheduler's
``prefill_chunk`` is computed ``prefill_chunk`` tokens per turn of the loop, one chunk between two
decode steps, so a running stream waits at most one chunk's compute for its next token. The
long request's own first token comes later by as many decode steps as it has chunks: the usual
trade (vLLM's and SGLang's chunked prefill make the same one, with one chunk per step's token
budget).

A chunk is a forward pass of one row, no padding, whose cache is the row's own
:class:`backend.serving.kv_arena.ArenaLayer` buffers: the first chunk allocates room for the
whole prompt and every token the row may produce, and each later chunk writes its columns into
that room, so the prompt's keys and values are written once. Attention of a chunk reads the
prompt's earlier columns through the cache, with positions continuing where the last chunk
ended, so the result is the one-pass prefill's, up to the order of floating-point sums
(``tests/backend/serving/test_chunked_prefill.py`` compares logits and greedy tokens).

Each chunk goes through the engine's forward pass like any other (``Engine._forward``): its row's
slot is checked against the load it was admitted on, and what the slot holds is observed, per
chunk. When the prompt's last chunk is done, the row is a one-row ``DecodeBatch`` that joins the
running batch as a short prompt's prefill does.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from backend.serving.batch_ops import cache_tensors
from backend.serving.batch_steps import BatchSteps
from backend.serving.engine_types import DecodeBatch, Sequence
from backend.serving.kv_arena import ArenaLayer, room_for
from backend.serving.lora_ops import SlotBatch


@dataclass(eq=False)
class PartialPrefill:
    """One sequence whose prompt is computed up to ``done`` tokens; its keys and values so far
    (per layer ``[1, kv_heads, done, head_dim]``, views of buffers holding ``capacity``)."""

    seq: Sequence
    done: int = 0
    keys: list[torch.Tensor] = field(default_factory=list)
    values: list[torch.Tensor] = field(default_factory=list)
    capacity: int = 0


def prefill_chunk(steps: BatchSteps, part: PartialPrefill, tokens: int) -> DecodeBatch | None:
    """Compute the next ``tokens`` (at least 1) of ``part``'s prompt with the engine's
    ``steps``; the one-row batch ready to join the running one once the prompt is done, else
    None."""
    seq, prompt = part.seq, part.seq.prompt_ids
    start = part.done
    end = min(len(prompt), start + max(1, tokens))
    # Room for the rest of the prompt and every token the row may produce: the later chunks and
    # the decode steps after them write into it.
    room = (len(prompt) - end) + room_for([seq])
    traffic, device = steps.kv_traffic, steps.device
    with steps.lock, torch.inference_mode():
        ids = torch.tensor([prompt[start:end]], dtype=torch.long, device=device)
        mask = torch.ones((1, end), dtype=torch.long, device=device)
        positions = torch.arange(start, end, dtype=torch.long, device=device)[None]
        if part.keys:
            layers = [ArenaLayer(k, v, part.capacity, room, traffic)
                      for k, v in zip(part.keys, part.values, strict=True)]
        else:
            layers = [ArenaLayer.empty(room, traffic)
                      for _ in range(steps.model.config.num_hidden_layers)]
        cache = DynamicCache(config=steps.model.config)
        cache.layers = list(layers)
        slots = SlotBatch.from_slots([seq.slot], device)
        logits = steps.forward([seq], slots, ids, mask, positions, cache)
        part.keys, part.values = cache_tensors(cache)
        part.capacity, part.done = layers[0].capacity, end
        if end < len(prompt):
            return None
        return DecodeBatch.one([seq], part.keys, part.values, mask, positions[:, -1:], logits,
                               slots, kv_capacity=part.capacity)
