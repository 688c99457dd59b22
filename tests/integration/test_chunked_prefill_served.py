"""Chunked prefill through the real tritonserver: with ``LORAPLANE_PREFILL_CHUNK=4`` every prompt
here is prefilled four tokens per scheduler turn, beside running streams of other tenants'
adapters, and every answer still equals its own adapter's PEFT reference, with its ledger row
naming that adapter (``backend.serving.chunked_prefill``; the serving state machine covers the
interleavings in process)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from control.contracts.db import make_engine
from control.contracts.ledger import Ledger
from control.ops.clients import Generation, generate
from tests.integration.conftest import ROUTES, Stack, started_stack
from tests.integration.reference import Reference

pytestmark = pytest.mark.triton

CHUNK = 4
PROMPTS = ["Hello there, how are you today", "Tell me a story about a quiet river",
           "What is the weather like", "Count to three"]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def stack(kit_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    before = os.environ.get("LORAPLANE_PREFILL_CHUNK")
    os.environ["LORAPLANE_PREFILL_CHUNK"] = str(CHUNK)  # the host's scheduler reads it
    try:
        with started_stack(kit_dir, tmp_path_factory, "chunked") as s:
            yield s
    finally:
        os.environ.pop("LORAPLANE_PREFILL_CHUNK", None)
        if before is not None:
            os.environ["LORAPLANE_PREFILL_CHUNK"] = before


def test_chunked_prompts_in_a_mixed_burst_each_answer_their_own(stack: Stack) -> None:
    reference = Reference(stack.kit_dir / stack.kit.base_path,
                          stack.kit_dir / stack.kit.tokenizer_path)
    tickets = {(t, a): stack.ticket(t, a) for t, a, _ in ROUTES}
    jobs = [(ROUTES[i % len(ROUTES)], PROMPTS[i % len(PROMPTS)], "grpc" if i % 2 else "http")
            for i in range(24)]

    def call(job: tuple[tuple[str, str, str | None], str, str]) -> Generation:
        (tenant, alias, _), prompt, proto = job
        return generate(stack.grpc if proto == "grpc" else stack.http, prompt,
                        tickets[(tenant, alias)], protocol=proto, max_tokens=MAX_TOKENS)

    with ThreadPoolExecutor(12) as pool:
        results = list(pool.map(call, jobs))
    ledger = Ledger(make_engine(stack.settings.db_url))
    for ((tenant, _alias, name), prompt, _), g in zip(jobs, results, strict=True):
        path = None if name is None else stack.kit_dir / stack.kit.adapters[name].path
        assert g.text == reference.generate(prompt, path, MAX_TOKENS), (name, prompt)
        want = stack.digests[name] if name else None
        assert (g.adapter_digest or None) == want
        row = ledger.get(g.request_id)
        assert row is not None and row.outcome == "ok"
        assert row.adapter_digest == want and row.tenant == tenant
