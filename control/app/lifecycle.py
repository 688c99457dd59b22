"""The lifecycle desk: evaluation reports, promotions and releases of an adapter.

Operators walk an adapter through its lifecycle one step at a time (``promote``) or with
``advance`` (evaluation report -> candidate -> canary -> stable, each step its own event, one
transaction). What each move needs is ``control.domain.evidence``: an external report says it
passed and names its producer, and never overrides a failing gate report; stable needs a
completed rollout, the alias's first release, or a break-glass (``break_glass``: an operator's
recorded override, in the same transaction as the move it allows). Entering canary builds the
release manifest (``CatalogueDesk.new_release``) and splits the alias; entering stable points
the alias at it.

Revocation and fallback, the moves that take an adapter away, are the revocation desk's
(``control.app.revocation``).
"""

from __future__ import annotations

from typing import Any
from uuid import UUID

from eventsourcing.domain import Aggregate

from control.app import evidence
from control.app.releases import (
    REPORT_FILE,
    chat_template_digest,
    chat_template_name,
    check_report,
    parse_defaults,
    put_document,
    report_summary,
)
from control.app.unit_of_work import UnitOfWork
from control.domain import (
    CANARY,
    CANDIDATE,
    DEPRECATED,
    DRAFT,
    STABLE,
    Adapter,
    Alias,
    Combination,
    DomainError,
    IllegalTransition,
    Release,
    ReleaseManifest,
    alias_id,
    lifecycle_guard,
    next_state,
    release_id,
)
from control.domain.evidence import StableBasis, external_report

DEFAULT_CANARY_PERCENT = 10


class LifecycleDesk:
    """Records evaluations and moves adapters along their lifecycle on ``registry``."""

    def __init__(self, registry: UnitOfWork) -> None:
        self.registry = registry

    def record_evaluation(self, digest: str, report: dict[str, Any], *, actor: str,
                          external: bool = False) -> str:
        """Store an evaluation report written outside the gate (content-addressed JSON) for an
        adapter; return its digest. Accepted only with ``external=True``, and recorded as
        external (the gate records its own reports: ``control.app.gate_desk``).

        Without a passing gate report, the latest external report is the one a canary release
        names.
        """
        _external_only(external)  # refused before anything is stored
        summary = external_summary(report)
        reg = self.registry
        adapter = reg.adapter(digest)
        report_digest = put_document(reg.store, REPORT_FILE, check_report(report))
        adapter.record_evaluation(report_digest, summary, actor, external=external)
        reg.commit(adapter, what="adapter")
        return report_digest

    def promote(self, digest: str, to: str | None = None, *, actor: str,
                canary_percent: int = DEFAULT_CANARY_PERCENT,
                inference_defaults: dict[str, Any] | None = None) -> str:
        """Move an adapter one step along its lifecycle (``to``: default the next state); return
        the new state. IllegalTransition, recording nothing, if the move or its guard fails.

        Entering canary creates the release manifest and sends ``canary_percent`` per cent of
        the sessions of the adapter's alias to it; entering stable makes it the alias's stable
        release (the previous one stays in the alias history for rollback).
        """
        adapter = self.registry.adapter(digest)
        changed = self._step(adapter, to or next_state(adapter.state), actor=actor,
                             canary_percent=canary_percent, defaults=inference_defaults)
        self.registry.commit(adapter, *changed, what="adapter")
        return adapter.state

    def advance(self, digest: str, *, actor: str, evaluation: dict[str, Any] | None = None,
                to: str = STABLE, canary_percent: int = DEFAULT_CANARY_PERCENT,
                inference_defaults: dict[str, Any] | None = None,
                external: bool = False) -> str:
        """Walk an adapter from where it stands up to ``to`` (canary or stable), recording each
        step as its own event, all in one transaction; return the final state.

        ``evaluation``: a report written outside the gate to record first, accepted only with
        ``external=True`` (recorded as external). Canary needs it unless a passing gate report
        for the canary's base, tokenizer and chat template, or an external report, is recorded.
        """
        if to not in (CANARY, STABLE):
            raise DomainError("release walks up to canary or stable")
        summary = None
        if evaluation is not None:
            _external_only(external)
            summary = external_summary(evaluation)
        reg = self.registry
        adapter = reg.adapter(digest)
        changed: dict[UUID, Aggregate] = {}
        if evaluation is not None and summary is not None:
            report_digest = put_document(reg.store, REPORT_FILE, check_report(evaluation))
            adapter.record_evaluation(report_digest, summary, actor, external=external)
        order = (CANDIDATE, CANARY, STABLE)
        if adapter.state not in (DRAFT, *order):
            raise IllegalTransition(
                f"an adapter in state {adapter.state.value!r} cannot be released")
        while adapter.state != to:
            if adapter.state == STABLE:
                raise IllegalTransition("the adapter is already stable")
            for agg in self._step(adapter, next_state(adapter.state), actor=actor,
                                  canary_percent=canary_percent, defaults=inference_defaults,
                                  cache=changed):
                changed[agg.id] = agg
        reg.commit(adapter, *changed.values(), what="adapter")
        return adapter.state

    def break_glass(self, digest: str, *, to: str, reason: str, actor: str,
                    canary_percent: int = DEFAULT_CANARY_PERCENT,
                    inference_defaults: dict[str, Any] | None = None) -> str:
        """An operator's recorded override: move ``digest`` to ``to`` (canary or stable)
        although the evidence that move needs is missing, ``BreakGlassUsed`` and the move in
        one transaction; return the new state. See ``control.app.evidence.break_glass``."""
        adapter = self.registry.adapter(digest)
        evidence.break_glass(self.registry, adapter, to=to, reason=reason, actor=actor,
                             canary_combination=self.canary_combination)
        changed = self._step(adapter, to, actor=actor, canary_percent=canary_percent,
                             defaults=inference_defaults)
        self.registry.commit(adapter, *changed, what="adapter")
        return adapter.state

    def stable_basis(self, adapter: Adapter, route: Alias | None) -> StableBasis:
        """On what basis the canary ``adapter`` may become stable now (``route``: its alias);
        IllegalTransition when on none (``control.app.evidence``)."""
        return evidence.stable_basis_of(self.registry, adapter, route)

    def canary_combination(self, adapter: Adapter) -> Combination:
        """The base, tokenizer and chat template a canary release of ``adapter`` is built on:
        what its gate report must name (the template's digest is computed, not stored)."""
        return Combination(adapter.base_digest, adapter.tokenizer_digest,
                           chat_template_name(self.registry.store, adapter.tokenizer_digest))

    # -- one move ---------------------------------------------------------------------------

    def _step(self, adapter: Adapter, to: str, *, actor: str, canary_percent: int,
              defaults: dict[str, Any] | None,
              cache: dict[UUID, Aggregate] | None = None) -> list[Aggregate]:
        """Apply one lifecycle move to ``adapter`` (and its release/alias); return the other
        aggregates that changed. Nothing is saved here."""
        reg = self.registry
        policy = reg.tenant(adapter.tenant).policy
        route = self._cached_alias(adapter.alias, cache)
        if to != CANARY:
            if to == STABLE and adapter.state == CANARY:
                self.stable_basis(adapter, route)  # IllegalTransition when it has none
            adapter.promote(to, actor, policy)
            if to == STABLE and route is not None and adapter.release is not None:
                release = self._cached_release(adapter.release, cache)
                if route.stable != release.digest:
                    route.point(release, True, actor)
                return [route]
            if to == DEPRECATED and route is not None and route.canary == adapter.release:
                route.clear_canary(actor)
                return [route]
            return []
        # Entering canary: build the release manifest; the guard checks that a passing gate
        # report vouches for exactly this base + tokenizer + chat template (or that an
        # external report was recorded), before any manifest or template is written.
        combination = self.canary_combination(adapter)
        if adapter.state == CANDIDATE:
            adapter.check_canary(combination)  # an external report never overrides the gate
        lifecycle_guard(adapter, CANARY, policy, combination)
        inference_defaults = parse_defaults(defaults)  # refused before the template is stored
        release = reg.catalogue.new_release(ReleaseManifest(
            tenant=adapter.tenant, adapter_digest=adapter.digest,
            base_digest=adapter.base_digest, tokenizer_digest=adapter.tokenizer_digest,
            chat_template_digest=chat_template_digest(reg.store, adapter.tokenizer_digest),
            inference_defaults=inference_defaults,
            evaluation_report_digest=adapter.canary_evidence(combination)), actor)
        adapter.promote(to, actor, policy, release=release.digest, combination=combination)
        out: list[Aggregate] = [release]
        if route is not None:
            if route.stable is None:
                route.point(release, True, actor)  # a first release: nothing to split with
            else:
                route.set_canary(release, canary_percent, True, actor)
            out.append(route)
        if cache is not None:
            cache[release.id] = release
        return out

    def _cached_alias(self, name: str, cache: dict[UUID, Aggregate] | None) -> Alias | None:
        if cache is not None and alias_id(name) in cache:
            return cache[alias_id(name)]  # type: ignore[return-value]
        route = self.registry.alias_or_none(name)
        if route is not None and cache is not None:
            cache[route.id] = route
        return route

    def _cached_release(self, digest: str, cache: dict[UUID, Aggregate] | None) -> Release:
        if cache is not None and release_id(digest) in cache:
            return cache[release_id(digest)]  # type: ignore[return-value]
        return self.registry.release_manifest(digest)


def external_summary(report: Any) -> dict[str, Any]:
    """The event summary of an external report: its scalar fields and who produced it;
    DomainError (nothing stored) when it does not say it passed or names no producer."""
    claims = external_report(check_report(report))
    return {**report_summary(report), "producer": claims.producer}


def _external_only(external: bool) -> None:
    """A report written outside the gate is accepted only when the caller says so."""
    if not external:
        raise IllegalTransition(
            "a report written outside the gate is accepted only as external: pass --external "
            "(external=True), and it is recorded as external; or let the gate write one "
            "(loraplane adapter gate DIGEST)")


__all__ = ["DEFAULT_CANARY_PERCENT", "LifecycleDesk", "external_summary"]
