"""The registry bench at a tiny size: the batched path records exactly the events of the
one-by-one path, keeps a tenant's adapter limit, and every adapter it registers is resolvable
through the routing projection the gateway reads; the figures are present and positive."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from control.domain import ValidationFailed
from control.domain.policy import TenantPolicy
from control.tools import bench_registry
from control.tools.bench_registry import ACTOR, Size, build, rebuild, register_one, write_adapter
from projections.follower import open_registry
from projections.routing import RoutingView

N, TENANTS = 6, 2


def _events(built: bench_registry.Built) -> list[tuple[Any, ...]]:
    """Every event in log order: aggregate, version, type, and its state but for the times
    (and the API keys' hashes, random per run)."""
    reg = open_registry(built.settings, follow=False)
    out = []
    for n in reg.recorder.select_notifications(start=1, limit=10_000):
        e = reg.mapper.to_domain_event(n)
        state = {k: v for k, v in vars(e).items()
                 if k not in ("timestamp", "key_hash", "originator_id", "originator_version")}
        out.append((e.originator_id, e.originator_version, type(e).__qualname__,
                    repr(sorted(state.items(), key=lambda kv: kv[0]))))
    return out


def test_batched_records_the_events_of_the_one_by_one_path(tmp_path: Path) -> None:
    one = build(tmp_path / "one", N, TENANTS, batched=False)
    bulk = build(tmp_path / "bulk", N, TENANTS, batched=True)
    a, b = _events(one), _events(bulk)
    assert len(a) == len(b) == one.events == bulk.events
    first = next(i for i, x in enumerate(a) if x[2] == "Adapter.AdapterRegistered")
    assert len(a) - first == 9 * N  # registered, alias, evaluation, 3 moves, release, ...
    # the same events, in the same order, with the same contents (but for each run's random
    # keys: the signing key's id and the API keys' hashes)
    a, b = ([x for x in xs if not x[2].startswith("SigningKey.")] for xs in (a, b))
    assert [x[:3] for x in a] == [x[:3] for x in b]
    differing = [x[2] for x, y in zip(a, b, strict=True) if x[3] != y[3]]
    assert set(differing) <= {"Tenant.TenantCreated"}, differing


def test_every_adapter_resolves_to_its_own_digest(tmp_path: Path) -> None:
    built = build(tmp_path / "r", N, TENANTS)
    events, seconds = rebuild(built.settings)
    assert events == built.events and seconds > 0
    view = RoutingView(bench_registry.make_engine(built.settings.db_url))
    reg = open_registry(built.settings, follow=False)
    for tenant, aliases in built.aliases.items():
        assert view.tenant_for_api_key(built.keys[tenant]) == tenant
        for alias in aliases:
            route = view.resolve(tenant, alias)
            assert route is not None and route.adapter_digest is not None
            assert reg.adapter(route.adapter_digest).alias == alias
            other = next(t for t in built.aliases if t != tenant)
            assert view.resolve(other, alias) is None  # granted to its owner only


def test_a_batch_counts_its_unsaved_adapters_against_the_tenant_limit(tmp_path: Path) -> None:
    built = build(tmp_path / "r", 0, 1)
    rebuild(built.settings)
    reg = open_registry(built.settings)
    reg.set_policy("rt0", TenantPolicy(max_adapters=2), actor=ACTOR)
    with pytest.raises(ValidationFailed), reg.batched():
        for i in range(3):
            register_one(reg, write_adapter(tmp_path / "src" / str(i), i), "rt0", f"ra-{i}")
    assert reg.follower.routing().live_adapter_count("rt0") == 2  # the first two, saved


def test_run_bench_reports_every_figure() -> None:
    out = bench_registry.run_bench(size=Size(adapters=10, small=3, tenants=2, rounds=1,
                                             requests=100))
    assert out["adapters"] == 10 and out["events_per_adapter"] >= 9
    assert out["projection_events"] == out["events"]
    for key in ("registration_adapters_per_s", "projection_events_per_s",
                "ticket_p99_100k_vs_100", "ticket_p99_100k_vs_100_churn"):
        assert out[key] > 0, key
    assert all(v > 0 for v in out["gateway_rss_mib"].values())
    assert out["host_view"]["large"]["releases"] == 10 + 1  # and the base's own
    assert out["host_view"]["small"]["releases"] == 3 + 1


def test_run_bench_measures_postgresql_too() -> None:
    """With a PostgreSQL URL the same figures come again from two scratch schemas, which are
    dropped afterwards."""
    import os

    import sqlalchemy as sa

    from tests.fixtures_control import PG_URL_ENV
    from tests.required import unavailable

    url = os.environ.get(PG_URL_ENV)
    if not url:
        unavailable("PostgreSQL", f"this test reads {PG_URL_ENV}")
    admin = sa.create_engine(url)
    schemas = ("SELECT count(*) FROM information_schema.schemata "
               "WHERE schema_name LIKE 'lp_bench_%%'")
    with admin.connect() as conn:
        before = conn.exec_driver_sql(schemas).scalar()
    out = bench_registry.run_bench(size=Size(adapters=10, small=3, tenants=2, rounds=1,
                                             requests=100), pg_url=url)
    pg = out["postgresql"]
    assert out["setup"]["database"] == "sqlite" and pg["setup"]["database"] == "postgresql"
    assert pg["events"] == out["events"] and pg["projection_events"] == pg["events"]
    for key in ("registration_adapters_per_s", "projection_events_per_s",
                "ticket_p99_100k_vs_100", "ticket_p99_100k_vs_100_churn"):
        assert pg[key] > 0, key
    assert pg["host_view"]["large"]["releases"] == 10 + 1
    with admin.connect() as conn:
        assert conn.exec_driver_sql(schemas).scalar() == before
    admin.dispose()
