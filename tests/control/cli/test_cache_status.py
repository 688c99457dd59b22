"""``loraplane cache status`` over a real registry on SQLite: the hosts' reported tiers and load
queue, each tenant's share use counted by the owner of each resident adapter, and the evictions
by reason from the hosts' load records."""

from __future__ import annotations

import json
import time

import pytest
from typer.testing import CliRunner

from control.cli.main import app
from control.contracts.host_status import HostStatus, HostStatusTable, SlotEntry
from control.contracts.ledger import AdapterLoad
from control.domain import TenantPolicy
from tests.control.app.rollout_world import RolloutWorld, World
from tests.fixtures_control import OnSQLite


class TestCacheStatus(RolloutWorld, OnSQLite):
    def test_tiers_queue_shares_and_evictions(self, world: World,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
        now = time.time()
        world.reg.set_policy("acme", TenantPolicy(resident_share=0.25), actor="op")
        HostStatusTable(world.ledger.engine).put(HostStatus(
            "h1", now, now - 600, 4,
            device=(SlotEntry(world.stable, 3 << 20, 2), SlotEntry(world.target, 1 << 20, 0)),
            host_tier=(SlotEntry(world.target, 2 << 20, 0),), pending_loads=1, load_waiters=3,
            load_queue_max=64, device_bytes=4 << 20, device_budget=16 << 20,
            host_bytes=2 << 20, host_budget=64 << 20))
        for i, reason in enumerate(("tenant_share", "tenant_share", "device_budget")):
            world.ledger.record_load(AdapterLoad("h1", world.target, now - 30 + i, 0.0,
                                                 "unloaded", None, reason))
        world.ledger.record_load(AdapterLoad("h1", world.stable, now - 7200, 0.0, "unloaded",
                                             None, "slots_full"))  # outside the window
        settings = world.reg.settings
        monkeypatch.setenv("LORAPLANE_DB_URL", settings.db_url)
        out = CliRunner().invoke(app, ["--json", "--home", str(settings.home), "cache",
                                       "status", "--window", "3600"])
        assert out.exit_code == 0, out.output
        data = json.loads(out.output)
        (h1,) = data["hosts"]
        assert h1["state"] == "healthy"
        assert h1["tiers"]["device"] == {"adapters": 2, "slots": 4, "bytes": 4 << 20,
                                         "budget": 16 << 20}
        assert h1["tiers"]["host"]["adapters"] == 1
        assert h1["load_queue"] == {"pending_loads": 1, "waiting_requests": 3, "max": 64}
        # both resident adapters are acme's: 4 MiB of 16, against the quarter its policy gives
        assert h1["tenants"] == [{"tenant": "acme", "device_bytes": 4 << 20,
                                  "share_used": 0.25, "share": 0.25}]
        ev = data["evictions"]
        assert ev["by_reason"] == {"tenant_share": 2, "device_budget": 1}
        assert ev["top"] == [{"digest": world.target, "tenant": "acme", "evictions": 3}]
        human = CliRunner().invoke(app, ["--home", str(settings.home), "cache", "status"],
                                   env={"COLUMNS": "200"})
        assert human.exit_code == 0, human.output
        assert "h1" in human.output and "acme 25%/25%" in human.output
        assert "tenant_share 2" in human.output
