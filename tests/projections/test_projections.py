"""The routing projection and its follower, on SQLite and on PostgreSQL.

``ProjectionContract`` is one suite; each backend subclasses it and provides ``settings``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from control.app.registry import NotYetVisible, Registry
from control.contracts.config import Settings
from control.contracts.db import make_engine
from projections import writers
from projections.follower import ProjectionFollower, open_registry, snapshot
from projections.routing import RoutingView
from tests import REPO
from tests.fixtures_control import (
    Artifacts,
    OnPostgres,
    OnSQLite,
    close_registry,
    sqlite_settings,
)

REAL_APPLY = writers.apply

apply_counts = sa.Table(
    "test_apply_counts", sa.MetaData(),
    sa.Column("event", sa.String(80), primary_key=True),
    sa.Column("n", sa.Integer, nullable=False),
)


def counting_apply(engine: Engine, fail_at: int | None = None
                   ) -> Callable[[Connection, list[Any]], None]:
    """``writers.apply_all`` that applies event by event and also counts, IN the projection's
    transaction, how often each event was applied: a rolled-back batch leaves no count behind,
    a committed one leaves exactly 1."""
    apply_counts.create(engine, checkfirst=True)
    calls = {"n": 0}

    def apply(conn: Connection, event: Any) -> None:
        calls["n"] += 1
        if fail_at is not None and calls["n"] == fail_at:
            raise RuntimeError("follower killed")
        key = f"{event.originator_id}:{event.originator_version}"
        if conn.execute(sa.select(apply_counts.c.n).where(apply_counts.c.event == key)).first():
            conn.execute(apply_counts.update().where(apply_counts.c.event == key)
                         .values(n=apply_counts.c.n + 1))
        else:
            conn.execute(apply_counts.insert().values(event=key, n=1))
        REAL_APPLY(conn, event)

    def apply_all(conn: Connection, events: list[Any]) -> None:
        for event in events:
            apply(conn, event)

    return apply_all


def unapplied(command: Callable[[], object]) -> None:
    """Run a command that waits for its change to show (revocations, credential changes)
    through a registry that does not follow, with no follower running: it is recorded, and
    reported as not yet visible (the test applies it later)."""
    with pytest.raises(NotYetVisible):
        command()


def revoke_unapplied(registry: Registry, digest: str) -> None:
    unapplied(lambda: registry.revoke(digest, "rotated", actor="sec", wait_s=0))


def credential_changes(registry: Registry) -> None:
    """One of each credential event, on the ``history`` fixture's world, none applied yet."""
    unapplied(lambda: registry.rotate_api_key("acme", actor="op", wait_s=0))
    unapplied(lambda: registry.revoke_api_keys("globex", actor="op", reason="left", wait_s=0))
    unapplied(lambda: registry.remove_grant("globex", "tiny-base", actor="op", wait_s=0))
    unapplied(lambda: registry.retire_signing_key("k1", actor="op", force=True, wait_s=0))


def counts(engine: Engine) -> list[int]:
    with engine.connect() as conn:
        return [int(n) for n in conn.execute(sa.select(apply_counts.c.n)).scalars()]


class ProjectionContract:
    @pytest.fixture
    def registry(self, settings: Settings) -> Iterator[Registry]:
        """A registry that does NOT catch up by itself: the tests drive the follower."""
        reg = open_registry(settings, follow=False)
        yield reg
        close_registry(reg)

    @pytest.fixture
    def engine(self, settings: Settings) -> Engine:
        return make_engine(settings.db_url)

    @pytest.fixture
    def history(self, registry: Registry, artifacts: Artifacts) -> dict[str, str]:
        """A dozen-odd events across every aggregate kind."""
        base = registry.register_base(artifacts.base, artifacts.tokenizer, name="tiny",
                                      actor="op", alias="tiny-base")
        registry.create_tenant("acme", actor="op")
        registry.create_tenant("globex", actor="op")
        alpha = registry.register_adapter(artifacts.adapters["alpha"], tenant="acme",
                                          alias="acme-chat", actor="alice")
        beta = registry.register_adapter(artifacts.adapters["beta"], tenant="globex",
                                         alias="globex-chat", actor="gina")
        registry.grant("acme", "acme-chat", actor="op")
        registry.grant("globex", "globex-chat", actor="op")
        registry.grant("globex", "tiny-base", actor="op")
        smoke = {"suite": "smoke", "passed": True}
        registry.advance(alpha, external=True, evaluation=smoke, actor="alice")
        registry.advance(beta, external=True, evaluation=smoke, actor="gina")
        registry.record_signing_key("k1", "11qYAYKxCrfVS/7TyWQHOg7hcvPapiMlrwIaaPcHURo=",
                                    actor="op")
        return {"base": base, "alpha": alpha, "beta": beta}

    def _total(self, registry: Registry) -> int:
        return int(registry.recorder.max_notification_id() or 0)

    def test_catch_up_and_resolve(self, registry: Registry, engine: Engine,
                                  history: dict[str, str]) -> None:
        view = RoutingView(engine)
        assert view.resolve("acme", "acme-chat") is None  # nothing applied yet
        follower = ProjectionFollower(registry, engine)
        assert follower.catch_up() == self._total(registry)
        assert follower.catch_up() == 0
        route = view.resolve("acme", "acme-chat")
        assert route is not None and route.adapter_digest == history["alpha"]
        assert route.base_digest == history["base"]
        assert view.resolve("globex", "acme-chat") is None  # another tenant's alias
        assert view.resolve("acme", "globex-chat") is None
        assert view.resolve("acme", "tiny-base") is None  # base alias not granted to acme
        base_route = view.resolve("globex", "tiny-base")
        assert base_route is not None and base_route.adapter_digest is None
        assert view.resolve("acme", "no-such-alias") is None
        assert sorted(view.tenants()) == ["acme", "globex"]

    def test_revocation_after_catch_up(self, registry: Registry, engine: Engine,
                                       history: dict[str, str]) -> None:
        view = RoutingView(engine)
        follower = ProjectionFollower(registry, engine)
        follower.catch_up()
        # Recorded, but nobody applied it yet: the command says so instead of succeeding.
        with pytest.raises(NotYetVisible, match="recorded but not yet visible"):
            registry.revoke(history["alpha"], "key material leaked", actor="sec", wait_s=0)
        assert registry.adapter(history["alpha"]).state == "revoked"
        assert history["alpha"] not in view.revoked_digests()  # not applied yet
        assert follower.catch_up() == 2  # the revocation and its alias's fallback (none)
        assert view.revoked_digests() == frozenset({history["alpha"]})
        assert view.is_revoked(history["alpha"]) and not view.is_revoked(history["beta"])
        assert view.resolve("acme", "acme-chat") is None
        row = view.adapter(history["alpha"])
        assert row is not None and row.state == "revoked"

    def test_killed_mid_batch_resumes_without_applying_twice(
        self, registry: Registry, engine: Engine, history: dict[str, str],
        monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        total = self._total(registry)
        monkeypatch.setattr(writers, "apply_all", counting_apply(engine, fail_at=5))
        first = ProjectionFollower(registry, engine, batch_size=3)
        with pytest.raises(RuntimeError, match="killed"):
            first.catch_up()
        assert first.position() == 3  # batch 1 committed, batch 2 rolled back entirely
        assert counts(engine) == [1, 1, 1]
        monkeypatch.setattr(writers, "apply_all", counting_apply(engine))
        second = ProjectionFollower(registry, engine, batch_size=3)
        assert second.catch_up() == total - 3
        assert sorted(counts(engine)) == [1] * total

    def test_killed_before_tracking_write(self, registry: Registry, engine: Engine,
                                          history: dict[str, str],
                                          monkeypatch: pytest.MonkeyPatch) -> None:
        total = self._total(registry)
        monkeypatch.setattr(writers, "apply_all", counting_apply(engine))
        follower = ProjectionFollower(registry, engine, batch_size=4)
        real_write = ProjectionFollower._write_position
        calls = {"n": 0}

        def write(self: ProjectionFollower, conn: Connection, old: int | None, new: int) -> None:
            calls["n"] += 1
            if calls["n"] == 2:
                raise KeyboardInterrupt  # the process dies between view rows and tracking
            real_write(self, conn, old, new)

        monkeypatch.setattr(ProjectionFollower, "_write_position", write)
        with pytest.raises(KeyboardInterrupt):
            follower.catch_up()
        assert follower.position() == 4 and sorted(counts(engine)) == [1] * 4
        assert ProjectionFollower(registry, engine).catch_up() == total - 4
        assert sorted(counts(engine)) == [1] * total

    def test_concurrent_followers_apply_each_event_once(
        self, registry: Registry, engine: Engine, history: dict[str, str],
        monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        total = self._total(registry)
        monkeypatch.setattr(writers, "apply_all", counting_apply(engine))
        followers = [ProjectionFollower(registry, engine, batch_size=2) for _ in range(3)]
        errors: list[BaseException] = []

        def run(f: ProjectionFollower) -> None:
            try:
                f.catch_up()
            except BaseException as exc:  # pragma: no cover - reported below
                errors.append(exc)

        threads = [threading.Thread(target=run, args=(f,)) for f in followers]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors
        assert followers[0].position() == total
        assert sorted(counts(engine)) == [1] * total

    def test_rebuild_equals_live(self, registry: Registry, engine: Engine,
                                 history: dict[str, str], tmp_path: Path) -> None:
        follower = ProjectionFollower(registry, engine)
        follower.catch_up()
        revoke_unapplied(registry, history["beta"])
        registry.point_alias("globex-chat", history["base"], actor="op")
        credential_changes(registry)
        follower.catch_up()
        live = snapshot(engine)
        assert live["revocations"] and live["routes"] and live["api_keys"]
        assert [r[1] for r in live["api_keys"]] == ["acme"]  # globex's key is revoked
        assert ("globex", "tiny-base") not in live["grants"]
        assert [(r[0], r[3] is not None) for r in live["signing_keys"]] == [("k1", True)]
        scratch = sa.create_engine(f"sqlite:///{tmp_path / 'rebuilt.db'}")
        assert follower.rebuild_into(scratch) == self._total(registry)
        assert snapshot(scratch) == live
        follower.rebuild_into(scratch)  # again: cleared first, same result
        assert snapshot(scratch) == live
        scratch.dispose()

    def test_batched_inserts_equal_event_by_event(
            self, registry: Registry, engine: Engine, history: dict[str, str], tmp_path: Path,
            monkeypatch: pytest.MonkeyPatch) -> None:
        """``apply_all`` (one executemany per table for each run of row-only events) leaves
        exactly the rows ``apply`` leaves one event at a time, updates interleaved."""
        revoke_unapplied(registry, history["beta"])
        registry.record_serving_step(history["beta"], "h1", "drained", actor="h1")
        registry.point_alias("globex-chat", history["base"], actor="op")
        registry.create_tenant("initech", actor="op")
        credential_changes(registry)
        follower = ProjectionFollower(registry, engine)
        batched = sa.create_engine(f"sqlite:///{tmp_path / 'batched.db'}")
        one_by_one = sa.create_engine(f"sqlite:///{tmp_path / 'one-by-one.db'}")
        follower.rebuild_into(batched)
        monkeypatch.setattr(writers, "apply_all", lambda conn, events: [
            REAL_APPLY(conn, e) for e in events])
        follower.rebuild_into(one_by_one)
        rows = snapshot(batched)
        assert rows["serving_steps"] and rows["revocations"] and len(rows["tenants"]) == 3
        assert rows == snapshot(one_by_one)
        batched.dispose()
        one_by_one.dispose()

    def test_registry_catches_up_after_commands(self, settings: Settings,
                                                engine: Engine) -> None:
        reg = open_registry(settings)  # follow=True: the default for the CLI
        try:
            key = reg.create_tenant("initech", actor="op")
            assert RoutingView(engine).tenant_for_api_key(key) == "initech"
        finally:
            close_registry(reg)

    def test_commands_apply_their_own_events_or_read_the_log(
            self, settings: Settings, engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
        """A command whose events are next in the log applies them without reading the log
        back; one that finds other processes' events before its own reads the log, and every
        event is applied exactly once either way."""
        a, b = open_registry(settings), open_registry(settings, follow=False)
        monkeypatch.setattr(writers, "apply_all", counting_apply(engine))
        reads: list[int] = []
        real = a.recorder.select_notifications

        def counted(*args: Any, **kwargs: Any) -> Any:
            reads.append(1)
            return real(*args, **kwargs)

        monkeypatch.setattr(a.recorder, "select_notifications", counted)
        try:
            a.create_tenant("acme", actor="op")
            assert reads == []  # applied as recorded
            b.create_tenant("globex", actor="op")  # another process, not caught up
            key = a.create_tenant("initech", actor="op")
            assert reads  # globex's event came first: read from the log
            assert sorted(counts(engine)) == [1, 1, 1]
            assert sorted(RoutingView(engine).tenants()) == ["acme", "globex", "initech"]
            assert RoutingView(engine).tenant_for_api_key(key) == "initech"
        finally:
            close_registry(a)
            close_registry(b)

    def test_follower_process_stops_on_sigterm(self, settings: Settings, registry: Registry,
                                               engine: Engine) -> None:
        registry.create_tenant("acme", actor="op")
        env = {**os.environ, "LORAPLANE_HOME": str(settings.home),
               "LORAPLANE_DB_URL": settings.db_url}
        proc = subprocess.Popen([sys.executable, "-m", "projections.follower"], env=env,
                                cwd=REPO,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        try:
            follower = ProjectionFollower(registry, engine)
            deadline = time.monotonic() + 30
            while follower.position() < 1 and time.monotonic() < deadline:
                time.sleep(0.1)
            assert follower.position() == 1
            registry.create_tenant("globex", actor="op")
            while follower.position() < 2 and time.monotonic() < deadline:
                time.sleep(0.1)
            assert sorted(RoutingView(engine).tenants()) == ["acme", "globex"]
        finally:
            proc.send_signal(signal.SIGTERM)
            out, _ = proc.communicate(timeout=30)
        assert proc.returncode == 0, out.decode(errors="replace")[-2000:]


class TestProjectionsSQLite(OnSQLite, ProjectionContract):
    pass


class TestProjectionsPostgres(OnPostgres, ProjectionContract):
    pass


def test_run_loop_stops_when_asked(tmp_path: Path) -> None:
    settings = sqlite_settings(tmp_path / "home")
    reg = open_registry(settings, follow=False)
    follower = ProjectionFollower(reg, make_engine(settings.db_url))
    stop = threading.Event()
    thread = threading.Thread(target=follower.run, args=(stop, 0.02))
    thread.start()
    reg.create_tenant("acme", actor="op")
    deadline = time.monotonic() + 10
    while follower.position() < 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    stop.set()
    thread.join(5)
    assert not thread.is_alive() and follower.position() == 1
    close_registry(reg)
