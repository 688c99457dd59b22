"""The scheduler's waiting room is shared fairly between tenants (backend.serving.tenant_queues).

A tenant that floods the host must not decide when another tenant is served, nor whether it is
let in at all: through the real scheduler on the kit engine, another tenant's requests are
admitted at the next free row, ahead of the flood, and find room in a full queue (the flooder's
newest request is refused as busy in its place, its lease released). A state machine checks the
waiting room's bookkeeping and its two rules against a model under any interleaving.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from backend.serving.engine import Engine, GenerationRequest, GenerationResult
from backend.serving.scheduler import QueueFull, Scheduler, SchedulerLimits
from backend.serving.tenant_queues import TenantQueues


@pytest.fixture(scope="module")
def engine(kit_dir: Path) -> Engine:
    return Engine(kit_dir / "base", kit_dir / "tokenizer", device="cpu", max_rank=16,
                  max_adapters=2)


class Ends:
    """Records the turn each job ended on, and how."""

    def __init__(self) -> None:
        self.turn = 0
        self.ended: dict[str, tuple[int, str, str | None]] = {}
        self.tokens: dict[str, list[int]] = {}
        self.first: dict[str, int] = {}  # the turn of each job's first streamed piece

    def sink(self, name: str) -> _Sink:
        return _Sink(self, name)


class _Sink:
    def __init__(self, ends: Ends, name: str) -> None:
        self.ends, self.name = ends, name

    def cancelled(self) -> bool:
        return False

    def token(self, piece: str) -> None:
        self.ends.first.setdefault(self.name, self.ends.turn)

    def finish(self, result: GenerationResult, outcome: str, reason: str | None) -> None:
        assert self.name not in self.ends.ended, f"{self.name} ended twice"
        self.ends.ended[self.name] = (self.ends.turn, str(outcome), reason)
        self.ends.tokens[self.name] = result.token_ids


def _submit(sched: Scheduler, engine: Engine, ends: Ends, tenant: str, i: int) -> str:
    name = f"{tenant}-{i}"
    seq = engine.open_sequence(GenerationRequest(f"Hello {i}", None, max_tokens=6))
    try:
        sched.submit(seq, ends.sink(name), tenant=tenant)
    except QueueFull:
        engine.close_sequence(seq)  # the caller still owns the lease on QueueFull
        raise
    return name


def _drain(sched: Scheduler, ends: Ends) -> None:
    for _ in range(2000):
        ends.turn += 1
        if not sched.run_once():
            return
    raise AssertionError("the scheduler did not drain")


def test_a_flood_from_one_tenant_does_not_delay_another(engine: Engine) -> None:
    ends = Ends()
    sched = Scheduler(engine, SchedulerLimits(max_running=2, max_queued=64), start=False)
    flood = [_submit(sched, engine, ends, "mallory", i) for i in range(20)]
    ends.turn += 1
    sched.run_once()  # two of the flood run
    alice = [_submit(sched, engine, ends, "alice", i) for i in range(2)]
    _drain(sched, ends)
    assert all(ends.ended[n][1] == "ok" for n in flood + alice)
    finished = sorted(ends.ended, key=lambda n: ends.ended[n][0])
    # From alice's arrival the rows are split evenly: each pair of rows that frees goes one to
    # each tenant (at equal use, the older head first), so alice's two end among the first six
    # (mallory's two that ran, then a pair each). One FIFO queue ended them after all twenty.
    assert set(alice) <= set(finished[:6]), finished
    assert engine.pins() == {}


def test_a_full_queue_makes_room_for_a_tenant_that_holds_less(engine: Engine) -> None:
    ends = Ends()
    sched = Scheduler(engine, SchedulerLimits(max_running=1, max_queued=8), start=False)
    flood = [_submit(sched, engine, ends, "mallory", i) for i in range(8)]  # alone: all of it
    with pytest.raises(QueueFull, match="busy"):
        _submit(sched, engine, ends, "mallory", 8)
    alice = [_submit(sched, engine, ends, "alice", i) for i in range(4)]
    with pytest.raises(QueueFull, match="busy"):  # an equal part each: alice holds hers
        _submit(sched, engine, ends, "alice", 4)
    # mallory's four newest were refused in alice's place, at once, as busy
    displaced = {n: e for n, e in ends.ended.items()}
    assert sorted(displaced) == sorted(flood[4:])
    assert all(outcome == "rejected" and reason == "busy"
               for _turn, outcome, reason in displaced.values())
    assert sched.load() == (0, 8)
    _drain(sched, ends)
    assert all(ends.ended[n][1] == "ok" for n in flood[:4] + alice)
    assert engine.pins() == {}  # every lease released, the displaced ones included


def test_a_tenant_whose_requests_hold_the_kv_goes_after_the_others(engine: Engine) -> None:
    """Use is KV reserved, not a count: one long request weighs more than a few short ones."""
    ends = Ends()
    sched = Scheduler(engine, SchedulerLimits(max_running=3, max_queued=64), start=False)
    big = engine.open_sequence(GenerationRequest("Hello " * 20, None, max_tokens=40))
    sched.submit(big, ends.sink("mallory-big"), tenant="mallory")
    ends.turn += 1
    sched.run_once()  # mallory's long request runs
    names = [_submit(sched, engine, ends, "mallory", 0)]
    names += [_submit(sched, engine, ends, "alice", i) for i in range(2)]
    ends.turn += 1
    sched.run_once()  # two rows free: both alice's, though mallory's short one came first
    assert sched.load() == (3, 1)
    _drain(sched, ends)
    assert ends.ended["alice-1"][0] < ends.ended["mallory-0"][0]


# -- the waiting room alone, against a model ----------------------------------------------------

TENANTS = ("a", "b", "c")


class Job:
    def __init__(self, tenant: str, n: int) -> None:
        self.tenant, self.n = tenant, n

    def __repr__(self) -> str:
        return f"{self.tenant}{self.n}"


class RoomMachine(RuleBasedStateMachine):
    """TenantQueues against a model: per-tenant FIFO lists and where every job went."""

    def __init__(self) -> None:
        super().__init__()
        self.bound = 5
        self.room: TenantQueues[Job] = TenantQueues(self.bound)
        self.model: dict[str, list[Job]] = {t: [] for t in TENANTS}
        self.fate: dict[int, str] = {}  # id(job) -> queued | taken | displaced | removed
        self.count = 0

    def _held(self) -> Counter[str]:
        return Counter({t: len(q) for t, q in self.model.items() if q})

    @rule(tenant=st.sampled_from(TENANTS))
    def push(self, tenant: str) -> None:
        job = Job(tenant, self.count)
        self.count += 1
        held = self._held()
        full = sum(held.values()) >= self.bound
        try:
            out = self.room.push(job)
        except QueueFull:
            # refused only when full, and only when this tenant holds its part already
            assert full and held[tenant] + 1 >= max(held.values())
            self.fate[id(job)] = "refused"
            return
        if full:
            assert out is not None
            # the newest of a largest holder, which held at least two more than the newcomer
            assert held[out.tenant] == max(held.values()) >= held[tenant] + 2
            assert self.model[out.tenant][-1] is out
            self.model[out.tenant].pop()
            self.fate[id(out)] = "displaced"
        else:
            assert out is None
        self.model[tenant].append(job)
        self.fate[id(job)] = "queued"

    @precondition(lambda self: any(self.model.values()))
    @rule(use=st.fixed_dictionaries({t: st.integers(0, 3) for t in TENANTS}))
    def admit_one(self, use: dict[str, int]) -> None:
        job = self.room.next(use)
        assert job is not None
        waiting = [t for t in TENANTS if self.model[t]]
        least = min(use[t] for t in waiting)
        assert use[job.tenant] == least
        # the head of its tenant, and the oldest head among the least-using tenants
        assert self.model[job.tenant][0] is job
        assert job.n == min(self.model[t][0].n for t in waiting if use[t] == least)
        self.room.take(job)
        self.model[job.tenant].pop(0)
        self.fate[id(job)] = "taken"

    @rule(tenant=st.sampled_from(TENANTS), parity=st.integers(0, 1))
    def remove_some(self, tenant: str, parity: int) -> None:
        gone = self.room.remove_if(lambda j: j.tenant == tenant and j.n % 2 == parity)
        want = [j for j in self.model[tenant] if j.n % 2 == parity]
        assert gone == want
        self.model[tenant] = [j for j in self.model[tenant] if j.n % 2 != parity]
        for j in gone:
            self.fate[id(j)] = "removed"

    @invariant()
    def the_room_is_the_model(self) -> None:
        assert len(self.room) == sum(len(q) for q in self.model.values()) <= self.bound
        assert list(self.room) == sorted((j for q in self.model.values() for j in q),
                                         key=lambda j: j.n)
        for t in TENANTS:
            assert self.room.waiting(t) == len(self.model[t])

    def teardown(self) -> None:
        left = self.room.clear()
        assert all(self.fate[id(j)] == "queued" for j in left)
        assert len(self.room) == 0 and not self.room and list(self.room) == []


TestWaitingRoom = RoomMachine.TestCase
TestWaitingRoom.settings = settings(max_examples=300, stateful_step_count=40, deadline=None,
                                    database=None)


# -- long prompts prefilled in chunks -----------------------------------------------------------

def test_long_prompts_of_two_tenants_are_prefilled_side_by_side(engine: Engine) -> None:
    ends = Ends()
    sched = Scheduler(engine, SchedulerLimits(max_running=8, max_queued=64, prefill_chunk=8),
                      start=False)
    long = [f"Once upon a time, far away {i} " * 3 for i in range(4)]
    requests = {f"acme-{i}": GenerationRequest(long[i], None, max_tokens=4) for i in range(3)}
    requests["globex-0"] = GenerationRequest(long[3], None, max_tokens=4)
    for name, r in requests.items():
        sched.submit(engine.open_sequence(r), ends.sink(name), stream=True,
                     tenant=name.split("-")[0])
        if name == "acme-2":  # acme's three are admitted and prefilling before globex's comes
            for _ in range(2):
                ends.turn += 1
                sched.run_once()
    _drain(sched, ends)
    first = ends.first
    # globex's prompt advanced beside acme's: its first token came before acme's second
    # prompt's (one at a time, oldest first, it came after all three of acme's: turns 11, 22,
    # 33, then 44)
    assert first["globex-0"] < first["acme-1"] < first["acme-2"], first
    assert first["acme-0"] < first["acme-1"]  # a tenant's own prompts keep their order
    for name, r in requests.items():  # and each answers as it would alone
        assert ends.ended[name][1] == "ok"
        assert ends.tokens[name] == engine.generate([r])[0].token_ids, name
    assert engine.pins() == {}


def test_a_finished_prompt_joins_ahead_only_when_the_new_order_fits() -> None:
    from backend.serving.chunked_prefill import PartialPrefill
    from backend.serving.prefill_order import Prefilling

    jobs = [Job("a", 0), Job("a", 1), Job("b", 2)]
    room: Prefilling[Job] = Prefilling()
    room.add(jobs, lambda j: PartialPrefill(None))  # type: ignore[arg-type]
    # the tenants alternate; each tenant's oldest unfinished prompt goes on
    assert [room.next()[0] for _ in range(4)] == [  # type: ignore[index]
        jobs[0], jobs[2], jobs[0], jobs[2]]
    done = object()
    room.finished(jobs[2], done)  # type: ignore[arg-type]
    seen: list[list[Job]] = []
    assert room.join_next(lambda order: seen.append(order) or False) is None
    assert seen == [[jobs[2], jobs[0], jobs[1]]]  # asked with it moved to the front
    assert room.jobs() == jobs  # refused: the order stands
    assert room.join_next(lambda order: True) == (jobs[2], done)
    assert room.jobs() == jobs[:2]
    assert [room.next()[0] for _ in range(2)] == [jobs[0], jobs[0]]  # type: ignore[index]
    room.finished(jobs[0], done)  # type: ignore[arg-type]
    assert room.join_next(lambda order: False) == (jobs[0], done)  # the front always joins


@pytest.mark.parametrize(("name", "value"), [("LORAPLANE_MAX_IN_FLIGHT", "0"),
                                             ("LORAPLANE_MAX_RUNNING", "0"),
                                             ("LORAPLANE_MAX_QUEUED", "-1"),
                                             ("LORAPLANE_PREFILL_CHUNK", "-1")])
def test_bounds_that_would_refuse_everything_are_refused_at_start(
        monkeypatch: pytest.MonkeyPatch, name: str, value: str) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=f"{name} must be >= "):
        SchedulerLimits.from_env()


def test_the_in_flight_bound_defaults_to_four_times_queued_and_running(
        monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("LORAPLANE_MAX_IN_FLIGHT", "LORAPLANE_MAX_RUNNING", "LORAPLANE_MAX_QUEUED"):
        monkeypatch.delenv(name, raising=False)
    assert SchedulerLimits.from_env().in_flight_bound() == 4 * (256 + 32)
    monkeypatch.setenv("LORAPLANE_MAX_IN_FLIGHT", "7")
    assert SchedulerLimits.from_env().in_flight_bound() == 7
