"""The engine watch against deliberate lifecycle steps, with a real process group standing in for
tritonserver (a shell that, on SIGTERM, "unloads its engine" and then takes a while to exit, as
Triton 2.51 does while it unloads the front model's stubs one by one).

Before: a graceful restart (``stop()`` then ``start()``) looked like a crash to the watch, since
the engine stub is gone while tritonserver still runs. The watch then marked the host's running
rows failed and started a second server alongside the operator's own start: in CI the two
launches raced on the backend links (``FileExistsError``) and the host stayed down
(tests/hostile/test_faults.py, ``restart``).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from control.ops import engine_watch, triton_server
from control.ops.engine_watch import EngineWatch
from control.ops.triton_server import TritonInstall, TritonProcess, free_ports

UNLOAD_S = 1.5  # how long the stand-in keeps running after its "engine" unloaded


@dataclass
class ShellTriton(TritonProcess):
    """A TritonProcess whose launch is a shell: its own process group, SIGTERM handled slowly."""

    marker: Path = Path()

    @property
    def launches(self) -> list[int]:
        """Every launch's pid, in order (each launch writes its own)."""
        pids = self.marker.with_suffix(".pids")
        return [int(x) for x in pids.read_text().split()] if pids.exists() else []

    def command(self, install: TritonInstall) -> list[str]:
        script = (f"echo $$ >> {self.marker.with_suffix('.pids')}; rm -f {self.marker}; "
                  f"trap 'touch {self.marker}; sleep {UNLOAD_S}; exit 0' TERM; "
                  "for i in $(seq 600); do sleep 0.05; done")  # ends by itself in any case
        return ["/bin/sh", "-c", script]

    def ready(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


class Ledger:
    def __init__(self) -> None:
        self.failed: list[str] = []

    def fail_running(self, host: str, *, reason: str) -> int:
        self.failed.append(reason)
        return 0


@pytest.fixture
def triton(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[ShellTriton]:
    monkeypatch.setattr(triton_server, "find_triton",
                        lambda _work: TritonInstall(Path("/bin/sh"), tmp_path))
    marker = tmp_path / "engine-unloaded"
    # The engine stub is "alive" until the stand-in's SIGTERM handler says it unloaded.
    monkeypatch.setattr(engine_watch, "engine_stub_pid",
                        lambda _group: None if marker.exists() else 4242)
    monkeypatch.setattr(engine_watch, "CHECK_S", 0.02)
    http, grpc, metrics = free_ports(3)
    t = ShellTriton(tmp_path / "run", http, grpc, metrics,
                    home=tmp_path, marker=marker)
    try:
        yield t
    finally:
        for pid in _alive(t.launches):
            os.kill(pid, signal.SIGKILL)


def _watching(triton: ShellTriton, ledger: Ledger) -> tuple[EngineWatch, threading.Event,
                                                           threading.Thread]:
    watch = EngineWatch(triton, ledger, "host-a", ready_timeout_s=5)  # type: ignore[arg-type]
    stop = threading.Event()
    thread = threading.Thread(target=watch.run, args=(stop,), daemon=True)
    thread.start()
    time.sleep(0.2)  # the watch has seen the engine stub
    return watch, stop, thread


def _alive(pids: list[int]) -> list[int]:
    """Those still running (a process nobody waited for stays a zombie: it counts as running,
    as the server it stood for was never stopped)."""
    return [pid for pid in pids if Path(f"/proc/{pid}").exists()]


def test_a_deliberate_restart_is_left_to_whoever_restarts(triton: ShellTriton) -> None:
    ledger = Ledger()
    triton.start()
    watch, stop, thread = _watching(triton, ledger)
    triton.stop()  # the engine "unloads" UNLOAD_S before the server exits
    triton.start()
    time.sleep(0.5)
    stop.set()
    thread.join(10)
    assert ledger.failed == [], "a graceful stop is not a crash: no running row is failed"
    assert watch.restarts == 0
    assert len(triton.launches) == 2, "one start by the operator, none by the watch"
    assert triton.proc is not None and _alive(triton.launches) == [triton.proc.pid]


def test_a_dead_engine_is_still_recovered_once(triton: ShellTriton) -> None:
    ledger = Ledger()
    triton.start()
    watch, stop, thread = _watching(triton, ledger)
    first = triton.proc
    triton.marker.touch()  # the engine stub dies; nobody touched the server
    deadline = time.monotonic() + 10
    while watch.restarts == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)
    stop.set()
    thread.join(10)
    assert ledger.failed == [engine_watch.ENGINE_CRASHED]
    assert watch.restarts == 1
    assert first is not None and first.poll() is not None, "the dead engine's server is gone"
    assert triton.proc is not None and _alive(triton.launches) == [triton.proc.pid]
    triton.stop()
