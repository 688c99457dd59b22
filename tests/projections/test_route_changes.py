"""The route cache refreshes only what changed (``routing_changes``,
``projections.route_snapshot``), and stays exactly as strict as a full reload.

- every event a projection writer folds in says what it changes of the cache's tables;
- after one command in a large registry a refresh reads a handful of rows, not the registry
  (rows counted at the database cursor, so the count holds whatever the cache does);
- a random sequence of registry commands: after each, the cache's answers (one cache that
  refreshes on every question, one that catches up over many batches at once) equal a fresh
  uncached ``RoutingView``'s (hypothesis state machine);
- readers racing a revocation never see the revoked release again once they saw it withdrawn,
  and all see it withdrawn within the refresh interval;
- a cache behind the pruned change log, or facing a change of unknown kind, reloads all.
"""

from __future__ import annotations

import contextlib
import sqlite3
import tempfile
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
    run_state_machine_as_test,
)

from control.app.registry import Registry
from control.contracts.config import Settings
from control.domain import DomainError, TenantPolicy
from projections import writers
from projections.follower import open_registry
from projections.route_cache import CachedRoutingView, RoutingUnavailable
from projections.routing import RoutingView
from projections.tables import (
    adapters,
    api_keys,
    grants,
    releases,
    routes,
    routing_changes,
    tenants,
)
from projections.writers import changes
from tests.fixtures_control import (
    Artifacts,
    OnSQLite,
    WithRegistry,
    close_registry,
    sqlite_settings,
)

EVAL = {"suite": "smoke", "accuracy": 0.9, "passed": True}
KEY_1 = "11qYAYKxCrfVS/7TyWQHOg7hcvPapiMlrwIaaPcHURo="
KEY_2 = "Pq5FjzhpVDq4GLiyKP8Csyv0uo+y7KSJfbiAtVtO0FM="
TENANTS = ("acme", "globex", "initech")
ALIASES = ("chat", "g-chat", "tiny-base", "missing")
SESSIONS = [f"s{i}" for i in range(12)]
BIG = 3000  # releases (and adapters, routes, grants) of the large registry


def test_every_written_event_says_what_it_changes() -> None:
    written = set(writers.INSERTS) | set(writers.HANDLERS)
    missing = sorted(t.__qualname__ for t in written - set(changes.CHANGES))
    assert not missing, f"events with no entry in projections.writers.changes: {missing}"


def test_an_event_of_no_known_kind_changes_everything() -> None:
    class Unknown:
        pass

    assert changes.changes_of([Unknown()], {Unknown}) == {changes.ALL}
    assert changes.changes_of([Unknown()], set()) == set()  # no writer: no row changed


def _answers(view: RoutingView, keys: dict[str, str]) -> dict[tuple[str, ...], object]:
    out: dict[tuple[str, ...], object] = {}
    for tenant in TENANTS:
        for alias in ALIASES:
            for s in SESSIONS:
                out[(tenant, alias, s)] = view.resolve(tenant, alias, s)
        out[("placement", tenant)] = view.placement(tenant)
    for name, key in keys.items():
        out[("key", name)] = view.tenant_for_api_key(key)
    out[("retired",)] = view.retired_key_ids()
    return out


def _world(registry: Registry, artifacts: Artifacts) -> dict[str, str]:
    """Two tenants, a base alias, a stable + 40 % canary alias and another tenant's alias."""
    registry.register_base(artifacts.base, artifacts.tokenizer, name="tiny", actor="op",
                           alias="tiny-base")
    keys = {t: registry.create_tenant(t, actor="op") for t in ("acme", "globex")}
    v1 = registry.register_adapter(artifacts.adapters["alpha"], tenant="acme", alias="chat",
                                   actor="op")
    registry.advance(v1, external=True, evaluation=EVAL, actor="op")
    v2 = registry.register_adapter(artifacts.adapters["beta"], tenant="acme", alias="chat",
                                   actor="op")
    registry.advance(v2, external=True, evaluation=EVAL, to="canary", canary_percent=40,
                     actor="op")
    g = registry.register_adapter(artifacts.adapters["gamma"], tenant="globex", alias="g-chat",
                                  actor="op")
    registry.advance(g, external=True, evaluation=EVAL, actor="op")
    registry.grant("acme", "chat", actor="op")
    registry.grant("acme", "tiny-base", actor="op")
    registry.grant("globex", "g-chat", actor="op")
    return keys | {"v1": v1, "v2": v2, "g": g}


# -- rows read after one change in a large registry ---------------------------------------------

class _CountingCursor(sqlite3.Cursor):
    rows = 0

    def fetchone(self) -> Any:
        row = super().fetchone()
        _CountingCursor.rows += row is not None
        return row

    def fetchmany(self, size: int | None = None) -> list[Any]:
        rows = super().fetchmany(size) if size is not None else super().fetchmany()
        _CountingCursor.rows += len(rows)
        return rows

    def fetchall(self) -> list[Any]:
        rows = super().fetchall()
        _CountingCursor.rows += len(rows)
        return rows


class _CountingConnection(sqlite3.Connection):
    def cursor(self, factory: Any = _CountingCursor) -> Any:
        return super().cursor(factory)


def _fill(engine: sa.Engine, n: int) -> None:
    """``n`` adapters, each with its release, alias and grant, and ``n // 10`` tenants with
    their keys, written straight into the projection tables (a large registry in a second)."""
    digest = [f"sha256:{i:064x}" for i in range(n)]
    now = datetime.now(UTC)
    with engine.begin() as conn:
        conn.execute(tenants.insert(), [{"name": f"t{j}", "created_at": now, "regions": ""}
                                        for j in range(n // 10)])
        conn.execute(api_keys.insert(), [{"key_hash": f"{j:064x}", "tenant": f"t{j}"}
                                         for j in range(n // 10)])
    with engine.begin() as conn:
        conn.execute(adapters.insert(), [{
            "digest": d, "tenant": f"t{i % (n // 10)}", "alias": f"a{i}", "base_digest": d,
            "tokenizer_digest": d, "state": "stable", "rank": 1, "registered_at": now,
            "owner": "", "training_data_version": "", "licence": "", "allowed_tasks": ""}
            for i, d in enumerate(digest)])
        conn.execute(releases.insert(), [{
            "digest": "sha256:" + d[-63:] + "r", "tenant": f"t{i % (n // 10)}",
            "adapter_digest": d, "base_digest": d, "tokenizer_digest": d,
            "inference_defaults": "{}", "created_at": now} for i, d in enumerate(digest)])
        conn.execute(routes.insert(), [{
            "alias": f"a{i}", "owner": f"t{i % (n // 10)}",
            "stable_release": "sha256:" + d[-63:] + "r", "canary_release": None,
            "canary_percent": 0, "fallback": "none"} for i, d in enumerate(digest)])
        conn.execute(grants.insert(), [{"tenant": f"t{i % (n // 10)}", "alias": f"a{i}"}
                                       for i in range(n)])


class TestRowsReadAfterOneChange(OnSQLite, WithRegistry):
    def test_a_refresh_reads_what_changed_not_the_registry(
            self, registry: Registry, artifacts: Artifacts, settings: Settings) -> None:
        world = _world(registry, artifacts)
        _fill(registry.follower.engine, BIG)
        path = settings.db_url.removeprefix("sqlite:///")
        counted = sa.create_engine("sqlite://", creator=lambda: sqlite3.connect(
            path, factory=_CountingConnection, check_same_thread=False))
        cached = CachedRoutingView(counted, refresh_s=0)
        sql = RoutingView(registry.follower.engine)
        keys = {t: world[t] for t in ("acme", "globex")}
        _CountingCursor.rows = 0
        assert cached.resolve("t1", "a1", "s") is not None
        assert _CountingCursor.rows > 3 * BIG  # the first load reads it all (the counter works)
        commands = [
            ("tenant created", lambda: keys.update(initech=registry.create_tenant(
                "initech", actor="op"))),
            ("adapter revoked", lambda: registry.revoke(world["g"], "leak", actor="sec")),
            ("grant removed", lambda: registry.remove_grant("acme", "tiny-base", actor="op")),
            ("alias rolled forward", lambda: registry.break_glass(
                world["v2"], to="stable", reason="test", actor="op")),
            ("API keys revoked", lambda: registry.revoke_api_keys("acme", actor="sec")),
        ]
        for what, command in commands:
            command()
            _CountingCursor.rows = 0
            cached.resolve("t1", "a1", "s")  # the refresh happens here
            assert _CountingCursor.rows <= 40, f"{what}: {_CountingCursor.rows} rows read"
            assert _answers(cached, keys) == _answers(sql, keys), what
        assert cached.full_reloads == 1
        counted.dispose()


# -- a random sequence of registry commands ------------------------------------------------------

def _try(command: Any) -> None:
    # refused: nothing recorded, and both views must still agree
    with contextlib.suppress(DomainError):
        command()


class RegistryCommands(RuleBasedStateMachine):
    """Random registry commands; after each, every cache answers as the SQL view does."""

    artifacts: Artifacts  # set by the test (a session fixture)

    @initialize()
    def start(self) -> None:
        self.tmp = tempfile.TemporaryDirectory(prefix="route-changes-")
        s = sqlite_settings(Path(self.tmp.name) / "home")
        s.ensure_dirs()
        self.registry = open_registry(s)
        self.world = _world(self.registry, self.artifacts)
        self.keys = {t: self.world[t] for t in ("acme", "globex")}
        engine = self.registry.follower.engine
        self.sql = RoutingView(engine)
        self.eager = CachedRoutingView(engine, refresh_s=0)
        self.lagging = CachedRoutingView(engine, refresh_s=0)  # asked only now and then
        _answers(self.eager, self.keys)
        _answers(self.lagging, self.keys)
        self.kids = 0

    def teardown(self) -> None:
        if hasattr(self, "registry"):
            close_registry(self.registry)
            self.registry.follower.engine.dispose()
            self.tmp.cleanup()

    @rule(which=st.sampled_from(["v1", "v2", "g"]), immediate=st.booleans())
    def revoke(self, which: str, immediate: bool) -> None:
        _try(lambda: self.registry.revoke(self.world[which], "test", actor="sec",
                                          immediate=immediate))

    @rule(which=st.sampled_from(["v1", "v2", "g"]))
    def deprecate(self, which: str) -> None:
        _try(lambda: self.registry.promote(self.world[which], to="deprecated", actor="op"))

    @rule()
    def graduate_canary(self) -> None:
        _try(lambda: self.registry.break_glass(self.world["v2"], to="stable", reason="t",
                                               actor="op"))

    @rule(alias=st.sampled_from(["chat", "g-chat"]))
    def rollback(self, alias: str) -> None:
        _try(lambda: self.registry.rollback(alias, actor="op"))

    @rule(tenant=st.sampled_from(TENANTS), alias=st.sampled_from(ALIASES[:3]))
    def grant(self, tenant: str, alias: str) -> None:
        _try(lambda: self.registry.grant(tenant, alias, actor="op"))

    @rule(tenant=st.sampled_from(TENANTS), alias=st.sampled_from(ALIASES[:3]))
    def remove_grant(self, tenant: str, alias: str) -> None:
        _try(lambda: self.registry.remove_grant(tenant, alias, actor="op"))

    @rule(tenant=st.sampled_from(TENANTS))
    def rotate_key(self, tenant: str) -> None:
        def rotate() -> None:
            self.keys[f"{tenant}-{len(self.keys)}"] = self.registry.rotate_api_key(
                tenant, actor="op")
        _try(rotate)

    @rule(tenant=st.sampled_from(TENANTS))
    def revoke_keys(self, tenant: str) -> None:
        _try(lambda: self.registry.revoke_api_keys(tenant, actor="sec"))

    @rule()
    def create_initech(self) -> None:
        _try(lambda: self.keys.update(initech=self.registry.create_tenant("initech",
                                                                          actor="op")))

    @rule(tenant=st.sampled_from(TENANTS), pool=st.sampled_from([None, "gold"]),
          regions=st.sampled_from([[], ["eu"], ["eu", "us"]]))
    def policy(self, tenant: str, pool: str | None, regions: list[str]) -> None:
        isolation = "shared" if pool is None else f"dedicated:{pool}"
        _try(lambda: self.registry.set_policy(
            tenant, TenantPolicy(isolation=isolation, regions=regions), actor="op"))

    @rule(retire=st.booleans())
    def signing_key(self, retire: bool) -> None:
        if self.kids < 2:
            self.registry.record_signing_key(f"k{self.kids}", (KEY_1, KEY_2)[self.kids],
                                             actor="op")
            self.kids += 1
        elif retire:
            _try(lambda: self.registry.retire_signing_key("k0", actor="op"))

    @rule()
    def lagging_catches_up(self) -> None:
        assert _answers(self.lagging, self.keys) == _answers(self.sql, self.keys)

    @invariant()
    def cache_answers_as_the_tables(self) -> None:
        if hasattr(self, "registry"):
            assert _answers(self.eager, self.keys) == _answers(self.sql, self.keys)


def test_random_registry_commands_keep_the_cache_equal_to_the_tables(
        artifacts: Artifacts) -> None:
    RegistryCommands.artifacts = artifacts
    run_state_machine_as_test(RegistryCommands, settings=settings(
        max_examples=8, stateful_step_count=12, deadline=None,
        suppress_health_check=list(HealthCheck)))


# -- readers racing a revocation -----------------------------------------------------------------

UNAVAILABLE = "unavailable"  # a read refused because the routing tables could not be read

class TestRaces(OnSQLite, WithRegistry):
    def test_a_withdrawn_release_is_never_served_again(
            self, registry: Registry, artifacts: Artifacts) -> None:
        world = _world(registry, artifacts)
        cached = CachedRoutingView(registry.follower.engine, refresh_s=0.02)
        stop = threading.Event()
        seen: list[list[tuple[float, str | None]]] = [[] for _ in range(4)]

        def read(out: list[tuple[float, str | None]]) -> None:
            i = 0
            while not stop.is_set():
                started = time.monotonic()
                try:
                    route = cached.resolve("globex", "g-chat", f"r{i}")
                except RoutingUnavailable:  # fail-closed while the tables are busy (CI saw
                    out.append((started, UNAVAILABLE))  # it): refused, proves no withdrawal
                else:
                    out.append((started, None if route is None else route.adapter_digest))
                i += 1

        threads = [threading.Thread(target=read, args=(s,)) for s in seen]
        for t in threads:
            t.start()
        time.sleep(0.1)
        for j in range(8):  # commands that move the projection, then the revocation
            registry.create_tenant(f"bystander{j}", actor="op")
        registry.revoke(world["g"], "leak", actor="sec")
        done = time.monotonic()
        time.sleep(0.2)
        stop.set()
        for t in threads:
            t.join(10)
        for out in seen:
            assert any(d == world["g"] for _, d in out)  # served before
            withdrawn = [k for k, (_, d) in enumerate(out) if d is None]
            assert withdrawn, "never withdrawn"
            # never put back
            assert all(d in (None, UNAVAILABLE) for _, d in out[withdrawn[0]:])
            late = [d for started, d in out if started > done + cached.refresh_s + 0.05]
            assert late and all(d in (None, UNAVAILABLE) for d in late)


# -- a cache the change log cannot serve ---------------------------------------------------------

class TestFallBackToFullReload(OnSQLite, WithRegistry):
    def test_behind_the_pruned_log_the_cache_reloads_everything(
            self, registry: Registry, artifacts: Artifacts) -> None:
        world = _world(registry, artifacts)
        keys = {t: world[t] for t in ("acme", "globex")}
        sql = RoutingView(registry.follower.engine)
        cached = CachedRoutingView(registry.follower.engine, refresh_s=0)
        assert _answers(cached, keys) == _answers(sql, keys)
        registry.revoke(world["g"], "leak", actor="sec")
        registry.remove_grant("acme", "tiny-base", actor="op")
        assert registry.follower.prune_changes(keep=1) > 0  # the revocation's rows are gone
        with registry.follower.engine.connect() as conn:
            left = conn.execute(sa.select(sa.func.min(routing_changes.c.position))).scalar()
        assert left == registry.follower.position()
        assert _answers(cached, keys) == _answers(sql, keys)
        assert cached.full_reloads == 2
        registry.create_tenant("initech", actor="op")  # above the horizon: changes only
        assert _answers(cached, keys) == _answers(sql, keys)
        assert cached.full_reloads == 2

    def test_a_change_of_every_kind_reloads_everything(
            self, registry: Registry, artifacts: Artifacts) -> None:
        world = _world(registry, artifacts)
        cached = CachedRoutingView(registry.follower.engine, refresh_s=0)
        assert cached.resolve("globex", "g-chat", "s") is not None
        # A batch whose events no change kind describes, revoking behind the log's back:
        with registry.follower.engine.begin() as conn:
            conn.execute(adapters.update().where(adapters.c.digest == world["g"])
                         .values(state="revoked"))
            changes.record(conn, {changes.ALL}, registry.follower.position() + 1)
            conn.exec_driver_sql("UPDATE projection_tracking SET position = position + 1 "
                                 "WHERE name = 'routing'")
        assert cached.resolve("globex", "g-chat", "s") is None
        assert cached.full_reloads == 2
