"""Decode stalls while a long prompt arrives (issue 26's ``decode_stall_during_prefill``).

31 streams run through one scheduler; once each has a few tokens, one request with a
:data:`LONG_PROMPT_TOKENS`-token prompt arrives. What the streams' clients see is the gap between
two of their tokens: the p95 of those gaps from the arrival until the long request's first token,
against the p95 of the gaps of the same streams with no arrival (``quiet``). Measured with the
prompt prefilled in chunks of :data:`CHUNK` tokens between decode steps
(``backend.serving.chunked_prefill``) and in one pass (``prefill_chunk=0``, as before), in
alternating rounds; the ratio is of the rounds' medians. The long request's time to first token
is reported both ways: chunking trades it for the streams' gaps.

Why :data:`CHUNK` is small here: on a CPU a forward pass costs about its tokens' compute, so a
chunk of 16 tokens costs about half a decode step of 31 rows; on a GPU a decode step is bound by
reading the weights, and a chunk of hundreds of tokens costs about as much as one step (the
scheduler's default, ``LORAPLANE_PREFILL_CHUNK`` 512, is set for that).
"""

from __future__ import annotations

import statistics
import time

from backend.serving.engine import Engine, GenerationRequest
from backend.serving.scheduler import Scheduler, SchedulerLimits
from control.tools.bench.kit import TokenClock, long_prompt
from control.tools.bench.stats import p95

LONG_PROMPT_TOKENS = 2048
STREAMS = 31
CHUNK = 16
WARM_TOKENS = 4  # tokens every stream has before the long request arrives
QUIET_TOKENS = 40  # tokens a stream gets in a quiet round's window
GOAL = 1.5


def _round(engine: Engine, streams: list[GenerationRequest], long: GenerationRequest | None,
           chunk: int) -> tuple[float, float | None]:
    """(p95 of the streams' gaps in the window, the long request's time to first token): the
    window runs from the arrival to that first token, or for ``quiet`` rounds (``long`` None)
    from the same point for :data:`QUIET_TOKENS` tokens; then the streams are cancelled."""
    sched = Scheduler(engine, SchedulerLimits(max_running=len(streams) + 1,
                                              max_queued=2 * len(streams), prefill_chunk=chunk))
    try:
        clocks = [TokenClock() for _ in streams]
        for r, c in zip(streams, clocks, strict=True):
            sched.submit(engine.open_sequence(r), c, stream=True)
        while min(len(c.times) for c in clocks) < WARM_TOKENS:
            time.sleep(0.001)
        arrival, ttft = time.perf_counter(), None
        first = TokenClock()
        if long is not None:
            sched.submit(engine.open_sequence(long), first, stream=True)
            while not first.times and not first.done.is_set():
                time.sleep(0.001)
            end = first.times[0] if first.times else time.perf_counter()
            ttft = end - arrival
        else:
            while min(len(c.times) for c in clocks) < WARM_TOKENS + QUIET_TOKENS and not all(
                    c.done.is_set() for c in clocks):
                time.sleep(0.001)
            end = time.perf_counter()
        for c in [*clocks, first]:
            c.stop = True
        for c in clocks:
            c.done.wait()
        if long is not None:
            first.done.wait()
        gaps = [b - a for c in clocks for a, b in zip(c.times, c.times[1:], strict=False)
                if arrival < b <= end]
        return p95(gaps), ttft
    finally:
        sched.stop()


def decode_stall(engine: Engine, prompts: list[str], reps: int, *,
                 long_tokens: int = LONG_PROMPT_TOKENS, n_streams: int = STREAMS,
                 chunk: int = CHUNK) -> dict[str, float]:
    """The measurement (see the module notes); ``prompts``: the streams' prompts (a byte
    tokenizer's: a character a token)."""
    # long enough to run through a chunked prefill of the whole prompt, with room to spare
    new_tokens = max(long_tokens // chunk, QUIET_TOKENS) + 2 * WARM_TOKENS + 8
    streams = [GenerationRequest(prompts[i % len(prompts)], None, max_tokens=new_tokens)
               for i in range(n_streams)]
    long = GenerationRequest(long_prompt(prompts, long_tokens), None, max_tokens=2)  # + bos
    quiet: list[float] = []
    chunked: list[float] = []
    whole: list[float] = []
    ttft_chunked: list[float] = []
    ttft_whole: list[float] = []
    _round(engine, streams[:4], None, chunk)  # warm-up
    for _ in range(max(1, reps)):
        quiet.append(_round(engine, streams, None, chunk)[0])
        p95, ttft = _round(engine, streams, long, chunk)
        chunked.append(p95)
        ttft_chunked.append(ttft or 0.0)
        p95, ttft = _round(engine, streams, long, 0)
        whole.append(p95)
        ttft_whole.append(ttft or 0.0)
    q = statistics.median(quiet)
    return {
        "decode_stall_during_prefill": statistics.median(chunked) / q,
        "decode_stall_unchunked": statistics.median(whole) / q,
        "stream_gap_p95_quiet_s": q,
        "stream_gap_p95_chunked_s": statistics.median(chunked),
        "stream_gap_p95_unchunked_s": statistics.median(whole),
        "long_ttft_chunked_s": statistics.median(ttft_chunked),
        "long_ttft_unchunked_s": statistics.median(ttft_whole),
        "prefill_chunk": chunk,
        "long_prompt_tokens": long_tokens,
        "streams": n_streams,
    }
