"""A base upgrade's shadow Triton host, in a process of its own that dies with its plan.

Why a process of its own: a plan (``loraplane base upgrade plan``) that was SIGKILLed left its
shadow tritonserver running, with nothing to reap it. A process cannot clean up after a
SIGKILL, so the shadow's lifetime is tied to the plan by the kernel instead:

- the plan starts ``python -m control.tools.shadow_host`` (:class:`ShadowHost`), which runs the
  shadow deployment (``control.ops.serve.Deployment``, role ``triton``: tritonserver, and the
  front door where haproxy is installed) and stops it whatever ends it;
- that process asks the kernel for SIGTERM when its parent dies (``prctl(PR_SET_PDEATHSIG)``,
  set first thing, then the parent's pid checked, so a plan that died before the call is seen
  too), and turns SIGTERM and SIGINT into a clean stop: the deployment's own stop, which kills
  tritonserver's process group (every Python stub with it) and the door;
- it also polls its parent every half second: a second guard, should the signal be lost.

The death signal is bound to the *thread* that started the process (Linux sends it when that
thread exits), so a plan starts its shadow from a thread that outlives the shadow: the CLI's
main thread, or the thread that calls ``plan_upgrade``.

Between the two processes: the child prints JSON lines on stdout, ``{"progress": "..."}`` while
it starts and ``{"ready": {...}}`` once Triton answers (its addresses, the process groups it
started); its stderr goes to ``run/<host id>.log`` under the home. The plan stops it with
SIGTERM, and if it does not exit in time, kills it and the process groups it reported.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from types import FrameType
from typing import IO, Any

from control.contracts.config import Settings
from control.ops.serve import Deployment, Ports

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_PARENT_POLL_S = 0.5
STOP_TIMEOUT_S = 60.0  # a clean stop: Triton's exit timeout, the stubs, the door


class ShadowFailed(RuntimeError):
    """The shadow host did not come up (its log says why)."""


def die_with_parent(signum: int = signal.SIGTERM) -> None:
    """Ask the kernel for ``signum`` when this process's parent (thread) dies (Linux)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signum, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")


class ShadowHost:
    """The plan's side: ``with ShadowHost(...) as urls:`` starts the shadow host process and
    waits until Triton answers; leaving the block stops it (see the module notes)."""

    def __init__(self, settings: Settings, base: str, host_id: str, ports: Ports, *,
                 actor: str, ready_timeout_s: float,
                 progress: Callable[[str], None] = lambda _m: None) -> None:
        self.settings = settings
        self.base = base
        self.host_id = host_id
        self.ports = ports
        self.actor = actor
        self.ready_timeout_s = ready_timeout_s
        self.progress = progress
        self.proc: subprocess.Popen[str] | None = None
        self.ready: dict[str, Any] = {}
        self.log_path = settings.run_dir / f"{host_id}.log"
        self._reader: threading.Thread | None = None

    def command(self) -> list[str]:
        return [sys.executable, "-m", "control.tools.shadow_host", "--home",
                str(self.settings.home), "--base", self.base, "--host-id", self.host_id,
                "--ports", json.dumps(asdict(self.ports)), "--actor", self.actor,
                "--parent", str(os.getpid()), "--ready-timeout", str(self.ready_timeout_s)]

    def __enter__(self) -> dict[str, Any]:
        self.settings.run_dir.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "LORAPLANE_HOME": str(self.settings.home),
               "LORAPLANE_DB_URL": self.settings.db_url}
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(self.command(), stdout=subprocess.PIPE, stderr=log,
                                         stdin=subprocess.DEVNULL, env=env, text=True)
        try:
            self.ready = self._wait_ready()
        except BaseException:
            self.stop()
            raise
        assert self.proc.stdout is not None
        # Keep reading after ready: a full pipe would block the shadow's progress lines.
        self._reader = threading.Thread(target=self._drain, args=(self.proc.stdout,),
                                        name="shadow-host-output", daemon=True)
        self._reader.start()
        return self.ready

    def __exit__(self, *_exc: object) -> None:
        self.stop()

    def _wait_ready(self) -> dict[str, Any]:
        assert self.proc is not None and self.proc.stdout is not None
        deadline = time.monotonic() + self.ready_timeout_s + 30.0
        for line in self.proc.stdout:  # ends when the shadow process exits
            message = _parse(line)
            if "progress" in message:
                self.progress(str(message["progress"]))
            if "ready" in message:
                return dict(message["ready"])
            if time.monotonic() > deadline:
                break
        raise ShadowFailed(f"the shadow host did not come up (exit code {self.proc.poll()}); "
                           f"see {self.log_path}")

    def _drain(self, stream: IO[str]) -> None:
        for line in stream:
            message = _parse(line)
            if "progress" in message:
                self.progress(str(message["progress"]))

    def stop(self) -> bool:
        """Stop the shadow host; True once its process and every process group it reported
        are gone (checked, not assumed)."""
        if self.proc is None:
            return True
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for pgid in self.ready.get("process_groups", []):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(int(pgid), signal.SIGKILL)  # only if the clean stop left any
        return self.gone()

    def gone(self) -> bool:
        """Whether the shadow process and its reported process groups have no process left."""
        if self.proc is None or self.proc.poll() is None:
            return self.proc is None
        return not any(_group_alive(int(g)) for g in self.ready.get("process_groups", []))


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # it exists, under another user (the Triton user)
    # A zombie leader still answers: look for a live member.
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat.rpartition(")")[2].split()
        if len(fields) > 2 and int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


def _parse(line: str) -> dict[str, Any]:
    try:
        data = json.loads(line)
    except ValueError:
        return {}
    return data if isinstance(data, dict) else {}


# -- the shadow host process ----------------------------------------------------------------------

def _say(**message: Any) -> None:
    try:
        print(json.dumps(message), flush=True)
    except (BrokenPipeError, ValueError, OSError):
        # The plan is gone (its end of the pipe with it): nobody reads, and a stop that is
        # reporting its progress must not be broken off by that.
        with contextlib.suppress(OSError):
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - lives as long as the process


def _stop_on_signal(signum: int, _frame: FrameType | None) -> None:
    # Raised in the main thread, as Ctrl-C's KeyboardInterrupt is: it unwinds whatever the
    # deployment was doing (starting, waiting) into the ``finally`` that stops it.
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    """``python -m control.tools.shadow_host``: run a shadow host until its parent dies or it
    is told to stop (see the module notes)."""
    parser = argparse.ArgumentParser(prog="python -m control.tools.shadow_host")
    parser.add_argument("--home", required=True, type=Path)
    parser.add_argument("--base", required=True)
    parser.add_argument("--host-id", required=True)
    parser.add_argument("--ports", required=True, help="Ports as JSON")
    parser.add_argument("--actor", default="gate")
    parser.add_argument("--parent", required=True, type=int)
    parser.add_argument("--ready-timeout", type=float, default=300.0)
    args = parser.parse_args(argv)
    die_with_parent(signal.SIGTERM)
    signal.signal(signal.SIGTERM, _stop_on_signal)
    signal.signal(signal.SIGINT, _stop_on_signal)
    if os.getppid() != args.parent:  # the plan died before the death signal was asked for
        print(f"the plan (process {args.parent}) is gone: the shadow host does not start",
              file=sys.stderr)
        return 1
    settings = Settings.from_env(args.home)
    dep = Deployment(settings, Ports(**json.loads(args.ports)), base=args.base,
                     actor=args.actor, progress=lambda m: _say(progress=m), role="triton",
                     host_id=args.host_id, rollout_controller=False)
    try:
        dep.start(args.ready_timeout)
        assert dep.triton is not None and dep.triton.proc is not None  # role triton
        groups = [dep.triton.proc.pid]  # tritonserver leads a session of its own
        if dep.door is not None and dep.door.proc is not None:
            groups.append(dep.door.proc.pid)
        _say(ready={"http": dep.triton.http_url, "grpc": dep.triton.grpc_url,
                    "tenant_http": dep.tenant_http_url, "tenant_grpc": dep.tenant_grpc_url,
                    "metrics": f"http://{dep.triton.http_url.rsplit(':', 1)[0]}:"
                               f"{dep.ports.metrics}/metrics",
                    "pid": os.getpid(), "process_groups": groups})
        while os.getppid() == args.parent:
            time.sleep(_PARENT_POLL_S)
        return 0
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # one stop, not interrupted by another
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        dep.stop()


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
