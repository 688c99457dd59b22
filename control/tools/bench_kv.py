"""``loraplane bench kv``: what one decode step costs the KV cache, written in place against
concatenated anew (issue 26).

Before ``backend.serving.kv_arena``, each decode step wrapped the batch's keys and values in a
fresh ``DynamicCache``, whose update concatenates every layer's KV with the new token's: the whole
KV copied once per token. Now a step writes the new column into room its buffer already has. This
bench runs both on the same tensors, alternating, and reports per context width:

- ``concat_vs_arena``: median seconds of the concatenating step over the arena's (higher is
  better for the arena; the baseline does exactly the work the old ``advance`` did to the cache);
- the bytes each allocates per step, counted from the storages it returns (the arena's is
  zero while it has room), beside the bytes one token's keys and values take;
- each side's median and spread, and that both hold the same values after every round.

The shapes are a GQA model's cache scaled to fit this machine's memory (the layers and rows are
fewer than an 8B model's; per layer and row the work is the same), in the engine's fp32 on CPU.
Only the cache's update is timed: attention reads the same columns either way.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from transformers.cache_utils import DynamicLayer

from backend.serving.kv_arena import ArenaLayer, stacked

LAYERS, ROWS, KV_HEADS, HEAD_DIM = 8, 8, 8, 128
WIDTHS = (256, 1024, 2048)
QUICK_WIDTHS = (256, 1024)


def _concat_layer(k: torch.Tensor, v: torch.Tensor) -> DynamicLayer:
    """The old decode step's layer: a fresh one over the batch's tensors, whose update
    concatenates."""
    layer = DynamicLayer()
    layer.lazy_initialization(k, v)
    layer.keys, layer.values = k, v
    return layer


def _step(keys: list[torch.Tensor], values: list[torch.Tensor], new: torch.Tensor,
          layer: Callable[[torch.Tensor, torch.Tensor], DynamicLayer],
          ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """One decode step's cache work: each layer, made by ``layer``, takes the new column."""
    out_k, out_v = [], []
    for k, v in zip(keys, values, strict=True):
        nk, nv = layer(k, v).update(new, new)
        out_k.append(nk)
        out_v.append(nv)
    return out_k, out_v


def _allocated(before: list[torch.Tensor], after: list[torch.Tensor]) -> int:
    """Bytes of the storages a step put under ``after`` that ``before`` did not have."""
    return sum(a.untyped_storage().nbytes() for b, a in zip(before, after, strict=True)
               if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr())


def _run_side(side: str, start: list[torch.Tensor], news: list[torch.Tensor],
              width: int) -> tuple[float, int, torch.Tensor]:
    """Mean seconds per step, mean bytes allocated per step, and the last layer's keys."""
    steps = len(news)
    if side == "concat":
        keys, values = [t.clone() for t in start], [t.clone() for t in start]
    else:  # what batch_ops.merged hands the steps: the rows in buffers with room
        keys = [stacked([t], width, steps) for t in start]
        values = [stacked([t], width, steps) for t in start]
    layer: Callable[[torch.Tensor, torch.Tensor], DynamicLayer] = (
        _concat_layer if side == "concat"
        else lambda k, v: ArenaLayer(k, v, width + steps, steps))
    seconds, allocated = 0.0, 0
    for new in news:
        t = time.perf_counter()
        nk, nv = _step(keys, values, new, layer)
        seconds += time.perf_counter() - t
        allocated += _allocated(keys + values, nk + nv)
        keys, values = nk, nv
    return seconds / steps, allocated // steps, keys[-1]


def _one_width(width: int, steps: int, rounds: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(width)
    shape = (ROWS, KV_HEADS, width, HEAD_DIM)
    start = [torch.randn(shape, generator=g) for _ in range(LAYERS)]
    news = [torch.randn((ROWS, KV_HEADS, 1, HEAD_DIM), generator=g) for _ in range(steps)]
    seconds: dict[str, list[float]] = {"concat": [], "arena": []}
    allocated: dict[str, int] = {}
    same = True
    with torch.inference_mode():
        for r in range(rounds):
            finals = {}
            for side in (("concat", "arena") if r % 2 == 0 else ("arena", "concat")):
                dt, allocated[side], finals[side] = _run_side(side, start, news, width)
                seconds[side].append(dt)
            same = same and torch.equal(finals["concat"], finals["arena"])
    c, a = seconds["concat"], seconds["arena"]
    return {
        "width": width,
        "concat_vs_arena": statistics.median(c) / statistics.median(a),
        "round_ratios": sorted(x / y for x, y in zip(c, a, strict=True)),
        "concat_step_s": {"median": statistics.median(c), "min": min(c), "max": max(c)},
        "arena_step_s": {"median": statistics.median(a), "min": min(a), "max": max(a)},
        "bytes_allocated_per_step": allocated,
        "new_token_bytes_per_step": 2 * LAYERS * ROWS * KV_HEADS * HEAD_DIM * 4,
        "same_values": same,
    }


def run_bench(*, quick: bool = False,
              progress: Callable[[str], None] = lambda _m: None) -> dict[str, Any]:
    """Every width's figures; ``quick``: fewer widths, steps and rounds (seconds, for CI)."""
    widths = QUICK_WIDTHS if quick else WIDTHS
    steps, rounds = (4, 3) if quick else (16, 7)
    out = []
    for width in widths:
        progress(f"kv step at width {width}: {rounds} alternating rounds of {steps} steps")
        out.append(_one_width(width, steps, rounds))
    return {
        "widths": out,
        "setup": {"layers": LAYERS, "rows": ROWS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM,
                  "dtype": "float32", "device": "cpu", "steps_per_round": steps,
                  "rounds": rounds, "threads": torch.get_num_threads()},
    }
