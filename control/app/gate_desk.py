"""The evaluation gate's commands: golden task sets, gate policies, the candidate's own release,
and gate reports, each recorded as events through the registry.

The rules live in ``control.domain.gate`` (thresholds, judgement) and on the ``Adapter`` and
``Tenant`` aggregates (what may be recorded when); the gate that measures runs in
``control.tools.gate``. This desk is how both it and the operator's verbs record:

- a golden task set is stored in the artifact store as a canonical JSON document
  (``control.contracts.golden``) before ``GoldenSetRecorded`` names its digest;
- a tenant's gate policy is ``Tenant.GatePolicySet``; one adapter's overrides are
  ``Adapter.GatePolicyOverridden``; the policy a gate run applies is the defaults overlaid by
  both (``control.domain.gate.effective_policy``), and the report records it;
- the gate serves the candidate under a release manifest of its own (adapter, base, tokenizer,
  chat template, no defaults, no report), created here if new, and pointed at by no alias: Triton
  hosts accept tickets for any recorded release whose digests the ticket names, while gateways
  resolve only what aliases point at, so no tenant can be routed to it;
- a gate report is stored like an evaluation report (a content-addressed document) before
  ``GateReportRecorded`` names its digest, whether it passed, its figures and the combination.

Transactions go through the registry's own save (``Registry.commit``), as every command does.
"""

from __future__ import annotations

from typing import Any

from control.app.registry import Registry
from control.app.releases import (
    GATE_REPORT_FILE,
    chat_template_digest,
    chat_template_name,
    check_report,
    get_document,
    put_document,
)
from control.contracts.golden import GOLDEN_FILE, GoldenSet
from control.domain import (
    Adapter,
    Combination,
    DomainError,
    GatePolicy,
    ReleaseManifest,
    check_actor,
    effective_policy,
)


class GateDesk:
    """Records what the evaluation gate needs and produces (see the module notes)."""

    def __init__(self, registry: Registry) -> None:
        self.registry = registry

    # -- golden task sets -----------------------------------------------------------------------

    def record_golden_set(self, digest: str, golden: GoldenSet, *, actor: str) -> str:
        """Store ``golden`` and record it as the adapter's golden task set; return its digest."""
        check_actor(actor)
        adapter = self.registry.adapter(digest)
        golden_digest = put_document(self.registry.store, GOLDEN_FILE, golden.document())
        adapter.record_golden_set(golden_digest, golden.family, len(golden.tasks), actor)
        self.registry.commit(adapter, what="adapter")
        return golden_digest

    def golden_set(self, adapter: Adapter) -> GoldenSet:
        """The adapter's recorded golden task set, read back from the store (bytes checked
        against the digest); DomainError if none is recorded."""
        if adapter.golden_set is None:
            raise DomainError("the adapter has no golden task set: record one with "
                              "`loraplane adapter golden DIGEST FILE` (or register it with "
                              "--golden FILE)")
        golden = GoldenSet.from_json(get_document(self.registry.store, GOLDEN_FILE,
                                                  adapter.golden_set))
        if golden.digest() != adapter.golden_set:  # canonical bytes in, same digest out
            raise DomainError("the stored golden task set does not match its digest")
        return golden

    # -- policies -------------------------------------------------------------------------------

    def set_tenant_policy(self, tenant: str, fields: dict[str, Any], *, actor: str
                          ) -> GatePolicy:
        """Record ``tenant``'s gate thresholds (policy fields; ``{}``: the defaults); return
        the policy its adapters are judged by when they override nothing."""
        t = self.registry.tenant(tenant)
        t.set_gate_policy(fields, actor)
        self.registry.commit(t, what="tenant gate policy")
        return effective_policy(t.gate_policy, None)

    def override_adapter_policy(self, digest: str, fields: dict[str, Any], *, actor: str
                                ) -> GatePolicy:
        """Record one adapter's gate thresholds over its tenant's (``{}``: none); return the
        policy it is judged by now."""
        adapter = self.registry.adapter(digest)
        adapter.override_gate_policy(fields, actor)
        self.registry.commit(adapter, what="adapter gate policy")
        return self.policy_for(adapter)

    def policy_for(self, adapter: Adapter) -> GatePolicy:
        """The gate policy ``adapter`` is judged by: defaults, its tenant's, its own."""
        return effective_policy(self.registry.tenant(adapter.tenant).gate_policy,
                                adapter.gate_overrides)

    # -- the candidate's release ---------------------------------------------------------------

    def combination_on(self, base_digest: str) -> Combination:
        """The combination an adapter is gated on when served on the registered base
        ``base_digest``: that base, its tokenizer and its chat template (a base upgrade gates
        adapters on a base other than their own)."""
        base = self.registry.base(base_digest)
        return Combination(base.digest, base.tokenizer_digest,
                           chat_template_name(self.registry.store, base.tokenizer_digest))

    def gate_release(self, adapter: Adapter, *, actor: str,
                     combination: Combination | None = None) -> str:
        """The release manifest the gate serves ``adapter`` under (created and recorded if new,
        pointed at by no alias); return its digest. ``combination``: another base than the
        adapter's own (a base upgrade's shadow host serves it); default its own."""
        check_actor(actor)
        reg = self.registry
        base, tokenizer = ((combination.base, combination.tokenizer) if combination is not None
                           else (adapter.base_digest, adapter.tokenizer_digest))
        release = reg.catalogue.new_release(ReleaseManifest(
            tenant=adapter.tenant, adapter_digest=adapter.digest,
            base_digest=base, tokenizer_digest=tokenizer,
            chat_template_digest=chat_template_digest(reg.store, tokenizer),
            inference_defaults={}, evaluation_report_digest=None), actor)
        if release.pending_events:
            reg.commit(release, what="release")
        return release.digest

    # -- reports --------------------------------------------------------------------------------

    def record_gate_report(self, digest: str, report: dict[str, Any], *, passed: bool,
                           figures: dict[str, Any], combination: Combination,
                           actor: str) -> str:
        """Store a report the gate wrote and record it on the adapter for ``combination``;
        return the report's digest."""
        check_actor(actor)
        adapter = self.registry.adapter(digest)
        report_digest = put_document(self.registry.store, GATE_REPORT_FILE,
                                     check_report(report))
        adapter.record_gate_report(report_digest, passed, figures, combination, actor)
        self.registry.commit(adapter, what="adapter")
        return report_digest

    def gate_report(self, report_digest: str) -> dict[str, Any]:
        """A stored gate report by digest (bytes checked against it)."""
        data = get_document(self.registry.store, GATE_REPORT_FILE, report_digest)
        if not isinstance(data, dict):
            raise DomainError("not a gate report")
        return data
