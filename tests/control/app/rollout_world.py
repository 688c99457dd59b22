"""A control plane for rollout tests without Triton: a registry on SQLite or PostgreSQL, a fake
clock, a fake probe, and ledger rows the test writes as a host would (admitted, finished,
rated). Shared by the rollout contract tests and the tests of the review's findings.

Alias ``chat`` of tenant ``acme`` has ``alpha`` stable and ``beta`` canary (10 %) until a rollout
takes over; :meth:`World.second_alias` adds ``chat2`` (``gamma`` stable, a copy of ``beta``
canary) for tests that need two rollouts at once.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from control.app.audit import audit_log
from control.app.registry import Registry
from control.app.rollouts import RolloutDesk
from control.contracts.ledger import Completion, Ledger, LedgerEntry, Outcome
from control.domain import CANARY, STABLE, ProbeReport, Release
from control.ops.rollout_controller import RolloutController
from tests.artifacts import perturbed_copy
from tests.fixtures_control import Artifacts, WithRegistry

ALIAS = "chat"
ALIAS2 = "chat2"
WINDOW = 10.0


def release_to(reg: Registry, digest: str, to: str) -> None:
    """Walk an adapter to ``to`` with a smoke report (an external one: not the gate's)."""
    reg.advance(digest, evaluation={"suite": "smoke", "passed": True}, to=to, actor="op",
                external=True)


@dataclass
class Clock:
    now: float = 1_000_000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class FakeProbe:
    """Passes unless told otherwise; records what it probed."""

    reports: list[ProbeReport] = field(default_factory=list)
    probed: list[str] = field(default_factory=list)

    def probe(self, owner: str | None, release: Release, requests: int) -> ProbeReport:
        self.probed.append(release.digest)
        if self.reports:
            return self.reports.pop(0)
        return ProbeReport(hosts=["fake:8000"], requests=requests, ok=requests)


@dataclass
class World:
    reg: Registry
    desk: RolloutDesk
    ledger: Ledger
    clock: Clock
    probe: FakeProbe
    stable: str  # adapter digests
    target: str
    tmp: Path
    artifacts: Artifacts
    ids: Iterator[int] = field(default_factory=itertools.count)

    def controller(self) -> RolloutController:
        """A controller as a fresh process starts one: it knows only the recorded events."""
        return RolloutController(self.desk, self.ledger, self.probe, clock=self.clock,
                                 retry_s=0.0)

    def traffic(self, release: str | None, adapter: str | None, n: int, *,
                rated: bool | None = None, outcome: str = Outcome.OK, took: float = 0.1,
                reason: str | None = None, at: float | None = None) -> list[str]:
        """``n`` requests admitted at ``at`` (default now) that ended ``outcome`` (``reason``)
        ``took`` seconds later, each rated ``rated`` by the tenant (None: not rated); returns
        their request ids."""
        when = self.clock.now if at is None else at
        rows = [LedgerEntry(request_id=f"r{next(self.ids)}", ticket_id="t", tenant="acme",
                            model="lora_llm", host="h1", base_digest=None,
                            adapter_digest=adapter, tokenizer_digest=None,
                            admitted_at=when, release_digest=release)
                for _ in range(n)]
        self.ledger.admit(rows)
        self.ledger.complete([Completion(r.request_id, outcome, reason=reason) for r in rows],
                             now=when + took)
        if rated is not None:
            for r in rows:
                self.ledger.rate(r.request_id, "acme", rated)
        return [r.request_id for r in rows]

    def releases(self, alias: str = ALIAS) -> tuple[str, str]:
        a = self.reg.alias(alias)
        assert a.stable is not None and a.canary is not None
        return a.stable, a.canary

    def events(self, kind: str) -> list[Any]:
        return [e for e in audit_log(self.reg) if e.event_type == kind]

    def release_of(self, adapter: str) -> str:
        release = self.reg.adapter(adapter).release
        assert release is not None
        return release

    def second_alias(self) -> tuple[str, str]:
        """Alias ``chat2``: ``gamma`` stable, a copy of ``beta`` canary; returns their adapter
        digests (stable, target)."""
        stable = self.reg.register_adapter(self.artifacts.adapters["gamma"], tenant="acme",
                                           alias=ALIAS2, actor="op")
        release_to(self.reg, stable, STABLE)
        copy = perturbed_copy(self.artifacts.adapters["beta"], self.tmp / "beta-copy", 1.001)
        target = self.reg.register_adapter(copy, tenant="acme", alias=ALIAS2, actor="op")
        release_to(self.reg, target, CANARY)
        return stable, target


class RolloutWorld(WithRegistry):
    """Mixin: the ``world`` fixture (on the suite's database, see ``tests.fixtures_control``)."""

    @pytest.fixture
    def world(self, registry: Registry, artifacts: Artifacts, tmp_path: Path) -> World:
        reg = registry
        reg.register_base(artifacts.base, artifacts.tokenizer, name="tiny", actor="op")
        reg.create_tenant("acme", actor="op")
        stable = reg.register_adapter(artifacts.adapters["alpha"], tenant="acme", alias=ALIAS,
                                      actor="op")
        release_to(reg, stable, STABLE)
        target = reg.register_adapter(artifacts.adapters["beta"], tenant="acme", alias=ALIAS,
                                      actor="op")
        release_to(reg, target, CANARY)  # the alias sends it 10 % until a rollout takes over
        clock = Clock()
        return World(reg, RolloutDesk(reg, clock=clock), Ledger(reg.follower.engine), clock,
                     FakeProbe(), stable, target, tmp_path, artifacts)
