"""Continuous batching: one thread admits new sequences between decode steps and streams tokens.

Each step: drop cancelled rows, admit queued sequences up to ``max_running`` (their prompts run as
one prefill, or come from the prefix cache, then join the running batch; a prompt longer than
``prefill_chunk`` is computed one chunk per step instead, ``backend.serving.chunked_prefill``, and
joins when it is done), pick every row's next token, hand new text to streaming sinks, finish rows
at eos or ``max_tokens``, run one decode step for the rest. Queued requests are bounded by
``max_queued``; past it ``submit`` raises ``QueueFull`` at once, so callers get a clear error
instead of an unbounded wait.

Every job ends exactly once (:meth:`Scheduler._end`): that one call releases the sequence's lease
(its slot pin and cache reference) and tells the sink. A second end is a no-op, counted as a
``double_finish`` violation. Faults stay as small as they can be:

- a row whose logits or sampling fail (``numerical``) fails alone;
- a sink that cannot take a streamed piece (client gone) ends only its own request;
- a row whose slot no longer holds the load it was admitted on fails alone, as
  ``identity_mismatch``, before the step that would have applied the other weights;
- independently of that check, a row whose forward pass read another digest in its slot's banks
  than its request names (``Sequence.observed``) fails alone, as ``identity_mismatch``, before
  the token that pass computed is sent;
- an exception that cannot be tied to one row fails every job still live, each exactly once.

Revocation reaches admitted work (:meth:`Scheduler.revoke`): queued sequences on a revoked digest
are refused at once and never start; running ones drain, or, with the kill switch, end before the
next step sends another token.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Protocol

import torch

from backend.serving.chunked_prefill import PartialPrefill
from backend.serving.engine import DecodeBatch, Engine, GenerationResult, Sequence
from backend.serving.kv_admission import KvHeld, admit, over_budget, reserved
from backend.serving.placement_gate import let_placements_in
from backend.serving.prefill_order import Prefilling
from backend.serving.prefix_cache import PrefixCache, PrefixKey
from backend.serving.prefix_entries import cached_entries, remember
from backend.serving.tenant_queues import QueueFull, TenantQueues
from control.contracts.ledger import Outcome

log = logging.getLogger("loraplane.backend")


class OverKVBudget(QueueFull):
    """The request alone needs more KV positions than the host's budget: it can never run."""


class AdapterRevoked(Exception):
    """The sequence's adapter was revoked while this host runs: it is not taken."""


class SequenceSink(Protocol):
    """Where one sequence's output goes; called from the scheduler thread."""

    def cancelled(self) -> bool: ...
    def token(self, piece: str) -> None: ...
    def finish(self, result: GenerationResult, outcome: Outcome, reason: str | None) -> None: ...


@dataclass(frozen=True)
class SchedulerLimits:
    """Bounds on concurrent work."""

    max_running: int = 32
    max_queued: int = 256
    # KV positions the engine's buffers may hold (padding, room and chunked prompts included,
    # ``backend.serving.kv_admission``). None: no bound but max_running. The service
    # takes the memory plan's (``MemoryPlan.kv_tokens``) unless LORAPLANE_MAX_KV_TOKENS is set.
    max_kv_tokens: int | None = None
    # Prompts longer than this many tokens are prefilled this many tokens per turn, between
    # decode steps (``backend.serving.chunked_prefill``); 0: every prompt in one pass.
    prefill_chunk: int = 512
    # Requests a host holds at once, from arrival to answer; past it they are refused as busy
    # before their tickets are read, without a tenant. A verified tenant may hold an equal part
    # of it between the tenants in flight and one more (``backend.serving.in_flight``). None:
    # four times max_queued + max_running, so that one tenant's flood, which the fair queue
    # keeps to its part (``backend.serving.tenant_queues``), cannot fill it for the others.
    max_in_flight: int | None = None

    def in_flight_bound(self) -> int:
        if self.max_in_flight is not None:
            return self.max_in_flight
        return 4 * (self.max_queued + self.max_running)

    @classmethod
    def from_env(cls, kv_tokens: int | None = None) -> SchedulerLimits:
        """From LORAPLANE_MAX_RUNNING / _MAX_QUEUED / _MAX_KV_TOKENS / _PREFILL_CHUNK /
        _MAX_IN_FLIGHT;
        ``kv_tokens``: the memory plan's budget, used when _MAX_KV_TOKENS is unset."""
        given = os.environ.get("LORAPLANE_MAX_KV_TOKENS")
        limits = cls(
            max_running=int(os.environ.get("LORAPLANE_MAX_RUNNING", cls.max_running)),
            max_queued=int(os.environ.get("LORAPLANE_MAX_QUEUED", cls.max_queued)),
            max_kv_tokens=int(given) if given else kv_tokens,
            prefill_chunk=int(os.environ.get("LORAPLANE_PREFILL_CHUNK", cls.prefill_chunk)),
            max_in_flight=int(flight) if (flight := os.environ.get("LORAPLANE_MAX_IN_FLIGHT"))
            else None,
        )
        # A bound that would refuse every request is a mistake to say at start, not to serve.
        floors = {"PREFILL_CHUNK": (limits.prefill_chunk, 0),  # 0: no chunking
                  "MAX_RUNNING": (limits.max_running, 1), "MAX_QUEUED": (limits.max_queued, 0),
                  "MAX_IN_FLIGHT": (limits.max_in_flight, 1)}
        for name, (value, least) in floors.items():
            if value is not None and value < least:
                raise ValueError(f"LORAPLANE_{name} must be >= {least}, not {value}")
        return limits


@dataclass(eq=False)  # jobs are compared by identity: one job, one end
class _Job:
    seq: Sequence
    sink: SequenceSink
    stream: bool
    key: PrefixKey | None
    tenant: str = ""  # whose request: the waiting room is shared fairly between tenants
    emitted: str = ""
    outcome: Outcome | None = None
    reason: str | None = None
    finished: bool = False


class Scheduler:
    """Owns the decode loop over one engine."""

    def __init__(self, engine: Engine, limits: SchedulerLimits | None = None,
                 prefix_cache: PrefixCache[DecodeBatch] | None = None, *,
                 start: bool = True) -> None:
        """``start=False``: no thread; the caller drives the loop with :meth:`run_once`
        (state-machine tests, which need every interleaving to be reproducible)."""
        self.engine = engine
        self.limits = limits or SchedulerLimits()
        self.prefix_cache = prefix_cache
        self._cv = threading.Condition()
        # waiting jobs, one FIFO per tenant (``backend.serving.tenant_queues``)
        self._queue: TenantQueues[_Job] = TenantQueues(self.limits.max_queued)
        self._running: list[_Job] = []
        # admitted jobs whose long prompts are prefilled a chunk per turn, oldest first; they
        # count as running (admission, load, KV) but are not rows of the batch yet
        self._prefilling: Prefilling[_Job] = Prefilling()
        # digest -> kill switch: adapters revoked while this scheduler runs (see ``revoke``)
        self._revoked: dict[str, bool] = {}
        self._batch: DecodeBatch | None = None
        self._stop, self.steps = False, 0
        self.ended = 0  # jobs ended (each exactly once)
        self.kv_waits = 0  # turns whose queue head waited for KV room
        self._thread: threading.Thread | None = None
        if start:
            self._thread = threading.Thread(target=self._loop, name="scheduler", daemon=True)
            self._thread.start()

    def submit(self, seq: Sequence, sink: SequenceSink, *, stream: bool = False,
               key: PrefixKey | None = None, tenant: str = "") -> None:
        """Queue an opened sequence of ``tenant``; raises ``QueueFull`` when the queue is full
        and this tenant holds its part of it (a job of a tenant over its part may be refused
        as busy in its place). From here on the scheduler owns the sequence's lease (released
        when the job ends); on ``QueueFull`` the caller still owns it."""
        with self._cv:
            if self._stop:
                raise QueueFull("scheduler stopped")
            if _digests(seq) & self._revoked.keys():
                raise AdapterRevoked("the sequence's adapter is revoked")
            too_big = over_budget(seq, self.limits.max_kv_tokens)
            if too_big is not None:
                raise OverKVBudget(too_big)
            displaced = self._queue.push(_Job(seq, sink, stream, key, tenant))
            self._cv.notify()
        if displaced is not None:  # out of the queue under the lock: no other thread holds it
            self._end(displaced, Outcome.REJECTED, "busy")

    def revoke(self, digest: str, *, immediate: bool) -> None:
        """``digest`` was revoked: refuse its queued sequences now (they never started:
        ``rejected``, reason ``revoked``) and every later ``submit`` of it. ``immediate``, the
        kill switch, also ends its running sequences before the next decode step sends another
        token (``revoked``); without it they run to completion (drain)."""
        with self._cv:
            self._revoked[digest] = self._revoked.get(digest, False) or immediate
            queued = self._queue.remove_if(lambda j: digest in _digests(j.seq))
            self._cv.notify()
        for job in queued:  # taken off the queue under the lock: no other thread holds them
            self._end(job, Outcome.REJECTED, "revoked")

    def load(self) -> tuple[int, int]:
        """(running, queued) right now."""
        with self._cv:
            return len(self._running) + len(self._prefilling), len(self._queue)

    def adapters_in_flight(self) -> tuple[list[str], list[str]]:
        """The adapter digests of the running and of the queued sequences right now (the
        placement metrics, ``backend.triton.placement_metrics``); the base model has none."""
        with self._cv:
            running = {d for j in self._live() for d in _digests(j.seq)}
            queued = {d for j in self._queue for d in _digests(j.seq)}
        return sorted(running), sorted(queued - running)

    def running_batch(self) -> DecodeBatch | None:
        """The batch being decoded now, or None (memory accounting reads its KV and copies)."""
        with self._cv:
            return self._batch

    def prefill_tensors(self) -> list[torch.Tensor]:
        """The keys and values of long prompts still being prefilled, per layer (memory
        accounting: they are KV held beside the running batch's)."""
        with self._cv:
            return self._prefilling.tensors()

    def stop(self) -> None:
        """Stop the loop; unfinished sequences end as failed."""
        with self._cv:
            self._stop = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(timeout=30)
        else:
            self._end_leftover()

    def run_once(self) -> bool:
        """One turn of the loop, on the caller's thread: admit what fits, one decode step.
        False when there was nothing to do. Only for a scheduler made with ``start=False``."""
        if self._thread is not None:
            raise RuntimeError("this scheduler runs its own thread")
        with self._cv:
            if self._stop or not (self._queue or self._running or self._prefilling):
                return False
            new = self._admit_from_queue()
        self._turn(new)
        return True

    def _admit_from_queue(self) -> list[_Job]:
        """Queued jobs that fit now (``backend.serving.admission``), oldest first."""
        admitted, waited = admit(self._queue, self._running, self.limits.max_running,
                                 self.limits.max_kv_tokens, chunked=self._chunked_jobs(),
                                 held=KvHeld.of(self._batch), will_chunk=self._will_chunk)
        self.kv_waits += waited
        return admitted

    def kv_reserved(self) -> int:
        """The most KV positions the buffers hold until the live rows end (what admission
        counts, ``backend.serving.kv_admission``)."""
        with self._cv:
            return reserved(self._running, self._chunked_jobs(), KvHeld.of(self._batch))

    def _chunked_jobs(self) -> list[_Job]:
        return self._prefilling.jobs()

    def _live(self) -> list[_Job]:
        """Jobs admitted and not ended: the batch's rows, then those still prefilling."""
        return self._running + self._chunked_jobs()

    # -- the loop ---------------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not (self._stop or self._queue or self._running or self._prefilling):
                    self._cv.wait()
                if self._stop:
                    break
                new = self._admit_from_queue()
            let_placements_in(self.engine)  # loads waiting for a slot go first
            self._turn(new)
        self._end_leftover()

    def _turn(self, new: list[_Job]) -> None:
        try:
            self._step(new)
        except Exception:
            # Not tied to one row: every job still live fails, each exactly once. Jobs this
            # step already ended (cancelled before start, finished on their first token) are
            # skipped, never ended again.
            live = [j for j in dict.fromkeys(self._live() + new) if not j.finished]
            log.exception("decode step failed; failing %d live sequences", len(live))
            with self._cv:
                self._running, self._batch = [], None
            self._prefilling.clear()
            for job in live:
                self._end(job, Outcome.FAILED, "engine")

    def _end_leftover(self) -> None:
        with self._cv:
            leftover = self._queue.clear() + self._live()
            self._running, self._batch = [], None
            self._prefilling.clear()
        for job in leftover:
            if not job.finished:
                self._end(job, Outcome.FAILED, "shutdown")

    def _step(self, new: list[_Job]) -> None:
        eng = self.engine
        with self._cv:
            revoked = dict(self._revoked)
        starting: list[_Job] = []
        for job in new:
            why = _unstartable(self.engine, job, revoked)
            if why is None:
                starting.append(job)
            else:
                self._end(job, *why)
        killed = [i for i, j in enumerate(self._running)
                  if any(revoked.get(d) for d in _digests(j.seq))]
        if killed:
            # The kill switch: these rows end here, before this step picks or sends a token.
            for i in killed:
                job = self._running[i]
                job.seq.done = True
                job.outcome, job.reason = Outcome.REVOKED, "immediate"
            self._retain([i for i in range(len(self._running)) if i not in set(killed)])
        cached = cached_entries(self.prefix_cache, [j.key for j in starting])
        long = [j for i, j in enumerate(starting) if i not in cached and self._will_chunk(j.seq)]
        if long:
            with self._cv:
                self._prefilling.add(long, lambda j: PartialPrefill(j.seq))
            short = [(j, cached.get(i)) for i, j in enumerate(starting) if j not in long]
            starting = [j for j, _hit in short]
            cached = {i: hit for i, (_j, hit) in enumerate(short) if hit is not None}
        if starting:
            starting, cached = _cached_last(starting, cached)
            joined = eng.prefill([j.seq for j in starting], cached)
            self._remember(starting, joined, cached.keys())
            self._join(starting, joined)
        self._prefill_turn(revoked)
        if self._batch is None:
            return
        eng.choose(self._batch)
        self.steps += 1
        for job in self._running:
            if job.seq.mismatched:
                # Provenance, read from the banks at compute time: the row's token was computed
                # with another adapter's weights. It fails closed before the token is sent,
                # whether or not the generation check (stale_rows) saw the slot change.
                job.seq.done, job.seq.failure = True, "slot_digest"
                job.outcome, job.reason = Outcome.IDENTITY_MISMATCH, "slot_digest"
            elif job.seq.failure is not None:  # failed alone (numerical): done, no token
                job.outcome, job.reason = Outcome.FAILED, job.seq.failure
            elif _gone(job):
                job.seq.done, job.outcome = True, Outcome.CANCELLED
            elif job.stream:
                _stream(self.engine, job)
        self._retain([i for i, j in enumerate(self._running) if not j.seq.done])
        if self._batch is None:
            return
        # Provenance: a row whose slot was emptied or refilled since admission must not get
        # this step's delta from whatever the slot holds now.
        stale = set(eng.stale_rows(self._batch.seqs))
        if stale:
            for i in stale:
                job = self._running[i]
                job.seq.done, job.seq.failure = True, "stale_slot"
                job.outcome, job.reason = Outcome.IDENTITY_MISMATCH, "stale_slot"
            self._retain([i for i in range(len(self._running)) if i not in stale])
        if self._batch is not None:
            eng.advance(self._batch)

    def _join(self, jobs: list[_Job], joined: DecodeBatch) -> None:
        """``jobs``, prefilled as ``joined``, become rows of the running batch."""
        batch = joined if self._batch is None else self.engine.merge(self._batch, joined)
        with self._cv:
            self._batch = batch
            self._running += jobs

    def _will_chunk(self, seq: Sequence) -> bool:
        chunk = self.limits.prefill_chunk
        return chunk > 0 and len(seq.prompt_ids) > chunk

    def _prefill_turn(self, revoked: dict[str, bool]) -> None:
        """A chunk of a long prompt, then joins (``backend.serving.prefill_order``); a job gone,
        revoked or whose slot was reloaded ends as a queued one would: it sent nothing yet."""
        for job, _part in self._prefilling:
            why = _unstartable(self.engine, job, revoked)
            if why is not None:
                with self._cv:
                    self._prefilling.drop(job)
                self._end(job, *why)
        self._prefilling.advance(lambda part: self.engine.prefill_chunk(
            part, self.limits.prefill_chunk))
        while True:  # one at a time: each join changes what the next one's check counts
            with self._cv:
                one = self._prefilling.join_next(_order_fits(
                    self.limits.max_kv_tokens, self._running, self._batch))
            if one is None:
                return
            self._remember([one[0]], one[1])
            self._join([one[0]], one[1])

    def _retain(self, keep: list[int]) -> None:
        """End the rows not in ``keep`` (done), keep the others in the batch."""
        assert self._batch is not None
        kept = set(keep)
        done = [j for i, j in enumerate(self._running) if i not in kept]
        batch = self.engine.retain(self._batch, keep, reuse=True)  # the old batch is dropped
        with self._cv:
            self._running = [self._running[i] for i in keep]
            self._batch = batch
        for job in done:
            self._end(job, job.outcome or Outcome.OK, job.reason)

    def _end(self, job: _Job, outcome: Outcome, reason: str | None = None) -> None:
        """End ``job``: release its lease and tell its sink. Exactly once per job."""
        if job.finished:
            self.engine.violations.count("double_finish", f"{outcome} after {job.outcome}")
            return
        job.finished, job.seq.done = True, True
        job.outcome, job.reason = outcome, reason
        with self._cv:  # ``revoke`` ends queued jobs from another thread
            self.ended += 1
        try:
            self.engine.close_sequence(job.seq)
        except Exception:
            log.exception("releasing a lease failed")
        try:
            result = job.seq.result(self.engine.text(job.seq.produced))
            job.sink.finish(result, outcome, reason)
        except Exception:
            log.exception("a sink failed to finish")

    # -- prefix cache (backend.serving.prefix_entries) ----------------------------------------

    def _remember(self, new: list[_Job], batch: DecodeBatch,
                  hits: Collection[int] = ()) -> None:
        remember(self.prefix_cache, [(j.seq, j.key) for j in new], batch, hits)


def _unstartable(engine: Engine, job: _Job,
                 revoked: dict[str, bool]) -> tuple[Outcome, str] | None:
    """Why a job that has sent nothing yet (new, or its long prompt still prefilling) must
    end now: its client is gone, its adapter was revoked, or its slot no longer holds the
    load it was admitted on. None: it goes on."""
    if _gone(job):
        return Outcome.CANCELLED, job.reason or "before_start"
    if _digests(job.seq) & revoked.keys():
        return Outcome.REJECTED, "revoked"
    if engine.stale_rows([job.seq]):
        job.seq.failure = "stale_slot"
        return Outcome.IDENTITY_MISMATCH, "stale_slot"
    return None


def _order_fits(budget: int | None, running: list[_Job], batch: DecodeBatch | None
                ) -> Callable[[list[_Job]], bool]:
    """Whether prompts prefilled in chunks joining in ``order`` keep what the buffers hold
    within ``budget`` (``backend.serving.kv_admission.reserved``)."""
    return lambda order: budget is None or reserved(running, order, KvHeld.of(batch)) <= budget


def _cached_last(jobs: list[_Job], cached: dict[int, DecodeBatch]
                 ) -> tuple[list[_Job], dict[int, DecodeBatch]]:
    """``jobs`` shortest prompt first, those restored from the prefix cache last, and ``cached``
    indexed accordingly. A prefill groups consecutive rows by length, each group a KV segment
    (``BatchSteps.prefill``), and its batch comes back in its jobs' order, each entry a segment
    after the computed rows' (``kv_segments``): this order needs no copy to restore."""
    computed = sorted((i for i in range(len(jobs)) if i not in cached),
                      key=lambda i: len(jobs[i].seq.prompt_ids))
    order = computed + sorted(cached)
    return [jobs[i] for i in order], {k: cached[i] for k, i in enumerate(order) if i in cached}


def _gone(job: _Job) -> bool:
    """The client cancelled, or its sink broke (then it is gone too)."""
    try:
        return bool(job.sink.cancelled())
    except Exception:
        log.warning("a sink failed to answer cancelled(); ending its request", exc_info=True)
        job.reason = "client_gone"
        return True


def _stream(engine: Engine, job: _Job) -> None:
    """Send ``job``'s sink the text its new tokens complete."""
    text = engine.text(job.seq.produced)
    # a multi-byte character split across tokens decodes to U+FFFD until it is complete
    if text.endswith("\ufffd") and not job.seq.done:
        return
    if len(text) > len(job.emitted):
        piece, job.emitted = text[len(job.emitted):], text
        try:
            job.sink.token(piece)
        except Exception:  # the client is gone: this request ends, no other
            log.info("a streamed piece could not be sent; ending that request")
            job.seq.done = True
            job.outcome, job.reason = Outcome.CANCELLED, "client_gone"


def _digests(seq: Sequence) -> set[str]:
    """The adapter digests a sequence runs on: its request's, and any its slot was seen to hold."""
    return {d for d in (seq.request.adapter, *seq.observed) if d is not None}

