"""32 concurrent clients, 1,000 requests over the kit adapters of two tenants: every ``ok`` answer
is the text PEFT computes, in this process, for the adapter its ticket named, and its ledger row
says ok, that tenant, that adapter.

The answer's ``adapter_digest`` and the ledger row are the engine's claims; they must agree with
the ticket, but only the text compared with an independent reference shows which adapter did the
work. Each prompt goes to every adapter in turn, and the references of the three adapters and of
the bare base differ on every prompt used, so a swap could not pass unseen.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from control.contracts.db import make_engine
from control.contracts.ledger import Ledger
from control.ops.clients import Generation, TritonRefused, generate
from tests.hostile.conftest import HostileStack
from tests.integration.conftest import ROUTES
from tests.integration.reference import Reference

pytestmark = pytest.mark.triton

REQUESTS, CLIENTS = 1000, 32
MAX_TOKENS = 16
# 125 prompts x 4 references (three adapters and the base) fit Reference's cache of 512.
PROMPTS = tuple(f"#{k:03d} marker-{k * 7919 % 100003} Hello" for k in range(125))

Route = tuple[str, str, str]  # tenant, alias, kit adapter name


def test_every_answer_is_its_own_adapters_output(hostile: HostileStack) -> None:
    routes: list[Route] = [(t, a, n) for t, a, n in ROUTES if n is not None]
    ref = Reference(hostile.kit_dir / hostile.kit.base_path,
                    hostile.kit_dir / hostile.kit.tokenizer_path)
    dirs: dict[str | None, Path | None] = {
        n: hostile.kit_dir / hostile.kit.adapters[n].path for _, _, n in routes}
    dirs[None] = None  # the bare base
    for prompt in PROMPTS:
        texts = {n: ref.generate(prompt, d, MAX_TOKENS) for n, d in dirs.items()}
        assert len(set(texts.values())) == len(texts), f"indistinguishable on {prompt!r}: {texts}"

    tickets = {alias: hostile.ticket(tenant, alias) for tenant, alias, _ in routes}
    jobs = [(routes[i % len(routes)], PROMPTS[(i // len(routes)) % len(PROMPTS)],
             "http" if i % 3 else "grpc") for i in range(REQUESTS)]

    def call(job: tuple[Route, str, str]) -> Generation | str:
        (_tenant, alias, _name), prompt, proto = job
        url = hostile.http if proto == "http" else hostile.grpc
        try:
            return generate(url, prompt, tickets[alias], protocol=proto, max_tokens=MAX_TOKENS)
        except TritonRefused as e:
            return f"{e.status}: {e.message}"

    started = time.time()
    with ThreadPoolExecutor(CLIENTS) as pool:
        results = list(pool.map(call, jobs))
    ledger = Ledger(make_engine(hostile.settings.db_url))
    wrong, refused = [], []
    for ((tenant, _alias, name), prompt, _), g in zip(jobs, results, strict=True):
        if isinstance(g, str):
            refused.append(g)
            continue
        digest = hostile.digests[name]
        row = ledger.get(g.request_id)
        ok = (g.text == ref.generate(prompt, dirs[name], MAX_TOKENS)
              and g.adapter_digest == digest and row is not None and row.outcome == "ok"
              and row.tenant == tenant and row.adapter_digest == digest)
        if not ok:
            wrong.append((prompt, name, g.adapter_digest, g.text,
                          row.outcome if row else None))
    assert refused == []
    assert len({g.request_id for g in results if isinstance(g, Generation)}) == REQUESTS
    assert ledger.query(since=started, outcome="identity_mismatch") == []
    print(f"attribution: {REQUESTS} requests, {CLIENTS} clients, {len(PROMPTS)} prompts, "
          f"{len(wrong)} misattributed")
    assert wrong == []
