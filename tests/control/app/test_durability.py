"""Durability: ``kill -9`` of the control plane in the middle of a burst of 1,000 commands.

A child process issues commands (each ``create_tenant`` with a policy: two events in one
transaction) and prints each acknowledged one. The parent kills it with SIGKILL part-way, then
checks that every acknowledged command's events are present, that no command is half-applied,
and that the projection tables, once caught up, equal a rebuild from the history.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from collections import Counter
from pathlib import Path

import sqlalchemy as sa

from control.app.audit import audit_log
from control.contracts.config import Settings
from control.contracts.db import make_engine
from projections.follower import ProjectionFollower, open_registry, snapshot
from tests import REPO
from tests.fixtures_control import (
    OnPostgres,
    OnSQLite,
    close_registry,
)

BURST = 1000
KILL_AFTER = 150

CHILD = textwrap.dedent("""
    import sys
    from pathlib import Path
    from control.contracts.config import Settings
    from control.domain import TenantPolicy
    from projections.follower import open_registry
    settings = Settings(home=Path(sys.argv[1]), db_url=sys.argv[2])
    reg = open_registry(settings)  # follows: each command also updates the projections
    for i in range(int(sys.argv[3])):
        reg.create_tenant(f"t{i:04d}", actor="burst", policy=TenantPolicy(max_adapters=i + 1))
        print(f"ack t{i:04d}", flush=True)
""")


class DurabilityContract:
    def test_kill_9_mid_burst(self, settings: Settings, tmp_path: Path) -> None:
        settings.ensure_dirs()
        root = REPO
        proc = subprocess.Popen(
            [sys.executable, "-c", CHILD, str(settings.home), settings.db_url, str(BURST)],
            cwd=root, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env={**os.environ, "PYTHONPATH": str(root)})
        acked: list[str] = []
        assert proc.stdout is not None
        for line in proc.stdout:
            acked.append(line.split()[1])
            if len(acked) == KILL_AFTER:
                os.kill(proc.pid, signal.SIGKILL)
                break
        proc.wait(60)
        assert proc.returncode == -signal.SIGKILL, proc.stderr.read() if proc.stderr else ""
        acked.extend(line.split()[1] for line in proc.stdout if line.startswith("ack "))

        reg = open_registry(settings, follow=False)
        try:
            entries = audit_log(reg)
            created = Counter(e.summary.get("name") or e.summary.get("tenant")
                              for e in entries)
            # Every acknowledged command is there, with both of its events.
            assert all(created[name] == 2 for name in acked)
            # No command is half-applied: each tenant has exactly its two events.
            assert set(created.values()) == {2}
            assert len(created) >= len(acked) and len(created) < BURST
            # Projections: caught up, they equal a rebuild from the history.
            engine = make_engine(settings.db_url)
            follower = ProjectionFollower(reg, engine)
            follower.catch_up()
            live = snapshot(engine)
            assert len(live["tenants"]) == len(created)
            scratch = sa.create_engine(f"sqlite:///{tmp_path / 'rebuilt.db'}")
            follower.rebuild_into(scratch)
            assert snapshot(scratch) == live
            scratch.dispose()
        finally:
            close_registry(reg)


class TestDurabilitySQLite(OnSQLite, DurabilityContract):
    pass


class TestDurabilityPostgres(OnPostgres, DurabilityContract):
    pass
