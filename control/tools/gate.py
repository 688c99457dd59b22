"""The evaluation gate: ``loraplane adapter gate DIGEST`` runs a candidate through the real
serving path of a running deployment and records a content-addressed report of every figure.

The module is split by what each part does: this one prepares and runs the phases and writes
the report; ``control.tools.gate_requests`` holds what is sent (targets, routes, one record per
request, the burst and mismatch plans); ``control.tools.gate_evidence`` reads what the requests
left behind (ledger rows, the burst's attribution, the memory accounting).

Access is the hostile self-test's: Triton's HTTP and gRPC addresses, its metrics endpoint, and
the deployment's home and database. The candidate is never routable by tenants: the gate serves
it under a release manifest of its own (``GateDesk.gate_release``, pointed at by no alias) and
signs its own tickets for it with the home's signing key (one recorded and unretired in this
deployment, else the gate refuses to start). Its first request loads it on the host.

What it runs, in order (requests one at a time unless said otherwise, so that every answer of a
phase is a solo computation the mixed burst can be judged against):

1. ``golden``: every golden task on the candidate; the success rate is the share whose answer
   passes the task's checker (a refused or failed request fails its task);
2. ``base``: the same tasks on the base alone (the control; ticket without adapter or release);
3. ``stable``: the same tasks on the stable release the candidate would replace (its alias's
   stable release, when it names another adapter on this base; a base-only stable release is the
   control itself);
4. ``mismatch``: tickets naming a wrong base, a wrong tokenizer, or a release that does not bind
   the candidate, over HTTP and gRPC: each must get Triton's one generic refusal;
5. ``mixed``: 32 (the policy's ``mixed_requests``) concurrent requests, candidate, stable and base
   mixed, HTTP and gRPC, released together; each answer is judged by issue 7's provenance: the
   answer's ``adapter_digest`` and the ledger row's ``served_digest`` must be the digest the
   ticket named, the row must not be ``identity_mismatch``, and where the prompt tells the
   releases apart (their solo answers differ), the text must equal that release's solo answer;
6. ``long_context``: the set's first task tagged ``long_context`` (or, without one, the first
   task padded to the base's context), which must be served by the candidate;

then reads the figures that are not answers: the cold-load p95 over the candidate's
``adapter_loads`` rows (``loaded`` ones; ``failed`` ones are load failures), and the
resident-memory accounting error: the host's ``loraplane_backend_resident_bytes`` (counted from
the live tensors' storages) against the memory plan the host admits adapters by
(``backend.serving.memory.plan_for_host``: base weights, every slot of the banks, one slot per
resident adapter), computed here from the stored base's ``config.json`` and the deployment's
settings. The error is the largest relative difference of the three; the batch-dependent
categories (gathered, kv_cache, prefix_cache, workspace) are reported, not planned.

Every ticket names the synthetic tenant ``loraplane:gate`` (``control.contracts.synthetic``),
not the adapter's tenant: the gate's requests are the control plane's own, kept out of rollout
windows and every tenant's statistics, and shown apart in the operator's (the report still
names the adapter's tenant). Every request's ticket id is kept, and the report's ``ledger``
section counts the ledger rows of those tickets by outcome per phase (tickets that fail
verification leave rows without a ticket id: the mismatch phase counts its
``base``/``tokenizer`` refusals by time window); any request whose row is missing or disagrees
with what its client got is a ``ledger_mismatches`` figure.
The figures are judged by the adapter's effective gate policy (``control.domain.gate``) and the
report is recorded (``GateReportRecorded``) whether it passed or not.

On a new base (:class:`OnNewBase`, a base upgrade's plan, ``control.tools.upgrade``) the target is
a shadow host serving the new base, and the candidate is the adapter itself on the new
combination (that base, its tokenizer and chat template): the same phases, with these changes.
The release it would replace is its own release on the base it is upgraded from, served by the
live deployment (``OnNewBase.reference``): the ``stable`` phase runs there, and the success
rule compares against it; the mixed burst mixes the candidate and the new base alone (the old
release is not servable on the shadow host). The mismatch phase adds the candidate's old release
(``old_base``): a ticket exactly like a tenant's for that release names the old base, and the
shadow host must refuse it. Figures read from the ledger by host (cold loads, the refusals
without a ticket id) count the shadow host's rows only (``GateTarget.host_id``).
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from control.app.gate_desk import GateDesk
from control.app.key_ring import pick_signer
from control.app.registry import Registry
from control.app.releases import chat_template_name
from control.contracts.db import make_engine
from control.contracts.golden import LONG_CONTEXT, GoldenSet, GoldenTask
from control.contracts.ledger import Ledger, Outcome
from control.contracts.synthetic import GATE_TENANT
from control.contracts.ticket_seals import publish_seal
from control.contracts.tickets import GENERIC_REFUSAL, TicketSigner
from control.domain import (
    DEPRECATED,
    REVOKED,
    Adapter,
    Combination,
    GateFigures,
    GatePolicy,
    RuleVerdict,
    judge,
)
from control.domain.gate import failures
from control.ops.clients import Generation, TritonRefused, infer_with
from control.ops.serve import pick_base
from control.tools import gate_evidence as evidence
from control.tools.gate_requests import (
    BURST_WAIT_S,
    GATE_ACTOR,
    REFUSED_STATUS,
    REPORT_KIND,
    GateResult,
    GateTarget,
    GateUnavailable,
    OnNewBase,
    Route,
    Sent,
    burst_plan,
    mismatch_routes,
    open_client,
    ready,
    task_table,
)
from projections.follower import open_registry
from projections.routing import RoutingView


def run_gate(target: GateTarget, digest: str, *, actor: str = GATE_ACTOR,
             on_new_base: OnNewBase | None = None) -> GateResult:
    """Run the gate on adapter ``digest`` against ``target`` (on a new base: ``on_new_base``);
    the report is recorded either way. Raises GateUnavailable (recording nothing) when the gate
    cannot run there."""
    registry = open_registry(target.settings)
    try:
        return Gate(target, registry, actor=actor).run(digest, on_new_base)
    finally:
        registry.close()


@dataclass(frozen=True)
class GateRun:
    """One run's plan: the adapter, its golden set and combination, and the routes compared."""

    adapter: Adapter
    golden: GoldenSet
    combination: Combination
    signer: TicketSigner
    policy: GatePolicy
    started: float
    release: str
    candidate: Route
    base: Route
    stable: Route | None
    has_stable: bool
    stable_note: str
    tasks: list[GoldenTask]
    on_new_base: OnNewBase | None


class Gate:
    """One gate run over one candidate (see the module notes)."""

    def __init__(self, target: GateTarget, registry: Registry, *, actor: str = GATE_ACTOR,
                 clock: Callable[[], float] = time.time) -> None:
        self.t = target
        self.registry = registry
        self.desk = GateDesk(registry)
        self.actor = actor
        self.clock = clock
        engine = make_engine(target.settings.db_url)
        self.routing = RoutingView(engine)
        self.ledger = Ledger(engine)
        self.sent: list[Sent] = []
        self._lock = threading.Lock()

    # -- preparing ------------------------------------------------------------------------------

    def _prepare(self, digest: str, on_new_base: OnNewBase | None
                 ) -> tuple[Adapter, GoldenSet, Combination, TicketSigner]:
        adapter = self.registry.adapter(digest)
        if adapter.state in (REVOKED, DEPRECATED):
            raise GateUnavailable(f"an adapter in state {adapter.state.value!r} is not gated")
        golden = self.desk.golden_set(adapter)
        if on_new_base is None:
            base = pick_base(self.routing, self.t.base)
            if adapter.base_digest != base:
                raise GateUnavailable("the deployment serves another base model than the "
                                      "adapter's: gate it where its base is served (--base)")
            served_tokenizer = next(b.tokenizer_digest for b in self.routing.bases()
                                    if b.digest == base)
            if adapter.tokenizer_digest != served_tokenizer:
                raise GateUnavailable("the adapter's tokenizer is not the served base's")
            combination = self.registry.canary_combination(adapter)
        else:
            combination = self._new_base_combination(adapter, on_new_base)
        view = self.routing
        # a key the root vouches for: hosts refuse tickets of any other
        usable = set(view.vouched_signing_keys(self.t.settings.keys_dir)) - view.retired_key_ids()
        signer = pick_signer(self.t.settings.keys_dir, lambda kid: kid in usable)
        if signer is None:
            raise GateUnavailable("no signing key under the home is recorded (and unretired) "
                                  "in this deployment: run the gate with the deployment's home")
        publish_seal(view.engine, signer)  # hosts open its tickets' arms with it
        if not ready(self.t.http_url):
            raise GateUnavailable(f"Triton does not answer as ready at {self.t.http_url} "
                                  "(--http)")
        if on_new_base is not None and not ready(on_new_base.reference.http_url):
            raise GateUnavailable("the live deployment does not answer as ready at "
                                  f"{on_new_base.reference.http_url} (--http)")
        return adapter, golden, combination, signer

    def _new_base_combination(self, adapter: Adapter, on: OnNewBase) -> Combination:
        """The combination ``adapter`` is gated on on the new base; GateUnavailable when the
        target does not serve that base or the release to replace is not the adapter's."""
        if self.t.base != on.base:
            raise GateUnavailable("a gate run on a new base needs the target serving it "
                                  "(GateTarget.base)")
        row = next((b for b in self.routing.bases() if b.digest == on.base), None)
        if row is None:
            raise GateUnavailable("the new base is not registered")
        replaced = self.registry.release_manifest(on.replaces)
        if replaced.adapter_digest != adapter.digest:
            raise GateUnavailable("the release to replace is not this adapter's")
        return Combination(on.base, row.tokenizer_digest,
                           chat_template_name(self.registry.store, row.tokenizer_digest))

    def _stable_route(self, adapter: Adapter, base: Route) -> tuple[Route | None, bool, str]:
        """(route of the stable release to compare with, whether there is one, why not run)."""
        route = self.registry.alias(adapter.alias)
        if route.stable is None:
            return None, False, "the alias has no stable release"
        stable = self.registry.release_manifest(route.stable)
        if stable.adapter_digest == adapter.digest:
            return None, False, "the candidate is the alias's stable release"
        if stable.adapter_digest is None:
            # The stable release is the base alone: the control phase measures it.
            return Route("stable", None, None, stable.base_digest,
                         stable.tokenizer_digest), True, "base-only stable: the control"
        if (stable.base_digest, stable.tokenizer_digest) != (base.base, base.tokenizer):
            return None, True, "the stable release is on another base: not servable here"
        return Route("stable", stable.adapter_digest, stable.digest, stable.base_digest,
                     stable.tokenizer_digest), True, ""

    # -- sending --------------------------------------------------------------------------------

    def _ticket(self, signer: TicketSigner, tenant: str, route: Route) -> tuple[str, str]:
        token, claims = signer.issue(tenant=tenant, model=self.t.settings.model_name,
                                     base=route.base, adapter=route.adapter,
                                     tokenizer=route.tokenizer, release=route.release,
                                     disclose=True,  # the gate checks what served it
                                     ttl_s=self.t.settings.ticket_ttl_s)
        return token, claims.jti

    def _send(self, client: Any, protocol: str, phase: str, route: Route, tenant: str,
              signer: TicketSigner, prompt: str, max_tokens: int,
              task: GoldenTask | None = None,
              barrier: threading.Barrier | None = None) -> Sent:
        token, jti = self._ticket(signer, tenant, route)
        if barrier is not None:
            # The burst leaves together, so the engine batches it; a sibling that failed
            # before sending breaks the barrier: send anyway, the figures show it.
            with contextlib.suppress(threading.BrokenBarrierError):
                barrier.wait(BURST_WAIT_S)
        s = Sent(phase, route.label, task.id if task else None, protocol, jti, route.adapter,
                 self.clock())
        try:
            g: Generation = infer_with(client, protocol, prompt, token, max_tokens=max_tokens)
        except TritonRefused as e:
            s.status = e.status
            s.generic_refusal = e.status in REFUSED_STATUS and e.message == GENERIC_REFUSAL
        except Exception as e:  # the connection itself failed: a failed request, counted
            s.status = type(e).__name__
        else:
            s.ok, s.status, s.text = True, "ok", g.text
            s.request_id, s.answer_digest = g.request_id, g.adapter_digest
        if task is not None:
            s.passed = s.ok and task.checker.check(s.text)
        with self._lock:
            self.sent.append(s)
        return s

    def _phase(self, phase: str, route: Route, tenant: str, signer: TicketSigner,
               tasks: Sequence[GoldenTask], http_url: str | None = None) -> dict[str, Sent]:
        """Every task of ``tasks`` on ``route``, one at a time, over HTTP to the target (or to
        ``http_url``: the live deployment, for the release a new-base candidate replaces)."""
        client = open_client("http", http_url or self.t.http_url)
        try:
            return {t.id: self._send(client, "http", phase, route, tenant, signer, t.prompt,
                                     t.max_tokens, t) for t in tasks}
        finally:
            client.close()

    def _mismatch(self, tenant: str, signer: TicketSigner, candidate: Route,
                  old: Route | None = None) -> None:
        """Tickets that must be refused (``gate_requests.mismatch_routes``), over HTTP and
        gRPC; on a new base also ``old``, the candidate's release on its old base."""
        cases = mismatch_routes(candidate, old)
        for protocol, url in (("http", self.t.http_url), ("grpc", self.t.grpc_url)):
            client = open_client(protocol, url)
            try:
                for route in cases:
                    self._send(client, protocol, "mismatch", route, tenant, signer, "Hello", 2)
            finally:
                client.close()

    def _burst(self, tenant: str, signer: TicketSigner, plan: list[tuple[Route, GoldenTask]]
               ) -> None:
        barrier = threading.Barrier(len(plan))

        def one(i: int) -> None:
            route, task = plan[i]
            protocol = "grpc" if i % 2 else "http"
            url = self.t.grpc_url if protocol == "grpc" else self.t.http_url
            client = open_client(protocol, url)
            try:
                self._send(client, protocol, "mixed", route, tenant, signer, task.prompt,
                           task.max_tokens, task, barrier)
            finally:
                client.close()

        with ThreadPoolExecutor(len(plan)) as pool:
            list(pool.map(one, range(len(plan))))

    # -- the run --------------------------------------------------------------------------------

    def run(self, digest: str, on_new_base: OnNewBase | None = None) -> GateResult:
        """Gate ``digest`` (on its own base, or on ``on_new_base``); see the module notes."""
        run = self._plan(digest, on_new_base)
        answers, long_task, mismatch_window = self._traffic(run)
        evidence.read_ledger(self.sent, self.ledger, run.started, mismatch_window,
                             self._on_target)
        evidence.judge_burst(self.sent, answers)
        figures, phase_figures, cold, memory = self._measure(run)
        policy = run.policy
        verdicts = judge(figures, policy)
        ledger_mismatches = sum(1 for s in self.sent if s.why.startswith("ledger"))
        verdicts.append(RuleVerdict(
            "ledger", ledger_mismatches == 0, ledger_mismatches, 0,
            "requests whose ledger row is missing or disagrees with what the client got"))
        ok = all(v.passed for v in verdicts)
        all_figures = {**figures.to_json(), "ledger_mismatches": ledger_mismatches}
        report = {
            **report_header(run, self.t.host_id),
            "policy": policy.to_json(),
            "figures": all_figures,
            "verdicts": [v.to_json() for v in verdicts],
            "failures": failures(verdicts),
            "passed": ok,
            "phases": phase_figures,
            "golden_by_tag": evidence.by_tag(self.sent, run.tasks),
            "ledger": evidence.ledger_counts(self.sent),
            "tasks": task_table(run.tasks, answers),
            "long_context": {"task": long_task.id, "prompt_chars": len(long_task.prompt)},
            "cold_loads_s": cold,
            "memory": memory,
            "requests": [s.brief() for s in self.sent],
            "started_at": run.started,
            "finished_at": self.clock(),
        }
        report_digest = self.desk.record_gate_report(
            run.adapter.digest, report, passed=ok, figures=all_figures,
            combination=run.combination, actor=self.actor)
        return GateResult(report, report_digest, ok, verdicts)

    def _plan(self, digest: str, on_new_base: OnNewBase | None) -> GateRun:
        """What this run gates, against what, under which policy and release."""
        adapter, golden, combination, signer = self._prepare(digest, on_new_base)
        started = self.clock()
        release = self.desk.gate_release(
            adapter, actor=self.actor,
            combination=combination if on_new_base is not None else None)
        candidate = Route("candidate", adapter.digest, release, combination.base,
                          combination.tokenizer)
        base = Route("base", None, None, combination.base, combination.tokenizer)
        if on_new_base is None:
            stable, has_stable, stable_note = self._stable_route(adapter, candidate)
        else:
            stable, has_stable, stable_note = self._replaced_route(on_new_base)
        return GateRun(adapter, golden, combination, signer, self.desk.policy_for(adapter),
                       started, release, candidate, base, stable, has_stable, stable_note,
                       list(golden.tasks), on_new_base)

    def _traffic(self, run: GateRun
                 ) -> tuple[dict[str, dict[str, Sent]], GoldenTask, tuple[float, float]]:
        """Every phase's requests: golden, base, stable, mismatch, the mixed burst, long context.

        Every ticket of the run names the synthetic tenant: the control plane's own traffic
        (control.contracts.synthetic), whatever release it names.
        """
        tenant, signer, tasks, stable = GATE_TENANT, run.signer, run.tasks, run.stable
        answers = {"candidate": self._phase("golden", run.candidate, tenant, signer, tasks),
                   "base": self._phase("base", run.base, tenant, signer, tasks)}
        if stable is not None and stable.adapter is not None:
            answers["stable"] = self._phase(
                "stable", stable, tenant, signer, tasks,
                run.on_new_base.reference.http_url if run.on_new_base is not None else None)
        mismatch_from = self.clock()
        self._mismatch(tenant, signer, run.candidate,
                       stable if run.on_new_base is not None else None)
        mismatch_until = self.clock()
        # On a new base the replaced release is served elsewhere: not in the target's burst.
        in_burst = stable if (stable is not None and stable.adapter and run.on_new_base is None
                              ) else None
        plan = burst_plan(tasks, answers, run.candidate, run.base, in_burst,
                          run.policy.mixed_requests)
        self._burst(tenant, signer, plan)
        long_task = long_task_of(run.golden, self.registry.store.path(run.combination.base))
        self._phase("long_context", run.candidate, tenant, signer, [long_task])
        return answers, long_task, (mismatch_from, mismatch_until)

    def _measure(self, run: GateRun
                 ) -> tuple[GateFigures, dict[str, Any], list[float], dict[str, Any]]:
        """The figures the policy judges, from what was sent and what the ledger recorded."""
        loads = [x for x in self.ledger.loads(run.adapter.digest) if self._on_target(x.host)]
        cold = sorted(x.seconds for x in loads if x.outcome == "loaded")
        memory = evidence.memory_accounting(self.t,
                                            self.registry.store.path(run.combination.base))
        phase_figures = evidence.phase_figures(self.sent)
        stable_rate: float | None = None
        if run.stable is not None:
            stable_rate = phase_figures["stable" if run.stable.adapter else "base"]["success_rate"]
        long_sent = [s for s in self.sent if s.phase == "long_context"]
        figures = GateFigures(
            golden_tasks=len(run.tasks),
            success_rate=phase_figures["golden"]["success_rate"],
            base_success_rate=phase_figures["base"]["success_rate"],
            stable_success_rate=stable_rate,
            authorization_errors=evidence.authorization_errors(self.sent),
            mismatch_tried=phase_figures["mismatch"]["requests"],
            mismatch_refused=phase_figures["mismatch"]["refused"],
            mixed_requests=phase_figures["mixed"]["requests"],
            misattributions=phase_figures["mixed"]["misattributions"],
            long_context_ok=bool(long_sent) and all(
                s.ok and not s.misattributed and s.ledger_outcome == Outcome.OK
                for s in long_sent),
            cold_load_p95_s=evidence.p95(cold),
            cold_loads=len(cold),
            load_failures=sum(1 for x in loads if x.outcome == "failed"),
            memory_accounting_error=memory.get("error"),
            has_stable=run.has_stable,
        )
        return figures, phase_figures, cold, memory

    def _replaced_route(self, on: OnNewBase) -> tuple[Route | None, bool, str]:
        """The release a new-base candidate would replace: its own on its old base, served by
        the live deployment (see the module notes)."""
        r = self.registry.release_manifest(on.replaces)
        return (Route("stable", r.adapter_digest, r.digest, r.base_digest, r.tokenizer_digest),
                True, "the adapter's release on the base it is upgraded from, served by the "
                      "live deployment")

    def _on_target(self, host: str | None) -> bool:
        """Whether a ledger row of ``host`` is the target's (every row, without a host id)."""
        return self.t.host_id is None or host == self.t.host_id


__all__ = ["GATE_ACTOR", "Gate", "GateResult", "GateTarget", "GateUnavailable", "OnNewBase",
           "run_gate"]


def report_header(run: GateRun, host_id: str | None) -> dict[str, Any]:
    """The report's header: what was gated, on which combination, against which stable."""
    adapter, stable, on = run.adapter, run.stable, run.on_new_base
    return {
        "kind": REPORT_KIND,
        "adapter": adapter.digest,
        "tenant": adapter.tenant,
        "ticket_tenant": GATE_TENANT,
        "alias": adapter.alias,
        "golden": {"digest": adapter.golden_set, "family": run.golden.family,
                   "tasks": len(run.tasks)},
        "combination": {"base": run.combination.base,
                        "tokenizer": run.combination.tokenizer,
                        "template": run.combination.template},
        "release": run.release,
        "stable": {"release": stable.release if stable else None,
                   "adapter": stable.adapter if stable else None,
                   "compared": run.has_stable, "note": run.stable_note},
        "upgrade": None if on is None else {
            "from_base": adapter.base_digest, "replaces": on.replaces,
            "reference": on.reference.http_url, "host": host_id},
    }


def long_task_of(golden: GoldenSet, base_dir: Path) -> GoldenTask:
    """The golden set's long-context task, or its first task padded to the base's context."""
    tagged = golden.tagged(LONG_CONTEXT)
    if tagged:
        return tagged[0]
    first = golden.tasks[0]
    # No long-context task: the first one, padded to the base's context (bos, prompt and
    # the answer must fit its positions; the kit's tokenizer is a byte per token).
    config = json.loads((base_dir / "config.json").read_text(encoding="utf-8"))
    limit = int(config.get("max_position_embeddings") or 2048)
    room = max(1, min(limit - first.max_tokens - 2, 4096) - len(first.prompt.encode()))
    pad = ("The quick brown fox jumps over the lazy dog. " * (room // 45 + 1))[:room]
    return GoldenTask("long-context-padded", pad + first.prompt, first.checker,
                      first.max_tokens, (LONG_CONTEXT,))
