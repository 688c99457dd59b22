"""Watching the engine model's stub: when it dies, its requests are recorded and Triton restarts.

The engine model (``lora_llm_stream``) holds the weights and writes the ledger. If its stub
process dies (killed, out of memory, a crash in the Python backend), tritonserver 2.51 neither
restarts it nor reports the model unready: the host would answer every request with an internal
error, forever, and the rows of the requests that were running would stay ``running``.

``serve`` survives such a crash, so it watches (:class:`EngineWatch`, one thread): every
:data:`CHECK_S` it looks for the engine stub among the processes of tritonserver's process group
(Triton starts its stubs in its own session). Once it has seen the stub and then no longer finds
it alive, it

1. completes this host's ``running`` rows as ``failed``, reason :data:`ENGINE_CRASHED` (their
   clients got an error or nothing; the engine cannot say which any more);
2. restarts tritonserver, and waits for it to be ready again (the front door answers 503 in the
   meantime, and the front model records the requests it could not forward:
   ``backend.triton.front_ledger``).

A tritonserver that exits on its own is treated the same way. One that is being stopped, killed
or started on purpose is not: a graceful stop unloads the engine first, which from outside looks
just like a crash, so the watch acts only if no such step happened since it looked
(:meth:`TritonProcess.restart_if`); otherwise a deliberate restart and the watch's would race.
"""

from __future__ import annotations

import logging
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path

from control.contracts.ledger import Ledger
from control.contracts.wire import ENGINE_MODEL
from control.ops.triton_server import TritonProcess

log = logging.getLogger("loraplane.serve")

CHECK_S = 0.25
RESTART_GRACE_S = 2.0  # before restarting a tritonserver that exited (see _crashed)
ENGINE_CRASHED = "engine_crashed"


def engine_stub_pid(group: int, proc: Path = Path("/proc")) -> int | None:
    """The pid of the live engine stub in process group ``group``, or None."""
    marker = f"/{ENGINE_MODEL}/".encode()
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            # pid (comm) state ppid pgrp ...: comm may hold spaces, so split after its ')'
            state, _ppid, pgrp = stat[stat.rindex(")") + 2:].split()[:3]
            if int(pgrp) != group or state == "Z":
                continue
            if marker in (entry / "cmdline").read_bytes():
                return int(entry.name)
        except (OSError, ValueError):
            continue  # gone meanwhile, or not ours to read
    return None


class EngineWatch:
    """Restarts tritonserver when its engine stub dies (see the module notes)."""

    def __init__(self, triton: TritonProcess, ledger: Ledger, host: str,
                 progress: Callable[[str], None] = lambda _m: None,
                 ready_timeout_s: float = TritonProcess.READY_TIMEOUT_S) -> None:
        self.triton = triton
        self.ledger = ledger
        self.host = host
        self.progress = progress
        self.ready_timeout_s = ready_timeout_s
        self.restarts = 0
        self._seen: int | None = None  # the engine stub's pid, once it was found
        self._generation = -1  # the server's lifecycle generation _seen belongs to

    def run(self, stop: threading.Event) -> None:
        while not stop.wait(CHECK_S):
            try:
                generation, proc = self.triton.observed()
                if generation != self._generation:  # a new launch: its stub is not seen yet
                    self._generation, self._seen = generation, None
                if self._crashed(stop, proc):
                    self._recover(stop, generation)
            except Exception:  # the watch must outlive whatever went wrong in one check
                log.exception("watching the engine model failed; still watching")

    def _crashed(self, stop: threading.Event, proc: subprocess.Popen[bytes] | None) -> bool:
        if proc is None:
            return False
        if proc.poll() is not None:
            # tritonserver itself is gone. Whoever stopped it may be starting it again (an
            # operator tool restarting it on purpose): give them a moment, and act only if
            # the very process that died is still the one on record.
            if stop.wait(RESTART_GRACE_S):
                return False  # the deployment is stopping it
            return self.triton.proc is proc and proc.poll() is not None
        pid = engine_stub_pid(proc.pid)
        if pid is not None:
            self._seen = pid
            return False
        return self._seen is not None  # seen alive before, gone now

    def _recover(self, stop: threading.Event, generation: int) -> None:
        if stop.is_set():
            return  # the deployment is stopping tritonserver itself
        failed: list[int] = []
        seen, self._seen = self._seen, None

        def record() -> None:  # under the server's lifecycle lock: no deliberate step meanwhile
            failed.append(self.ledger.fail_running(self.host, reason=ENGINE_CRASHED))
            log.error("the engine model's stub (pid %s) died: %d running requests recorded as "
                      "failed (%s); restarting tritonserver", seen, failed[0],
                      ENGINE_CRASHED)
            self.progress(f"engine model crashed: {failed[0]} running request(s) recorded as "
                          "failed; restarting tritonserver")

        # The engine is dead: nothing with state is left to stop gracefully (the front stubs
        # hold none), so the group goes at once instead of waiting for an unload that cannot come.
        if not self.triton.restart_if(generation, before=record):
            log.info("tritonserver was stopped or restarted on purpose meanwhile; the watch "
                     "leaves it to whoever did")
            return
        self.triton.wait_ready(self.ready_timeout_s)
        self.restarts += 1
        self.progress(f"tritonserver restarted and ready (log {self.triton.log_path})")

