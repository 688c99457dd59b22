"""A deployment for the rollout tests: one tenant, one alias per scenario, its own home.

Each alias gets a baseline released to stable and a target released to canary; the adapters are
the kit's (``alpha`` and perturbed copies of it as baselines, ``alpha-v2`` and
``alpha-degraded`` as targets). A perturbed copy (every lora_B scaled by a hair) answers as its
source does and has a digest of its own, so each alias has adapters no other alias shares.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from control.app.key_ring import held_seal_keys
from control.app.registry import Registry
from control.app.rollouts import RolloutDesk
from control.contracts.config import Settings
from control.contracts.tickets import unverified_claims
from control.domain import CANARY, STABLE, RolloutPolicy
from control.ops.serve import Deployment
from control.tools.canary_traffic import CanaryTraffic
from control.tools.kit import KitManifest
from projections.follower import open_registry
from tests.artifacts import perturbed_copy
from tests.integration.conftest import sqlite_home

ACTOR = "test-operator"
TENANT = "acme"
# Windows of two seconds, judged half a second after they end. A margin of 10 points lets about
# 40 requests per arm show a good canary not worse (the default's 3 points need some 150):
# a rollout of three steps then takes some twenty seconds of traffic on two CPU cores.
# ``test_rollouts.py`` also runs the default policy (``RolloutPolicy()``) end to end.
WINDOW_S = 2.0
POLICY = RolloutPolicy(min_requests=20, min_ratings=20, margin_pp=10, settle_s=0.5,
                       probe_requests=2)


@dataclass(frozen=True)
class Scenario:
    alias: str
    baseline: str  # adapter digests
    target: str


@dataclass
class RolloutStack:
    settings: Settings
    registry: Registry
    desk: RolloutDesk
    kit: KitManifest
    api_key: str
    scenarios: dict[str, Scenario] = field(default_factory=dict)
    deployment: Deployment | None = None

    @property
    def seal_keys(self) -> dict[str, bytes]:
        """What opens the arm of this home's tickets (for :class:`ArmTraffic`)."""
        return held_seal_keys(self.settings.keys_dir)

    @property
    def http(self) -> str:
        assert self.deployment is not None and self.deployment.triton is not None
        return self.deployment.triton.http_url

    @property
    def gateway(self) -> str:
        assert self.deployment is not None
        return self.deployment.gateway_url

    def release_of(self, adapter: str) -> str:
        release = self.registry.adapter(adapter).release
        assert release is not None
        return release

    def events(self, rid: object) -> list[tuple[str, dict[str, object]]]:
        return self.desk.history(rid)  # type: ignore[arg-type]


def release(reg: Registry, source: Path, alias: str, to: str) -> str:
    """Register ``source`` for the tenant on ``alias`` and walk it to ``to``."""
    digest = reg.register_adapter(source, tenant=TENANT, alias=alias, actor=ACTOR)
    reg.advance(digest, evaluation={"suite": "smoke", "passed": True}, to=to, actor=ACTOR,
                external=True)
    return digest


def build(tmp_path_factory: pytest.TempPathFactory, kit_dir: Path, name: str,
          plans: dict[str, tuple[str, float, str, float]]) -> RolloutStack:
    """A home with the kit's base, tenant ``acme`` and, per alias in ``plans``, (baseline kit
    adapter, its perturbation factor, target kit adapter, its factor; 1.0: the kit's bytes)."""
    settings = sqlite_home(tmp_path_factory, name)
    kit = KitManifest.load(kit_dir)
    reg = open_registry(settings)
    reg.register_base(kit_dir / kit.base_path, kit_dir / kit.tokenizer_path, name="tiny-llama",
                      actor=ACTOR)
    key = reg.create_tenant(TENANT, actor=ACTOR)
    stack = RolloutStack(settings, reg, RolloutDesk(reg), kit, key)
    copies = tmp_path_factory.mktemp(f"{name}-adapters")

    def source(kit_name: str, factor: float) -> Path:
        src = kit_dir / kit.adapters[kit_name].path
        if factor == 1.0:
            return src
        return perturbed_copy(src, copies / f"{kit_name}-{factor}", factor)

    for alias, (base_name, base_factor, target_name, target_factor) in plans.items():
        baseline = release(reg, source(base_name, base_factor), alias, STABLE)
        target = release(reg, source(target_name, target_factor), alias, CANARY)
        reg.grant(TENANT, alias, actor=ACTOR)
        stack.scenarios[alias] = Scenario(alias, baseline, target)
    return stack


def wait_for(what: str, condition: Callable[[], bool], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(0.05)


def ticket_release(token: str, keys_dir: Path) -> str | None:
    """The release a ticket names, its sealed arm opened with the signing keys under
    ``keys_dir``: neither the gateway's answer nor the ticket tells a tenant."""
    release: str | None = unverified_claims(token, held_seal_keys(keys_dir))["release"]
    return release


class ArmTraffic(CanaryTraffic):
    """:class:`control.tools.canary_traffic.CanaryTraffic` as the rollout tests drive it: it
    already counts and prompts per arm from each ticket's own claims (see
    :func:`ticket_release`), so the tests use it as it is."""
