"""The evaluation gate: ``loraplane adapter gate DIGEST`` runs a candidate through the real
serving path of a running deployment and records a content-addressed report of every figure.

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

Every request's ticket id is kept, and the report's ``ledger`` section counts the ledger rows of
those tickets by outcome per phase (tickets that fail verification leave rows without a ticket
id: the mismatch phase counts its ``base``/``tokenizer`` refusals by time window); any request
whose row is missing or disagrees with what its client got is a ``ledger_mismatches`` figure.
The figures are judged by the adapter's effective gate policy (``control.domain.gate``) and the
report is recorded (``GateReportRecorded``) whether it passed or not.

On a new base (:class:`OnNewBase`, a base upgrade's plan, ``control.ops.upgrade``) the target is
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
import hashlib
import json
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

from backend.serving.memory import (
    BaseShapes,
    default_device,
    element_size,
    plan_for_host,
    serving_dtype,
)
from control.app.gate_desk import GateDesk
from control.app.key_ring import pick_signer
from control.app.registry import Registry
from control.app.releases import chat_template_name
from control.contracts.config import Settings
from control.contracts.db import make_engine
from control.contracts.golden import LONG_CONTEXT, GoldenSet, GoldenTask
from control.contracts.ledger import Ledger, LedgerEntry, Outcome
from control.contracts.tickets import GENERIC_REFUSAL, TicketSigner
from control.domain import (
    DEPRECATED,
    REVOKED,
    Adapter,
    Combination,
    DomainError,
    GateFigures,
    RuleVerdict,
    judge,
)
from control.domain.gate import failures
from control.ops.clients import Generation, TritonRefused, infer_with
from control.ops.serve import pick_base
from projections.follower import open_registry
from projections.routing import RoutingView

REPORT_KIND = "loraplane.gate-report/v1"
GATE_ACTOR = "gate"
REFUSED_STATUS = ("400", "StatusCode.INVALID_ARGUMENT")
PHASES = ("golden", "base", "stable", "mismatch", "mixed", "long_context")
_LEDGER_SLACK_S = 1.0  # host and gate clocks are one machine's, or NTP-close
_METRICS_SETTLE_S = 1.5  # the host refreshes its memory gauges every second when idle
_SAMPLE = "loraplane_backend_resident_bytes"
_BURST_WAIT_S = 60.0
OLD_BASE_ROUTE = "old_base"  # a new-base candidate's old release, sent to the new base's host
# Mismatch routes refused before their ticket is verified (their rows carry no ticket id), by
# the refusal reason their ledger rows hold.
UNVERIFIED_ROUTES = {"wrong_base": "base", "wrong_tokenizer": "tokenizer",
                     OLD_BASE_ROUTE: "base"}


class GateUnavailable(DomainError):
    """The gate cannot run here (no golden set, another base served, no usable key, ...)."""


@dataclass(frozen=True)
class GateTarget:
    """A running deployment, as the operator sees it (what the hostile self-test needs too)."""

    settings: Settings
    http_url: str  # host:port
    grpc_url: str  # host:port
    metrics_url: str | None = None  # e.g. http://host:8002/metrics; without it: not measured
    base: str | None = None  # the served base digest (default: the only one registered)
    device: str | None = None  # the Triton host's device ("cpu", "cuda"); default: this one's
    # The ledger's host id of the Triton host at http_url; given, the figures read by host
    # (cold loads, refusals without a ticket id) count its rows only. A shadow host has one.
    host_id: str | None = None


@dataclass(frozen=True)
class OnNewBase:
    """A gate run of an adapter on a base other than its own (see the module notes)."""

    base: str  # the new base digest: the target (a shadow host) serves it
    replaces: str  # the adapter's release on its own base, the one a new release would replace
    reference: GateTarget  # the live deployment serving ``replaces``


@dataclass(frozen=True)
class Route:
    """What one of the gate's tickets names: a release (or the base alone) to be served."""

    label: str  # candidate, base, stable, or a mismatch case
    adapter: str | None
    release: str | None
    base: str
    tokenizer: str


@dataclass
class Sent:
    """One request the gate sent, and what came back."""

    phase: str
    route: str
    task: str | None
    protocol: str
    ticket_id: str
    expected: str | None  # the adapter digest the ticket names (None: the base)
    started_at: float
    ok: bool = False
    status: str = ""  # "ok", or Triton's status (HTTP code or gRPC code name)
    generic_refusal: bool = False
    text: str = ""
    request_id: str = ""
    answer_digest: str = ""
    passed: bool | None = None  # the task's checker on the answer
    ledger_outcome: str | None = None
    ledger_reason: str | None = None
    served_digest: str | None = None
    misattributed: bool = False
    why: str = ""

    def brief(self) -> dict[str, Any]:
        """What the report keeps of it (no prompt text: the tasks are in the golden set)."""
        return {k: v for k, v in asdict(self).items() if k not in ("why",) or v}


@dataclass
class GateResult:
    """A finished gate run: the stored report, its digest, and the verdict."""

    report: dict[str, Any]
    report_digest: str
    passed: bool
    verdicts: list[RuleVerdict] = field(default_factory=list)

    @property
    def failures(self) -> list[str]:
        return failures(self.verdicts)


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
        usable = set(view.signing_keys()) - view.retired_key_ids()
        signer = pick_signer(self.t.settings.keys_dir, lambda kid: kid in usable)
        if signer is None:
            raise GateUnavailable("no signing key under the home is recorded (and unretired) "
                                  "in this deployment: run the gate with the deployment's home")
        if not _ready(self.t.http_url):
            raise GateUnavailable(f"Triton does not answer as ready at {self.t.http_url} "
                                  "(--http)")
        if on_new_base is not None and not _ready(on_new_base.reference.http_url):
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
                barrier.wait(_BURST_WAIT_S)
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
        client = _open_client("http", http_url or self.t.http_url)
        try:
            return {t.id: self._send(client, "http", phase, route, tenant, signer, t.prompt,
                                     t.max_tokens, t) for t in tasks}
        finally:
            client.close()

    def _mismatch(self, tenant: str, signer: TicketSigner, candidate: Route,
                  old: Route | None = None) -> None:
        """Tickets that must be refused: wrong base, wrong tokenizer, unbound release; on a
        new base also ``old``, the candidate's release on its old base (a tenant's ticket)."""
        cases = (
            Route("wrong_base", candidate.adapter, candidate.release,
                  _made_up("base", candidate.base), candidate.tokenizer),
            Route("wrong_tokenizer", candidate.adapter, candidate.release, candidate.base,
                  _made_up("tokenizer", candidate.tokenizer)),
            Route("wrong_release", candidate.adapter, _made_up("release", candidate.release),
                  candidate.base, candidate.tokenizer),
            *([Route(OLD_BASE_ROUTE, old.adapter, old.release, old.base, old.tokenizer)]
              if old is not None else []),
        )
        for protocol, url in (("http", self.t.http_url), ("grpc", self.t.grpc_url)):
            client = _open_client(protocol, url)
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
            client = _open_client(protocol, url)
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
        adapter, golden, combination, signer = self._prepare(digest, on_new_base)
        policy = self.desk.policy_for(adapter)
        started = self.clock()
        release = self.desk.gate_release(
            adapter, actor=self.actor,
            combination=combination if on_new_base is not None else None)
        tenant = adapter.tenant
        candidate = Route("candidate", adapter.digest, release, combination.base,
                          combination.tokenizer)
        base = Route("base", None, None, combination.base, combination.tokenizer)
        if on_new_base is None:
            stable, has_stable, stable_note = self._stable_route(adapter, candidate)
        else:
            stable, has_stable, stable_note = self._replaced_route(on_new_base)
        tasks = list(golden.tasks)

        answers = {"candidate": self._phase("golden", candidate, tenant, signer, tasks),
                   "base": self._phase("base", base, tenant, signer, tasks)}
        if stable is not None and stable.adapter is not None:
            answers["stable"] = self._phase(
                "stable", stable, tenant, signer, tasks,
                on_new_base.reference.http_url if on_new_base is not None else None)
        mismatch_from = self.clock()
        self._mismatch(tenant, signer, candidate, stable if on_new_base is not None else None)
        mismatch_until = self.clock()
        # On a new base the replaced release is served elsewhere: not in the target's burst.
        in_burst = stable if (stable is not None and stable.adapter and on_new_base is None
                              ) else None
        plan = _burst_plan(tasks, answers, candidate, base, in_burst, policy.mixed_requests)
        self._burst(tenant, signer, plan)
        long_task = self._long_task(golden, combination.base)
        self._phase("long_context", candidate, tenant, signer, [long_task])

        self._read_ledger(started, (mismatch_from, mismatch_until))
        self._judge_burst(answers)
        loads = [x for x in self.ledger.loads(adapter.digest) if self._on_target(x.host)]
        cold = sorted(x.seconds for x in loads if x.outcome == "loaded")
        load_failures = sum(1 for x in loads if x.outcome == "failed")
        memory = self._memory(combination.base)

        phase_figures = self._phase_figures()
        rate = phase_figures["golden"]["success_rate"]
        stable_rate: float | None = None
        if stable is not None:
            stable_rate = phase_figures["stable" if stable.adapter else "base"]["success_rate"]
        long_sent = [s for s in self.sent if s.phase == "long_context"]
        figures = GateFigures(
            golden_tasks=len(tasks),
            success_rate=rate,
            base_success_rate=phase_figures["base"]["success_rate"],
            stable_success_rate=stable_rate,
            authorization_errors=self._authorization_errors(),
            mismatch_tried=phase_figures["mismatch"]["requests"],
            mismatch_refused=phase_figures["mismatch"]["refused"],
            mixed_requests=phase_figures["mixed"]["requests"],
            misattributions=phase_figures["mixed"]["misattributions"],
            long_context_ok=bool(long_sent) and all(
                s.ok and not s.misattributed and s.ledger_outcome == Outcome.OK
                for s in long_sent),
            cold_load_p95_s=_p95(cold),
            cold_loads=len(cold),
            load_failures=load_failures,
            memory_accounting_error=memory.get("error"),
            has_stable=has_stable,
        )
        verdicts = judge(figures, policy)
        ledger_mismatches = sum(1 for s in self.sent if s.why.startswith("ledger"))
        verdicts.append(RuleVerdict(
            "ledger", ledger_mismatches == 0, ledger_mismatches, 0,
            "requests whose ledger row is missing or disagrees with what the client got"))
        ok = all(v.passed for v in verdicts)
        report = {
            "kind": REPORT_KIND,
            "adapter": adapter.digest,
            "tenant": tenant,
            "alias": adapter.alias,
            "golden": {"digest": adapter.golden_set, "family": golden.family,
                       "tasks": len(tasks)},
            "combination": {"base": combination.base, "tokenizer": combination.tokenizer,
                            "template": combination.template},
            "release": release,
            "stable": {"release": stable.release if stable else None,
                       "adapter": stable.adapter if stable else None,
                       "compared": has_stable, "note": stable_note},
            "upgrade": None if on_new_base is None else {
                "from_base": adapter.base_digest, "replaces": on_new_base.replaces,
                "reference": on_new_base.reference.http_url, "host": self.t.host_id},
            "policy": policy.to_json(),
            "figures": {**figures.to_json(), "ledger_mismatches": ledger_mismatches},
            "verdicts": [v.to_json() for v in verdicts],
            "failures": failures(verdicts),
            "passed": ok,
            "phases": phase_figures,
            "golden_by_tag": self._by_tag(tasks),
            "ledger": self._ledger_counts(),
            "tasks": _task_table(tasks, answers),
            "long_context": {"task": long_task.id, "prompt_chars": len(long_task.prompt)},
            "cold_loads_s": cold,
            "memory": memory,
            "requests": [s.brief() for s in self.sent],
            "started_at": started,
            "finished_at": self.clock(),
        }
        report_digest = self.desk.record_gate_report(
            adapter.digest, report, passed=ok,
            figures={**figures.to_json(), "ledger_mismatches": ledger_mismatches},
            combination=combination, actor=self.actor)
        return GateResult(report, report_digest, ok, verdicts)

    def _long_task(self, golden: GoldenSet, base_digest: str) -> GoldenTask:
        tagged = golden.tagged(LONG_CONTEXT)
        if tagged:
            return tagged[0]
        first = golden.tasks[0]
        # No long-context task: the first one, padded to the base's context (bos, prompt and
        # the answer must fit its positions; the kit's tokenizer is a byte per token).
        config = json.loads((self.registry.store.path(base_digest) / "config.json")
                            .read_text(encoding="utf-8"))
        limit = int(config.get("max_position_embeddings") or 2048)
        room = max(1, min(limit - first.max_tokens - 2, 4096) - len(first.prompt.encode()))
        pad = ("The quick brown fox jumps over the lazy dog. " * (room // 45 + 1))[:room]
        return GoldenTask("long-context-padded", pad + first.prompt, first.checker,
                          first.max_tokens, (LONG_CONTEXT,))

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

    # -- reading the record ---------------------------------------------------------------------

    def _read_ledger(self, started: float, mismatch_window: tuple[float, float]) -> None:
        rows = self.ledger.query(since=started - _LEDGER_SLACK_S)
        by_ticket: dict[str, list[LedgerEntry]] = {}
        for r in rows:
            if r.ticket_id:
                by_ticket.setdefault(r.ticket_id, []).append(r)
        # Tickets that fail verification leave rows without a ticket id, so the wrong-base
        # and wrong-tokenizer rows are the refusals with those reasons within the phase.
        lo, hi = mismatch_window
        unverified = Counter(r.reason for r in rows
                             if r.ticket_id is None and lo - 0.2 <= r.admitted_at <= hi + 0.2
                             and r.reason in ("base", "tokenizer") and self._on_target(r.host))
        for s in self.sent:
            if s.route in UNVERIFIED_ROUTES:
                reason = UNVERIFIED_ROUTES[s.route]
                if unverified[reason] > 0:
                    unverified[reason] -= 1
                    s.ledger_outcome, s.ledger_reason = Outcome.REJECTED.value, reason
                else:
                    s.why = "ledger: no refused row without a ticket for this request"
                continue
            found = by_ticket.get(s.ticket_id, [])
            if len(found) != 1:
                s.why = f"ledger: {len(found)} rows for this request's ticket"
                continue
            row = found[0]
            s.ledger_outcome, s.ledger_reason = row.outcome, row.reason
            s.served_digest = row.served_digest
            if s.ok != (row.outcome == Outcome.OK) or (s.ok and row.request_id != s.request_id):
                s.why = f"ledger: row says {row.outcome}, the client got {s.status}"
            elif s.ok and (s.answer_digest != (s.expected or "")
                           or row.served_digest != s.expected
                           or row.adapter_digest != s.expected):
                s.misattributed = True
                s.why = "attribution: answer or ledger names another digest than the ticket"
            elif row.outcome == Outcome.IDENTITY_MISMATCH:
                s.misattributed = True
                s.why = "attribution: identity mismatch"

    def _judge_burst(self, answers: dict[str, dict[str, Sent]]) -> None:
        """Mixed answers against their release's solo answer, where the prompt tells the
        releases in the burst apart (else the text proves nothing; the digests still count)."""
        labels = [k for k in answers if any(s.phase == "mixed" and s.route == k
                                            for s in self.sent)]
        for s in self.sent:
            if s.phase != "mixed" or not s.ok or s.misattributed or s.task is None:
                continue
            own = answers[s.route].get(s.task)
            others = [answers[k][s.task].text for k in labels if k != s.route
                      and s.task in answers[k] and answers[k][s.task].ok]
            if own is None or not own.ok or own.text in others:
                s.why = s.why or "indistinguishable: its release's solo answer equals another's"
                continue
            if s.text != own.text:
                s.misattributed = True
                s.why = "attribution: the text is not its release's solo answer"

    def _authorization_errors(self) -> int:
        wrong = sum(1 for s in self.sent if s.phase == "mismatch" and not s.generic_refusal)
        refused = sum(1 for s in self.sent if s.phase != "mismatch" and s.generic_refusal)
        return wrong + refused

    def _phase_figures(self) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        for phase in PHASES:
            sent = [s for s in self.sent if s.phase == phase]
            judged = [s for s in sent if s.passed is not None]
            out[phase] = {
                "requests": len(sent),
                "ok": sum(s.ok for s in sent),
                "refused": sum(s.generic_refusal for s in sent),
                "other_errors": sum(not s.ok and not s.generic_refusal for s in sent),
                "passed": sum(bool(s.passed) for s in judged),
                # the share of answers its checker passed; the mixed burst mixes releases on
                # purpose, and mismatch tickets carry no task: no rate for those
                "success_rate": (round(sum(bool(s.passed) for s in judged) / len(judged), 6)
                                 if judged and phase not in ("mixed", "mismatch") else None),
                "misattributions": sum(s.misattributed for s in sent),
                "indistinguishable": sum(s.why.startswith("indistinguishable") for s in sent),
                "ledger_mismatches": sum(s.why.startswith("ledger") for s in sent),
            }
        return out

    def _by_tag(self, tasks: Sequence[GoldenTask]) -> dict[str, dict[str, Any]]:
        """The candidate's golden success per task tag (in and out of distribution, ...)."""
        tags: dict[str, list[bool]] = {}
        results = {s.task: bool(s.passed) for s in self.sent if s.phase == "golden"}
        for t in tasks:
            for tag in t.tags:
                tags.setdefault(tag, []).append(results.get(t.id, False))
        return {tag: {"tasks": len(v), "passed": sum(v), "success_rate": round(sum(v) / len(v), 6)}
                for tag, v in sorted(tags.items())}

    def _ledger_counts(self) -> dict[str, dict[str, int]]:
        """Ledger rows of the gate's requests by outcome, per phase (None: no row found)."""
        out: dict[str, dict[str, int]] = {}
        for s in self.sent:
            counts = out.setdefault(s.phase, {})
            key = s.ledger_outcome or "missing"
            counts[key] = counts.get(key, 0) + 1
        return out

    def _memory(self, base_digest: str) -> dict[str, Any]:
        """The host's resident bytes against its memory plan (see the module notes)."""
        if not self.t.metrics_url:
            return {"error": None, "why": "no metrics endpoint given (--metrics)"}
        time.sleep(_METRICS_SETTLE_S)
        try:
            reported, resident = _scrape_resident(self.t.metrics_url)
        except OSError as e:
            return {"error": None, "why": f"metrics endpoint unreachable ({type(e).__name__})"}
        if not reported:
            return {"error": None, "why": "the metrics endpoint exports no resident bytes"}
        base_dir = self.registry.store.path(base_digest)
        device = self.t.device or default_device()
        plan = plan_for_host(base_dir, self.t.settings, device)
        shapes = BaseShapes.from_dir(base_dir)
        size = element_size(serving_dtype(device.split(":")[0]))
        expected = {"base_weights": shapes.weight_count() * size,
                    "adapter_banks": plan.bank_bytes,
                    "adapter_weights": resident * plan.slot_bytes}
        errors = {k: (abs(reported.get(k, 0.0) - v) / v if v else
                      (0.0 if reported.get(k, 0.0) == 0 else 1.0))
                  for k, v in expected.items()}
        summed = sum(v for k, v in reported.items() if k != "adapter_weights")
        return {"error": round(max(errors.values()), 6), "by_kind": errors,
                "reported": reported, "expected": expected, "resident_adapters": resident,
                "reported_sum": summed, "device": device,
                "why": "host's resident bytes (live tensor storages) against its memory plan"}


def _burst_plan(tasks: Sequence[GoldenTask], answers: dict[str, dict[str, Sent]],
                candidate: Route, base: Route, stable: Route | None,
                n: int) -> list[tuple[Route, GoldenTask]]:
    """``n`` requests: candidate, stable (when there is one) and base in turn, each on the
    tasks whose solo answers tell the releases apart first (so most answers can be judged by
    their text, not only by the digests)."""
    routes = [candidate, *([stable] if stable is not None else []), base]

    def telling(label: str) -> list[GoldenTask]:
        def distinct(t: GoldenTask) -> bool:
            mine = answers[label].get(t.id)
            return mine is not None and mine.ok and all(
                answers[k][t.id].text != mine.text for k in answers
                if k != label and t.id in answers[k])
        return sorted(tasks, key=lambda t: not distinct(t))

    order = {r.label: telling(r.label) for r in routes}
    plan = []
    for i in range(n):
        route = routes[i % len(routes)]
        pool = order[route.label]
        plan.append((route, pool[(i // len(routes)) % len(pool)]))
    return plan


def _task_table(tasks: Sequence[GoldenTask], answers: dict[str, dict[str, Sent]]
                ) -> list[dict[str, Any]]:
    rows = []
    for t in tasks:
        row: dict[str, Any] = {"id": t.id, "tags": list(t.tags), "checker": t.checker.kind}
        for label, by_task in answers.items():
            s = by_task.get(t.id)
            if s is not None:
                row[label] = {"passed": bool(s.passed), "text": s.text, "status": s.status}
        rows.append(row)
    return rows


def _open_client(protocol: str, url: str) -> Any:
    """A stock tritonclient client, the way a tenant's application opens one."""
    if protocol == "grpc":
        import tritonclient.grpc as grpcclient  # a client library: only the gate's run needs it

        return grpcclient.InferenceServerClient(url)
    import tritonclient.http as httpclient

    return httpclient.InferenceServerClient(url)


def _ready(http_url: str) -> bool:
    client = _open_client("http", http_url)
    try:
        return bool(client.is_server_ready())
    except Exception:  # refused, reset, timed out: not ready, whatever the exception type
        return False
    finally:
        client.close()


def _made_up(kind: str, real: str | None) -> str:
    """A digest no artifact has: what a forged or misbound ticket names instead of ``real``."""
    return "sha256:" + hashlib.sha256(f"loraplane-gate:wrong-{kind}:{real}".encode()).hexdigest()


def _p95(values: Sequence[float]) -> float | None:
    """Nearest-rank 95th percentile (None for no values)."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, -(-95 * len(ordered) // 100))  # ceil(0.95 n)
    return round(float(ordered[rank - 1]), 6)


def _scrape_resident(url: str) -> tuple[dict[str, float], int]:
    """``loraplane_backend_resident_bytes`` by kind, and the resident adapter count, summed over
    the engine instances the endpoint reports."""
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode("utf-8", "replace")
    by_kind: dict[str, float] = {}
    resident = 0.0
    for line in text.splitlines():
        if line.startswith(_SAMPLE + "{"):
            labels, _, value = line[len(_SAMPLE) + 1:].rpartition("} ")
            kind = next((p.split("=", 1)[1].strip('"') for p in labels.split(",")
                         if p.startswith("kind=")), None)
            if kind is not None:
                by_kind[kind] = by_kind.get(kind, 0.0) + float(value)
        elif line.startswith("loraplane_backend_resident_adapters"):
            resident += float(line.rpartition(" ")[2])
    return by_kind, int(resident)


__all__ = ["GATE_ACTOR", "Gate", "GateResult", "GateTarget", "GateUnavailable", "OnNewBase",
           "run_gate"]
