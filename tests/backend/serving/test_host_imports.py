"""A Triton host's serving code never loads the control plane's application, domain or event
store: what it needs from the projections it reads through ``projections.host_view``. (Before,
the service read the base's tokenizer through ``RoutingView``, which pulled in 34 modules of
``control.app``, ``control.domain`` and eventsourcing.) import-linter checks the same statically,
indirect imports included (pyproject.toml); this checks what a real import loads."""

from __future__ import annotations

import subprocess
import sys

from tests import REPO

CONTROL_PLANE = ("control.app", "control.domain", "control.gateway", "control.ops",
                 "control.cli", "eventsourcing")


def test_importing_the_serving_service_loads_no_control_plane_module() -> None:
    code = ("import sys, backend.serving.service, backend.triton.glue, backend.triton.front\n"
            f"print('\\n'.join(m for m in sys.modules if m.startswith({CONTROL_PLANE!r})))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                         check=True).stdout.split()
    assert out == [], out
