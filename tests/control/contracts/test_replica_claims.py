"""Claims on an adapter's replicas (``control.contracts.replica_claims``), on SQLite and
PostgreSQL: hosts racing for a bound get exactly the bound, leases lapse, a shrunk bound takes
the newest claims, a release frees a place at once, and a state machine of hosts claiming,
renewing, releasing and pausing never sees more live claims than the bound."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import hypothesis.strategies as st
import pytest
import sqlalchemy as sa
from hypothesis import settings as hsettings
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule
from sqlalchemy.engine import Engine

from control.contracts.config import Settings
from control.contracts.db import make_engine
from control.contracts.replica_claims import (
    LEASE_ENV,
    ReplicaTable,
    adapter_replicas,
    lease_from_env,
)
from tests.fixtures_control import OnPostgres, OnSQLite

DIGEST = "sha256:" + "ab" * 32
OTHER = "sha256:" + "cd" * 32


class Clock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def _live(engine: Engine, digest: str, now: float) -> list[str]:
    t = adapter_replicas
    with engine.connect() as conn:
        return sorted(str(h) for h in conn.execute(sa.select(t.c.host).where(
            (t.c.adapter_digest == digest) & (t.c.expires_at > now))).scalars())


class Contract:
    @pytest.fixture
    def engine(self, settings: Settings) -> Iterator[Engine]:
        engine = make_engine(settings.db_url)
        yield engine
        engine.dispose()

    def test_hosts_racing_for_a_bound_get_exactly_the_bound(self, engine: Engine) -> None:
        tables = [ReplicaTable(engine, f"host-{i}") for i in range(8)]
        start = threading.Barrier(len(tables))
        granted: dict[str, bool] = {}
        errors: list[BaseException] = []

        def race(table: ReplicaTable) -> None:
            try:
                start.wait()
                granted[table.host] = table.claim(DIGEST, 3)
            except BaseException as e:  # reported below
                errors.append(e)

        threads = [threading.Thread(target=race, args=(t,)) for t in tables]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        winners = sorted(h for h, ok in granted.items() if ok)
        assert len(winners) == 3, granted
        assert tables[0].holders(DIGEST) == sorted(winners, key=tables[0].holders(DIGEST).index)
        assert _live(engine, DIGEST, tables[0].clock()) == winners
        # the winners renew, the others are still refused; another adapter is counted apart
        assert all(t.claim(DIGEST, 3) == (t.host in winners) for t in tables)
        assert all(t.claim(OTHER, 8) for t in tables)

    def test_a_lease_lapses_and_a_release_frees_its_place_at_once(self, engine: Engine) -> None:
        clock = Clock()
        a, b, c = (ReplicaTable(engine, h, lease_s=10.0, clock=clock) for h in "abc")
        assert a.claim(DIGEST, 1)
        assert not b.claim(DIGEST, 1)
        clock.t += 9.9
        assert not b.claim(DIGEST, 1)  # a's lease still runs
        clock.t += 0.2
        assert b.claim(DIGEST, 1)  # a stopped renewing: its claim lapsed, nobody deleted it
        assert not a.claim(DIGEST, 1)  # and a, back, is the newcomer now
        b.release(DIGEST)
        assert c.claim(DIGEST, 1)
        assert a.holders(DIGEST) == ["c"]

    def test_a_shrunk_bound_takes_the_newest_claims(self, engine: Engine) -> None:
        clock = Clock()
        tables = [ReplicaTable(engine, h, clock=clock) for h in ("z", "y", "x")]
        for table in tables:  # claimed in this order: z first, x last
            assert table.claim(DIGEST, 3)
            clock.t += 1.0
        assert [t.claim(DIGEST, 2) for t in tables] == [True, True, False]
        assert [t.claim(DIGEST, 1) for t in tables] == [True, False, False]

    def test_a_bound_below_one_is_a_programming_error(self, engine: Engine) -> None:
        with pytest.raises(ValueError):
            ReplicaTable(engine, "a").claim(DIGEST, 0)


class TestOnSQLite(OnSQLite, Contract):
    pass


class TestOnPostgres(OnPostgres, Contract):
    pass


def test_the_lease_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(LEASE_ENV, raising=False)
    assert lease_from_env() == 15.0
    monkeypatch.setenv(LEASE_ENV, "4.5")
    assert lease_from_env() == 4.5
    for bad in ("0", "-1", "soon", "nan", "1e9"):
        monkeypatch.setenv(LEASE_ENV, bad)
        with pytest.raises(ValueError, match=LEASE_ENV):
            lease_from_env()


HOSTS = ("h0", "h1", "h2", "h3")
BOUND = 2
LEASE = 10.0


class Hosts(RuleBasedStateMachine):
    """Four hosts claim, renew (a claim by a holder), release and pause (time passes without
    their renewing) on one adapter bounded to two. Checked against what a bound means, not
    against the table's own rule: never more than two live claims, a host told yes holds a live
    claim, and a host is refused only while two others hold live ones."""

    def __init__(self) -> None:
        super().__init__()
        self.clock = Clock()
        self.engine = make_engine(f"sqlite:///{Hosts.db_dir / 'replicas.db'}")
        self.tables = {h: ReplicaTable(self.engine, h, lease_s=LEASE, clock=self.clock)
                       for h in HOSTS}
        with self.engine.begin() as conn:  # one database for every example: start empty
            conn.execute(adapter_replicas.delete())
        self.until: dict[str, float] = {}  # host -> when its last granted claim lapses

    db_dir: Path = Path(".")

    def live(self) -> set[str]:
        return {h for h, t in self.until.items() if t > self.clock.t}

    @rule(host=st.sampled_from(HOSTS))
    def claim(self, host: str) -> None:
        others = self.live() - {host}
        holder = host in self.live()
        granted = self.tables[host].claim(DIGEST, BOUND)
        if holder:
            assert granted, (host, others)  # a holder's renewal within the bound is kept
        elif len(others) < BOUND:
            assert granted, (host, others)  # a place was free: refusing it would be a bug
        else:
            assert not granted, (host, others)
        if granted:
            self.until[host] = self.clock.t + LEASE
        elif host in self.until and self.until[host] <= self.clock.t:
            self.until.pop(host)

    @rule(host=st.sampled_from(HOSTS))
    def release(self, host: str) -> None:
        self.tables[host].release(DIGEST)
        self.until.pop(host, None)

    @rule(seconds=st.sampled_from([0.5, 3.0, 9.9, 10.0, 25.0]))
    def time_passes(self, seconds: float) -> None:
        self.clock.t += seconds

    @invariant()
    def never_over_the_bound(self) -> None:
        live = _live(self.engine, DIGEST, self.clock.t)
        assert len(live) <= BOUND, live
        assert set(live) == self.live(), (live, self.until, self.clock.t)

    def teardown(self) -> None:
        self.engine.dispose()


def test_hosts_never_hold_more_live_claims_than_the_bound(tmp_path: Path) -> None:
    Hosts.db_dir = tmp_path
    Hosts.TestCase.settings = hsettings(max_examples=60, stateful_step_count=30, deadline=None)
    Hosts.TestCase().runTest()
