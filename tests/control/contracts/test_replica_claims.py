"""Claims on an adapter's replicas (``control.contracts.replica_claims``), on SQLite and
PostgreSQL: hosts racing for a bound get exactly the bound, leases lapse, a shrunk bound takes
the newest claims, a release frees a place at once, a tick gives claims up in its renewal's
transaction (only the host's own rows, locks in digest order: two hosts ticking at once never
deadlock), an owner's claim outranks granted tenants' claims, and a state machine of hosts
claiming (for the owner or not), renewing, releasing and pausing checks every answer against
what the bound and the owner's precedence mean."""

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
    ADAPTER_REPLICAS,
    IDLE_ENV,
    LEASE_ENV,
    ReplicaTable,
    adapter_replicas,
    idle_from_env,
    lease_from_env,
)
from control.contracts.schema import SchemaOutdated, upgrade
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

    def test_the_owners_claim_outranks_granted_tenants_claims(self, engine: Engine) -> None:
        """A granted tenant's traffic on one host cannot keep the owner's requests on another
        from the adapter's only place: the owner's claim is granted, the grantee's host loses
        its claim at its next renewal, and its row goes then."""
        clock = Clock()
        a, b, c = (ReplicaTable(engine, h, lease_s=10.0, clock=clock) for h in "abc")
        assert b.claim(DIGEST, 1, for_owner=False)  # a grantee's requests placed it on b
        assert not c.claim(DIGEST, 1, for_owner=False)  # another grantee's: the place is b's
        clock.t += 1.0
        assert a.claim(DIGEST, 1, for_owner=True)  # the owner's, on a: granted
        assert a.holders(DIGEST) == ["a", "b"]  # the first (bound) of them hold the places
        assert not b.claim(DIGEST, 1, for_owner=False)  # b's renewal: lost
        assert _live(engine, DIGEST, clock.t) == ["a"]  # and its row is gone
        assert not b.claim(DIGEST, 1, for_owner=True)  # owners' claims rank by age: a's first
        assert not c.claim(DIGEST, 1, for_owner=False)
        # a's claim keeps its owner's rank while it renews, even for grantees' requests
        assert a.claim(DIGEST, 1, for_owner=False)
        assert not b.claim(DIGEST, 1, for_owner=True)
        # with room for two, a grantee's claim takes the second place until an owner needs it
        assert b.claim(DIGEST, 2, for_owner=False)
        assert c.claim(DIGEST, 2, for_owner=True)
        assert [t.claim(DIGEST, 2, for_owner=False) for t in (a, b, c)] == [True, False, True]

    def test_version_1_leases_are_dropped_by_the_upgrade(self, settings: Settings) -> None:
        """A table of version 1 (no rank) is refused on open, and `db upgrade` brings it to
        version 2 empty: its rows were leases only, which the hosts take afresh."""
        engine = make_engine(settings.db_url)
        try:
            v1 = sa.MetaData()
            old = sa.Table("adapter_replicas", v1,
                           sa.Column("adapter_digest", sa.String(71), primary_key=True),
                           sa.Column("host", sa.String(128), primary_key=True),
                           sa.Column("claimed_at", sa.Float, nullable=False),
                           sa.Column("expires_at", sa.Float, nullable=False))
            v1.create_all(engine)
            with engine.begin() as conn:
                conn.execute(old.insert().values(adapter_digest=DIGEST, host="a",
                                                 claimed_at=1.0, expires_at=9e9))
            with pytest.raises(SchemaOutdated):
                ReplicaTable(engine, "b")
            changes = {c.component: c for c in upgrade(
                engine, rebuild=None, components=(ADAPTER_REPLICAS,))}
            assert (changes["adapter_replicas"].before,
                    changes["adapter_replicas"].after) == (1, 2)
            table = ReplicaTable(engine, "b")
            assert table.holders(DIGEST) == [] and table.claim(DIGEST, 1)
        finally:
            engine.dispose()

    def test_renewing_many_claims_is_one_answer_per_adapter(self, engine: Engine) -> None:
        """``renew`` answers each adapter as ``claim`` would, in one transaction: held claims
        are kept, a new one is made where there is room, and a lost one is refused and gone."""
        clock = Clock()
        a, b = (ReplicaTable(engine, h, lease_s=10.0, clock=clock) for h in "ab")
        third = "sha256:" + "ef" * 32
        assert a.claim(DIGEST, 1, for_owner=False) and a.claim(OTHER, 1)
        assert b.claim(third, 1)
        clock.t += 1.0
        assert b.claim(DIGEST, 1, for_owner=True)  # the owner's: outranks a's grantee claim
        lost = a.renew({DIGEST: (1, False), OTHER: (1, True), third: (2, False)})
        assert lost == {DIGEST}
        assert (a.holders(DIGEST), a.holders(OTHER), a.holders(third)) == (
            ["b"], ["a"], ["b", "a"])
        assert a.renew({}) == set()
        with pytest.raises(ValueError):
            a.renew({DIGEST: (0, True)})

    def test_a_tick_gives_up_claims_in_the_renewals_transaction(self, engine: Engine) -> None:
        """``renew(needs, release=...)``: the released claims go in the renewal's transaction, and
        the other host takes a freed place at once; a digest with no claim is passed over, and
        one digest is renewed or released, not both."""
        clock = Clock()
        a, b = (ReplicaTable(engine, h, lease_s=10.0, clock=clock) for h in "ab")
        third = "sha256:" + "ef" * 32
        assert a.claim(DIGEST, 1) and a.claim(OTHER, 1) and a.claim(third, 1)
        assert not b.claim(DIGEST, 1) and not b.claim(OTHER, 1)
        nothing = "sha256:" + "00" * 32  # no claim on it anywhere: a no-op
        assert a.renew({third: (1, True)}, release=[OTHER, DIGEST, nothing]) == set()
        assert (a.holders(DIGEST), a.holders(OTHER), a.holders(third)) == ([], [], ["a"])
        assert b.claim(DIGEST, 1) and b.claim(OTHER, 1)  # the freed places, at once
        assert not b.claim(third, 1)
        assert a.renew({}, release=[third]) == set()  # releases alone: one transaction too
        assert b.claim(third, 1)
        with pytest.raises(ValueError):
            a.renew({DIGEST: (1, True)}, release=[DIGEST])

    def test_a_release_deletes_only_the_hosts_own_row(self, engine: Engine) -> None:
        """Two hosts hold one digest: a's batched release takes a's row and leaves b's, whether
        b's claim ranks before or after a's; a release by a host holding nothing takes nothing."""
        clock = Clock()
        a, b, c = (ReplicaTable(engine, h, lease_s=10.0, clock=clock) for h in "abc")
        assert b.claim(DIGEST, 2)
        clock.t += 1.0
        assert a.claim(DIGEST, 2) and a.claim(OTHER, 1)
        a.renew({OTHER: (1, True)}, release=[DIGEST])
        assert _live(engine, DIGEST, clock.t) == ["b"]
        assert a.claim(DIGEST, 2)
        c.renew({}, release=[DIGEST, OTHER])  # c holds neither
        assert _live(engine, DIGEST, clock.t) == ["a", "b"]
        assert _live(engine, OTHER, clock.t) == ["a"]
        b.renew({}, release=[DIGEST])
        assert _live(engine, DIGEST, clock.t) == ["a"] and a.holders(OTHER) == ["a"]

    def test_hosts_ticking_at_once_over_the_same_adapters_never_deadlock(
            self, engine: Engine) -> None:
        """Two hosts renew some of four adapters and give up the others in one transaction per
        tick, at once, each naming them in its own order: the locks are taken in digest order,
        so neither waits on the other in a cycle (PostgreSQL would abort one as deadlocked)."""
        digests = ["sha256:" + f"{i:02x}" * 32 for i in range(4)]
        hosts = [ReplicaTable(engine, h) for h in ("a", "b")]
        start = threading.Barrier(len(hosts))
        errors: list[BaseException] = []

        def ticks(table: ReplicaTable, order: list[str]) -> None:
            try:
                start.wait()
                for i in range(20):
                    kept = order[i % 2::2]  # the halves swap between renewed and released
                    table.renew({d: (2, True) for d in kept},
                                release=[d for d in order if d not in kept])
            except BaseException as e:  # reported below
                errors.append(e)

        threads = [threading.Thread(target=ticks, args=(t, o))
                   for t, o in zip(hosts, (digests, digests[::-1]), strict=True)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors

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


def test_the_idle_time_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(IDLE_ENV, raising=False)
    assert idle_from_env(15.0) == 60.0  # four leases
    monkeypatch.setenv(IDLE_ENV, "20")
    assert idle_from_env(15.0) == 20.0
    for bad in ("10", "0", "soon", "inf"):  # below one lease: places given up between requests
        monkeypatch.setenv(IDLE_ENV, bad)
        with pytest.raises(ValueError, match=IDLE_ENV):
            idle_from_env(15.0)


HOSTS = ("h0", "h1", "h2", "h3")
BOUND = 2
LEASE = 10.0


class Hosts(RuleBasedStateMachine):
    """Four hosts claim (for the adapter's owner's requests or a grantee's), renew, release and
    pause (time passes without their renewing) on one adapter bounded to two. The model keeps
    each live claim's rank (the owner's first, then the oldest) and checks every answer against
    what the bound means: an owner's claim is refused only while two other owner's claims rank
    before it, a grantee's only while two live claims do (a free place is never refused), a
    holder's renewal is kept unless two claims rank before it, and a refused host's row is gone
    (it counts against nobody)."""

    def __init__(self) -> None:
        super().__init__()
        self.clock = Clock()
        self.engine = make_engine(f"sqlite:///{Hosts.db_dir / 'replicas.db'}")
        self.tables = {h: ReplicaTable(self.engine, h, lease_s=LEASE, clock=self.clock)
                       for h in HOSTS}
        with self.engine.begin() as conn:  # one database for every example: start empty
            conn.execute(adapter_replicas.delete())
        # host -> (owner's?, since, until) of its last granted claim
        self.claims: dict[str, tuple[bool, float, float]] = {}

    db_dir: Path = Path(".")

    def live(self) -> dict[str, tuple[bool, float, float]]:
        return {h: c for h, c in self.claims.items() if c[2] > self.clock.t}

    def rank(self, host: str, owner: bool, since: float) -> tuple[int, float, str]:
        return (0 if owner else 1, since, host)

    @rule(host=st.sampled_from(HOSTS), for_owner=st.booleans())
    def claim(self, host: str, for_owner: bool) -> None:
        live = self.live()
        mine = live.get(host)
        others = {h: c for h, c in live.items() if h != host}

        def ahead(owner: bool, since: float | None) -> list[str]:
            """Live claims ranking before this one; a new claim (since None) comes after
            every live claim of its rank."""
            return [h for h, (o, s, _) in others.items() if (
                (o or not owner) if since is None
                else self.rank(h, o, s) < self.rank(host, owner, since))]

        tries: list[tuple[bool, float | None]] = []
        if mine is None:
            tries.append((for_owner, None))
        else:
            if for_owner and not mine[0]:
                tries.append((True, None))  # the owner's now: ranked as a new owner's claim
            tries.append((mine[0], mine[1]))
        fits = [(o, s) for o, s in tries if len(ahead(o, s)) < BOUND]
        granted = self.tables[host].claim(DIGEST, BOUND, for_owner=for_owner)
        assert granted == bool(fits), (host, for_owner, live)
        if for_owner and mine is None:  # nothing a grantee holds keeps the owner's claim out
            assert granted == (sum(1 for o, _, _ in others.values() if o) < BOUND)
        if granted:
            owner, since = fits[0][0], (self.clock.t if fits[0][1] is None else fits[0][1])
            self.claims[host] = (owner, since, self.clock.t + LEASE)
        else:
            self.claims.pop(host, None)

    @rule(host=st.sampled_from(HOSTS))
    def release(self, host: str) -> None:
        self.tables[host].release(DIGEST)
        self.claims.pop(host, None)

    @rule(seconds=st.sampled_from([0.5, 3.0, 9.9, 10.0, 25.0]))
    def time_passes(self, seconds: float) -> None:
        self.clock.t += seconds

    @invariant()
    def the_table_holds_the_live_claims_in_rank(self) -> None:
        live = self.live()
        assert _live(self.engine, DIGEST, self.clock.t) == sorted(live), (live, self.clock.t)
        ranked = sorted(live, key=lambda h: self.rank(h, live[h][0], live[h][1]))
        assert self.tables[HOSTS[0]].holders(DIGEST) == ranked
        # never more than the bound among the owner's claims, which nothing can outrank
        assert sum(1 for o, _, _ in live.values() if o) <= BOUND

    def teardown(self) -> None:
        self.engine.dispose()


def test_claims_follow_the_bound_and_the_owners_precedence(tmp_path: Path) -> None:
    Hosts.db_dir = tmp_path
    Hosts.TestCase.settings = hsettings(max_examples=80, stateful_step_count=30, deadline=None)
    Hosts.TestCase().runTest()
