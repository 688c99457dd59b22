"""A deployment of its own for the hostile suite: it kills and restarts tritonserver, locks the
database and floods the server, so it never shares the integration tests' ``stack``.

Same pattern as ``tests/integration/conftest.py``: a SQLite home, the kit's base registered, a
real tritonserver. Tenants ``acme`` and ``globex`` get the kit adapters (whose greedy outputs
start with known marker phrases); the self-test adds tenants of its own.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from control.ops.serve import Deployment, Ports
from control.tools.selftest import Target
from tests.integration.conftest import ACTOR, Stack, provision, sqlite_home


@dataclass
class HostileStack(Stack):
    ports: Ports | None = None

    @property
    def target(self) -> Target:
        assert self.ports is not None
        return Target(self.settings, self.deployment.gateway_url, self.http, self.grpc,
                      f"http://127.0.0.1:{self.ports.metrics}/metrics")

    def restart_triton(self, *, kill: bool) -> None:
        """SIGKILL (or stop) tritonserver and start it again on the same ports."""
        triton = self.deployment.triton
        assert triton is not None
        if kill:
            triton.kill()
        else:
            triton.stop()
        triton.start()
        triton.wait_ready(240)


@pytest.fixture(scope="session")
def hostile(kit_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[HostileStack]:
    settings = sqlite_home(tmp_path_factory, "hostile-home")
    reg, kit, keys, digests = provision(settings, kit_dir)
    ports = Ports.free()
    dep = Deployment(settings, ports, actor=ACTOR)
    dep.start()
    try:
        yield HostileStack(settings, reg, dep, kit_dir, kit, keys, digests, ports=ports)
    finally:
        dep.stop()
