"""What padding rows costs (issue 26's ``mixed_lengths_vs_uniform`` and
``peak_kv_vs_live_kv``).

The running batch keeps its rows' keys and values in segments (``backend.serving.kv_segments``):
rows prefilled together, grouped by prompt length, each group left-padded to its own longest
row, in buffers with room for the most tokens its rows may still make
(``backend.serving.kv_arena``). Two figures show what padding still costs, each from runs
through one scheduler:

- ``mixed_lengths_vs_uniform``: decode tokens/s of 31 short rows plus one row with a
  :data:`LONG_PROMPT_TOKENS`-token prompt, over 32 short rows, alternated, best of ``reps``
  each. Decode only: the window runs from the long row's first token (every row is then in the
  batch) to the end, so the long prompt's own prefill is not counted against it. The long row
  is a segment of its own, and the row runs (``backend.serving.row_runs``) keep each row's
  attention to its own columns.
- ``peak_kv_vs_live_kv``: the most KV bytes the engine held (every layer's buffers under the
  running batch, their room included, and any prompt being prefilled in chunks) over the most
  it needed for the tokens the rows actually have (each row's prompt and tokens so far, no
  padding, no room), sampled at every decode step of the mixed run. The copies a join holds
  for a moment (old and new buffers) are not sampled. Before the segments, every short row was
  padded to the long row's width: 13.3.
"""

from __future__ import annotations

from typing import Any

from backend.serving.engine import DecodeBatch, Engine, GenerationRequest
from backend.serving.scheduler import Scheduler, SchedulerLimits
from control.tools.bench.kit import TokenClock, long_prompt

LONG_PROMPT_TOKENS = 2048
ROWS = 32


class _KvSampler:
    """Held and live KV bytes at every decode step, through the engine's ``advance``."""

    def __init__(self, engine: Engine, sched: Scheduler) -> None:
        c = engine.base_config
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        # one position: keys and values of every layer
        self.position = (2 * c.num_hidden_layers * c.num_key_value_heads * head_dim
                         * engine.dtype.itemsize)
        self.sched, self.held, self.live = sched, 0, 0

    def sample(self, batch: DecodeBatch) -> None:
        storages: dict[int, int] = {}
        for t in [*batch.kv_tensors(), *self.sched.prefill_tensors()]:
            s = t.untyped_storage()
            storages[s.data_ptr()] = s.nbytes()
        held = sum(storages.values())
        live = sum(len(s.prompt_ids) + len(s.produced) for s in batch.seqs) * self.position
        self.held, self.live = max(self.held, held), max(self.live, live)


def _run(engine: Engine, requests: list[GenerationRequest],
         sample: bool) -> tuple[float, int, int]:
    """(decode tokens/s of ``requests`` as concurrent streams, from the last request's first
    token to the end; the peak KV bytes held and live, when ``sample``)."""
    sched = Scheduler(engine, SchedulerLimits(max_running=len(requests),
                                              max_queued=2 * len(requests)))
    sampler = _KvSampler(engine, sched)
    advance = engine.advance
    if sample:
        def sampled(batch: DecodeBatch) -> None:
            sampler.sample(batch)
            advance(batch)
        engine.advance = sampled  # type: ignore[method-assign]
    try:
        streams = [TokenClock() for _ in requests]
        for r, t in zip(requests, streams, strict=True):
            sched.submit(engine.open_sequence(r), t, stream=True)
        for t in streams:
            t.done.wait()
    finally:
        engine.advance = advance  # type: ignore[method-assign]
        sched.stop()
    start = streams[-1].times[0] if streams[-1].times else min(t.times[0] for t in streams)
    end = max(t.times[-1] for t in streams if t.times)
    tokens = sum(1 for t in streams for x in t.times if x > start)
    rate = tokens / (end - start) if end > start else 0.0
    return rate, sampler.held, sampler.live


def padding_costs(engine: Engine, prompts: list[str], new_tokens: int, reps: int, *,
                  long_tokens: int = LONG_PROMPT_TOKENS, rows: int = ROWS) -> dict[str, Any]:
    """The two figures (see the module notes); ``prompts``: short prompts (a byte tokenizer's:
    a character a token)."""
    short = [GenerationRequest(prompts[i % len(prompts)], None, max_tokens=new_tokens)
             for i in range(rows)]
    # the long row last, so the window starts when it joins
    mixed = [*short[:-1], GenerationRequest(long_prompt(prompts, long_tokens), None,
                                            max_tokens=new_tokens)]
    uniform_best, mixed_best, held, live = 0.0, 0.0, 0, 0
    for _ in range(max(1, reps)):
        uniform_best = max(uniform_best, _run(engine, short, False)[0])
        rate, h, lv = _run(engine, mixed, True)
        mixed_best, held, live = max(mixed_best, rate), max(held, h), max(live, lv)
    return {
        "mixed_lengths_vs_uniform": mixed_best / uniform_best if uniform_best else 0.0,
        "peak_kv_vs_live_kv": held / live if live else 0.0,
        "decode_tokens_per_s_uniform": uniform_best,
        "decode_tokens_per_s_mixed": mixed_best,
        "kv_peak_held_bytes_mixed": float(held),
        "kv_peak_live_bytes_mixed": float(live),
    }
