"""Base-model upgrades as commands: a plan's start, its matrix, and the releases on the new base
that passing adapters get, each recorded through the registry.

The rules live in ``control.domain.upgrade`` (what is planned for, what a cell may say, that
only a passing cell gets a release) and on ``Adapter.verified_on`` (which releases of an adapter
an alias may move to); the plan that starts the shadow engine and runs the gate on it runs in
``control.tools.upgrade``. This desk is how it records:

- ``start`` numbers the plan per (old base, new base) and records ``UpgradePlanStarted`` with
  the adapters to plan for and the shadow host's ledger id, before anything is served;
- ``fits`` asks whether an adapter's stored bytes fit the new base with registration's own
  checks (``control.app.validation.validate_adapter`` against the new base, and the tenant's
  rank and target-module limits): the same rules, not a second version of them. What the
  engine does with an adapter whose ``adapter_config.json`` names its old base: nothing, it
  reads only the LoRA fields (``control.contracts.adapter_format``) and checks every tensor
  against the base it serves, so the fit is decided by shapes, and the golden tasks decide the
  rest;
- ``record`` creates, for every passing cell, the release manifest on the new combination
  (adapter, new base, its tokenizer and chat template, the inference defaults of the release it
  would replace, the new gate report as its evaluation report), and records it with
  ``UpgradePlanRecorded`` in one transaction. Nothing else moves: aliases keep pointing where
  they did, and an operator moves each passing alias with ``alias point``, ``alias canary`` or
  ``alias rollout``.

Transactions go through the registry's own save (``Registry.commit``), as every command does.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from eventsourcing.domain import Aggregate

from control.app import limits
from control.app.gate_desk import GateDesk
from control.app.registry import Registry
from control.app.releases import chat_template_digest
from control.app.validation import validate_adapter
from control.contracts.store import ArtifactCorrupt, ArtifactMissing
from control.domain import (
    Adapter,
    BaseUpgrade,
    CellVerdict,
    DomainError,
    IllegalTransition,
    NotFound,
    Release,
    ReleaseManifest,
    UpgradeCell,
    ValidationFailed,
    check_actor,
    is_approved,
    upgrade_id,
)


class UpgradeDesk:
    """Records base-upgrade plans (see the module notes)."""

    def __init__(self, registry: Registry) -> None:
        self.registry = registry
        self.gates = GateDesk(registry)

    # -- reading ------------------------------------------------------------------------------

    def latest_number(self, from_base: str, to_base: str) -> int:
        """How many plans of this upgrade were started (0: none)."""
        n = 0
        while self.registry.exists(upgrade_id(from_base, to_base, n + 1)):
            n += 1
        return n

    def get(self, from_base: str, to_base: str, number: int | None = None) -> BaseUpgrade:
        """A plan by number (default the latest); NotFound if none."""
        n = self.latest_number(from_base, to_base) if number is None else number
        if n < 1:
            raise NotFound("no upgrade plan between those bases")
        return self.registry.load(BaseUpgrade, upgrade_id(from_base, to_base, n),
                                  "upgrade plan")

    def approved(self, digests: list[str], from_base: str) -> list[Adapter]:
        """The adapters among ``digests`` a plan of ``from_base`` covers, in that order: those
        registered on it, canary or stable (read from their aggregates, not a projection)."""
        out = []
        for d in digests:
            a = self.registry.adapter(d)
            if a.base_digest == from_base and is_approved(a.state):
                out.append(a)
        return out

    def fits(self, adapter: Adapter, to_base: str) -> list[str]:
        """Why ``adapter`` cannot be served on ``to_base`` (empty: it fits), by registration's
        checks run on its stored bytes against that base, and its tenant's limits there."""
        reg = self.registry
        policy = reg.tenant(adapter.tenant).policy
        try:
            path = reg.store.verify(adapter.digest)
            facts = validate_adapter(path, lookup_base=reg.catalogue.base_info, base=to_base,
                                     max_rank=limits.rank_limit(policy, reg.settings.max_rank))
            limits.check_targets(policy, facts.base_digest, facts.target_modules)
        except ValidationFailed as e:
            return [f"{e.check}: {e.message}"]
        except (ArtifactMissing, ArtifactCorrupt):
            return ["store: the adapter's stored bytes are missing or do not match its digest"]
        return []

    def replaced_release(self, adapter: Adapter) -> Release | None:
        """The release of ``adapter`` a release on the new base would replace: the one its
        alias serves (stable, else canary) when it is this adapter's on its own base, else the
        release it entered canary with."""
        reg = self.registry
        try:
            route = reg.alias(adapter.alias)
        except NotFound:
            route = None
        for digest in ((route.stable, route.canary) if route is not None else ()):
            if digest is None:
                continue
            r = reg.release_manifest(digest)
            if r.adapter_digest == adapter.digest and r.base_digest == adapter.base_digest:
                return r
        return reg.release_manifest(adapter.release) if adapter.release else None

    # -- commands -----------------------------------------------------------------------------

    def start(self, from_base: str, to_base: str, adapters: list[str], *, shadow_host: str,
              actor: str) -> BaseUpgrade:
        """Record the start of a plan of ``adapters`` (approved ones of ``from_base``) on
        ``to_base``, which the shadow host ``shadow_host`` will serve."""
        check_actor(actor)
        reg = self.registry
        to = reg.base(to_base)  # NotFound: register the new base first
        reg.base(from_base)
        number = self.latest_number(from_base, to.digest) + 1
        plan = BaseUpgrade.start(from_base=from_base, to_base=to.digest, number=number,
                                 combination=self.gates.combination_on(to.digest),
                                 adapters=adapters, shadow_host=shadow_host, actor=actor)
        reg.commit(plan, what="upgrade plan",
                  already="an upgrade plan of these bases was started concurrently")
        return plan

    def record(self, plan: BaseUpgrade, cells: list[UpgradeCell], shadow: dict[str, Any], *,
               actor: str) -> BaseUpgrade:
        """Record the plan's matrix; every passing cell gets its release on the new
        combination in the same transaction (its ``new.release`` is filled in here)."""
        check_actor(actor)
        reg = self.registry
        combination = plan.combination
        done: list[UpgradeCell] = []
        releases: list[Aggregate] = []
        for cell in cells:
            if cell.new.verdict != CellVerdict.PASSED:
                done.append(cell)
                continue
            adapter = reg.adapter(cell.adapter)
            if adapter.passing_gate_report(combination) != cell.new.report:
                raise DomainError("a passing cell names the adapter's latest passing gate "
                                  "report on the new combination")
            release = self._upgrade_release(adapter, plan, cell.new.report, actor)
            if release.pending_events:
                releases.append(release)
            done.append(replace(cell, new=replace(cell.new, release=release.digest)))
        plan.record(done, shadow, actor)
        reg.commit(plan, *releases, what="upgrade plan")
        return plan

    def abandon(self, plan: BaseUpgrade, reason: str, *, actor: str) -> None:
        """Record that the plan broke off (``UpgradePlanAbandoned``)."""
        plan.abandon(reason, actor)
        self.registry.commit(plan, what="upgrade plan")

    def _upgrade_release(self, adapter: Adapter, plan: BaseUpgrade, report: str | None,
                         actor: str) -> Release:
        reg = self.registry
        replaced = self.replaced_release(adapter)
        if replaced is None:
            raise IllegalTransition("the adapter has no release on its own base to replace")
        return reg.catalogue.new_release(ReleaseManifest(
            tenant=adapter.tenant, adapter_digest=adapter.digest, base_digest=plan.to_base,
            tokenizer_digest=plan.tokenizer,
            chat_template_digest=chat_template_digest(reg.store, plan.tokenizer),
            inference_defaults=dict(replaced.inference_defaults),
            evaluation_report_digest=report), actor)
