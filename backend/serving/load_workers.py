"""The threads that run cold adapter loads, kept apart from the serving threads' cores.

A cold load is CPU work: read and hash the files, parse, check, convert. How it is kept from
slowing the rows being served:

- **Kept threads.** A thread's first torch operations cost it milliseconds of set-up (its
  OpenMP team, allocator caches); a thread per load paid them on every load, more than the
  parse itself at the bench's size. Workers stay for :data:`IDLE_EXIT_S` after their last load.
- **One intra-op thread.** Torch splits a large operation over its OpenMP threads, all of them,
  from whichever thread calls it. A load's tensor work split over every core competes with
  decoding for all of them, and on a busy machine a team that waits for its slowest member
  makes the load itself many times slower (a 4,096-wide adapter's conversion: 60 ms on one
  thread, up to a second on two busy cores). OpenMP's thread count is per calling thread, so a
  worker sets its own to one and the serving threads keep theirs.
- **A priority of their own, not lowered by default.** Linux gives each thread its own nice
  value, and a pool can raise its workers' by ``nice_delta``. On two shared cores +5 did not
  lower the base rows' p95 during a storm of cold loads (``base_p95_storm_vs_quiet`` 1.14 and
  1.52 at +0, 1.33 and 1.40 at +5, alternated in one process on 2026-12-03), and a worker also
  takes the cache's and the engine's locks to place an adapter, where a starved worker would
  hold up decoding: :data:`NICE_DELTA` is 0.
"""

from __future__ import annotations

import ctypes
import logging
import os
import queue
import re
import threading
from collections.abc import Callable
from functools import cache

import torch

log = logging.getLogger("loraplane.cache")

IDLE_EXIT_S = 60.0  # an idle worker ends after this long
NICE_DELTA = 0  # added to a worker's nice value (19 at most); 0 leaves it as it is


@cache
def _omp_set_num_threads() -> Callable[[int], object] | None:
    """libgomp's ``omp_set_num_threads`` from the copy torch loaded, or None (another
    threading backend, or not found: workers then run with torch's default)."""
    if "OpenMP" not in torch.__config__.parallel_info():
        return None
    try:
        with open("/proc/self/maps", encoding="ascii", errors="replace") as f:
            found = re.search(r"(/\S*libgomp[^/\s]*\.so[^/\s]*)", f.read())
        if found is None:
            return None
        return ctypes.CDLL(found.group(1)).omp_set_num_threads
    except (OSError, AttributeError):
        return None


def confine_this_thread(nice_delta: int = NICE_DELTA) -> None:
    """Make the calling thread's torch operations run on itself alone (one OpenMP thread, for
    this thread only), and raise its nice value by ``nice_delta`` (0: unchanged)."""
    torch.get_num_threads()  # torch sets each thread's OpenMP count on first use: do it now
    set_threads = _omp_set_num_threads()
    if set_threads is not None:
        set_threads(1)
    if nice_delta > 0 and hasattr(os, "setpriority"):
        tid = threading.get_native_id()
        try:
            now = os.getpriority(os.PRIO_PROCESS, tid)
            os.setpriority(os.PRIO_PROCESS, tid, min(19, now + nice_delta))
        except OSError:  # not permitted here: the load runs at the serving threads' priority
            log.debug("could not lower the load worker's priority", exc_info=True)


class LoadWorkers:
    """A pool of confined daemon threads: an idle one takes the next load, else a new one
    starts, so loads that wait (for room on the device) never hold up the others."""

    def __init__(self, name: str = "adapter-load", nice_delta: int = NICE_DELTA,
                 idle_exit_s: float = IDLE_EXIT_S) -> None:
        self.name, self.nice_delta, self.idle_exit_s = name, nice_delta, idle_exit_s
        self._jobs: queue.SimpleQueue[Callable[[], object]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0  # workers waiting for a job and not yet promised one
        self.started = 0  # threads started over the pool's life

    def submit(self, job: Callable[[], object]) -> None:
        """Run ``job`` on a worker; it must catch its own errors."""
        with self._lock:
            if self._idle:
                self._idle -= 1  # that worker's next get() is this job's
                start = False
            else:
                self.started += 1
                start = True
            self._jobs.put(job)
        if start:
            threading.Thread(target=self._run, daemon=True, name=self.name).start()

    def _run(self) -> None:
        confine_this_thread(self.nice_delta)
        while True:
            try:
                job = self._jobs.get(timeout=self.idle_exit_s)
            except queue.Empty:
                with self._lock:
                    if self._idle:  # nobody promised this worker a job: end it
                        self._idle -= 1
                        return
                continue  # a job was promised meanwhile: take it
            try:
                job()
            except BaseException:
                log.exception("an adapter load job raised")
            with self._lock:
                self._idle += 1


# One pool per process: every cache in it loads on the same kept threads.
SHARED = LoadWorkers()
