"""The hostile suite's state and judgement: the tenants, adapters and aliases it makes on a running
deployment, the PEFT reference it judges answers by, and the run over its categories.

The categories' cases live in :mod:`control.tools.hostile.cases` and
:mod:`control.tools.hostile.serving`; they take this suite, and :mod:`control.tools.selftest` hands
them to :meth:`HostileSuite.run`, so this module imports none of them (imports point one way).
"""

from __future__ import annotations

import contextlib
import json
import secrets
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from control.contracts.db import make_engine
from control.contracts.ledger import Ledger
from control.contracts.tickets import GENERIC_REFUSAL, TicketSigner
from control.ops.clients import Generation, Streamed, TritonRefused, generate, request_ticket
from control.ops.serve import pick_base
from control.tools.attribution_reference import (
    BASE,
    AttributionReference,
    ReferenceUnavailable,
    add_adapters,
    load_reference,
)
from control.tools.hostile.artifacts import synth_adapter
from control.tools.hostile.report import (
    CATEGORIES,
    NOT_APPLICABLE,
    NOT_TRIED,
    SERVED,
    Expectation,
    Report,
)
from control.tools.hostile.target import ACTOR, Target, TicketRoute, short
from control.tools.hostile.wire import b64d, http_call
from projections.follower import open_registry
from projections.routing import RoutingView

MAX_TOKENS = 8
# Prompts the serving cases draw from: several uses of each prompt on each adapter also try the
# prompt cache's keying (same tokens, different adapter: they must never share an entry).
PROMPTS = tuple(f"{w} #{i}" for i in range(8) for w in (
    "Hello", "Tell me", "Open the", "Why is", "Count to", "Once upon"))
REFUSED_STATUS = ("400", "StatusCode.INVALID_ARGUMENT")

# One category's cases: they take the suite and count into its report.
Case = Callable[["HostileSuite"], None]


def _stable(registry: Any, digest: str) -> None:
    """Walk a freshly registered adapter through candidate and canary to stable."""
    registry.advance(digest, external=True, evaluation={"suite": "selftest", "passed": True},
                     actor=ACTOR)


class HostileSuite:
    """Creates its tenants and adapters, runs every category, revokes what it made."""

    def __init__(self, target: Target, *, attribution_requests: int = 1000, clients: int = 32,
                 work_dir: Path | None = None) -> None:
        self.t = target
        self.attribution_requests = attribution_requests
        self.clients = clients
        self.work = Path(work_dir or tempfile.mkdtemp(prefix="lp-selftest-"))
        self.report = Report()
        tag = secrets.token_hex(3)
        self.a, self.b = f"st-a-{tag}", f"st-b-{tag}"
        self.keys: dict[str, str] = {}
        self.routes: dict[str, TicketRoute] = {}
        self.made: list[str] = []
        self._seed = int(tag, 16)
        self.base = ""
        self.shapes: dict[str, list[int]] = {}
        self.started = time.time()
        self.openai_missing: str | None = None  # why the OpenAI routes cannot be tried
        self._signer: TicketSigner | None = None
        self.signer_missing = "not checked yet"
        self._reference: AttributionReference | None = None
        self._reference_missing: str | None = None

    # -- setup ----------------------------------------------------------------------------------

    def _open(self) -> None:
        self.registry = open_registry(self.t.settings)
        self.routing = RoutingView(make_engine(self.t.settings.db_url))

    def ledger(self) -> Any:
        return Ledger(make_engine(self.t.settings.db_url))

    def new_adapter(self, tenant: str, alias: str, *, grant: bool = True,
                    stable: bool = True) -> TicketRoute:
        self._seed += 1
        src = synth_adapter(self.work / f"{alias}-{self._seed}", self.shapes, self.base,
                            seed=self._seed, targets=("q_proj", "v_proj", "o_proj"))
        digest = self.registry.register_adapter(src, tenant=tenant, alias=alias, actor=ACTOR)
        self.made.append(digest)
        if stable:
            _stable(self.registry, digest)
        if grant:
            self.registry.grant(tenant, alias, actor=ACTOR)
        return TicketRoute(tenant, alias, digest)

    def setup(self) -> None:
        self.base = pick_base(self.routing, self.t.base)
        self.shapes = self.registry.base(self.base).linear_shapes
        for tenant in (self.a, self.b):
            self.keys[tenant] = self.registry.create_tenant(tenant, actor=ACTOR)
        for key, tenant in (("a1", self.a), ("a2", self.a), ("b1", self.b)):
            self.routes[key] = self.new_adapter(tenant, f"{tenant}-{key}")
        self.wait_routable(self.routes.values())
        self._check_signer()
        self._check_openai_routes()

    def wait_routable(self, routes: Any, timeout_s: float = 30.0) -> None:
        # The gateway resolves on the projection, which follows the event store.
        deadline = time.monotonic() + timeout_s
        for r in routes:
            while request_ticket(self.t.gateway_url, self.keys[r.tenant], r.alias)[0] != 200:
                if time.monotonic() > deadline:
                    raise RuntimeError("the selftest's aliases never became routable")
                time.sleep(0.1)

    def _check_signer(self) -> None:
        """Use the home's signing key only if the gateway signs with it too.

        Otherwise every ticket signed with it would be refused for its unknown key, and the cases
        that mean to test a binding (expiry, model, base, tokenizer) would pass for that reason.
        """
        signer = TicketSigner.load_or_create(self.t.settings.keys_dir)[0]
        kid = json.loads(b64d(self.ticket(self.routes["a1"]).split(".")[3]))["kid"]
        if signer.kid == kid:
            self._signer, self.signer_missing = signer, ""
        else:
            self.signer_missing = ("the signing key under --home is not the one the gateway "
                                   "signs with")

    def _check_openai_routes(self) -> None:
        status, _ = http_call(self.t.gateway_url + "/v1/models", "GET", self.keys[self.a], None)
        if status == 404:
            self.openai_missing = "the gateway serves no OpenAI routes (no Triton URL given to it)"
        elif status != 200:
            self.openai_missing = f"GET /v1/models answered {status} to a valid key"

    def ticket(self, route: TicketRoute) -> str:
        status, body = request_ticket(self.t.gateway_url, self.keys[route.tenant], route.alias)
        if status != 200:
            raise RuntimeError(f"no ticket for the selftest's own alias ({status})")
        return str(body["ticket"])

    def secrets_of(self, tenant: str) -> list[str]:
        """Identifiers of ``tenant`` that no other tenant may ever see."""
        out = [tenant]
        for r in self.routes.values():
            if r.tenant == tenant:
                out += [r.alias, r.digest, r.digest.removeprefix("sha256:")[:12]]
        return out

    def leaks(self, text: str, tenant: str) -> list[str]:
        return [s for s in self.secrets_of(tenant) if s in text]

    def cleanup(self) -> None:
        for digest in self.made:
            with contextlib.suppress(Exception):  # already revoked by a case
                self.registry.revoke(digest, reason="selftest finished", actor=ACTOR)

    # -- references -----------------------------------------------------------------------------

    def reference(self) -> AttributionReference | None:
        """The PEFT reference over the stored base, with the suite's routes loaded (once)."""
        if self._reference is None and self._reference_missing is None:
            try:
                self._reference = load_reference(
                    self.registry.store, self.base, self.tokenizer_digest(),
                    [r.digest for r in self.routes.values()])
            except ReferenceUnavailable as e:
                self._reference_missing = e.reason
        return self._reference

    def expect(self, digest: str, prompt: str, max_tokens: int = MAX_TOKENS) -> Expectation:
        """What ``digest``'s answer to ``prompt`` must be, or why it cannot be judged."""
        ref = self.reference()
        if ref is None:
            return Expectation(None, NOT_TRIED, f"no reference: {self._reference_missing}")
        try:
            add_adapters(ref, self.registry.store, [digest])
        except ReferenceUnavailable as e:
            return Expectation(None, NOT_TRIED, f"no reference: {e.reason}")
        same = ref.indistinguishable(prompt, digest, max_tokens)
        if same is not None:
            whom = "the bare base" if same == BASE else "another adapter in play"
            return Expectation(None, NOT_APPLICABLE,
                               f"indistinguishable prompt: its reference equals that of {whom}, "
                               "so a swap would be invisible")
        return Expectation(ref.generate(prompt, digest, max_tokens))

    def telling_prompt(self, digests: list[str], max_tokens: int = MAX_TOKENS) -> str:
        """The first pool prompt on which each of ``digests`` has a non-empty reference of its
        own (the first prompt when none has: its answers are then counted apart)."""
        for p in PROMPTS:
            if all(self.expect(d, p, max_tokens).text for d in digests):
                return p
        return PROMPTS[0]

    def judge_served(self, cat: str, case: str, g: Generation | Streamed, route: TicketRoute,
                     exp: Expectation, ledger: Any) -> None:
        """An answer that must come from ``route``'s adapter: the engine's claims must agree
        with the ticket (a mismatch fails), and the text must equal the reference."""
        row = ledger.get(g.request_id)
        claims = (g.adapter_digest == route.digest and row is not None and row.outcome == "ok"
                  and row.tenant == route.tenant and row.adapter_digest == route.digest)
        if not claims:
            self.report.check(cat, case, False,
                              f"answer claims {short(g.adapter_digest)}, ledger row "
                              f"{row.outcome if row else 'missing'} "
                              f"{short(row.adapter_digest) if row else ''}; ticket named "
                              f"{short(route.digest)}")
        elif exp == SERVED:
            self.report.check(cat, case, True)
        elif exp.text is None:
            self.report.set_aside(cat, case, exp.kind, exp.reason)
        else:
            self.report.check(cat, case, g.text == exp.text,
                              f"output {g.text!r} is not the reference {exp.text!r} of "
                              f"{short(route.digest)}")

    # -- helpers --------------------------------------------------------------------------------

    def refused_by_triton(self, category: str, case: str, ticket: str | None,
                          leak_of: str | None = None, *, parameters: dict[str, Any] | None = None,
                          headers: dict[str, str] | None = None) -> None:
        for proto, url in (("http", self.t.http_url), ("grpc", self.t.grpc_url)):
            try:
                g = generate(url, "Hello", ticket, protocol=proto, max_tokens=2,
                             parameters=parameters, headers=headers)
            except TritonRefused as e:
                leaked = self.leaks(e.message, leak_of) if leak_of else []
                self.report.check(category, f"{case}/{proto}",
                                  e.status in REFUSED_STATUS and e.message == GENERIC_REFUSAL
                                  and not leaked, f"{e.status} {e.message[:80]} leaks={leaked}")
            else:
                self.report.check(category, f"{case}/{proto}", False,
                                  f"served (adapter {short(g.adapter_digest)})")

    def signer(self) -> TicketSigner | None:
        return self._signer

    def claims(self, adapter: str | None, **over: Any) -> dict[str, Any]:
        c: dict[str, Any] = dict(tenant=self.a, model=self.t.settings.model_name, base=self.base,
                                 adapter=adapter, tokenizer=self.tokenizer_digest(),
                                 release=self.release_of(adapter), disclose=True, ttl_s=300)
        c.update(over)
        return c

    def release_of(self, adapter: str | None) -> str | None:
        """The release manifest the control plane would sign beside ``adapter``."""
        row = self.routing.adapter(adapter) if adapter is not None else None
        return row.release_digest if row is not None else None

    def tokenizer_digest(self) -> str:
        return next(b.tokenizer_digest for b in self.routing.bases() if b.digest == self.base)

    def no_loads(self, category: str, case: str, digest: str) -> None:
        loads = self.ledger().loads(digest)
        served = [r for r in self.ledger().query(adapter=digest) if r.outcome != "rejected"]
        self.report.check(category, case, not loads and not served,
                          f"{len(loads)} load records, {len(served)} served rows")

    # -- the run --------------------------------------------------------------------------------

    def run(self, cases: Mapping[str, Case], categories: tuple[str, ...] = CATEGORIES) -> Report:
        """Run ``cases`` of ``categories``; what could not run is in the report, never raised."""
        import sqlalchemy.exc
        from eventsourcing.persistence import PersistenceError

        try:
            self._open()
            self.setup()
        except (sqlalchemy.exc.SQLAlchemyError, PersistenceError) as e:
            return self._blocked(categories, f"no access to the database ({type(e).__name__})")
        except OSError as e:  # the gateway does not answer
            return self._blocked(categories, f"the gateway does not answer ({type(e).__name__})")
        except RuntimeError as e:  # the selftest's own aliases never became routable, say
            return self._blocked(categories, f"setup failed: {e}")
        try:
            for c in categories:
                try:
                    cases[c](self)
                except Exception as e:  # one category's crash must not hide the others' counts
                    self.report.check(c, "category-crashed", False, f"{type(e).__name__}: {e}")
        finally:
            self.cleanup()
        return self.report

    def _blocked(self, categories: tuple[str, ...], reason: str) -> Report:
        for c in categories:
            self.report.block(c, reason)
        self.cleanup()
        return self.report


