"""The warm-up after a restart (issue 24): a host preloads the adapters its slots held when it
last ran, before its first request, and governance decides first (revoked, no release, or a
placement that no longer allows this host: skipped). Real engine, cache, ledger and registry
projections on SQLite; no tritonserver."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from backend.serving.engine import Engine
from backend.serving.scheduler import SchedulerLimits
from backend.serving.service import IncomingRequest, LoraService
from control.app.serving_steps import RegistrySteps
from control.contracts.config import Settings
from control.domain import TenantPolicy
from tests.integration.conftest import ACTOR
from tests.serving_home import Home, Sink, provision_home

ROUTES = (("acme", "acme-alpha", "alpha"), ("acme", "acme-beta", "beta"),
          ("globex", "globex-gamma", "gamma"))


@pytest.fixture
def home(kit_dir: Path, tmp_path: Path) -> Home:
    return provision_home(Settings(home=tmp_path, db_url=f"sqlite:///{tmp_path / 'l.db'}"),
                          kit_dir)


def _service(home: Home, warmup: int) -> LoraService:
    engine = Engine(home.kit_dir / "base", home.kit_dir / "tokenizer", device="cpu",
                    max_rank=home.settings.max_rank, max_adapters=4)
    return LoraService(replace(home.settings, warmup_adapters=warmup), home.base_digest,
                       host="restarting-host", engine=engine,
                       limits=SchedulerLimits(max_running=8, max_queued=64), steps=RegistrySteps)


def _serve(svc: LoraService, home: Home, tenant: str, alias: str) -> None:
    sink = Sink()
    svc.submit(IncomingRequest(b"Hello", home.ticket(tenant, alias), max_tokens=2), sink)
    assert sink.wait().ok


def _first_run(home: Home) -> None:
    svc = _service(home, 0)
    try:
        for tenant, alias, _name in ROUTES:
            _serve(svc, home, tenant, alias)
    finally:
        svc.close()


def test_a_restarted_host_preloads_what_it_held(home: Home) -> None:
    _first_run(home)
    cold = _service(home, 0)  # off: nothing is loaded before a request asks
    try:
        assert cold.warmup.done.is_set() and cold.engine.resident_adapters() == {}
    finally:
        cold.close()
    svc = _service(home, 8)
    try:
        assert svc.warmup.done.wait(60)
        held = {home.digests[name] for _t, _a, name in ROUTES}
        assert set(svc.engine.resident_adapters()) == held
        assert sorted(svc.warmup.loaded) == sorted(held) and svc.warmup.skipped == {}
        # the first request after the restart is a hit: its adapter was loaded before it came
        _serve(svc, home, "acme", "acme-alpha")
        report = svc.cache.report()[home.digests["alpha"]]
        assert (report.hits, report.misses, report.loads) == (1, 1, 1)  # the miss: the preload
        assert report.tenant == "acme"
    finally:
        svc.close()


def test_governance_decides_what_is_preloaded(home: Home) -> None:
    _first_run(home)
    home.registry.revoke(home.digests["beta"], reason="leak", actor=ACTOR)
    # globex moved to a dedicated pool: its adapter may no longer be held on a shared host
    home.registry.set_policy("globex", TenantPolicy(isolation="dedicated:gold"), actor=ACTOR)
    svc = _service(home, 8)
    try:
        assert svc.warmup.done.wait(60)
        assert set(svc.engine.resident_adapters()) == {home.digests["alpha"]}
        assert svc.warmup.skipped == {"revoked": 1, "placement": 1}
    finally:
        svc.close()


def test_at_most_the_configured_number_most_recent_first(home: Home) -> None:
    _first_run(home)
    svc = _service(home, 1)
    try:
        assert svc.warmup.done.wait(60)
        assert list(svc.engine.resident_adapters()) == [home.digests["gamma"]]  # the last one
    finally:
        svc.close()
