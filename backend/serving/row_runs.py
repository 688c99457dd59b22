"""Decode attention over each group of rows' own width, not the batch's longest row.

The running batch keeps its rows left-padded to the longest one (``backend.serving.kv_arena``):
a row's keys and values are the rightmost ``length`` columns of the batch's width, and the
columns left of them are padding the mask hides. Masked columns still cost: SDPA reads and
multiplies every one. With one 2,048-token row among 31 rows of 64 tokens, each short row
attended over 2,080 columns, and the batch decoded at 0.28 of the rate of 32 short rows
(``bench engine``'s ``mixed_lengths_vs_uniform``).

So a decode step splits the batch into runs of consecutive rows (:func:`plan`) and runs PyTorch's
SDPA once per run, over only the rightmost columns its longest row needs: a view of the same
buffer (``key[r0:r1, :, -cols:]``), so nothing is copied, and the same mask, sliced alike. The
columns a run leaves out are padding for every row in it, so each row's attention is over exactly
the columns it had before (the serving state machine checks the tokens against PEFT's). Runs
cost a call each, so :func:`plan` picks the split that minimises rows x columns plus a fixed cost
per run, at most :data:`MOST_RUNS`. Prefill passes (more than one query position) take plain SDPA.

A batch whose KV is in several segments (``backend.serving.kv_segments``) is planned within each
segment, and its keys and values come as one view per segment: a run reads its own segment's.

The function is registered with transformers' attention interface under :data:`NAME` (and the
SDPA mask under the same name, so the model builds the masks SDPA gets); a pass gives the runs as
the ``row_runs`` keyword, which transformers hands from the model's call to each attention layer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from backend.serving.kv_segments import SegmentViews

NAME = "loraplane_row_runs"
MOST_RUNS = 4
# What one more SDPA call is taken to cost, in row x column units of attention work: 64 rows
# over 64 columns. On the CPU bench a sweep from 256 to 16,384 (2026-12-06, three rounds each)
# moved the mixed decode rate by less than its noise; what matters is splitting a 2,048-column
# row off 31 short ones, which every value in that range does.
RUN_COST = 4096
ATOMS = 32  # rows are planned in at most this many consecutive groups (the plan is quadratic)


@dataclass(frozen=True)
class RowRuns:
    """Consecutive rows ``[first, end)`` attending over their rightmost ``columns``."""

    spans: tuple[tuple[int, int, int], ...]


def plan(lengths: Sequence[int], width: int, *, run_cost: int | None = None,
         most: int = MOST_RUNS) -> RowRuns | None:
    """The runs for rows whose KV lengths are ``lengths`` in a batch ``width`` columns wide;
    None when one run over the whole width is the best (plain SDPA then). ``run_cost``:
    :data:`RUN_COST` unless given (read at each call, so a test can make runs cheap)."""
    run_cost = RUN_COST if run_cost is None else run_cost
    n = len(lengths)
    if n == 0 or max(lengths) > width:
        raise ValueError(f"row lengths {max(lengths, default=0)} over the batch width {width}")
    if (width - min(lengths)) * n <= run_cost:
        return None  # the most any split could leave out is worth less than one more call
    size = max(1, -(-n // ATOMS))
    bounds = [*range(0, n, size), n]  # atom k is rows [bounds[k], bounds[k + 1])
    atoms = len(bounds) - 1
    atom_max = [max(lengths[bounds[k]:bounds[k + 1]]) for k in range(atoms)]
    inf = float("inf")
    # best[r][k]: least cost of the first k atoms in r runs; back[r][k]: where its last run begins
    best = [[inf] * (atoms + 1) for _ in range(most + 1)]
    back = [[0] * (atoms + 1) for _ in range(most + 1)]
    best[0][0] = 0.0
    for r in range(1, most + 1):
        for k in range(1, atoms + 1):
            longest = 0
            for j in range(k - 1, -1, -1):  # the last run is atoms [j, k)
                longest = max(longest, atom_max[j])
                if best[r - 1][j] == inf:
                    continue
                cost = best[r - 1][j] + (bounds[k] - bounds[j]) * longest + run_cost
                if cost < best[r][k]:
                    best[r][k], back[r][k] = cost, j
    runs = min(range(1, most + 1), key=lambda r: best[r][atoms])
    spans: list[tuple[int, int, int]] = []
    k = atoms
    for r in range(runs, 0, -1):
        j = back[r][k]
        first, end = bounds[j], bounds[k]
        spans.append((first, end, max(lengths[first:end])))
        k = j
    spans.reverse()
    if len(spans) == 1 and spans[0][2] == width:
        return None
    return RowRuns(tuple(spans))


def row_run_attention(module: torch.nn.Module, query: torch.Tensor,
                      key: torch.Tensor | SegmentViews, value: torch.Tensor | SegmentViews,
                      attention_mask: torch.Tensor | None, dropout: float = 0.0,
                      scaling: float | None = None, row_runs: RowRuns | None = None,
                      **kwargs: Any) -> tuple[torch.Tensor, None]:
    """SDPA per run of rows over the run's columns (see the module notes); plain SDPA without
    runs or for more than one query position. A segmented batch's keys and values
    (``kv_segments.SegmentViews``) are read per segment, each run within one."""
    if isinstance(key, torch.Tensor) and isinstance(value, torch.Tensor) and (
            row_runs is None or query.shape[2] != 1):
        return sdpa_attention_forward(module, query, key, value, attention_mask,
                                      dropout=dropout, scaling=scaling, **kwargs)
    if row_runs is None:  # segments, no plan: each segment over its whole width
        assert isinstance(key, SegmentViews)
        row_runs = RowRuns(tuple((f, e, t.shape[2]) for f, e, t in key.parts))
    outs = []
    for first, end, cols in row_runs.spans:
        k, v = _rows(key, first, end), _rows(value, first, end)
        mask = None if attention_mask is None else attention_mask[first:end, ..., -cols:]
        out, _ = sdpa_attention_forward(module, query[first:end], k[:, :, -cols:],
                                        v[:, :, -cols:], mask, dropout=dropout,
                                        scaling=scaling, **kwargs)
        outs.append(out)
    return torch.cat(outs, dim=0), None


def _rows(kv: torch.Tensor | SegmentViews, first: int, end: int) -> torch.Tensor:
    """Rows ``[first, end)`` of a batch's keys or values (one tensor, or the segment holding
    them)."""
    if isinstance(kv, torch.Tensor):
        return kv[first:end]
    start, t = kv.part_of(first, end)
    return t[first - start:end - start]


def use_row_runs(model: PreTrainedModel) -> None:
    """Make ``model`` attend through :func:`row_run_attention` (SDPA's masks, SDPA's kernel)."""
    AttentionInterface.register(NAME, row_run_attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    model.set_attn_implementation(NAME)
