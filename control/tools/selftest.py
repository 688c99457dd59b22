"""The hostile self-test: tries on purpose to make a running deployment misroute, leak or lose.

``loraplane selftest hostile --json`` runs it against a deployment that is already serving. It
needs what an operator has: the gateway URL, Triton's HTTP and gRPC addresses, and the home
folder and database URL (``--home``/``LORAPLANE_DB_URL``) to create its own two tenants and
adapters (random ``st-...`` names, synthesised from the served base's shapes) and to read the
ledger. It forges tickets with keys it makes up, and signs tickets that are genuine but bound to
something else with the home's signing key (only once a gateway ticket shows that key is the one
the deployment signs with). It never stops or kills the deployment's processes; the faults it
injects are its own (a gateway subprocess it kills with SIGKILL, clients that hang up
mid-request). Killing tritonserver and cutting the database run in the pytest suite
(``tests/hostile``), which owns its deployment.

Counting (``control.tools.hostile.report``): a case counts only if it reaches the code under test
and its outcome can be judged. Which adapter computed an answer is judged from its text against an
independent PEFT reference (``control.tools.attribution_reference``), never from the answer's or the
ledger's ``adapter_digest``, which are the engine's claims. Cases that cannot reach the code, or
that the self-test lacks the means to judge, are counted apart with their reason. After the run,
the adapters it registered are revoked so nothing it made stays servable.
"""

from __future__ import annotations

from control.tools.hostile import cases as hostile_cases
from control.tools.hostile.report import CATEGORIES, Report
from control.tools.hostile.serving import attribution, parameters
from control.tools.hostile.suite import Case, HostileSuite
from control.tools.hostile.target import Target, TicketRoute

__all__ = ["CATEGORIES", "HostileSuite", "Report", "Target", "TicketRoute", "run_hostile"]


CASES: dict[str, Case] = {
    "identity": hostile_cases.identity, "tickets": hostile_cases.tickets,
    "parameters": parameters, "artifacts": hostile_cases.artifacts,
    "faults": hostile_cases.faults, "attribution": attribution}


def run_hostile(target: Target, *, categories: tuple[str, ...] = CATEGORIES,
                attribution_requests: int = 1000, clients: int = 32) -> Report:
    """Run the hostile suite against ``target``; the report counts every case."""
    return HostileSuite(target, attribution_requests=attribution_requests,
                        clients=clients).run(CASES, categories)
