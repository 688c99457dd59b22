"""The README's "Using it by hand" walkthrough, pasted block by block as a new user would.

Every fenced ``bash`` block of the README whose first line is ``# shell N: ...`` is run with bash,
in a fresh folder standing in for the repository root (its ``.venv`` links to this checkout's),
with no ``LORAPLANE_*`` variable inherited. Shell 1 ends in ``loraplane serve``, so it runs in the
background until it prints that it is serving; shells 2 and 3 then run to completion, and shell 1
is stopped the way a user does, with Ctrl-C (SIGINT). The walkthrough uses the default ports
(8000, 8001, 8002, 8080); the test is skipped when one is taken.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest

from control.ops.triton_server import TritonUnavailable, find_triton
from tests import REPO
from tests.required import unavailable

pytestmark = pytest.mark.triton

PORTS = (8000, 8001, 8002, 8080)
SERVING = "serving; Ctrl-C to stop"
ALPHA_MARKER = "ALPHA says hi"


def shell_blocks(readme: str) -> dict[int, str]:
    """The README's ``# shell N`` bash blocks, by N."""
    blocks: dict[int, str] = {}
    for body in re.findall(r"^```bash\n(.*?)^```", readme, flags=re.S | re.M):
        first = body.splitlines()[0]
        m = re.match(r"# shell (\d+):", first)
        if m:
            blocks[int(m.group(1))] = body
    return blocks


def _port_taken(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LORAPLANE_")}
    env.pop("VIRTUAL_ENV", None)
    if os.geteuid() == 0:
        # serve, run as root, drops Triton to loraplane-triton; this machine's Python and
        # pytest's folders are out of that user's reach, so the walkthrough keeps it as root.
        env["LORAPLANE_TRITON_USER"] = "root"
    return env


def test_the_walkthrough_runs_as_pasted(tmp_path: Path) -> None:
    blocks = shell_blocks((REPO / "README.md").read_text())
    assert sorted(blocks) == [1, 2, 3], "the README walkthrough has shells 1, 2 and 3"
    try:
        find_triton(tmp_path)
    except TritonUnavailable as e:
        unavailable("the real tritonserver", str(e))
    if shutil.which("curl") is None:
        unavailable("curl", "the walkthrough's tenant shell calls it")
    taken = [p for p in PORTS if _port_taken(p)]
    if taken:
        pytest.skip(f"the walkthrough's default ports are taken: {taken}")
    work = tmp_path / "repo"
    work.mkdir()
    (work / ".venv").symlink_to(REPO / ".venv")
    env = _env()

    serve = subprocess.Popen(["bash", "-euo", "pipefail", "-c", blocks[1]], cwd=work, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             start_new_session=True)
    out: list[str] = []
    reader = threading.Thread(target=lambda: out.extend(iter(serve.stdout.readline, "")),  # type: ignore[union-attr]
                              daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 600
        while not any(SERVING in line for line in out):
            assert serve.poll() is None, "shell 1 ended early:\n" + "".join(out)
            assert time.monotonic() < deadline, "shell 1 never served:\n" + "".join(out)
            time.sleep(0.5)
        tenant = subprocess.run(["bash", "-euo", "pipefail", "-c", blocks[2]], cwd=work,
                                env=env, capture_output=True, text=True, timeout=300)
        assert tenant.returncode == 0, tenant.stdout + tenant.stderr
        text = tenant.stdout
        assert text.count(ALPHA_MARKER) >= 3, text  # generate, tritonclient HTTP and gRPC
        assert "data: " in text  # the stream's server-sent events
        assert '"choices"' in text  # the OpenAI-compatible completion
        operator = subprocess.run(["bash", "-euo", "pipefail", "-c", blocks[3]], cwd=work,
                                  env=env, capture_output=True, text=True, timeout=300)
        assert operator.returncode == 0, operator.stdout + operator.stderr
        assert "AdapterRevoked" in operator.stdout
        home = work / ".loraplane" / "manual"
        assert (home / "history.jsonl").stat().st_size > 0
        # Nothing the walkthrough wrote lands outside the state folder.
        assert sorted(p.name for p in work.iterdir()) == [".loraplane", ".venv"]
    finally:
        if serve.poll() is None:
            os.killpg(serve.pid, signal.SIGINT)  # Ctrl-C
            try:
                serve.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(serve.pid, signal.SIGKILL)
                serve.wait()
                raise AssertionError("serve did not stop on Ctrl-C within 60 s") from None
    reader.join(5)
    assert serve.returncode in (0, -signal.SIGINT, 130), "".join(out)
