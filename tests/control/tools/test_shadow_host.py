"""The shadow host dies with its plan (issue 21: a SIGKILLed plan left its shadow tritonserver
running): the death signal it asks for reaches it when its parent is SIGKILLed, it turns that
signal into its clean stop, and it does not start at all when its parent is already gone.
Without Triton: ``tests/integration/test_base_upgrade.py`` SIGKILLs a real plan."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests import REPO

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="prctl(PR_SET_PDEATHSIG) is Linux's")

# A stand-in for the plan: it starts a child that asks for the death signal (as the shadow host
# does first thing) and, on SIGTERM, writes a mark (as the shadow host runs its stop), then
# reports the child's pid and waits to be killed.
PLAN = textwrap.dedent("""
    import subprocess, sys, time
    # the shadow's stdout is a pipe to this process, as ShadowHost reads it
    child = subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]],
                             stdout=subprocess.PIPE)
    print(child.pid, flush=True)
    time.sleep(600)
""")
SHADOW = textwrap.dedent("""
    import signal, sys, time
    from pathlib import Path
    from control.tools.shadow_host import _say, die_with_parent
    die_with_parent(signal.SIGTERM)
    def stop(signum, frame):
        # the deployment's stop reports progress into the dead plan's pipe: it must go on
        for _ in range(3):
            _say(progress="stopping tritonserver")
        Path(sys.argv[1]).write_text("stopped cleanly")
        raise SystemExit(0)
    signal.signal(signal.SIGTERM, stop)
    Path(sys.argv[1] + ".ready").write_text("")
    time.sleep(600)
""")


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


def _wait(condition: object, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():  # type: ignore[operator]
            return True
        time.sleep(0.05)
    return False


def test_a_sigkilled_plan_takes_its_shadow_with_it(tmp_path: Path) -> None:
    mark = tmp_path / "mark"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    plan = subprocess.Popen([sys.executable, "-c", PLAN, SHADOW, str(mark)],
                            stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert plan.stdout is not None
        shadow = int(plan.stdout.readline())
        assert _wait(lambda: (tmp_path / "mark.ready").exists(), 30), "the shadow never started"
        assert _alive(shadow)
        plan.send_signal(signal.SIGKILL)  # no handler, no cleanup: only the kernel acts
        plan.wait(10)
        assert _wait(lambda: not _alive(shadow), 10), "the shadow outlived its plan"
        assert mark.read_text() == "stopped cleanly"  # its stop ran: it can stop Triton
    finally:
        if plan.poll() is None:
            plan.kill()


def test_a_shadow_whose_plan_is_already_gone_does_not_start(tmp_path: Path) -> None:
    # The plan's pid it is given is not its parent's: it returns at once, starting nothing.
    done = subprocess.run(
        [sys.executable, "-m", "control.tools.shadow_host", "--home", str(tmp_path / "home"),
         "--base", "sha256:" + "0" * 64, "--host-id", "upgrade-shadow-test",
         "--ports", "{}", "--parent", "1"],
        cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and done.stdout == ""
    assert "the plan (process 1) is gone" in done.stderr
    assert not (tmp_path / "home").exists()  # not even a home was made
