"""The hostile cases that go through the serving path: parameters and attribution.

Every answer these cases get is judged by its text against the PEFT reference of the adapter its
ticket named (``HostileSuite.expect``); the answer's and the ledger's ``adapter_digest`` must
agree with the ticket too, but agreeing is not evidence on its own: they are the engine's claims.

- *parameters*: names, paths, URLs and digests of another tenant in every parameter and in every
  header Triton forwards; sampling inputs outside their documented ranges (refused with
  INVALID_ARG naming the parameter, and a ``rejected`` ledger row); the edges of those ranges
  (served); and poisoned rows inside a burst of good ones from both tenants (only the poisoned
  rows are refused; every good one is answered by its own adapter).
- *attribution*: a burst of many concurrent clients over HTTP, gRPC and gRPC streaming, over
  three adapters of two tenants, each prompt used on every adapter; every ledger row of the run
  with the outcome ``identity_mismatch`` (the engine failing a row closed) counts as a failure.
"""

from __future__ import annotations

import math
import re
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np

from control.contracts import wire
from control.contracts.tickets import GENERIC_REFUSAL
from control.ops.clients import Generation, Streamed, TritonRefused, generate, stream_generate
from control.tools.hostile.report import NOT_TRIED, SERVED
from control.tools.hostile.suite import MAX_TOKENS, PROMPTS, REFUSED_STATUS
from control.tools.hostile.wire import unverified_claims

if TYPE_CHECKING:
    from control.tools.hostile.suite import HostileSuite
    from control.tools.hostile.target import TicketRoute

NOT_FORWARDED = (f"a header Triton never forwards (only {wire.FORWARDED_HEADERS} reach the model): "
                 "it cannot reach the code under test")
# Inputs outside the documented ranges (control/contracts/sampling.py; README, "Contracts"). float32
# on the
# wire: 1e-39 and 1e-40 arrive as denormals.
OUT_OF_RANGE: tuple[tuple[str, float | int], ...] = (
    *((wire.TEMPERATURE, t) for t in (math.nan, math.inf, -math.inf, 1e-39, 1e-30, 0.005, -0.5,
                                      10.5, 3e38)),
    *((wire.TOP_P, p) for p in (0.0, 0.0005, 1.01, -0.1, math.nan, math.inf, 1e-40)),
    *((wire.MAX_TOKENS, n) for n in (0, -1, 513, 2**31 - 1)),
)
# The smallest float32 in the temperature range: float32(0.01) itself rounds to just below it.
TEMPERATURE_MIN_FP32 = float(np.nextafter(np.float32(0.01), np.float32(1)))
# The edges of those ranges, which must be served (refusing them would be a bug too).
EDGES: tuple[dict[str, float | int], ...] = (
    {wire.TEMPERATURE: TEMPERATURE_MIN_FP32, wire.SEED: 7},
    {wire.TEMPERATURE: 10.0, wire.SEED: 7},
    {wire.TEMPERATURE: 1.0, wire.TOP_P: 0.001, wire.SEED: 7},
    {wire.TEMPERATURE: 1.0, wire.TOP_P: 1.0, wire.SEED: 7},
    {wire.MAX_TOKENS: 1},
)
POISON: tuple[float, ...] = (1e-39, 1e-30, math.nan)

Answer = Generation | Streamed


def parameters(s: HostileSuite) -> None:
    """Injected names, sampling limits and poisoned rows (see the module docstring)."""
    _injections(s)
    _sampling_limits(s)
    _poisoned_rows(s)


def _injections(s: HostileSuite) -> None:
    """Names, paths, URLs and digests of B in parameters and headers: the ticket alone routes."""
    cat = "parameters"
    a1, b1 = s.routes["a1"], s.routes["b1"]
    ticket = s.ticket(a1)
    prompt = s.telling_prompt([a1.digest])
    expected = s.expect(a1.digest, prompt)
    store_path = str(s.t.settings.store_dir / "sha256" / b1.digest.removeprefix("sha256:"))
    injections = [b1.digest, b1.alias, store_path, f"file://{store_path}",
                  f"http://127.0.0.1:1/{b1.alias}.safetensors", "../../" * 8 + "etc/passwd",
                  b1.tenant]
    names = ["adapter", "adapter_digest", "lora_adapter", "lora_name", "lora_path", "alias",
             "model", "tenant", "x-lora-adapter", "x-lora-digest", "x-lora-alias",
             "x-lora-tenant"]
    ledger = s.ledger()
    for name in names:
        for where in ("param", "header"):
            case = f"{where}:{name}"
            if where == "header" and not re.fullmatch(wire.FORWARDED_HEADERS, name):
                for _ in injections:
                    s.report.not_applicable(cat, case, NOT_FORWARDED)
                continue
            for value in injections:
                try:
                    g = generate(s.t.http_url, prompt, ticket, max_tokens=MAX_TOKENS,
                                 parameters={name: value} if where == "param" else None,
                                 headers={name: value} if where == "header" else None)
                except TritonRefused as e:  # refusing is fine, if it says nothing
                    s.report.check(cat, case, e.message == GENERIC_REFUSAL
                                   and not s.leaks(e.message, s.b), e.message)
                    continue
                s.judge_served(cat, case, g, a1, expected, ledger)
    # B's adapter was only ever loaded by B's own traffic (attribution runs after this).
    b_rows = [r for r in ledger.query(adapter=b1.digest) if r.outcome != "rejected"]
    s.report.check(cat, "b-adapter-never-served-to-a", all(r.tenant == s.b for r in b_rows))


def _sampling_limits(s: HostileSuite) -> None:
    """Each out-of-range input refused, naming the parameter, with its own ledger row; each
    edge of a range served."""
    cat = "parameters"
    a1 = s.routes["a1"]
    ledger = s.ledger()
    prompt = s.telling_prompt([a1.digest])
    for name, value in OUT_OF_RANGE:
        for proto in ("http", "grpc"):
            inputs = {wire.MAX_TOKENS: MAX_TOKENS, name: value}
            _refused_naming(s, f"{name}={value!r}/{proto}", a1, s.ticket(a1), proto, prompt,
                            inputs, name, ledger)
    for edge in EDGES:
        for proto in ("http", "grpc"):
            case = f"edge:{','.join(f'{k}={v}' for k, v in edge.items())}/{proto}"
            inputs = {wire.MAX_TOKENS: MAX_TOKENS, **edge}
            greedy = edge.get(wire.TEMPERATURE, 0.0) == 0.0
            n = int(inputs[wire.MAX_TOKENS])
            edge_prompt = s.telling_prompt([a1.digest], n) if greedy else prompt
            try:
                g = generate(_url(s, proto), edge_prompt, s.ticket(a1), protocol=proto,
                             inputs=inputs)
            except TritonRefused as e:
                s.report.check(cat, case, False, f"refused: {e.message[:100]}")
                continue
            # A sampled answer has no reference; it must be served and recorded as a1's.
            expected = s.expect(a1.digest, edge_prompt, n) if greedy else SERVED
            s.judge_served(cat, case, g, a1, expected, ledger)


def _refused_naming(s: HostileSuite, case: str, route: TicketRoute, ticket: str, proto: str,
                    prompt: str, inputs: dict[str, float | int], name: str, ledger: Any) -> None:
    """Refused with INVALID_ARG and ``invalid parameter <name>``, and a rejected ledger row for
    this very ticket (a fresh one per case, so its id finds the row)."""
    cat = "parameters"
    jti = unverified_claims(ticket)["jti"]
    try:
        g = generate(_url(s, proto), prompt, ticket, protocol=proto, inputs=inputs)
    except TritonRefused as e:
        rows = [r for r in ledger.query(tenant=route.tenant, since=s.started)
                if r.ticket_id == jti]
        outcomes = [r.outcome for r in rows]
        s.report.check(cat, case, e.status in REFUSED_STATUS
                       and e.message.startswith(f"invalid parameter {name}")
                       and not s.leaks(e.message, s.b) and outcomes == ["rejected"],
                       f"{e.status} {e.message[:100]}; ledger rows {outcomes}")
    else:
        s.report.check(cat, case, False, f"served ({len(g.text)} characters)")


def _poisoned_rows(s: HostileSuite) -> None:
    """Poisoned rows in one burst with good rows of both tenants: only they are refused."""
    cat = "parameters"
    routes = [s.routes["a1"], s.routes["a2"], s.routes["b1"]]
    prompt = s.telling_prompt([r.digest for r in routes])
    expected = {r.digest: s.expect(r.digest, prompt) for r in routes}
    tickets = {r.digest: s.ticket(r) for r in routes}
    good = [(routes[i % 3], "http" if i % 2 else "grpc") for i in range(24)]
    # a fresh ticket per poisoned row: its id finds the row's ledger entry
    bad = [(r, proto, t, s.ticket(r)) for i, t in enumerate(POISON)
           for r in (routes[i % 2 * 2],) for proto in ("http", "grpc")]

    def good_call(job: tuple[TicketRoute, str]) -> Answer | str:
        r, proto = job
        try:
            return generate(_url(s, proto), prompt, tickets[r.digest], protocol=proto,
                            max_tokens=MAX_TOKENS)
        except TritonRefused as e:
            return e.message

    ledger = s.ledger()
    with ThreadPoolExecutor(len(good) + len(bad)) as pool:
        poisoned = [pool.submit(_refused_naming, s, f"poisoned-row:temperature={t!r}/{p}", r,
                                ticket, p, prompt,
                                {wire.MAX_TOKENS: MAX_TOKENS, wire.TEMPERATURE: t},
                                wire.TEMPERATURE, ledger) for r, p, t, ticket in bad]
        answers = list(pool.map(good_call, good))
        for f in poisoned:
            f.result()
    for (r, _proto), g in zip(good, answers, strict=True):
        if isinstance(g, str):
            s.report.check(cat, "good-row-beside-poisoned", False, g[:100])
        else:
            s.judge_served(cat, "good-row-beside-poisoned", g, r, expected[r.digest], ledger)


def attribution(s: HostileSuite) -> None:
    """Many concurrent clients over mixed adapters of two tenants: every answer is computed by
    the adapter its ticket named (judged by the reference), and recorded as such."""
    cat = "attribution"
    routes = [s.routes["a1"], s.routes["a2"], s.routes["b1"]]
    tickets = {r.digest: s.ticket(r) for r in routes}
    prompts = _telling_prompts(s, cat, [r.digest for r in routes])
    # Each prompt goes to every adapter in turn; references are computed before the burst.
    jobs = [(routes[i % 3], prompts[(i // 3) % len(prompts)],
             "grpc" if i % 4 == 0 else "stream" if i % 8 == 7 else "http")
            for i in range(s.attribution_requests)]
    expected = {(r.digest, p): s.expect(r.digest, p) for r, p, _ in jobs}

    def call(job: tuple[TicketRoute, str, str]) -> Answer | str:
        r, prompt, proto = job
        try:
            if proto == "stream":
                return stream_generate(s.t.grpc_url, prompt, tickets[r.digest],
                                       max_tokens=MAX_TOKENS)
            return generate(_url(s, proto), prompt, tickets[r.digest], protocol=proto,
                            max_tokens=MAX_TOKENS)
        except TritonRefused as e:
            return e.message

    with ThreadPoolExecutor(s.clients) as pool:
        results = list(pool.map(call, jobs))
    ledger = s.ledger()
    seen: set[str] = set()
    for (r, prompt, proto), g in zip(jobs, results, strict=True):
        case = f"request/{proto}"
        exp = expected[(r.digest, prompt)]
        if isinstance(g, str):
            s.report.check(cat, case, False, g[:100])
        elif isinstance(g, Streamed) and not g.pieces and exp.text is None:
            # An empty stream carries no request id, and there is no reference: nothing to judge.
            s.report.set_aside(cat, case, exp.kind, exp.reason)
        elif g.request_id in seen:
            s.report.check(cat, case, False, f"request id {g.request_id} answered twice")
        else:
            seen.add(g.request_id)
            s.judge_served(cat, case, g, r, exp, ledger)
    # The engine's own alarm: a row it failed closed because the slot held another adapter.
    # Only ever a failure: its absence proves nothing by itself (the references do that).
    for row in ledger.query(since=s.started, outcome="identity_mismatch"):
        s.report.check(cat, "identity-mismatch-row", False, f"request {row.request_id}")


def _telling_prompts(s: HostileSuite, cat: str, digests: list[str]) -> list[str]:
    """The pool's prompts on which every adapter's reference is non-empty and its own; the
    others are counted apart, one case per prompt. With no reference at all, the whole pool
    (each answer is then counted apart as not tried)."""
    telling: list[str] = []
    for p in PROMPTS:
        expected = [s.expect(d, p) for d in digests]
        unjudged = [e for e in expected if e.text is None]
        if unjudged and unjudged[0].kind == NOT_TRIED:
            return list(PROMPTS)
        if unjudged:
            s.report.not_applicable(cat, f"prompt:{p}", "prompt left out of the burst: "
                                    + unjudged[0].reason)
        elif not all(e.text for e in expected):
            # A streamed empty answer carries no request id to find its ledger row by.
            s.report.not_applicable(cat, f"prompt:{p}", "prompt left out of the burst: an "
                                    "adapter's reference is empty")
        else:
            telling.append(p)
    return telling or list(PROMPTS)


def _url(s: HostileSuite, proto: str) -> str:
    return s.t.http_url if proto == "http" else s.t.grpc_url
