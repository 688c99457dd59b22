"""Continuous batching: one thread admits new sequences between decode steps and streams tokens.

Each step: drop cancelled rows, admit queued sequences up to ``max_running`` (their prompts run as
one prefill, or come from the prefix cache, then join the running batch), pick every row's next
token, hand new text to streaming sinks, finish rows at eos or ``max_tokens``, run one decode step
for the rest. Queued requests are bounded by ``max_queued``; past it ``submit`` raises ``QueueFull``
at once, so callers get a clear error instead of an unbounded wait.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import deque
from dataclasses import dataclass
from typing import Protocol

import torch

from backend.engine import DecodeBatch, Engine, GenerationResult, Sequence
from backend.prefix_cache import PrefixCache, PrefixKey

log = logging.getLogger("loraplane.backend")


class QueueFull(Exception):
    """The scheduler holds ``max_queued`` waiting requests already."""


class SequenceSink(Protocol):
    """Where one sequence's output goes; called from the scheduler thread."""

    def cancelled(self) -> bool: ...
    def token(self, piece: str) -> None: ...
    def finish(self, result: GenerationResult, outcome: str) -> None: ...  # ok|cancelled|failed


@dataclass(frozen=True)
class SchedulerLimits:
    """Bounds on concurrent work."""

    max_running: int = 32
    max_queued: int = 256

    @classmethod
    def from_env(cls) -> SchedulerLimits:
        return cls(
            max_running=int(os.environ.get("LORAPLANE_MAX_RUNNING", cls.max_running)),
            max_queued=int(os.environ.get("LORAPLANE_MAX_QUEUED", cls.max_queued)),
        )


@dataclass
class _Job:
    seq: Sequence
    sink: SequenceSink
    stream: bool
    key: PrefixKey | None
    emitted: str = ""
    outcome: str = ""


class Scheduler:
    """Owns the decode loop over one engine."""

    def __init__(self, engine: Engine, limits: SchedulerLimits | None = None,
                 prefix_cache: PrefixCache[DecodeBatch] | None = None) -> None:
        self.engine = engine
        self.limits = limits or SchedulerLimits()
        self.prefix_cache = prefix_cache
        self._cv = threading.Condition()
        self._queue: deque[_Job] = deque()
        self._running: list[_Job] = []
        self._batch: DecodeBatch | None = None
        self._stop = False
        self.steps = 0
        self._thread = threading.Thread(target=self._loop, name="scheduler", daemon=True)
        self._thread.start()

    def submit(self, seq: Sequence, sink: SequenceSink, *, stream: bool = False,
               key: PrefixKey | None = None) -> None:
        """Queue an opened sequence; raises ``QueueFull`` past the bound."""
        with self._cv:
            if self._stop:
                raise QueueFull("scheduler stopped")
            if len(self._queue) >= self.limits.max_queued:
                raise QueueFull(f"server busy: {self.limits.max_queued} requests already queued")
            self._queue.append(_Job(seq, sink, stream, key))
            self._cv.notify()

    def load(self) -> tuple[int, int]:
        """(running, queued) right now."""
        with self._cv:
            return len(self._running), len(self._queue)

    def stop(self) -> None:
        """Stop the loop; unfinished sequences end as failed."""
        with self._cv:
            self._stop = True
            self._cv.notify()
        self._thread.join(timeout=30)

    # -- the loop ---------------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._stop and not self._queue and not self._running:
                    self._cv.wait()
                if self._stop:
                    leftover = list(self._queue) + self._running
                    self._queue.clear()
                    self._running = []
                    break
                room = self.limits.max_running - len(self._running)
                new = [self._queue.popleft() for _ in range(min(room, len(self._queue)))]
            try:
                self._step(new)
            except Exception:
                log.exception("decode step failed; failing %d sequences", len(self._running))
                for job in self._running + [j for j in new if j not in self._running]:
                    self._end(job, "failed")
                self._running, self._batch = [], None
        for job in leftover:
            self._end(job, "failed")

    def _step(self, new: list[_Job]) -> None:
        eng = self.engine
        new = [j for j in new if not self._cancelled_before_start(j)]
        if new:
            joined = eng.prefill([j.seq for j in new], self._cached(new))
            self._remember(new, joined)
            self._batch = joined if self._batch is None else eng.merge(self._batch, joined)
            self._running += new
        if self._batch is None:
            return
        eng.choose(self._batch)
        self.steps += 1
        for job in self._running:
            if job.sink.cancelled():
                job.seq.done, job.outcome = True, "cancelled"
            elif job.stream:
                self._stream(job)
        keep = [i for i, j in enumerate(self._running) if not j.seq.done]
        for job in [j for j in self._running if j.seq.done]:
            self._end(job, job.outcome or "ok")
        self._running = [self._running[i] for i in keep]
        self._batch = eng.retain(self._batch, keep)
        if self._batch is not None:
            eng.advance(self._batch)

    def _cancelled_before_start(self, job: _Job) -> bool:
        if job.sink.cancelled():
            self._end(job, "cancelled")
            return True
        return False

    def _stream(self, job: _Job) -> None:
        text = self.engine.text(job.seq.produced)
        # a multi-byte character split across tokens decodes to U+FFFD until it is complete
        if text.endswith("\ufffd") and not job.seq.done:
            return
        if len(text) > len(job.emitted):
            piece, job.emitted = text[len(job.emitted):], text
            job.sink.token(piece)

    def _end(self, job: _Job, outcome: str) -> None:
        self.engine.close_sequence(job.seq)
        try:
            job.sink.finish(job.seq.result(self.engine.text(job.seq.produced)), outcome)
        except Exception:
            log.exception("a sink failed to finish")

    # -- prefix cache -----------------------------------------------------------------------

    def _cached(self, new: list[_Job]) -> dict[int, DecodeBatch]:
        if self.prefix_cache is None:
            return {}
        hits: dict[int, DecodeBatch] = {}
        for i, job in enumerate(new):
            if job.key is not None:
                found = self.prefix_cache.get(job.key)
                if found is not None:
                    hits[i] = found
        return hits

    def _remember(self, new: list[_Job], batch: DecodeBatch) -> None:
        if self.prefix_cache is None:
            return
        for i, job in enumerate(new):
            if job.key is None:
                continue
            one = self.engine.retain(batch, [i])
            assert one is not None
            keys = [k.clone() for k in one.keys]
            values = [v.clone() for v in one.values]
            entry = DecodeBatch([], keys, values, one.mask.clone(), one.last_pos.clone(),
                                one.logits.clone(), one.slots)
            nbytes = sum(_nbytes(t) for t in keys + values)
            self.prefix_cache.put(job.key, entry, nbytes)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
